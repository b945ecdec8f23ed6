"""kernels_moe.py's bookkeeping around the routed experts against NumPy and the torch path: gate_topk against
moe.gate_ref (ties, groups, biases) and backend_torch.gate_weights' bits, route against backend_torch.route,
moe_combine bit for bit a float32 NumPy sum in expert-id order; the grouped-GEMM path (routed_grouped, mlp)
against moe.mlp_ref, and backend_torch.moe with the kernels bit for bit the same layer in torch ops. On a GPU
for real, on the CPU under TRITON_INTERPRET=1 (conftest.py)."""
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels_cuda
import quant
from bounds import loads_and_stores_in_bounds  # noqa: F401  (autouse: no address outside a kernel's arguments)
from helpers import DEV, INTERPRETED

pytestmark = pytest.mark.slow      # the Triton kernels in the CPU interpreter: not in the fast loop (-m "not slow")


# the routed experts' bookkeeping (kernels_moe.py): choice and weights, the grouped GEMM's rows, the sum

@settings(max_examples=12)
@given(st.integers(1, 6), st.sampled_from([(256, 8, 4, 8), (16, 4, 2, 3), (8, 1, 1, 2), (12, 3, 2, 4), (64, 8, 3, 6),
                                           (8, 8, 4, 2)]),
       st.booleans(), st.booleans(), st.sampled_from([0, 2, 64]), st.integers(0, 2 ** 31))
def test_gate_topk_kernel(M, shape, biased, norm, grid, seed):
    # against moe.gate_ref on the same scores (an identity router: logits = x), the weights bit for bit
    # the torch path's (backend_torch.gate_weights); grid > 0 draws the logits and the bias from a grid of that many steps: exact ties,
    # within groups, between groups and in the top-K
    import backend_torch
    import moe
    E, G, TG, K = shape
    rng = np.random.default_rng(seed)
    draw = (lambda *sh: rng.integers(-grid, grid + 1, sh) / max(grid, 1)) if grid else (lambda *sh: rng.standard_normal(sh))
    x = draw(M, E).astype(np.float32)
    bias = draw(E).astype(np.float32) / 4 if biased else None
    a = SimpleNamespace(scoring_func="sigmoid", n_group=G, topk_group=TG, num_experts_per_tok=K, norm_topk_prob=norm,
                        routed_scaling_factor=2.5)
    w_ref, idx_ref = moe.gate_ref(x, np.eye(E, dtype=np.float32), bias, a)
    s = 1 / (1 + np.exp(-x))                                                 # gate_ref's scores, the same NumPy ops
    w, idx = kernels_cuda.gate_topk(torch.from_numpy(s).to(DEV), None if bias is None else torch.from_numpy(bias).to(DEV),
                                    K, G, TG, norm, 2.5)
    np.testing.assert_array_equal(idx.cpu().numpy(), idx_ref)                # comparisons only: the same choice
    np.testing.assert_allclose(w.cpu().numpy(), w_ref, rtol=4 * K * 2.0 ** -24, atol=0)   # NumPy sums pairwise
    torch_w = backend_torch.gate_weights(torch.from_numpy(s).to(DEV), idx, a)   # the torch path's eq. (14)
    np.testing.assert_array_equal(w.cpu().numpy(), torch_w.cpu().numpy())   # the same sum, best first: the same bits


def test_gate_topk_sums_best_first():
    # one score near 1 and seven below half its ulp: summed best first they vanish, summed pairwise (NumPy,
    # or a tree of lanes) they do not; the kernel's weights are the torch path's, bit for bit
    import backend_torch
    x = np.array([[20.0] + [-17.0] * 7], np.float32)
    s = 1 / (1 + np.exp(-x))
    assert s[0, 0] == 1 and (s[0, 1:] < 2.0 ** -24).all()                    # below half an ulp of 1
    a = SimpleNamespace(norm_topk_prob=True, routed_scaling_factor=1.0)
    w, idx = kernels_cuda.gate_topk(torch.from_numpy(s).to(DEV), None, 8)
    torch_w = backend_torch.gate_weights(torch.from_numpy(s).to(DEV), idx, a)
    np.testing.assert_array_equal(w.cpu().numpy(), torch_w.cpu().numpy())
    assert w[0, 0].item() == 1.0 and (s / s.sum())[0, 0] != 1.0                   # the order shows


@settings(max_examples=12)
@given(st.integers(1, 70), st.integers(1, 8), st.integers(1, 300), st.booleans(), st.integers(0, 2 ** 31))
def test_route_kernel(M, Kt, E, crowded, seed):
    # the same tables as backend_torch.route (torch's stable sort by expert), and what they mean, checked in NumPy
    import backend_torch
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, min(E, 3) if crowded else E, (M, Kt))                # crowded: long runs of one expert
    it = torch.from_numpy(idx).to(DEV)
    got = kernels_cuda.route(it, E, 16)
    for g, r in zip(got, backend_torch.route(it, E, 16)):
        np.testing.assert_array_equal(g.cpu().numpy(), r.cpu().numpy())
    rows, pair_at, block_expert = (g.cpu().numpy() for g in got)
    flat = idx.reshape(-1)
    live = rows >= 0
    np.testing.assert_array_equal(pair_at[live], np.argsort(flat, kind="stable"))   # every pair once, by expert
    assert (rows[live] == pair_at[live] // Kt).all() and (pair_at[~live] == M * Kt).all()
    assert (block_expert[np.nonzero(live)[0] // 16] == flat[pair_at[live]]).all()  # one expert a block
    used = np.zeros(len(block_expert), bool)
    used[np.nonzero(live)[0] // 16] = True
    assert (block_expert[~used] == -1).all()
    with pytest.raises(ValueError, match="at most 2048"):
        kernels_cuda.route(torch.zeros(1025, 2, dtype=torch.int64, device=DEV), E, 16)


@settings(max_examples=10)
@given(st.integers(1, 5), st.integers(1, 8), st.integers(1, 2200), st.booleans(), st.integers(0, 2 ** 31))
def test_moe_combine_kernel(M, Kt, d, official, seed):  # (d > 1024: more than one program's columns)
    # moe.moe_ref's sum in NumPy float32: each token's experts in id order, product then sum, the shared part last
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(16, Kt, replace=False) for _ in range(M)])
    out = rng.standard_normal((M, Kt, d)).astype(np.float32)
    w = rng.random((M, Kt)).astype(np.float32)
    shared = rng.standard_normal((M, d)).astype(np.float32)
    want = np.zeros((M, d), np.float32)
    for e in range(16):                                                      # as moe_ref: ascending expert id
        tok, slot = np.nonzero(idx == e)
        want[tok] += out[tok, slot] * w[tok, slot, None]
    want = want + shared
    want = quant.bf16_round(want) if official else want
    got = kernels_cuda.moe_combine(*(torch.from_numpy(a).to(DEV) for a in (out, w, idx, shared)), official)
    np.testing.assert_array_equal(got.cpu().numpy(), want)                   # bit for bit


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
def test_routed_and_shared_experts_through_the_kernels_equal_mlp_ref():
    # backend_torch.routed_grouped (grouped GEMM, swiglu_quant, rows written to their pairs' places) and
    # backend_torch.mlp with swiglu_quant against moe.mlp_ref per token and expert, official numerics. On a
    # GPU within 1% of the output's largest value (the tensor core's block sums, Triton's exp); in the
    # interpreter, whose FP8 casts are defective (15% off here), with exact quantisers in their place
    # (quant_torch's; swiglu_quant's own test holds the kernel), bit for bit; and routed_grouped's CPU branch
    import backend_torch
    import moe
    import quant_torch
    from helpers import rel_err
    rng = np.random.default_rng(5)
    E, d, I, M = 6, 128, 256, 5

    def fp8(n, k):
        return quant.Weight(*quant.weight_quant(rng.standard_normal((n, k)).astype(np.float32) / 8))
    ws = [{"w1": fp8(I, d), "w3": fp8(I, d), "w2": fp8(d, I)} for _ in range(E)]
    p = backend_torch.experts(ws, device=DEV, kern=kernels_cuda)
    x = quant.bf16_round(rng.standard_normal((M, d)).astype(np.float32))
    idx = np.stack([rng.choice(E, 3, replace=False) for _ in range(M)])
    want = np.stack([np.stack([moe.mlp_ref(x[m:m + 1], ws[e], True)[0] for e in idx[m]]) for m in range(M)])
    kern = kernels_cuda
    if INTERPRETED:
        kern = SimpleNamespace(**vars(kernels_cuda))
        kern.act_quant = quant_torch.act_quant
        kern.swiglu_quant = lambda a, b, official: quant_torch.act_quant(
            torch.from_numpy(quant.bf16_round(moe.silu(a.numpy()) * b.numpy())))
    close = (lambda g, w: np.testing.assert_array_equal(g, w)) if INTERPRETED else \
        (lambda g, w: np.testing.assert_array_less(rel_err(g, w), 1e-2))
    X, IDX = torch.from_numpy(x).to(DEV), torch.from_numpy(idx).to(DEV)
    got = backend_torch.routed_grouped(X, p, IDX, kern=kern).cpu().numpy()
    assert got.shape == (M, 3, d)
    close(got, want)
    if INTERPRETED:
        np.testing.assert_array_equal(backend_torch.routed_grouped(X, p, IDX).numpy(), want)
    sh = {k: backend_torch.weight(w, device=DEV, kern=kernels_cuda) for k, w in ws[0].items()}
    close(backend_torch.mlp(X, sh, True, kern=kern).cpu().numpy(), moe.mlp_ref(x, ws[0], True))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
def test_moe_takes_the_bookkeeping_kernels():  # (the warnings: the interpreter's NumPy on padding rows, garbage by contract)
    # backend_torch.moe with the kernels (FP8 experts, official numerics: the grouped GEMM) equals the same
    # layer with its bookkeeping in torch ops (gate's sorts, route's scatters, weighted_sum's loop), bit for
    # bit, for a decode step's tokens, and where route's one program would take too many pairs
    import backend_torch
    rng = np.random.default_rng(3)
    E, d, I = 16, 128, 128
    a = SimpleNamespace(scoring_func="sigmoid", n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=True,
                        routed_scaling_factor=2.5)

    def fp8(n, k):  # a checkpoint FP8 weight
        return quant.Weight(*quant.weight_quant(rng.standard_normal((n, k)).astype(np.float32) / 8))
    dev = partial(backend_torch.weight, device=DEV, kern=kernels_cuda)
    p = dict(backend_torch.experts([{"w1": fp8(I, d), "w3": fp8(I, d), "w2": fp8(d, I)} for _ in range(E)], device=DEV,
                                   kern=kernels_cuda),
             gate=quant.Weight(torch.from_numpy(rng.standard_normal((E, d)).astype(np.float32) / 8).to(DEV), None),
             gate_bias=torch.from_numpy(rng.standard_normal(E).astype(np.float32) / 8).to(DEV),
             shared_experts={k: dev(fp8(*sh)) for k, sh in (("w1", (I, d)), ("w3", (I, d)), ("w2", (d, I)))})
    torch_route = SimpleNamespace(**vars(kernels_cuda))
    torch_route.ROUTE_MAX = -1                                               # backend_torch.route in torch ops
    few = SimpleNamespace(**vars(kernels_cuda))
    few.ROUTE_MAX = 8                                                        # more pairs than that: torch's route
    for M, kern in ((2, kernels_cuda), (7, kernels_cuda), (7, few)):
        x = torch.from_numpy(quant.bf16_round(rng.standard_normal((M, d)).astype(np.float32))).to(DEV)
        got = backend_torch.moe(x, p, a, True, kern=kern)
        assert torch.isfinite(got).all()                                     # (the padding rows' garbage stays there)
        w, idx = backend_torch.gate(x, p["gate"].w, p["gate_bias"], a)
        out = backend_torch.routed_grouped(x, p, idx, kern=torch_route)
        y = backend_torch.weighted_sum(w, idx, out) + backend_torch.mlp(x, p["shared_experts"], True, kern=kernels_cuda)
        np.testing.assert_array_equal(got.cpu().numpy(), backend_torch.bf16_round(y).cpu().numpy())
