"""kernels_fp8.py's kernels against their NumPy references, with hypothesis-drawn shapes and values: act_quant
and swiglu_quant against quant.act_quant (and moe.mlp_ref's steps), the FP8 GEMMs (split-K, ragged tiles, the
grouped moe_gemm) against quant.fp8_gemm, matmul_f32 / heads_matmul_f32 against float64, rms_norm / add_rms_norm
against attention.rms_norm_ref / compressor.rms_norm, the e4m3 decode against ml_dtypes; on a GPU for real
(bit for bit), on the CPU under TRITON_INTERPRET=1 (conftest.py), where the interpreter's fp32->fp8 cast is
defective (spec/kernels.md §4.3): there, and only there, codes may differ by exactly a factor of two. Also
the test infrastructure: bounds.py catching a load past a tensor, and programmatic dependent launch (pdl())."""
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels_cuda
import kernels_fp8
import quant
from bounds import loads_and_stores_in_bounds  # noqa: F401  (autouse: no address outside a kernel's arguments)
from conftest import gpu
from helpers import DEV, INTERPRETED, assert_codes, assert_fp8_gemm_close, t8

pytestmark = pytest.mark.slow      # the Triton kernels in the CPU interpreter: not in the fast loop (-m "not slow")


def test_out_of_bounds_loads_are_caught():  # bounds.py itself: a load one element past a tensor fails
    import triton
    import triton.language as tl

    @triton.jit
    def copy(X, Y, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(Y + i, tl.load(X + i, mask=i < n), mask=i < 8)

    x, y = torch.arange(8.0, device=DEV), torch.zeros(8, device=DEV)
    copy[(1,)](x, y, 8, BLOCK=16)                                         # the masked load: within bounds
    assert torch.equal(y, x)
    if INTERPRETED:
        from triton.runtime.errors import InterpreterError                # (the interpreter wraps the kernel's errors)
        with pytest.raises(InterpreterError, match="copy: 1 load addresses outside"):
            copy[(1,)](x, y, 9, BLOCK=16)                                 # one element past x


@gpu
def test_a_kernel_launched_early_reads_its_inputs_only_after_waiting():
    # Programmatic dependent launch (kernels_fp8.pdl): a slow writer lets the next kernel start at once;
    # a reader that waits first (as every kernel of the project does) sees the flag written, one that
    # does not sees it unwritten. The second half shows that the launches really overlap here, so the
    # first half is a test of the wait.
    import triton
    import triton.language as tl
    if not kernels_fp8.pdl():
        pytest.skip("programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0 or later")

    @triton.jit
    def slow_writer(FLAG, X, n, PDL: tl.constexpr):
        kernels_fp8._await_inputs(PDL)                                    # lets the reader launch now
        acc = tl.load(X)
        for _ in range(n):                                                # about 100 us of dependent steps
            acc = acc * 0.999999 + 1e-6
        tl.store(X, acc)
        tl.store(FLAG, (acc > -1.0).to(tl.int32))                        # 1, after the loop (it depends on it)

    @triton.jit
    def flag_reader(FLAG, SEEN, WAIT: tl.constexpr):
        if WAIT:
            kernels_fp8._await_inputs(WAIT)
        tl.store(SEEN + tl.program_id(0), tl.load(FLAG, volatile=True))

    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = torch.ones(1, device="cuda")
    for wait in (True, False):
        seen = []
        for _ in range(20):
            flag.zero_()
            s = torch.full((132,), 7, dtype=torch.int32, device="cuda")
            slow_writer[(1,)](flag, x, 200_000, **kernels_fp8.pdl())
            flag_reader[(132,)](flag, s, WAIT=wait, launch_pdl=True)
            seen.append(s.cpu())
        seen = torch.cat(seen)
        if wait:
            assert (seen == 1).all()                                      # every reader saw the write
        else:
            assert (seen == 0).any()                                      # some started before the writer ended


def block_scaled(rng, rows, K, weight=False, integers=False):  # normal values times 2^-4 .. 2^4 by scale block
    """[rows, K] float32 whose 1x128 (activation) or 128x128 (weight) blocks differ in magnitude, so that
    their ue8m0 scales differ: a kernel that pairs a block's partial with another block's scale fails.
    integers: integers in [-16, 16] in place of the normal values, for tests that compare two tilings'
    bits in the interpreter. There tl.dot is NumPy's float32 matmul, which sums in an order that depends
    on the tile's shape and on the kernel OpenBLAS picks for the CPU (on an AVX-512 EPYC, 2026-12-03, a
    16 x 64 and a 32 x 128 tile summed the same products differently); such integers are exact e4m3
    codes after either scale, and each 128-wide block's sum of their products is exact in float32 in
    any order, so the bits then depend on the tiles alone."""
    kb = -(-K // 128)
    mag = np.exp2(rng.integers(-4, 5, (-(-rows // 128) if weight else rows, kb)).astype(np.float32))
    mag = mag.repeat(128, 0)[:rows] if weight else mag
    v = rng.integers(-16, 17, (rows, K)) if integers else rng.standard_normal((rows, K))
    return (v * mag.repeat(128, 1)[:, :K]).astype(np.float32)


@settings(max_examples=15)
@given(st.integers(1, 40), st.sampled_from([128, 256, 384]), st.integers(-12, 12), st.booleans(), st.integers(0, 2 ** 31))
def test_act_quant_kernel(M, N, e, bf16_input, seed):
    x = (np.random.default_rng(seed).standard_normal((M, N)) * 2.0 ** e).astype(np.float32)
    if bf16_input:
        x = quant.bf16_round(x)
    x[0, :128] = 0 if M > 1 else x[0, :128]                                  # an all-zero group
    xt = torch.from_numpy(x).to(DEV)
    q, s = kernels_cuda.act_quant(xt.to(torch.bfloat16) if bf16_input else xt)
    qr, sr = quant.act_quant(x)
    np.testing.assert_array_equal(s.cpu().numpy(), sr)                      # scales bit for bit everywhere
    assert_codes(q, qr, "act_quant")


@settings(max_examples=10)
@given(st.integers(1, 40), st.sampled_from([128, 256, 384]), st.integers(-6, 3), st.booleans(), st.booleans(),
       st.integers(0, 2 ** 31))
def test_swiglu_quant_kernel(M, I, e, official, halves, seed):
    """act_quant(rnd(silu(a) * b)) in one launch against moe.mlp_ref's steps in NumPy float32 and
    quant.act_quant: in the interpreter (whose exp is NumPy's) the reference's codes but for the cast's
    defects and its scales exactly; on a GPU, whose exp is Triton's, within an ulp before the rounding, so
    a code may be one e4m3 step off and a scale double or half where the group's maximum sits on a power
    of two. halves: a and b the two halves of one [M, 2I] output (strided rows), as the fused w1 | w3."""
    import moe
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal((M, 2 * I)) * 2.0 ** e).astype(np.float32)
    g[:, :I] += np.float32(rng.choice([-10, -3, 0, 3, 10]))                 # silu's tails too (not past exp(-a) = 1e20:
    # smaller quotients by the scale are float32 subnormals, which the interpreter's fp8 cast gets wrong)
    a, b = (g[:, :I], g[:, I:]) if halves else (g[:, :I].copy(), g[:, I:].copy())
    rnd = quant.bf16_round if official else quant.no_round
    qr, sr = quant.act_quant(rnd(moe.silu(a) * b))
    G = torch.from_numpy(g).to(DEV)
    A, B = (G[:, :I], G[:, I:]) if halves else (G[:, :I].contiguous(), G[:, I:].contiguous())
    q, s = kernels_cuda.swiglu_quant(A, B, official)
    s = s.cpu().numpy()
    if INTERPRETED:
        np.testing.assert_array_equal(s, sr)
        assert_codes(q, qr, "swiglu_quant", rate=0.2 if official else 0.1)
    else:
        same = s == sr
        assert same.mean() >= 0.9 and np.all(same | (s == 2 * sr) | (2 * s == sr))
        got, want = q.float().cpu().numpy().astype(np.float64), qr.astype(np.float64)
        ok = same.repeat(128, 1)
        big = np.maximum(np.maximum(np.abs(got), np.abs(want)), 2.0 ** -6)
        assert np.all(np.abs(got - want)[ok] <= np.exp2(np.floor(np.log2(big)) - 3)[ok]), "one e4m3 step"
    # where exp(-a) < 2^-25, 1 + exp(-a) is 1 and silu(a) = a whatever the exp: the reference's codes exactly
    # on a GPU (so its bf16 rounding before act_quant is checked: without it some codes round differently)
    a2 = (20 + np.abs(a) * 8).astype(np.float32)
    q2, s2 = kernels_cuda.swiglu_quant(torch.from_numpy(a2).to(DEV), B.contiguous(), official)
    qr2, sr2 = quant.act_quant(rnd(a2 * b))
    np.testing.assert_array_equal(s2.cpu().numpy(), sr2)
    assert_codes(q2, qr2, "swiglu_quant where silu(a) = a", rate=0.2 if official else 0.1)
    # a and b with different row strides (a contiguous, b cut from a wider array): each read with its own
    b3 = torch.from_numpy(np.concatenate([b, -b, b], 1)).to(DEV)[:, I:2 * I]
    q3, s3 = kernels_cuda.swiglu_quant(A.contiguous(), b3, official)
    qr3, sr3 = quant.act_quant(rnd(moe.silu(a) * -b))
    if INTERPRETED:
        np.testing.assert_array_equal(s3.cpu().numpy(), sr3)
        assert_codes(q3, qr3, "swiglu_quant, strides apart", rate=0.2 if official else 0.1)
    else:
        assert (s3.cpu().numpy() == sr3).mean() >= 0.9
    with pytest.raises(ValueError, match="swiglu_quant"):
        kernels_cuda.swiglu_quant(A[:, :-1], B[:, :-1], official)


@settings(max_examples=10)
@given(st.integers(1, 40), st.integers(1, 160), st.sampled_from([128, 256, 384]), st.integers(0, 2 ** 31))
def test_fp8_gemm_kernel(M, N, K, seed):
    rng = np.random.default_rng(seed)
    a, sa = quant.act_quant(block_scaled(rng, M, K))
    b, sb = quant.weight_quant(block_scaled(rng, N, K, weight=True))
    ref = quant.fp8_gemm(a, sa, b, sb)                                       # exact partials, fp32 promotion
    args = (t8(a), torch.from_numpy(sa).to(DEV), t8(b), torch.from_numpy(sb).to(DEV))
    got = kernels_cuda.fp8_gemm(*args, out_dtype=torch.float32).cpu().numpy()
    assert_fp8_gemm_close(got, ref, a, sa, b, sb)
    bf = kernels_cuda.fp8_gemm(*args).float().cpu().numpy()                  # the bf16 output of the official kernel
    if not INTERPRETED:                                                     # (the interpreter's bf16 cast truncates)
        assert np.abs(bf - quant.bf16_round(got)).max() <= 2.0 ** -7 * np.abs(ref).max()
    # bf16 values in float32 (what the model's linears take): rounded from the bits of the float32 result,
    # so ml_dtypes' rounding of it everywhere, and on a GPU the bits of the bf16 output widened
    bv = kernels_cuda.fp8_gemm(*args, out_dtype=torch.float32, bf16_values=True).cpu().numpy()
    np.testing.assert_array_equal(bv.view(np.uint32), got.astype(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32))
    if not INTERPRETED:
        np.testing.assert_array_equal(bv.view(np.uint32), bf.view(np.uint32))
    with pytest.raises(ValueError, match="bf16_values writes float32"):
        kernels_cuda.fp8_gemm(*args, bf16_values=True)


@settings(max_examples=8)
@given(st.sampled_from([1, 2, 7, 16, 20, 40, 70]), st.integers(1, 200), st.sampled_from([2, 3, 5, 9, 33]), st.integers(2, 9),
       st.booleans(), st.integers(0, 2 ** 31))
def test_fp8_gemm_split_k(M, N, kblocks, split_k, decode, seed):
    """K split over programs (decode's few output tiles): the same fp32 operations in the same order as
    the unsplit kernel, so the same bits, on a GPU as in the interpreter, with rows in one tile or in
    two or three (of the 16-, 32- and 64-row tiles); and the oracle's values."""
    if M > 20:                                  # the interpreter's combine takes a program per row: kept short
        N, kblocks = min(N, 64), min(kblocks, 5)
    rng = np.random.default_rng(seed)
    K = 128 * kblocks
    a, sa = quant.act_quant(block_scaled(rng, M, K))
    b, sb = quant.weight_quant(block_scaled(rng, N, K, weight=True))
    args = (t8(a), torch.from_numpy(sa).to(DEV), t8(b), torch.from_numpy(sb).to(DEV))
    one = kernels_cuda.fp8_gemm(*args, out_dtype=torch.float32, decode=decode, split_k=1).cpu().numpy()
    got = kernels_cuda.fp8_gemm(*args, out_dtype=torch.float32, decode=decode, split_k=split_k).cpu().numpy()
    np.testing.assert_array_equal(got.view(np.uint32), one.view(np.uint32))
    bv = kernels_cuda.fp8_gemm(*args, out_dtype=torch.float32, decode=decode, split_k=split_k, bf16_values=True)
    np.testing.assert_array_equal(bv.cpu().numpy().view(np.uint32),            # rounded in the combine, from the bits
                                  one.astype(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32))
    with pytest.raises(ValueError, match="split_k = 0"):
        kernels_cuda.fp8_gemm(*args, split_k=0)
    ref = quant.fp8_gemm(a, sa, b, sb)
    assert_fp8_gemm_close(got, ref, a, sa, b, sb)
    auto = kernels_cuda.fp8_gemm(*args, decode=decode)                      # the default split (33 blocks), bf16 out
    np.testing.assert_array_equal(auto.view(torch.int16).cpu().numpy(),
                                  kernels_cuda.fp8_gemm(*args, decode=decode, split_k=1).view(torch.int16).cpu().numpy())


@pytest.mark.parametrize("MN", [(5, 40), (16, 64), (32, 128), (128, 256), (384, 128)])
@pytest.mark.parametrize("more_rows", [True, False])
@settings(max_examples=1, deadline=None)
@given(st.integers(1, 3), st.integers(0, 2 ** 31))
def test_fp8_gemm_ragged_tiles_give_the_whole_tiles_bits(MN, more_rows, kblocks, seed):
    """A GEMM of whole tiles (every tile configuration: 16 x 64, 32 x 128, 64 x 128, 128 x 128) against
    the same GEMM with one row or column more, whose last tile is moved back over its neighbour (its
    columns; its rows where M + 1 rows fill a tile: not the 16-row tile's, which serves up to 16), or
    clamped to the last row or column where there are fewer than a tile (5 x 40): the shared outputs
    are the same bits, and both GEMMs the oracle's values (the ragged one's extra row or column too);
    no load or store outside the operands (interpreter)."""
    M, N = MN
    rng = np.random.default_rng(seed)
    K = 128 * kblocks
    a, sa = quant.act_quant(block_scaled(rng, M + 1, K, integers=INTERPRETED))      # (the interpreter's BLAS)
    b, sb = quant.weight_quant(block_scaled(rng, N + 1, K, weight=True, integers=INTERPRETED))
    m, n = (M + 1, N) if more_rows else (M, N + 1)
    gemm = lambda m, n: kernels_cuda.fp8_gemm(t8(a[:m]), torch.from_numpy(sa[:m]).to(DEV), t8(b[:n]),  # noqa: E731
                                              torch.from_numpy(np.ascontiguousarray(sb[:-(-n // 128)])).to(DEV),
                                              out_dtype=torch.float32).cpu().numpy()
    whole, ragged = gemm(M, N), gemm(m, n)
    np.testing.assert_array_equal(whole.view(np.uint32), ragged[:M, :N].view(np.uint32))
    for (i, j), got in (((M, N), whole), ((m, n), ragged)):
        operands = a[:i], sa[:i], b[:j], sb[:-(-j // 128)]
        assert_fp8_gemm_close(got, quant.fp8_gemm(*operands), *operands)


def test_fp8_gemm_of_no_rows_or_columns_is_empty():  # (K long enough for the split-K choice: it divided by 0 tiles)
    K = 4096
    for M, N in ((0, 256), (3, 0)):
        a, b = torch.zeros(M, K, device=DEV).to(torch.float8_e4m3fn), torch.zeros(N, K, device=DEV).to(torch.float8_e4m3fn)
        sa, sb = torch.ones(M, K // 128, device=DEV), torch.ones(-(-N // 128), K // 128, device=DEV)
        assert kernels_cuda.fp8_gemm(a, sa, b, sb).shape == (M, N)


@settings(max_examples=5)
@given(st.integers(1, 3), st.lists(st.integers(1, 2), min_size=2, max_size=3), st.integers(1, 128),
       st.integers(2, 5), st.booleans(), st.data())
def test_fp8_gemm_columns_do_not_depend_on_their_neighbours(M, blocks, ragged, kblocks, decode, data):
    """The model's fused projections (backend_torch.fuse_rows / linears) rely on this: the GEMM over
    weights stacked by rows gives each weight's own GEMM's bits, whatever tiles and K split (drawn
    apart for each call) the wider output gets."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 31)))
    K = 128 * kblocks
    rows = [128 * b for b in blocks[:-1]] + [128 * (blocks[-1] - 1) + ragged]
    a, sa = quant.act_quant(rng.standard_normal((M, K)).astype(np.float32))
    Ws = [quant.weight_quant(rng.standard_normal((n, K)).astype(np.float32)) for n in rows]
    A = (t8(a), torch.from_numpy(sa).to(DEV))
    split = lambda: data.draw(st.integers(1, kblocks))                  # noqa: E731
    apart = [kernels_cuda.fp8_gemm(*A, t8(b), torch.from_numpy(sb).to(DEV), decode=decode, split_k=split())
             for b, sb in Ws]
    b, sb = np.concatenate([w for w, _ in Ws]), np.concatenate([s for _, s in Ws])
    whole = kernels_cuda.fp8_gemm(*A, t8(b), torch.from_numpy(sb).to(DEV), decode=decode, split_k=split())
    np.testing.assert_array_equal(whole.view(torch.int16).cpu().numpy(),
                                  torch.cat(apart, 1).view(torch.int16).cpu().numpy())


@settings(max_examples=14, deadline=None)
@example(64, 300, 100, True, "W.T", False, True, 1)             # each route pinned: the GEMV at 64 rows,
@example(17, 1100, 40, False, "[K, N]", True, True, 2)          # at 17 rows, K in nine steps,
@example(8, 200, 130, True, "[K, N]", False, False, 3)          # the 8 x 64 tiles,
@example(64, 150, 70, True, "W.T", True, False, 4)              # the 16 x 32 tiles
@given(st.sampled_from([1, 2, 3, 5, 8, 16, 17, 64, 70]), st.integers(1, 1400), st.integers(1, 150), st.booleans(),
       st.sampled_from(["W.T", "[K, N]"]), st.booleans(), st.booleans(), st.integers(0, 2 ** 31))
def test_matmul_f32(M, K, N, bf16, layout, strided_a, small_b_gemv, seed):
    """The fp32 projections: every product exact and the sums in float64, rounded once, so the bits of
    the float64 oracle rounded to float32 (two float64 sums of the same terms in different orders round
    to different float32 values only when one lands within ~1e-16 of a rounding boundary: never, in
    practice; an fp32 accumulator differs in a large share of the outputs), whatever the rows (the GEMV
    of up to 4 rows, one or two outputs a program, and of up to 64 where b is small, or the 8 x 64 and
    16 x 32 tiles: small_b_gemv False sends the small weights drawn here to the tiles), K (one or more
    unrolled tiles), the weight's dtype and layout and a's strides."""
    with pytest.MonkeyPatch.context() as mp:
        if not small_b_gemv:
            mp.setattr(kernels_fp8, "GEMV_SMALL_B", 0)
        check_matmul_f32(M, K, N, bf16, layout, strided_a, seed)


def check_matmul_f32(M, K, N, bf16, layout, strided_a, seed):
    rng = np.random.default_rng(seed)
    step = 2 if strided_a else 1                                           # x as a view with a column stride
    A = torch.from_numpy((rng.standard_normal((M, step * K)) * 3).astype(np.float32)).to(DEV)[:, ::step]
    a = A.cpu().numpy()
    W = rng.standard_normal((N, K)).astype(np.float32)
    if bf16:
        W = W.astype(ml_dtypes.bfloat16).astype(np.float32)                # bf16 values, read as bf16
    want = (a.astype(np.float64) @ W.T.astype(np.float64)).astype(np.float32)
    Wt = torch.from_numpy(W).to(DEV).to(torch.bfloat16 if bf16 else torch.float32)
    b = Wt.T if layout == "W.T" else Wt.T.contiguous()
    got = kernels_cuda.matmul_f32(A, b)
    np.testing.assert_array_equal(got.cpu().numpy().view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="matmul_f32"):
        kernels_cuda.matmul_f32(A, torch.cat([b, b]))                     # [M, K] @ [2K, N]
    with pytest.raises(ValueError, match="matmul_f32"):
        kernels_cuda.matmul_f32(got[:, :1].to(torch.float16), b[:1])


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.sampled_from([1, 7, 128, 200, 512]), st.integers(1, 150),
       st.sampled_from(["W^UK [H, K, N]", "W^UV [H, N, K] transposed"]), st.booleans(),
       st.sampled_from([(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)]), st.integers(0, 2 ** 31))
def test_heads_matmul_f32(M, H, K, N, layout, bf16, out_official, seed):
    """The absorbed MLA's per-head products of a decode step (q^C W^UK, o W^UV^T): the float64 oracle's
    bits rounded to float32, then (official) to bf16 values, in a float32 output (W^UV's, the model's
    next input) or a bf16 one (q^C W^UK's, the attention kernel's operand), whatever the weight's layout
    and dtype and the query's strides (a view of [M, H, K + R])."""
    out, official = out_official
    rng = np.random.default_rng(seed)
    q = torch.from_numpy((rng.standard_normal((M, H, K + 3)) * 3).astype(np.float32)).to(DEV)[:, :, :K]   # a view
    W = rng.standard_normal((H, K, N)).astype(np.float32)
    if bf16:
        W = W.astype(ml_dtypes.bfloat16).astype(np.float32)                # bf16 values, read as bf16
    want = np.einsum("mhk,hkn->mhn", q.cpu().numpy().astype(np.float64), W.astype(np.float64)).astype(np.float32)
    dt = torch.bfloat16 if bf16 else torch.float32
    b = torch.from_numpy(W).to(DEV).to(dt) if layout.startswith("W^UK") else \
        torch.from_numpy(np.ascontiguousarray(W.transpose(0, 2, 1))).to(DEV).to(dt).transpose(1, 2)
    got = kernels_cuda.heads_matmul_f32(q, b, out_dtype=out, bf16_values=official)
    assert got.dtype == out and got.shape == (M, H, N)
    if official:
        want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got.float().cpu().numpy().view(np.uint32), want.view(np.uint32))
    for bad in ((q, torch.zeros(H, K + 1, N, device=DEV)), (torch.zeros(5, H, K, device=DEV), b), (q.half(), b)):
        with pytest.raises(ValueError, match="heads_matmul_f32"):                 # shapes, 5 rows, fp16
            kernels_cuda.heads_matmul_f32(*bad)
    with pytest.raises(ValueError, match="bf16_values=True"):
        kernels_cuda.heads_matmul_f32(q, b, out_dtype=torch.bfloat16)


def test_e4m3_decode_matches_every_code():
    # the in-kernel decoder of the no-FP8 path, through a GEMM against the identity: all 256 codes
    codes = np.arange(256, dtype=np.uint8)
    finite = ~np.isnan(codes.view(quant.E4M3).astype(np.float32))
    a = codes[finite][None, :]
    pad = (-a.shape[1]) % 128
    a = np.concatenate([a, np.zeros((1, pad), np.uint8)], 1)
    K = a.shape[1]
    eye = np.eye(K, dtype=np.float32).astype(quant.E4M3)
    ta = torch.from_numpy(a).view(torch.float8_e4m3fn).to(DEV)
    got = kernels_cuda.fp8_gemm(ta, torch.ones(1, K // 128, device=DEV), t8(eye), torch.ones(K // 128, K // 128, device=DEV),
                                out_dtype=torch.float32, decode=True)
    np.testing.assert_array_equal(got.cpu().numpy()[0], a.view(quant.E4M3).astype(np.float32)[0])


@settings(max_examples=8)
@given(st.integers(1, 12), st.integers(1, 4), st.integers(2, 6), st.integers(1, 140), st.sampled_from([128, 256]),
       st.integers(0, 2 ** 31))
def test_moe_gemm_kernel(M, Kt, E, N, K, seed):
    import backend_torch
    rng = np.random.default_rng(seed)
    Kt = min(Kt, E)
    idx = np.stack([rng.choice(E, Kt, replace=False) for _ in range(M)])       # each token's experts
    a, sa = quant.act_quant((rng.standard_normal((M, K)) * 3).astype(np.float32))
    ws = [quant.weight_quant(rng.standard_normal((N, K)).astype(np.float32)) for _ in range(E)]
    rows, pair_at, block_expert = backend_torch.route(torch.from_numpy(idx).to(DEV), E, kernels_cuda.MOE_BLOCK_M)
    W = torch.stack([t8(w) for w, _ in ws]), torch.stack([torch.from_numpy(s).to(DEV) for _, s in ws])
    got = kernels_cuda.moe_gemm(t8(a), torch.from_numpy(sa).to(DEV), *W, rows, block_expert, out_dtype=torch.float32)
    got, rows_np, pair_np = got.cpu().numpy(), rows.cpu().numpy(), pair_at.cpu().numpy()
    assert sorted(pair_np[rows_np >= 0].tolist()) == list(range(M * Kt))        # every pair exactly once
    for p in np.nonzero(rows_np >= 0)[0]:
        t, slot = divmod(int(pair_np[p]), Kt)
        assert rows_np[p] == t
        w, s = ws[idx[t, slot]]
        ref = quant.fp8_gemm(a[t:t + 1], sa[t:t + 1], w, s)[0]
        assert_fp8_gemm_close(got[p], ref, a[t:t + 1], sa[t:t + 1], w, s)
    # a SwiGLU's second GEMM: output row p multiplies row p of its input (rows only marks the live ones),
    # written as bf16 values in float32: the same sums as above, rounded
    live = rows_np >= 0
    at = torch.from_numpy(np.where(live, rows_np, 0)).to(DEV).long()
    a_p, sa_p = t8(a)[at].contiguous(), torch.from_numpy(sa).to(DEV)[at].contiguous()
    own = kernels_cuda.moe_gemm(a_p, sa_p, *W, rows, block_expert, out_dtype=torch.float32, self_rows=True,
                                bf16_values=True).cpu().numpy()
    np.testing.assert_array_equal(own[live].view(np.uint32), quant.bf16_round(got[live]).astype(np.float32).view(np.uint32))
    with pytest.raises(ValueError, match="bf16_values writes float32"):
        kernels_cuda.moe_gemm(a_p, sa_p, *W, rows, block_expert, bf16_values=True)
    # each live row written to its pair's place instead (out_at = pair_at: the [M, Kt] order, no copy after)
    placed = kernels_cuda.moe_gemm(a_p, sa_p, *W, rows, block_expert, out_dtype=torch.float32, self_rows=True,
                                   bf16_values=True, out_at=pair_at, out_rows=M * Kt).cpu().numpy()
    assert placed.shape == (M * Kt, N)
    np.testing.assert_array_equal(placed[pair_np[live]].view(np.uint32), own[live].view(np.uint32))
    with pytest.raises(ValueError, match="out_at"):
        kernels_cuda.moe_gemm(a_p, sa_p, *W, rows, block_expert, out_at=pair_at)


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 4), st.integers(1, 700), st.sampled_from(["v3.2", "v4", "v4 unweighted"]), st.booleans(),
       st.floats(-14, 8), st.integers(0, 2 ** 31))
def test_rms_norm_kernel(M, D, form, official, log_scale, seed):
    """RMSNorm in one launch against both references: V3.2's w x / rms and V4's w x (1 / rms), eps
    mattering where the rows are small. The kernel's sum of squares is a tree: each sum's relative error
    is under (D - 1) 2^-24 (positive terms), so the two results differ by under (D + 3) 2^-24 relative
    before rounding, and by at most one bf16 step after it (official numerics)."""
    import attention
    import compressor
    from helpers import assert_bf16_close
    rng = np.random.default_rng(seed)
    x = quant.bf16_round((rng.standard_normal((M, D)) * 2.0 ** log_scale).astype(np.float32))
    w = None if form == "v4 unweighted" else quant.bf16_round((1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    rnd = quant.bf16_round if official else quant.no_round
    ref = attention.rms_norm_ref if form == "v3.2" else compressor.rms_norm
    want = ref(x, w, 1e-6, rnd)
    got = kernels_cuda.rms_norm(torch.from_numpy(x).to(DEV), None if w is None else torch.from_numpy(w).to(DEV), 1e-6,
                                official, recip=form != "v3.2").cpu().numpy()
    if official:
        np.testing.assert_array_equal(got, quant.bf16_round(got))                    # bf16 values
        assert_bf16_close(got, want, ulps=1, what="rms_norm")
    else:
        assert np.all(np.abs(got - want) <= (D + 4) * 2.0 ** -24 * np.abs(want))
    if form == "v3.2":  # with the residual add before it in the same launch (model._norm): the fp32 sum rounded
        # out (NumPy's float32 add, ml_dtypes' rounding) and its norm, the bits of rms_norm's over that sum
        r = quant.bf16_round((rng.standard_normal((M, D)) * 2.0 ** log_scale).astype(np.float32))
        s_want = x + r
        P = lambda a: torch.from_numpy(a).to(DEV)                               # noqa: E731
        y, s = kernels_cuda.add_rms_norm(P(x), P(r), P(w), 1e-6, official)
        np.testing.assert_array_equal(s.cpu().numpy(), s_want.astype(ml_dtypes.bfloat16).astype(np.float32)
                                      if official else s_want)
        np.testing.assert_array_equal(y.cpu().numpy(), kernels_cuda.rms_norm(P(s_want), P(w), 1e-6, official).cpu().numpy())
        with pytest.raises(ValueError, match="residual"):
            kernels_cuda.add_rms_norm(P(x), P(r[:, :-1]) if D > 1 else P(r[:0]), P(w), 1e-6, official)
    with pytest.raises(ValueError, match="rms_norm"):
        kernels_cuda.rms_norm(torch.from_numpy(x).to(DEV), torch.ones(D + 1, device=DEV), 1e-6, official)
    with pytest.raises(ValueError, match="rms_norm"):
        kernels_cuda.rms_norm(torch.ones((), device=DEV), None, 1e-6, official)


def test_the_torch_path_norms_take_the_kernel():
    # backend_torch.rms_norm and v4_norm with the kernels: the op table's roundings (bf16_round, its partial with
    # the kernels, no_round) go through kernels_cuda.rms_norm, anything else (and a weight of another width) stays
    # torch; both within a bf16 step of torch's
    from functools import partial
    import backend_torch as bt
    calls = []
    kern = SimpleNamespace(rms_norm=lambda *a, **k: calls.append(k) or kernels_cuda.rms_norm(*a, **k),
                           add_rms_norm=lambda *a: calls.append("add") or kernels_cuda.add_rms_norm(*a),
                           RMS_NORM_MAX=kernels_cuda.RMS_NORM_MAX)
    x = torch.from_numpy(quant.bf16_round(np.random.default_rng(0).standard_normal((3, 200)).astype(np.float32))).to(DEV)
    w = torch.from_numpy(quant.bf16_round((1 + 0.1 * np.random.default_rng(1).standard_normal(200)).astype(np.float32))).to(DEV)
    for rnd, taken in ((bt.bf16_round, True), (partial(bt.bf16_round, kern=kernels_cuda), True), (bt.no_round, True),
                       (lambda v: v * 1, False)):
        for norm, weight in ((bt.rms_norm, w), (bt.v4_norm, w), (bt.v4_norm, None)):
            calls.clear()
            got = norm(x, weight, 1e-6, rnd, kern=kern).cpu().numpy()
            want = norm(x, weight, 1e-6, rnd).cpu().numpy()
            assert bool(calls) == taken, (rnd, norm)
            if taken:
                assert calls[0].get("recip", False) == (norm is bt.v4_norm)
            assert np.all(np.abs(got - want) <= 2.0 ** -7 * np.abs(want) + 1e-30), (rnd, norm)
        calls.clear()                                   # add_norm: model._norm's steps, in one launch where taken
        (y, s), (y0, s0) = bt.add_norm(x, x.flip(0), w, 1e-6, rnd, kern=kern), bt.add_norm(x, x.flip(0), w, 1e-6, rnd)
        assert calls == (["add"] if taken else []), rnd
        np.testing.assert_array_equal(s.cpu().numpy(), s0.cpu().numpy())
        assert np.all(np.abs((y - y0).cpu().numpy()) <= 2.0 ** -7 * np.abs(y0.cpu().numpy()) + 1e-30), rnd
    calls.clear()
    with pytest.raises(RuntimeError):                                              # torch's own error, not the kernel
        bt.rms_norm(x, w[:100], 1e-6, bt.bf16_round, kern=kern)
    assert not calls
