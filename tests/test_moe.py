"""moe.py: routing against a brute-force float64 router, weights summing to the route scale, the
bias used for choice only, and the MoE layer against a float64 evaluation of eq. (12)."""
from types import SimpleNamespace

import numpy as np
from hypothesis import assume, given, strategies as st

import moe
import quant
from helpers import rel_err


def router_oracle(x, W, bias, a):  # float64, one token at a time, straight from the rules
    logits = x.astype(np.float64) @ W.astype(np.float64).T
    out_w, out_i = [], []
    for u in logits:
        if a.scoring_func == "sigmoid":
            s = 1 / (1 + np.exp(-u))
        else:
            s = np.exp(u - u.max()) / np.exp(u - u.max()).sum()
        c = s + (bias if bias is not None else 0)
        size = len(s) // a.n_group
        if bias is not None:
            g = [sum(sorted(c[i * size:(i + 1) * size])[-2:]) for i in range(a.n_group)]
        else:
            g = [max(c[i * size:(i + 1) * size]) for i in range(a.n_group)]
        groups = sorted(range(a.n_group), key=lambda i: -g[i])[:a.topk_group]
        cand = [e for e in range(len(s)) if e // size in groups]
        chosen = sorted(cand, key=lambda e: -c[e])[:a.num_experts_per_tok]
        w = s[chosen]
        if a.norm_topk_prob:
            w = w / w.sum()
        out_w.append(w * a.routed_scaling_factor)
        out_i.append(chosen)
    return np.array(out_w), np.array(out_i)


@st.composite
def router_case(draw):
    G = draw(st.sampled_from([1, 2, 4, 8]))
    E = G * draw(st.integers(2, 6))
    a = SimpleNamespace(n_group=G, topk_group=draw(st.integers(1, G)), scoring_func=draw(st.sampled_from(["sigmoid", "softmax"])),
                        norm_topk_prob=draw(st.booleans()), routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])))
    a.num_experts_per_tok = draw(st.integers(1, a.topk_group * (E // G)))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    M, d = draw(st.integers(1, 8)), draw(st.sampled_from([16, 64]))
    x = rng.standard_normal((M, d)).astype(np.float32)
    W = rng.standard_normal((E, d)).astype(np.float32) / 4
    bias = (0.1 * rng.random(E)).astype(np.float32) if draw(st.booleans()) else None
    return x, W, bias, a


def no_near_ties(x, W, bias, a):  # every expert score and group score differs by more than float32 noise
    u = x.astype(np.float64) @ W.astype(np.float64).T
    s = 1 / (1 + np.exp(-u)) if a.scoring_func == "sigmoid" else np.exp(u) / np.exp(u).sum(-1, keepdims=True)
    c = s + (bias if bias is not None else 0)
    g = np.sort(c.reshape(len(c), a.n_group, -1), -1)
    g = g[..., -2:].sum(-1) if bias is not None else g[..., -1]
    gap = lambda v: np.diff(np.sort(v, -1), axis=-1).min() if v.shape[-1] > 1 else np.inf
    return gap(c) > 1e-5 and gap(g) > 1e-5


@given(router_case())
def test_router_matches_brute_force(case):
    x, W, bias, a = case
    assume(no_near_ties(x, W, bias, a))
    w, idx = moe.gate_ref(x, W, bias, a)
    w_ref, idx_ref = router_oracle(x, W, bias, a)
    np.testing.assert_array_equal(idx, idx_ref)                # same experts, best first
    np.testing.assert_allclose(w, w_ref, rtol=1e-5)
    if a.norm_topk_prob:
        np.testing.assert_allclose(w.sum(-1), a.routed_scaling_factor, rtol=1e-5)   # eq. (14) * route scale
    # group limit: every chosen expert lies in at most topk_group groups
    size = W.shape[0] // a.n_group
    assert all(len(set((i // size).tolist())) <= a.topk_group for i in idx)


def test_bias_chooses_but_does_not_weigh():
    a = SimpleNamespace(n_group=1, topk_group=1, scoring_func="sigmoid", norm_topk_prob=False, swiglu_limit=None,
                        routed_scaling_factor=1.0, num_experts_per_tok=1)
    x = np.ones((1, 2), np.float32)
    W = np.array([[1, 1], [0, 0]], np.float32)                     # scores sigmoid(2) and sigmoid(0)
    w, idx = moe.gate_ref(x, W, np.array([0, 1], np.float32), a)    # bias lifts expert 1 above expert 0
    assert idx[0, 0] == 1 and np.isclose(w[0, 0], 0.5)             # weight is its unbiased score


def expert(rng, d, I):
    def lin(n, k):
        return quant.Weight(*quant.weight_quant(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)))
    return {"w1": lin(I, d), "w3": lin(I, d), "w2": lin(d, I)}


def mlp_oracle(x, p):
    a, b = (x.astype(np.float64) @ p[w].dequant().astype(np.float64).T for w in ("w1", "w3"))
    return (a / (1 + np.exp(-a)) * b) @ p["w2"].dequant().astype(np.float64).T


@given(st.integers(1, 12), st.integers(0, 2 ** 31))
def test_moe_layer_matches_float64(M, seed):
    rng = np.random.default_rng(seed)
    d, I, E = 128, 128, 8
    a = SimpleNamespace(n_group=4, topk_group=2, scoring_func="sigmoid", norm_topk_prob=True, swiglu_limit=None,
                        routed_scaling_factor=2.5, num_experts_per_tok=2)
    p = {"gate": quant.Weight(rng.standard_normal((E, d)).astype(np.float32) / 8, None),
         "gate_bias": (0.05 * rng.random(E)).astype(np.float32),
         "experts": [expert(rng, d, I) for _ in range(E)], "shared_experts": expert(rng, d, I)}
    x = rng.standard_normal((M, d)).astype(np.float32)
    got = moe.moe_ref(x, p, a, official=False)
    w, idx = moe.gate_ref(x, p["gate"].w, p["gate_bias"], a)
    ref = mlp_oracle(x, p["shared_experts"])
    for t in range(M):
        for k in range(2):
            ref[t] += w[t, k] * mlp_oracle(x[t:t + 1], p["experts"][idx[t, k]])[0]
    assert rel_err(got, ref) <= 1e-5
    off = moe.moe_ref(x, p, a, official=True)               # official: FP8 activations, bf16 out
    assert np.array_equal(off, quant.bf16_round(off)) and rel_err(off, ref) < 0.1
