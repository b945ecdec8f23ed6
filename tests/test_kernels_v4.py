"""kernels_v4.py against mhc.py's references, with hypothesis-drawn shapes, streams, value scales and
Sinkhorn lengths: on a GPU for real, on the CPU under TRITON_INTERPRET=1 (conftest.py). The references
sum Φ x̄ in float64 and the kernels in float32, so the mixes agree to a few float32 ulps (the GPU's exp
is approximate too); a bf16 output may sit on the other side of a rounding boundary: one bf16 ulp."""
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels_v4  # noqa: E402
import mhc  # noqa: E402
import quant  # noqa: E402
from bounds import loads_and_stores_in_bounds  # noqa: E402, F401  (autouse: no address outside a kernel's arguments)
from conftest import HAS_CUDA  # noqa: E402

pytestmark = pytest.mark.slow      # the Triton kernels in the CPU interpreter: not in the fast loop (-m "not slow")

DEV = "cuda" if HAS_CUDA else "cpu"


def bf16_ulp(x):  # the spacing of bf16 values at |x| (8 significant bits), float64
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -126))) - 7)


def draw(rng, M, n, d, spread):  # bf16 streams, a mix matrix of V4's scale, base and α as trained ones
    X = quant.bf16_round((rng.standard_normal((M, n, d)) * spread).astype(np.float32))
    fn = (rng.standard_normal(((2 + n) * n, n * d)) / np.sqrt(n * d)).astype(np.float32)
    base = (rng.standard_normal((2 + n) * n) * 0.5).astype(np.float32)
    scale = (rng.random(3) * 2).astype(np.float32)
    return X, fn, base, scale


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEV)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 40), st.sampled_from([2, 4]), st.integers(1, 300), st.floats(0.01, 100), st.integers(1, 20),
       st.booleans(), st.integers(0, 2 ** 31))
def test_hc_mix_pre_kernel(M, n, d, spread, iters, official, seed):
    rng = np.random.default_rng(seed)
    X, fn, base, scale = draw(rng, M, n, d, spread)
    args = SimpleNamespace(rms_norm_eps=1e-6, hc_eps=1e-6, hc_sinkhorn_iters=iters)
    pre, post, comb, u = mhc.hc_mix_pre_ref(X, fn, base, scale, args, official)
    got = [g.cpu().numpy() for g in kernels_v4.hc_mix_pre(t(X), t(fn), t(base), scale, args, official)]
    for name, g, w in zip(("pre", "post", "comb"), got, (pre, post, comb)):
        assert g.shape == w.shape and np.abs(g - w).max() <= 2e-5, name      # values in (0, 2]: float32 ulps
    ref_u = np.einsum("mn,mnd->md", pre.astype(np.float64), X.astype(np.float64))
    # the kernel's own mixes (within 2e-5 of the reference's, above) and fp32 sums of n terms
    tol = 2e-5 * np.abs(X).sum(1) + n * 2.0 ** -24 * np.einsum("mn,mnd->md", pre, np.abs(X))
    assert u.shape == ref_u.shape
    own = n * 2.0 ** -24 * np.einsum("mn,mnd->md", pre, np.abs(X))          # the reference's own u: its mixes, fp32 sums
    if official:                                                             # bf16 values: one ulp beyond that
        assert np.array_equal(got[3], quant.bf16_round(got[3]))
        assert np.all(np.abs(got[3] - ref_u) <= bf16_ulp(ref_u) * 1.0001 + tol)
        assert np.all(np.abs(u - ref_u) <= bf16_ulp(ref_u) * 1.0001 + own)
    else:
        assert np.all(np.abs(got[3] - ref_u) <= tol)
        assert np.all(np.abs(u - ref_u) <= own)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 24), st.sampled_from([2, 4, 8]), st.integers(1, 600), st.floats(0.01, 100), st.booleans(),
       st.integers(0, 2 ** 31))
def test_hc_post_kernel(M, n, d, spread, official, seed):
    rng = np.random.default_rng(seed)
    X = quant.bf16_round((rng.standard_normal((M, n, d)) * spread).astype(np.float32))
    y = quant.bf16_round((rng.standard_normal((M, d)) * spread).astype(np.float32))
    post = (2 * rng.random((M, n))).astype(np.float32)
    # a mix far from symmetric (B_ij - B_ji > 0.5 for i < j): a Sinkhorn matrix of 2 streams is symmetric, so
    # a transposed mix would pass with it
    comb = ((0.5 * rng.random((M, n, n)) + np.triu(np.ones((n, n)), 1)) / n).astype(np.float32)
    want = mhc.hc_post_ref(X, y, post, comb, official)
    got = kernels_v4.hc_post(t(X), t(y), t(post), t(comb), official).cpu().numpy()
    exact = post.astype(np.float64)[:, :, None] * y[:, None, :] + np.einsum("mij,mid->mjd", comb.astype(np.float64), X)
    mag = np.abs(post)[:, :, None] * np.abs(y)[:, None, :] + np.einsum("mij,mid->mjd", comb.astype(np.float64), np.abs(X))
    fp32 = (n + 1) * 2.0 ** -24 * mag                   # fp32 sums of n + 1 terms (in any order, FMA or not)
    if official:                                        # one bf16 ulp of the exact value, beyond the fp32 error
        assert np.array_equal(got, quant.bf16_round(got)) and np.array_equal(want, quant.bf16_round(want))
        assert np.all(np.abs(got - exact) <= bf16_ulp(exact) * 1.0001 + fp32)
        assert np.all(np.abs(want - exact) <= bf16_ulp(exact) * 1.0001 + fp32)
    else:
        assert np.all(np.abs(got - exact) <= fp32)
        assert np.all(np.abs(want - exact) <= fp32)


def test_the_kernels_refuse_shapes_that_do_not_agree():
    args = SimpleNamespace(rms_norm_eps=1e-6, hc_eps=1e-6, hc_sinkhorn_iters=20)
    X = torch.zeros(2, 4, 8, device=DEV)
    with pytest.raises(ValueError, match="hc_mix_pre"):
        kernels_v4.hc_mix_pre(X, torch.zeros(24, 31, device=DEV), torch.zeros(24, device=DEV), [1, 1, 1], args)
    with pytest.raises(ValueError, match="hc_mix_pre"):
        kernels_v4.hc_mix_pre(torch.zeros(2, 3, 8, device=DEV), torch.zeros(15, 24, device=DEV),
                              torch.zeros(15, device=DEV), [1, 1, 1], args)
    with pytest.raises(ValueError, match="hc_post"):
        kernels_v4.hc_post(X, torch.zeros(2, 7, device=DEV), torch.zeros(2, 4, device=DEV), torch.zeros(2, 4, 4, device=DEV))


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 40), st.integers(1, 150), st.integers(1, 8), st.floats(0.01, 100), st.integers(-12, 4),
       st.booleans(), st.sampled_from(["fp16", "int8"]), st.integers(0, 2 ** 31))
def test_fp4_gemm_kernel(M, N, Kb, spread, e_lo, fnuz, route, seed):
    # quant.fp4_gemm's promotion order (per 32-wide K block: partial x activation scale x weight scale); the
    # fp16 route's fp32 sums of exact products may round a partial differently where it needs more than 24
    # bits (the int8 route's partials are exact), and decode shapes split K over programs whose partial sums
    # are added after: bounded by K/32 fp32 roundings of the magnitudes' sum (2^-23 each). fnuz (gfx942): the
    # same bytes read as e4m3fnuz are half the e4m3fn values, so the activation scales double (0x80, NaN
    # there, is -0 here: mapped to +0). The int8 route through kernels_rocm's gfx90a dispatch
    import kernels_rocm
    rng = np.random.default_rng(seed)
    K = 128 * Kb
    q, sa = quant.act_quant((rng.standard_normal((M, K)) * spread).astype(np.float32))
    codes = np.array(q.view(np.uint8))
    codes[codes == 0x80] = 0
    q = codes.view(quant.E4M3)
    packed = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
    sb = np.exp2(rng.integers(e_lo, e_lo + 6, (N, K // 32))).astype(np.float32)
    want = quant.fp4_gemm(q, sa, packed, sb)
    mag = quant.fp4_gemm((codes & 0x7F).view(quant.E4M3), sa, packed & 0x77, sb)          # sum of |terms|, a bound
    args = t(codes), t(sa * (2 if fnuz else 1)), t(packed), t(sb)
    if route == "int8":
        got = kernels_rocm.fp4_gemm(*args, fnuz=fnuz, arch="gfx90a").cpu().numpy()
    else:
        got = kernels_v4.fp4_gemm(*args, fnuz=fnuz).cpu().numpy()
    assert np.all(np.abs(got - want) <= (K // 32) * 2.0 ** -23 * mag)      # + the K splits' fp32 sum
    if route == "int8" and Kb == 1:                                         # 4 blocks: never split (8 at least a split)
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="route"):
        kernels_rocm.fp4_gemm(*args, arch="gfx90a", route="int4")


def test_fp4_exact_routes_on_extreme_codes():
    # the int8 route's and the GEMV's partials are exact integers: on codes at the ends of both formats (448,
    # its neighbours, subnormals, both signs; e2m1's 6, 0.5, -0) some 32-wide partial sums need more than 24
    # bits, where an fp32 sum of the same products (the fp16 route's MMA) may round: the exact kernels may not
    import backend_torch
    rng = np.random.default_rng(5)
    M, N, K = 16, 64, 128
    codes = rng.choice(np.array([0x7E, 0xFE, 0x7D, 0xFD, 0x01, 0x81, 0x03, 0x83, 0x09], np.uint8), (M, K))
    packed = rng.choice(np.array([0x77, 0xF7, 0x7F, 0x71, 0x17, 0x97, 0x79, 0x11], np.uint8), (N, K // 2))
    sa, sb = np.ones((M, 1), np.float32), np.ones((N, K // 32), np.float32)
    want = quant.fp4_gemm(codes.view(quant.E4M3), sa, packed, sb)
    got = kernels_v4.fp4_gemm(t(codes), t(sa), t(packed), t(sb), int8=True).cpu().numpy()
    np.testing.assert_array_equal(got, want)
    rows, _, be = backend_torch.route(t(np.zeros((M, 1), np.int64)), 1, 16)        # every token to the one expert
    for gemv in (True, False):
        got = kernels_v4.fp4_moe_gemm(t(codes), t(sa), t(packed)[None], t(sb)[None], rows, be, gemv=gemv,
                                      int8=True).cpu().numpy()
        np.testing.assert_array_equal(got[:M], want, err_msg="gemv" if gemv else "mma int8")


def draw_sparse(rng, B, T, H, c, P, n, K, official):  # q, window and compressed keys, keys listed and dense
    rnd = quant.bf16_round if official else quant.no_round
    q = rnd(rng.standard_normal((B, T, H, c)).astype(np.float32))
    KW, KC = (rnd(rng.standard_normal((B, r, c)).astype(np.float32)) for r in (P, n))
    n_dense = rng.integers(0, n + 1, T)
    idx = np.full((B, T, K), -1)
    for b in range(B):
        for t in range(T):
            free = np.concatenate([np.arange(P), P + np.arange(n_dense[t], n)])   # never a dense key twice
            pick = rng.choice(free, min(len(free), rng.integers(0, K + 1)), replace=False)
            idx[b, t, rng.choice(K, len(pick), replace=False)] = pick             # -1 anywhere in the list
    sink = (rng.standard_normal(H) * 2).astype(np.float32)
    return q, KW, KC, idx, n_dense, sink


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 2), st.integers(1, 5), st.integers(1, 20), st.sampled_from([64, 128]), st.integers(0, 40),
       st.integers(0, 90), st.integers(1, 48), st.booleans(), st.sampled_from([None, 1, 3]), st.integers(0, 2 ** 31))
def test_sparse_attention_kernel(B, T, H, c, P, n, K, official, splits, seed):
    # the reference sums in float64 and the kernel in fp32 (splits combined after), and the logits' last bit
    # may differ: a probability then rounds to the other bf16 neighbour (official), moving the output by at
    # most 2^-8 of that key's term; otherwise one bf16 ulp of the output
    import attention_v4
    rng = np.random.default_rng(seed)
    q, KW, KC, idx, n_dense, sink = draw_sparse(rng, B, T, H, c, max(P, 1), n, K, official)
    scale = c ** -0.5
    want = attention_v4.sparse_attention_ref(q, KW, KC, idx, n_dense, sink, scale, official)
    got = kernels_v4.sparse_attention(t(q), t(KW), t(KC), t(idx), t(n_dense), t(sink), scale, official,
                                      splits).cpu().numpy()
    keys = np.concatenate([KW, KC], 1).astype(np.float64)
    z = np.einsum("bthc,bsc->bths", q.astype(np.float64), keys) * scale
    allowed = np.zeros(z.shape[:2] + z.shape[3:], bool)                       # [B, T, S] from the lists
    bb, tt, jj = np.nonzero(idx >= 0)
    allowed[bb, tt, idx[bb, tt, jj]] = True
    allowed[:, :, KW.shape[1]:] |= np.arange(KC.shape[1])[None, None] < n_dense[None, :, None]
    z = np.where(allowed[:, :, None], z, -np.inf)
    m = np.maximum(z.max(-1, keepdims=True), sink[None, None, :, None])
    e = np.exp(z - m)
    p = e / (e.sum(-1, keepdims=True) + np.exp(sink[None, None, :, None] - m))   # [B, T, H, S]
    term = p[..., None] * np.abs(keys)[:, None, None]                          # [B, T, H, S, c]
    mag, top = term.sum(3), term.max(3)
    exact = np.einsum("bths,bsc->bthc", p, keys)
    assert got.shape == want.shape
    if official:
        assert np.array_equal(got, quant.bf16_round(got))
        assert np.all(np.abs(got - want) <= bf16_ulp(exact) * 1.0001 + 2.0 ** -7 * top + 2.0 ** -20 * mag)
    else:
        assert np.all(np.abs(got - exact) <= 2.0 ** -19 * mag + 1e-30)
        assert np.all(np.abs(want - exact) <= 2.0 ** -19 * mag + 1e-30)


def test_sparse_attention_at_v4_flash_width():
    # V4-Flash's decode shape: 64 heads of 512 against a 128-key window and 512 picks (here 40 of them)
    import attention_v4
    rng = np.random.default_rng(7)
    q, KW, KC, idx, n_dense, sink = draw_sparse(rng, 1, 1, 64, 512, 128, 60, 168, True)
    want = attention_v4.sparse_attention_ref(q, KW, KC, idx, n_dense, sink, 512 ** -0.5, True)
    got = kernels_v4.sparse_attention(t(q), t(KW), t(KC), t(idx), t(n_dense), t(sink), 512 ** -0.5, True).cpu().numpy()
    assert np.abs(got - want).max() <= 2 * bf16_ulp(np.abs(want).max())


def test_window_indices_are_the_window_mask_in_the_official_layout():
    # the same keys as the mask, listed oldest first with the -1 padding at the end, in min(T, W) columns
    # for a prefill from position 0 and W otherwise (the official index layout: its blocks of 64 columns
    # decide the official rounding)
    import attention_v4
    for T, start, W in ((1, 0, 4), (1, 2, 4), (1, 9, 4), (7, 3, 4), (9, 0, 16), (30, 0, 16), (3, 15, 16), (5, 40, 16)):
        P = min(start, W - 1)
        pos = start - P + np.arange(P + T)
        mask = attention_v4.window_mask_ref(T, start, pos, W)
        idx = attention_v4.window_indices_ref(T, start, P, W)
        assert idx.shape == (T, min(T, W) if start == 0 else W)
        got = np.zeros_like(mask)
        tt, jj = np.nonzero(idx >= 0)
        got[tt, idx[tt, jj]] = True
        assert np.array_equal(got, mask), (T, start, W)
        n = (idx >= 0).sum(1)
        assert (idx[np.arange(idx.shape[1])[None] >= n[:, None]] == -1).all()         # the padding last
        for row, k in zip(idx, n):
            assert (np.diff(pos[row[:k]]) == 1).all()                                 # oldest first


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 2), st.integers(1, 40), st.integers(1, 6), st.sampled_from([32, 64, 128]), st.integers(0, 150),
       st.integers(0, 600), st.booleans(), st.integers(0, 2 ** 31))
def test_index_scores_v4_kernel(B, T, J, D, n, start_pos, official, seed):
    # official: q and the keys are FP4 values (the official fake quant), so each head's q . K is exact in any
    # order; with 16 queries or more the kernel sums the heads in order as the reference: equal bit for bit;
    # fewer (decode) sum them as a tree: within fp32 rounding of the head sum, then one bf16 ulp. exact: fp32
    import compressor
    rng = np.random.default_rng(seed)
    if official:
        q = compressor.index_fp4_ref(rng.standard_normal((B, T, J, D)).astype(np.float32))
        K = compressor.index_fp4_ref(rng.standard_normal((B, max(n, 1), D)).astype(np.float32))[:, :n]
        w = quant.bf16_round(rng.standard_normal((B, T, J)).astype(np.float32))
    else:
        q, K, w = (rng.standard_normal(s).astype(np.float32) for s in ((B, T, J, D), (B, n, D), (B, T, J)))
    want = compressor.index_scores_v4_ref(q, w, K, official)
    visible = np.arange(n)[None, :] < ((start_pos + np.arange(T) + 1) // 4)[:, None]
    want = np.where(visible[None], want, -np.inf)
    got = kernels_v4.index_scores_v4(t(q), t(w), t(K), start_pos, 4, official).cpu().numpy()
    mag = np.einsum("btj,btjs->bts", np.abs(w), np.einsum("btjd,bsd->btjs", np.abs(q), np.abs(K)))   # Σ|terms|
    assert np.array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    if official and T >= 16:
        assert np.array_equal(got, want)
    elif official:
        assert np.all(np.abs(got[fin] - want[fin]) <= bf16_ulp(want[fin]) * 1.0001 + J * 2.0 ** -24 * mag[fin])
    else:
        assert np.all(np.abs(got[fin] - want[fin]) <= 2.0 ** -20 * mag[fin] + 1e-30)


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.sampled_from([4, 16, 128]), st.sampled_from([64, 512]), st.sampled_from([16, 64]),
       st.booleans(), st.booleans(), st.floats(0.01, 30), st.integers(0, 2 ** 31))
def test_compress_keys_kernel(B, k, m, c, R, official, first, spread, seed):
    # the compressor's pooling (CSA's overlapping windows for m = 4, from the window before or none), RMSNorm and
    # RoPE, against compressor.pool_ref, rms_norm and rope_tail as compress_ref composes them
    import compressor
    rng = np.random.default_rng(seed)
    overlap = m == 4
    h = 2 * c if overlap else c
    rows = (rng.standard_normal((B, k * m, 2 * h)) * spread).astype(np.float32)
    prev = None if first or not overlap else tuple((rng.standard_normal((B, m, h)) * spread).astype(np.float32)
                                                 for _ in range(2))
    norm = (1 + 0.1 * rng.standard_normal(c)).astype(np.float32)
    ang = rng.random((k, R // 2)) * 6
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    rnd = quant.bf16_round if official else quant.no_round
    pooled = compressor.pool_ref(rows[..., :h], rows[..., h:], prev, m, overlap)
    want = rnd(compressor.rope_tail(compressor.rms_norm(rnd(pooled), norm, 1e-6, rnd)[:, :, None], cos, sin)[:, :, 0])
    Cp, Zp = prev if prev is not None else (np.zeros((B, m, h), np.float32), np.full((B, m, h), -np.inf, np.float32))
    got = kernels_v4.compress_keys(t(rows), t(Cp), t(Zp), t(norm), t(cos), t(sin), 1e-6, m, overlap, official).cpu().numpy()
    assert got.shape == want.shape == (B, k, c)
    if official:                                     # the pooled sum or the norm on a bf16 rounding boundary: an ulp
        assert np.all(np.abs(got - want) <= 2 * bf16_ulp(want) + 1e-30)
    else:
        assert np.abs(got - want).max(initial=0) <= 1e-5 * max(1.0, np.abs(want).max(initial=0))


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 12), st.integers(1, 5), st.integers(1, 3), st.integers(1, 100), st.integers(1, 8),
       st.sampled_from(["mma fp16", "mma int8", "gemv"]), st.booleans(), st.integers(0, 2 ** 31))
@example(12, 4, 3, 64, 3, "gemv", False, 1).via("the blocks' order matters in about 1% of the outputs here")
@example(12, 4, 3, 64, 3, "mma int8", True, 1).via("as for the GEMV")
def test_fp4_moe_gemm_kernel(M, E, Kt, N, Kb, kernel, fnuz, seed):
    # the routed experts' grouped FP4 GEMM: each routed (token, expert) pair's row through its expert, rows
    # gathered and padded by backend_torch.route as for the FP8 experts; against quant.fp4_gemm per pair.
    # The int8 route and the decode GEMV sum each block's exact integers and add the blocks in order: bit for
    # bit where K is not split (the MMA kernel never splits it; the GEMV not below K = 512: 4 tiles of 128 at
    # least a split); the fp16 route and a split GEMV within the K/32 fp32 roundings of test_fp4_gemm_kernel
    import backend_torch
    rng = np.random.default_rng(seed)
    K, Kt = 128 * Kb, min(Kt, E)
    q, sa = quant.act_quant(rng.standard_normal((M, K)).astype(np.float32) * rng.choice([0.01, 1, 100], (M, 1)))
    codes = np.array(q.view(np.uint8))
    codes[codes == 0x80] = 0                                                        # (NaN in e4m3fnuz)
    q = codes.view(quant.E4M3)
    packed = rng.integers(0, 256, (E, N, K // 2)).astype(np.uint8)
    sb = np.exp2(rng.integers(-12, 0, (E, N, K // 32))).astype(np.float32)
    idx = np.argsort(rng.random((M, E)), 1)[:, :Kt]                                  # distinct experts per token
    rows, pair_at, block_expert = backend_torch.route(t(idx), E, 16)
    got = kernels_v4.fp4_moe_gemm(t(codes), t(sa * (2 if fnuz else 1)), t(packed), t(sb), rows, block_expert, fnuz=fnuz,
                                  gemv=kernel == "gemv", int8=kernel == "mma int8").cpu().numpy()
    rows, pair_at = rows.cpu().numpy(), pair_at.cpu().numpy()
    for p in np.nonzero(rows >= 0)[0]:
        m, e = rows[p], idx.reshape(-1)[pair_at[p]]
        want = quant.fp4_gemm(q[m:m + 1], sa[m:m + 1], packed[e], sb[e])[0]
        if kernel == "mma fp16" or (kernel == "gemv" and K >= 512):
            mag = quant.fp4_gemm((codes[m:m + 1] & 0x7F).view(quant.E4M3), sa[m:m + 1], packed[e] & 0x77, sb[e])[0]
            assert np.all(np.abs(got[p] - want) <= (K // 32) * 2.0 ** -23 * mag), (p, m, e)
        else:
            np.testing.assert_array_equal(got[p], want, err_msg=f"row {p}: token {m}, expert {e}")


@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_sparse_attention_kernel_on_the_official_trace(layer):
    # the official code's own attention inputs (tests/fixtures: q, the cached keys, its index list with the
    # window's columns, the picks and HCA's windows) on 17 prefill queries from position 60 on (two blocks
    # or more): the kernel walks the list in blocks of 64 as the official kernel, and its only freedom is
    # the fp32 order of each block's sums (measured: 7 of 34816 values one bf16 step off, all in layer 1)
    import attention_v4
    import checkpoint
    from conftest import FIXTURE_V4_CKPT, FIXTURE_V4_TRACE
    assert kernels_v4.BLOCK == attention_v4.BLOCK
    tr = np.load(FIXTURE_V4_TRACE)
    rows = np.arange(60, 206, 9)
    sink = np.asarray(checkpoint.Checkpoint(FIXTURE_V4_CKPT).get(f"layers.{layer}.attn.attn_sink"))
    KC = tr[f"l{layer}.comp_kv"] if f"l{layer}.comp_kv" in tr else np.zeros((0, 128), np.float32)
    want = tr[f"l{layer}.attn_kernel_out"][rows]
    got = kernels_v4.sparse_attention(t(tr[f"l{layer}.q"][rows][None]), t(tr[f"l{layer}.kv"][None]), t(KC[None]),
                                      t(tr[f"l{layer}.attn_topk_idxs"][rows][None]), t(np.zeros(len(rows), np.int64)),
                                      t(sink.astype(np.float32)), 128 ** -0.5, True)[0].cpu().numpy()
    top = np.abs(want).max(-1, keepdims=True)                                   # each (query, head)'s largest
    assert np.all(np.abs(got - want) <= bf16_ulp(top))
    assert (got != want).mean() <= 0.002
