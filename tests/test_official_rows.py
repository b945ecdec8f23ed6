"""Official numerics are a function of each row: every V4 op of the NumPy reference and of torch on the
CPU gives a row the same bits alone as among others (a batch, more tokens of a chunk), so a server that
batches requests answers each one as if it ran alone. Hypothesis draws the batch, the rows and their
values; the weights are the official tiny V4 checkpoint's (tests/fixtures). The ops that sum over a row
are where this could fail (BLAS orders a GEMM's sums by the number of rows, NumPy's einsum and pairwise
sums by the shape): the references sum those in float64 and round once, or in a fixed order."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import quant
from conftest import FIXTURE_V4_CKPT, backends
from model import Transformer


@pytest.fixture(scope="module", params=[b for b in backends() if b[1] in (None, "cpu")], ids=lambda b: b[0])
def model(request):
    return Transformer.from_pretrained(FIXTURE_V4_CKPT, backend=request.param[0], device=request.param[1])


def host(x):
    return np.asarray(x.cpu() if hasattr(x, "cpu") else x)


def rows_alone(f, x, *rest):  # f on all rows at once, and on each row alone -> (together, alone)
    together = host(f(x, *rest))
    alone = np.concatenate([host(f(x[i:i + 1], *(r[i:i + 1] for r in rest))) for i in range(len(x))])
    return together, alone


def draw(rng, shape, spread=1.0):
    return quant.bf16_round(rng.standard_normal(shape) * spread)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(st.integers(1, 9), st.integers(0, 3), st.floats(0.1, 30), st.integers(0, 2 ** 31))
def test_mhc_and_norm_ops_row_by_row(model, M, i, spread, seed):
    m, ops, a = model, model.ops, model.args
    rng = np.random.default_rng(seed)
    lw = m.w["layers"][i]
    X = ops.param(draw(rng, (M, a.hc_mult, a.hidden_size), spread))
    u_all, u_one = rows_alone(lambda X: ops.hc_mix_pre(X, lw["hc_attn_fn"], lw["hc_attn_base"], lw["hc_attn_scale"],
                                                       a, True)[3], X)
    assert np.array_equal(u_all, u_one)
    for j in range(3):                                                           # pre, post, comb
        t, s = rows_alone(lambda X: ops.hc_mix_pre(X, lw["hc_ffn_fn"], lw["hc_ffn_base"], lw["hc_ffn_scale"], a,
                                                   True)[j], X)
        assert np.array_equal(t, s), j
    y = ops.param(draw(rng, (M, a.hidden_size)))
    pre, post, comb, _ = ops.hc_mix_pre(X, lw["hc_attn_fn"], lw["hc_attn_base"], lw["hc_attn_scale"], a, True)
    t, s = rows_alone(lambda X, y, post, comb: ops.hc_post(X, y, post, comb, True), X, y, post, comb)
    assert np.array_equal(t, s)
    hc = m.w["hc_head"]
    t, s = rows_alone(lambda X: ops.hc_head(X, hc["fn"], hc["base"], hc["scale"], a, True), X)
    assert np.array_equal(t, s)
    t, s = rows_alone(lambda y: ops.v4_norm(y, lw["attn_norm"], a.rms_norm_eps, ops.bf16_round), y)
    assert np.array_equal(t, s)
    t, s = rows_alone(lambda y: ops.matmul_f32(y, m.w["head_f32"].T), y)               # the fp32 head
    assert np.array_equal(t, s)


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 9), st.integers(0, 3), st.floats(0.1, 30), st.integers(0, 2 ** 31))
def test_moe_row_by_row(model, M, i, spread, seed):
    # the router's fp32 logits, the hash or score routing, the FP8 / FP4 experts, the weighted sum
    m, ops, a = model, model.ops, model.args
    rng = np.random.default_rng(seed)
    x = ops.param(draw(rng, (M, a.hidden_size), spread))
    tokens = ops.tokens(rng.integers(0, a.vocab_size, M))
    t, s = rows_alone(lambda x, tok: ops.v4_moe(x, m.w["layers"][i]["ffn"], a, True, tok, weight_inside=True), x, tokens)
    assert np.array_equal(t, s)


@settings(max_examples=8, deadline=None)
@given(st.integers(2, 40), st.integers(1, 3), st.floats(0.1, 30), st.integers(0, 2 ** 31))
def test_router_row_by_row(M, i, spread, seed):
    # the routing weights themselves (the MoE's FP8 step before w2 hides most of a weight's last bits)
    import moe
    m = Transformer.from_pretrained(FIXTURE_V4_CKPT)
    ffn = m.w["layers"][i]["ffn"]
    x = draw(np.random.default_rng(seed), (M, m.args.hidden_size), spread)
    for j in range(2):                                                            # weights, indices
        t, s = rows_alone(lambda x: moe.gate_ref(x, ffn["gate"].dequant(), ffn.get("gate_bias"), m.args)[j], x)
        assert np.array_equal(t, s), j


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(st.integers(2, 3), st.integers(1, 40), st.integers(0, 3), st.integers(0, 2 ** 31))
def test_attention_batch_by_batch(model, B, T, i, seed):
    # a batch of B sequences through one attention layer (window, CSA or HCA; a prefill of T tokens, then a
    # decode step), and each sequence alone: the same bits
    m, ops, a = model, model.ops, model.args
    rng = np.random.default_rng(seed)
    p, kind, r = m.w["layers"][i]["attn"], a.layer_types[i], a.ratio(i)
    x = ops.param(draw(rng, (B, T + 1, a.hidden_size)))

    def run(x):
        cache = ops.v4_cache(x.shape[0], a, kind, p)
        for state in (cache.comp, cache.idx):
            if state is not None:
                state.reserve(T // r + 2)
        pre = ops.v4_attention(x[:, :T], p, kind, r, 0, m.freqs[r > 0], a, cache, True, True)
        step = ops.v4_attention(x[:, T:], p, kind, r, T, m.freqs[r > 0], a, cache, True, True)
        return np.concatenate([host(pre), host(step)], 1)
    together = run(x)
    for b in range(B):
        assert np.array_equal(together[b:b + 1], run(x[b:b + 1])), b
