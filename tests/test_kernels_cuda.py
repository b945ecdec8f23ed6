"""kernels_cuda.py's kernels (NVIDIA's entry point: the DSA kernels and RoPE) against their references: top-k
as sets against indexer.topk_select_ref / topk_indices_ref, index_scores against index_scores_causal_ref,
index_prep against indexer.index_prep_ref, store_latent against act_quant and ml_dtypes, sparse MLA decode and
prefill against float64 attention, RoPE and bf16 rounding bit for bit; on a GPU for real, on the CPU under
TRITON_INTERPRET=1 (conftest.py), allowing exactly the interpreter's fp32->fp8 cast defects (spec/kernels.md §4.3).
On a GPU, that the torch path takes the kernels."""
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels_cuda
import quant
from bounds import loads_and_stores_in_bounds  # noqa: F401  (autouse: no address outside a kernel's arguments)
from conftest import gpu
from helpers import DEV, INTERPRETED, assert_codes, t8

pytestmark = pytest.mark.slow      # the Triton kernels in the CPU interpreter: not in the fast loop (-m "not slow")


@gpu
def test_kernels_are_used_on_the_gpu():
    import backend_torch
    ops = backend_torch.torch_ops("cuda")
    assert ops.kernels is not None


@pytest.mark.parametrize("strided", [None, False, True])
def test_topk_kernel_paths(strided):
    """Step 2's paths in one call, with step 1's lists and without: rows of 61-68 causal keys against a
    64-key register tile (unlisted rows in registers, listed rows in registers and streamed; their lists
    of 24-32 keys are too long for strided's 64 / 4); and the defaults a decode step takes (a 4096-key
    register tile; lists past 4 x 2048 keys, or 4 x 4096 past 64K context), on rows long enough to build
    lists and one too short to. strided: the same rows with a 128-key tile (lists of up to 32 read by fixed
    stride, ten rows of one call), a list of exactly one past the stride (joined), one whole-row list;
    None: as a caller who leaves it out (strided where the tile is in registers)."""
    import indexer
    rng = np.random.default_rng(5)
    I = rng.standard_normal((2, 8, 68)).astype(np.float32)
    I[1, 3, :20] = np.round(I[1, 3, :20])                                  # ties inside a listed row
    I[0, 5] = np.linspace(-1, 1, 68)                                      # rising: the longest list past 16
    got = kernels_cuda.topk_indices(torch.from_numpy(I).to(DEV), 12, 60, sample=16, regs=64, segments=3, few=4, block=16,
                                    strided=strided)
    np.testing.assert_array_equal(got.cpu().numpy(), indexer.topk_indices_ref(I, 12, 60))
    if strided:
        got = kernels_cuda.topk_indices(torch.from_numpy(I).to(DEV), 12, 60, sample=16, regs=128, segments=3, few=4,
                                        block=16, strided=True)
        np.testing.assert_array_equal(got.cpu().numpy(), indexer.topk_indices_ref(I, 12, 60))
        tight = np.full((1, 1, 68), -1, np.float32)                       # 2 lists: 33 keys (stride 32 + 1), 5
        tight[0, 0, :33], tight[0, 0, 32], tight[0, 0, 48::4] = 1, 2, 1
        flat = np.full((1, 1, 64), 0.5, np.float32)                       # 1 list of every key, K past the row
        for I2, K, kw in ((tight, 3, dict(regs=64, segments=2, block=16)), (flat, 100, dict(regs=64, segments=1))):
            got = kernels_cuda.topk_indices(torch.from_numpy(I2).to(DEV), K, I2.shape[2] - 1, sample=16, strided=True, **kw)
            np.testing.assert_array_equal(got.cpu().numpy(), indexer.topk_indices_ref(I2, K, I2.shape[2] - 1))
    for shape, K in (((1, 1, 20000), 2048), ((1, 2, 17000), 2048), ((1, 1, 12000), 2048), ((1, 1, 70000), 1024)):
        I = rng.standard_normal(shape).astype(np.float32)
        past = shape[2] - shape[1]
        got = kernels_cuda.topk_indices(torch.from_numpy(I).to(DEV), K, past, strided=strided)
        np.testing.assert_array_equal(got.cpu().numpy(), indexer.topk_indices_ref(I, K, past), err_msg=str(shape))


def test_topk_kernel_counts_at_their_widths():
    """Step 2 packs its counts: the radix bucket's (bin, keys above it, keys in it) in 8 + 24 + 24 bits of
    one int64, and a tile's (keys above the K-th, keys equal to it) in 16 + 16 bits of one int32. Each field
    past what 16 bits hold, and a tile's at the 16384 keys allowed, all keys equal, streamed and in
    registers; a row of 2^24 keys refused."""
    import indexer
    rng = np.random.default_rng(7)
    P = lambda a: torch.from_numpy(a).to(DEV)
    flat = np.full((1, 1, 16384), 0.5, np.float32)                            # 16384 equal keys in one tile
    for kw in (dict(block=16384, regs=0), dict(regs=16384)):
        got = kernels_cuda.topk_indices(P(flat), 16384, 16383, sample=8192, **kw).cpu().numpy()
        np.testing.assert_array_equal(got, indexer.topk_indices_ref(flat, 16384, 16383), err_msg=str(kw))
    wide = rng.standard_normal((1, 1, 70000)).astype(np.float32)              # 69000 keys above the bucket's
    one_bin = np.full((1, 1, 65601), 0.25, np.float32)                        # 65600 keys in the chosen bin
    one_bin[0, 0, 12345] = 1.0
    for I, K in ((wide, 69000), (one_bin, 1000)):
        got = kernels_cuda.topk_indices(P(I), K, I.shape[2] - 1, regs=0, sample=32768).cpu().numpy()
        np.testing.assert_array_equal(got, indexer.topk_indices_ref(I, K, I.shape[2] - 1), err_msg=str(K))
    with pytest.raises(ValueError, match="16777216 keys a row"):
        kernels_cuda.topk_indices(torch.empty(1, 1, 1 << 24, device="meta"), 1, 0)


@settings(max_examples=10)
@given(st.integers(1, 2), st.integers(1, 9), st.integers(0, 300), st.sampled_from([1, 4, 16, 64]), st.booleans(),
       st.sampled_from([16, 32, 128]), st.integers(0, 2 ** 31))
def test_index_scores_kernel(B, T, past, J, fp8, block_n, seed):
    import indexer
    rng = np.random.default_rng(seed)
    S, D = past + T, 128
    q = rng.standard_normal((B, T, J, D)).astype(np.float32)
    k = rng.standard_normal((B, S, D)).astype(np.float32)
    w = rng.standard_normal((B, T, J)).astype(np.float32)
    ks = np.exp2(rng.integers(-3, 3, (B, S))).astype(np.float32)
    if fp8:
        q, k = q.astype(quant.E4M3), k.astype(quant.E4M3)
        args = (t8(q), torch.from_numpy(w).to(DEV), t8(k), torch.from_numpy(ks).to(DEV))
    else:
        args = tuple(torch.from_numpy(a).to(DEV) for a in (q, w, k, ks))
    got = kernels_cuda.index_scores(*args, start_pos=past, block_n=block_n, programs=7).cpu().numpy()
    ref = indexer.index_scores_causal_ref(q, w, k, ks, past)                  # the kernel's contract
    causal = np.isfinite(ref)                                                  # [B, T, S]: the visible keys
    assert np.array_equal(np.isneginf(got), ~causal)                           # future keys: -inf, no others
    scale = (np.abs(w).sum(-1)[..., None] * ks[:, None, :]).max() * D
    tol = (2.0 ** -12 if (fp8 and not INTERPRETED) else 1e-6) * scale
    assert np.abs(np.where(causal, got - np.where(causal, ref, 0), 0)).max() <= tol


def packed_rows(kv, pe):
    """The FP8 latent cache rows of spec/kernels.md §3.4 built with ml_dtypes (the oracle's side):
    [..., C] latent, [..., R] rope -> [..., C + 4 C/128 + 2 R] bytes, and the values they hold."""
    codes, scales = quant.act_quant(kv.astype(np.float32))
    rope = quant.bf16_round(pe.astype(np.float32))
    rows = np.concatenate([codes.view(np.uint8), scales.astype(np.float32).view(np.uint8),
                           rope.astype(quant.BF16).view(np.uint8)], -1)
    return rows, quant.act_dequant(codes, scales).astype(np.float64), rope.astype(np.float64)


@settings(max_examples=10)
@given(st.integers(1, 2), st.integers(1, 3), st.sampled_from([1, 16, 20, 64, 128]), st.integers(1, 40),
       st.integers(1, 48), st.sampled_from(["fp8", "bf16", "fp32"]), st.booleans(), st.sampled_from([None, 1, 3]),
       st.integers(0, 2 ** 31))
def test_sparse_mla_kernel(B, T, H, L, K, cache_fmt, dense, splits, seed):
    """Decode (splits + combine) and prefill (one pass) against a float64 softmax over the selected
    rows; the packed FP8 rows are built with ml_dtypes, and read by FP8 conversion or (ROCm's path)
    by integer decoding of the bytes. Selections hold causal positions first, then -1 padding (whole
    blocks of it, and rows with nothing selected), with contexts shorter than K."""
    rng = np.random.default_rng(seed)
    C, R = 128, 32                                             # small latent for the interpreter (real: 512 + 64)
    past = int(rng.integers(0, L))                             # the first query's position
    T = min(T, L - past)
    qa = quant.bf16_round(rng.standard_normal((B, T, H, C))).astype(np.float64)   # bf16 values, as the model's
    qp = quant.bf16_round(rng.standard_normal((B, T, H, R))).astype(np.float64)
    kv, pe = rng.standard_normal((B, L, C)) * 2, rng.standard_normal((B, L, R))
    if cache_fmt == "fp8":
        rows, kv, pe = packed_rows(kv, pe)
        cache = torch.from_numpy(rows).to(DEV)
    else:
        if cache_fmt == "bf16":
            kv, pe = quant.bf16_round(kv).astype(np.float64), quant.bf16_round(pe).astype(np.float64)
        cache = torch.from_numpy(np.concatenate([kv, pe], -1).astype(np.float32)).to(DEV)
        cache = cache.to(torch.bfloat16) if cache_fmt == "bf16" else cache
    idx = np.full((B, T, K), -1)                               # topk_indices's layout: causal entries first, then -1
    for b in range(B):
        for t in range(T):
            n = int(rng.integers(0, min(K, past + t + 1) + 1))  # some rows select nothing at all
            idx[b, t, :n] = rng.permutation(past + t + 1)[:n]
    scale = 0.1
    tq = [torch.from_numpy(a.astype(np.float32)).to(DEV) for a in (qa, qp)]
    sel_t = None if dense else torch.from_numpy(idx).to(DEV)
    decode = cache_fmt == "fp8" and bool(rng.integers(0, 2))  # bytes decoded by integer arithmetic (gfx90a/gfx942)
    tiles = dict(block_n=16, q_in_loop=bool(rng.integers(0, 2)), halves=bool(rng.integers(0, 2)),
                 late_sum=bool(rng.integers(0, 2)), ahead=bool(rng.integers(0, 2)), clamp=bool(rng.integers(0, 2)))
    limit, kernels_cuda.ROW32_LIMIT = kernels_cuda.ROW32_LIMIT, 2 ** 31 if rng.integers(0, 2) else 0  # 64-bit rows too
    try:
        if splits == 1:
            got, lse = kernels_cuda.sparse_mla_prefill(*tq, cache, sel_t, scale, past, S=past + T, out_dtype=torch.float32,
                                                       decode=decode, **tiles)
        else:
            got, lse = kernels_cuda.sparse_mla_decode(*tq, cache, sel_t, scale, past, S=past + T, splits=splits,
                                                      decode=decode, **tiles)
    finally:
        kernels_cuda.ROW32_LIMIT = limit
    got, lse = got.cpu().numpy(), lse.cpu().numpy()
    tol = 1e-5 if cache_fmt == "fp32" else 2.0 ** -8          # 16-bit MMA operands: p is rounded
    for b in range(B):
        for t in range(T):
            sel = np.arange(past + t + 1) if dense else idx[b, t][idx[b, t] >= 0]
            if len(sel) == 0:
                assert np.all(got[b, t] == 0) and np.all(np.isneginf(lse[b, t])), "no keys: zero output"
                continue
            z = (qa[b, t] @ kv[b, sel].T + qp[b, t] @ pe[b, sel].T) * scale             # [H, n] float64
            p = np.exp(z - z.max(1, keepdims=True))
            ref = (p / p.sum(1, keepdims=True)) @ kv[b, sel]
            assert np.abs(got[b, t] - ref).max() <= tol * np.abs(kv[b, sel]).max(), (b, t)
            ref_lse = (z.max(1) + np.log(p.sum(1))) / np.log(2)
            assert np.abs(lse[b, t] - ref_lse).max() <= 1e-3 * max(1, np.abs(ref_lse).max())


def test_sparse_mla_refuses_shapes_that_do_not_fit():
    """Both entry points (and so the Hopper variant behind the prefill one) check the shapes first."""
    qa, qp = torch.zeros(1, 2, 16, 128, device=DEV), torch.zeros(1, 2, 16, 32, device=DEV)
    cache, idx = torch.zeros(1, 8, 160, device=DEV), torch.zeros(1, 2, 4, dtype=torch.int32, device=DEV)
    for fn in (kernels_cuda.sparse_mla_decode, kernels_cuda.sparse_mla_prefill):
        with pytest.raises(ValueError, match="idx"):
            fn(qa, qp, cache, idx[:, :1], 0.1, 0)                          # [B, 1, K] for two queries
        with pytest.raises(ValueError, match="do not fit"):
            fn(qa, qp[:, :, :8], cache, idx, 0.1, 0)                       # q^R for 8 heads of 16
        with pytest.raises(ValueError, match="do not fit"):
            fn(qa, qp, cache[..., :150], idx, 0.1, 0)                      # rows of another width


@settings(max_examples=16)
@given(st.integers(1, 2), st.integers(1, 4), st.integers(0, 150), st.integers(1, 40), st.sampled_from(["normal", "ties", "equal"]),
       st.sampled_from([16, 64]), st.sampled_from([(2048, None), (16, None), (16, 1)]), st.sampled_from([None, 1, 3]),
       st.sampled_from([1, 2, 4]), st.sampled_from([1, 4, 256]), st.sampled_from([0, 16, 64, 256]),
       st.sampled_from([None, False, True]), st.integers(0, 2 ** 31))
def test_topk_kernel(B, T, past, K, values, block, sample_cap, segments, digits, few, regs, strided, seed):
    """Exact top-k as sets against topk_select_ref: contexts shorter than k, exactly k (past + t + 1 =
    K happens), one token; many ties (rounded scores, +0 and -0), a row of one repeated value, -inf.
    A small sample puts rows of >= 64 keys on the sampled-threshold lists (in 1 or 3 segments per row,
    or as many as fill the GPU), their threshold found with 1, 2 or 4 radix digits; a list capacity of 1
    forces the fall-back to the whole row there. The radix select's later digits run over the keys
    left in the chosen bin once it holds at most `few` (1, 4: sometimes, 256: after the first digit).
    Step 2 holds a row's keys (or lists) in registers when they number at most `regs`, else streams
    them for each digit: 16 streams almost every row, 256 none, 0 (the kernel compiled without the
    register path) every row (test_topk_kernel_paths: both paths in one call, with lists); strided reads
    listed rows whose lists fit regs / segments each by fixed stride."""
    sample, cap = sample_cap
    with pytest.raises(ValueError, match="K = 0 < 1"):
        kernels_cuda.topk_indices(torch.zeros(1, 1, 4, device=DEV), 0, 0)
    with pytest.raises(ValueError, match="digits = 5"):
        kernels_cuda.topk_indices(torch.zeros(1, 1, 4, device=DEV), 1, 0, digits=5)
    for bad, match in ((dict(few=3), "few = 3 is not a power of two"), (dict(sample=1000), "sample = 1000 is not"),
                       (dict(block=96), "block = 96 is not"), (dict(segments=0), "segments = 0"), (dict(cap=0), "cap = 0"),
                       (dict(block=32768), "at most 16384"), (dict(regs=32768), "at most 16384"),
                       (dict(num_warps=64), "regs = 32768"),              # the register tile num_warps makes
                       (dict(regs=100), "regs = 100 is not"), (dict(sample=0), "sample = 0 is not")):
        with pytest.raises(ValueError, match=match):
            kernels_cuda.topk_indices(torch.zeros(1, 1, 4, device=DEV), 1, 0, **bad)
    import indexer
    rng = np.random.default_rng(seed)
    S = past + T
    I = rng.standard_normal((B, T, S)).astype(np.float32)
    if values == "ties":
        I = np.round(I).astype(np.float32)                         # many exact ties (and zeros of both signs)
    elif values == "equal":
        I[:] = np.float32(rng.standard_normal())                   # every causal key tied
    I[0, 0, 0] = -np.inf                                            # a masked key among the causal ones
    got = kernels_cuda.topk_indices(torch.from_numpy(I).to(DEV), K, past, block=block, sample=sample, cap=cap,
                                     segments=segments, digits=digits, few=few, regs=regs, strided=strided).cpu().numpy()
    np.testing.assert_array_equal(got, indexer.topk_indices_ref(I, K, past))   # the contract, whole
    want = indexer.topk_select_ref(I, K, past)                      # [B, T, S] bool, ties toward the lower index
    for b in range(B):
        for t in range(T):
            n = min(K, past + t + 1)
            assert np.all(got[b, t, n:] == -1) and np.all(got[b, t, :n] >= 0), "valid entries first, then -1"
            sel = got[b, t, :n]
            assert np.all(np.diff(sel) > 0), "in index order, each once"
            assert set(sel.tolist()) == set(np.nonzero(want[b, t])[0].tolist()), (b, t)


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 2), st.integers(1, 5), st.sampled_from([1, 4, 16, 20]), st.sampled_from([(128, 64), (128, 32)]),
       st.integers(0, 6), st.integers(-8, 8), st.integers(0, 2 ** 31))
def test_index_prep_kernel(B, T, J, dims, start_pos, e, seed):
    """The indexer's fused per-token steps against indexer.index_prep_ref (indexer_forward's unfused
    branch, with the kernel's contract): query codes, scales and head weights; the keys' codes and scales in the cache at
    start_pos + t and nowhere else. The key's LayerNorm sums in another order than NumPy's, so its
    codes may differ by an e4m3 step where a bf16 rounding lands on the other side."""
    import indexer
    import rope
    D, R = dims
    rng = np.random.default_rng(seed)
    bf = quant.bf16_round
    q = bf(rng.standard_normal((B, T, J, D)) * 2.0 ** e)
    k = bf(rng.standard_normal((B, T, D)) * 2.0 ** e + rng.standard_normal())
    xw = rng.standard_normal((B, T, J)).astype(np.float32)
    lnw, lnb = rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32)
    cos, sin = rope.rope_angles((1.0 / 10000 ** (np.arange(0, R, 2) / R)).astype(np.float32), np.arange(start_pos, start_pos + T))
    cap = start_pos + T + 3
    k8, ks = torch.zeros(B + 1, cap, D, dtype=torch.float8_e4m3fn, device=DEV), torch.zeros(B + 1, cap, device=DEV)
    P = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(DEV)
    with pytest.raises(ValueError, match="do not fit"):                     # keys of another width
        kernels_cuda.index_prep(P(q), P(k[..., :-1]), P(xw), P(cos), P(sin), P(lnw), P(lnb), k8, ks, start_pos)
    assert not ks.any()                                                     # nothing written
    q8, w = kernels_cuda.index_prep(P(q), P(k), P(xw), P(cos), P(sin), P(lnw), P(lnb), k8, ks,
                                    torch.tensor(start_pos, device=DEV) if seed % 2 else start_pos)
    k8c, ksc = np.zeros((B, cap, D), quant.E4M3), np.zeros((B, cap), np.float32)   # the reference's caches
    q8r, w_ref = indexer.index_prep_ref(q, k, xw, cos, sin, lnw, lnb, k8c, ksc, start_pos)
    assert_codes(q8, q8r, "index_prep q")
    np.testing.assert_array_equal(w.cpu().numpy(), w_ref)
    got_s, ksr = ks[:B, start_pos:start_pos + T].cpu().numpy(), ksc[:, start_pos:start_pos + T]
    same = got_s == ksr                                                      # a scale may double or halve
    assert same.mean() >= 0.9 and np.all(same | (got_s == 2 * ksr) | (2 * got_s == ksr))
    g = k8[:B, start_pos:start_pos + T].float().cpu().numpy()[same].astype(np.float64)
    r = k8c[:, start_pos:start_pos + T].astype(np.float64)[same]
    big = np.maximum(np.maximum(np.abs(g), np.abs(r)), 2.0 ** -6)
    near = np.abs(g - r) <= np.exp2(np.floor(np.log2(big)) - 3)              # one e4m3 step
    if INTERPRETED:                                                         # and the interpreter's cast defect
        near |= (np.abs(r) == np.exp2(np.round(np.log2(np.maximum(np.abs(r), 2.0 ** -9))))) & (g == r / 2)
    assert near.all() and (g != r).mean() <= 0.1, "index_prep k codes"
    written = torch.zeros(B + 1, cap, dtype=torch.bool)
    written[:B, start_pos:start_pos + T] = True
    assert not ks.cpu()[~written].any() and not k8.cpu().view(torch.uint8)[~written].any()


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.sampled_from([(128, 16), (256, 64), (512, 64)]), st.integers(0, 4),
       st.integers(-10, 10), st.booleans(), st.integers(0, 2 ** 31))
def test_store_latent_kernel(B, T, dims, start_pos, e, device_pos, seed):
    """The packed latent row (spec/kernels.md §3.4) written in one launch against the reference's own
    packing: act_quant's codes (ml_dtypes' e4m3fn) and ue8m0 scales, k^R rounded to bf16 by ml_dtypes,
    at slots start_pos + t of each batch and nowhere else; a start that does not fit is refused."""
    C, R = dims
    rng = np.random.default_rng(seed)
    c_kv = (rng.standard_normal((B, T, C)) * 2.0 ** e * np.exp2(rng.integers(-4, 4, (B, T, C // 128)).repeat(128, -1)))
    c_kv = c_kv.astype(np.float32)
    k_pe = rng.standard_normal((B, T, R)).astype(np.float32)                  # not bf16 values: rounded on the way
    cap = start_pos + T + 2
    rows = torch.zeros(B + 1, cap, quant.latent_width(C, R), dtype=torch.uint8, device=DEV)
    P = lambda a: torch.from_numpy(a).to(DEV)                                   # noqa: E731
    with pytest.raises(ValueError, match="outside the cache"):
        kernels_cuda.store_latent(rows, cap - T + 1, P(c_kv), P(k_pe))
    with pytest.raises(ValueError, match="do not fit"):
        kernels_cuda.store_latent(rows, start_pos, P(c_kv), P(k_pe[..., :-1]))
    assert not rows.any()                                                       # nothing written
    kernels_cuda.store_latent(rows, torch.tensor(start_pos, device=DEV) if device_pos else start_pos, P(c_kv), P(k_pe))
    got = rows.cpu().numpy()
    new = got[:B, start_pos:start_pos + T]
    codes, scales = quant.act_quant(c_kv)
    assert_codes(torch.from_numpy(new[..., :C].copy()).view(torch.float8_e4m3fn), codes, "store_latent codes")
    np.testing.assert_array_equal(new[..., C:C + 4 * (C // 128)].copy().view(np.float32), scales)
    np.testing.assert_array_equal(new[..., C + 4 * (C // 128):].copy().view(ml_dtypes.bfloat16),
                                  k_pe.astype(ml_dtypes.bfloat16))
    written = np.zeros(got.shape[:2], bool)
    written[:B, start_pos:start_pos + T] = True
    assert not got[~written].any()
    # a device start the host cannot check: the slots past the cache are skipped, never the next batch's row 0
    rows.zero_()
    kernels_cuda.store_latent(rows, torch.tensor(cap - 1, device=DEV), P(c_kv), P(k_pe))
    got = rows.cpu().numpy()
    assert got[:B, cap - 1].any(axis=-1).all() and not got[:, :cap - 1].any() and not got[B:].any()


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 9), st.sampled_from([16, 64]), st.booleans(), st.booleans(),
       st.integers(0, 2 ** 31))
def test_rope_and_bf16_round_kernels(B, T, H, R, interleaved, bf16_input, seed):
    """RoPE in both layouts on a strided view (the query's rope columns), and bf16 rounding: the same
    fp32 operations as the references, so the same bits (no FMA contraction; ties to even)."""
    import rope
    rng = np.random.default_rng(seed)
    full = rng.standard_normal((B, T, H, R + 8)).astype(np.float32) * 2.0 ** rng.integers(-20, 20, (B, T, H, 1))
    full = quant.bf16_round(full) if bf16_input else full
    cos, sin = rope.rope_angles((1.0 / 10000 ** (np.arange(0, R, 2) / R)).astype(np.float32), np.arange(7, 7 + T))
    x = torch.from_numpy(full).to(DEV)[..., 8:]                              # not contiguous
    x = x.to(torch.bfloat16) if bf16_input else x
    got = kernels_cuda.rope(x, torch.from_numpy(cos).to(DEV), torch.from_numpy(sin).to(DEV), interleaved)
    ref = (rope.rope_interleaved if interleaved else rope.rope_half_split)(full[..., 8:], cos, sin)
    np.testing.assert_array_equal(got.cpu().numpy().view(np.uint32), ref.view(np.uint32))
    y = kernels_cuda.bf16_round(got)
    np.testing.assert_array_equal(y.cpu().numpy().view(np.uint32), quant.bf16_round(ref).view(np.uint32))
    with pytest.raises(ValueError, match="float32 input"):
        kernels_cuda.bf16_round(got.to(torch.bfloat16))
    with pytest.raises(ValueError, match="do not fit"):
        kernels_cuda.rope(x, torch.from_numpy(cos[:, :-1]).to(DEV), torch.from_numpy(sin[:, :-1]).to(DEV), interleaved)
    edge = np.array([np.inf, -np.inf, np.nan, np.float32(3.4e38), -np.float32(3.4e38), 1e-40, -0.0,
                     np.uint32(0x7FFFFFFF).view(np.float32), np.uint32(0x3F808000).view(np.float32)], np.float32)
    got_e = kernels_cuda.bf16_round(torch.from_numpy(edge).to(DEV)).cpu().numpy()   # overflow, NaN payloads, ties
    want_e = quant.bf16_round(edge)
    assert np.array_equal(np.isnan(got_e), np.isnan(want_e))
    np.testing.assert_array_equal(got_e[~np.isnan(want_e)].view(np.uint32), want_e[~np.isnan(want_e)].view(np.uint32))
