"""Every Triton kernel against its NumPy reference, with hypothesis-drawn shapes and values: on a GPU
for real (bit for bit), on the CPU under TRITON_INTERPRET=1 (set in conftest.py), where the
interpreter's fp32->fp8 cast is defective (spec/kernels.md §4.3: about 1.3% of values come out a
factor of two off, exactly): there, and only there, codes may differ by exactly that factor. In the
interpreter every kernel's loads and stores are also held inside its tensor arguments (bounds.py)."""
import math
from functools import partial
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels_cuda
import kernels_fp8
import kernels_rocm
import quant
from bounds import loads_and_stores_in_bounds  # noqa: F401  (autouse: no address outside a kernel's arguments)
from conftest import HAS_CUDA, gpu

pytestmark = pytest.mark.slow      # the Triton kernels in the CPU interpreter: not in the fast loop (-m "not slow")

DEV = "cuda" if HAS_CUDA else "cpu"
INTERPRETED = not HAS_CUDA


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


def t8(a, dtype=torch.float8_e4m3fn):  # ml_dtypes FP8 array -> torch FP8 tensor on DEV
    return torch.from_numpy(np.array(a.view(np.uint8))).view(dtype).to(DEV)


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


def assert_fp8_gemm_close(got, ref, a, sa, b, sb):  # a kernel's fp32 [M, N] against quant.fp8_gemm's
    """Each output within a fraction of its sum of absolute products, Σ_k |a_k b_k| times the scales (the
    result itself can be far smaller where the terms cancel): 2^-10 on a GPU, 2^-18 in the interpreter.
    On the H200 the 64- and 128-row tiles run Hopper's fp8 wgmma, which adds a 128-term block keeping
    about 13 bits below its largest term and drops the rest: 2^16 + 127 x 2^0 comes back 2^16, and
    2^8 + 127 x 2^-4 whole (the 16- and 32-row tiles' mma keeps all of both). Truncated, the errors do not
    average out: at most 2^-11.6 of the sum over 300 drawn GEMMs (2026-12-03). In the interpreter the products are
    exact and only the fp32 sums round (128 additions at 2^-24: 2^-17 at worst; measured 2^-24)."""
    bound = 2.0 ** -10 if not INTERPRETED else 2.0 ** -18
    rel = np.abs(got - ref) / np.maximum(quant.fp8_gemm(np.abs(a), sa, np.abs(b), sb), np.finfo(np.float32).tiny)
    assert rel.max() <= bound, f"an output {rel.max():.3g} of its sum of absolute products off (bound {bound:.3g})"


def assert_codes(got, want, what, rate=0.1):
    """FP8 codes equal on a GPU. Under the interpreter, whose fp32->fp8 cast is defective (spec/kernels.md
    §4.3; seen here: a lost mantissa carry turns 2^k into 2^(k-1), ties go away from even, subnormals
    truncate), a code may be one e4m3 step off, or half the reference where that is a power of two; at
    most `rate` of them (bf16 values hit e4m3's ties one time in sixteen: more there)."""
    if not INTERPRETED:
        np.testing.assert_array_equal(got.view(torch.uint8).cpu().numpy(), want.view(np.uint8), err_msg=what)
        return
    g, w = got.float().cpu().numpy().astype(np.float64), want.astype(np.float64)
    bad = g != w
    g, w = g[bad], w[bad]
    big = np.maximum(np.abs(g), np.abs(w))
    step = np.maximum(np.exp2(np.floor(np.log2(big)) - 3), 2.0 ** -9)       # one e4m3 step (subnormal: 2^-9)
    pow2 = np.exp2(np.round(np.log2(np.abs(w)))) == np.abs(w)
    ok = (np.abs(g - w) <= step) | (pow2 & (g == w / 2))
    assert ok.all(), f"{what}: differences beyond the interpreter's defects: {list(zip(g[~ok], w[~ok]))[:5]}"
    assert bad.mean() <= rate, f"{what}: {bad.mean():.1%} of the codes differ"


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


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx90a"])
@settings(max_examples=4)
@given(st.integers(1, 24), st.integers(1, 130), st.sampled_from([128, 256]), st.integers(0, 2 ** 31))
def test_rocm_kernels(arch, M, N, K, seed):
    if HAS_CUDA and not torch.version.hip:
        pytest.skip("ROCm variants run in the interpreter (or on an AMD GPU)")
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
    fnuz = kernels_rocm.ARCHS[arch]["fnuz"]
    flavour = quant.E4M3FNUZ if fnuz else quant.E4M3
    q, s = kernels_rocm.act_quant(torch.from_numpy(x).to(DEV), arch=arch)
    qr, sr = quant.act_quant(x, fp8=flavour)                                 # the flavour's own maximum (240 or 448)
    np.testing.assert_array_equal(s.cpu().numpy(), sr)
    if arch != "gfx90a":
        assert_codes(q, qr, f"act_quant {arch}")
    else:                                                                   # gfx90a quantizes in torch: exact
        np.testing.assert_array_equal(q.view(torch.uint8).cpu().numpy(), qr.view(np.uint8))
    b, sb = quant.weight_quant(rng.standard_normal((N, K)).astype(np.float32))
    bw, bs = kernels_rocm.prepare_weight(t8(b), torch.from_numpy(sb).to(DEV), arch=arch)
    b_ref, sb_ref = quant.to_e4m3fnuz(b, sb) if fnuz else (b, sb)
    np.testing.assert_array_equal(bw.view(torch.uint8).cpu().numpy(), b_ref.view(np.uint8))
    np.testing.assert_array_equal(bs.cpu().numpy(), sb_ref)
    a = t8(qr, torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
    got = kernels_rocm.fp8_gemm(a, torch.from_numpy(sr).to(DEV), bw, bs, out_dtype=torch.float32, arch=arch)
    ref = quant.fp8_gemm(qr, sr, b_ref, sb_ref)
    assert_fp8_gemm_close(got.cpu().numpy(), ref, qr, sr, b_ref, sb_ref)
    # swiglu_quant in the flavour (gfx90a: torch's steps): each value within one e4m3 step of the reference's
    import moe
    g = (rng.standard_normal((M, 2 * K)) * 3).astype(np.float32)
    G = torch.from_numpy(g).to(DEV)
    qh, sh = kernels_rocm.swiglu_quant(G[:, :K], G[:, K:], True, arch=arch)
    qhr, shr = quant.act_quant(quant.bf16_round(moe.silu(g[:, :K]) * g[:, K:]), fp8=flavour)
    got_h = qh.float().cpu().numpy() * sh.cpu().numpy().repeat(128, 1)
    want_h = qhr.astype(np.float32) * shr.repeat(128, 1)
    step = np.maximum(2.0 ** -3 * np.maximum(np.abs(got_h), np.abs(want_h)), 2.0 ** -9 * shr.repeat(128, 1))
    ok = np.abs(got_h - want_h) <= step
    if INTERPRETED:                                                         # the cast's lost carry (assert_codes)
        ok |= (got_h == want_h / 2) & (np.exp2(np.round(np.log2(np.abs(want_h) + 1e-30))) == np.abs(want_h))
    assert ok.all(), f"swiglu_quant {arch}: {list(zip(got_h[~ok], want_h[~ok]))[:4]}"


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx90a"])
def test_rocm_dsa_kernels(arch):
    """The DSA kernels with each AMD architecture's data, against the references: the indexer's FP8 in
    the arch's flavour (fnuz on gfx942; bytes decoded to fp16 on gfx90a), the packed latent's e4m3fn
    codes quantized by latent_quant and read natively or decoded from their bytes."""
    if HAS_CUDA and not torch.version.hip:
        pytest.skip("ROCm variants run in the interpreter (or on an AMD GPU)")
    import indexer
    rng = np.random.default_rng(11)
    B, T, J, D, past, K = 1, 3, 16, 128, 37, 8
    S = past + T
    fnuz = kernels_rocm.ARCHS[arch]["fnuz"]
    assert kernels_rocm.fp8_dtype(arch) == (torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
    flavour = quant.E4M3FNUZ if fnuz else quant.E4M3
    q, k = (rng.standard_normal(sh).astype(flavour) for sh in ((B, T, J, D), (B, S, D)))
    w, ks = rng.standard_normal((B, T, J)).astype(np.float32), np.exp2(rng.integers(-2, 2, (B, S))).astype(np.float32)
    dt = kernels_rocm.fp8_dtype(arch)
    got = kernels_rocm.index_scores(t8(q, dt), torch.from_numpy(w).to(DEV), t8(k, dt), torch.from_numpy(ks).to(DEV),
                                    past, arch=arch).cpu().numpy()
    ref = indexer.index_scores_ref(q, w, k, ks)
    causal = indexer.causal_ref(T, past)[None]
    assert np.abs(np.where(causal, got - ref, 0)).max() <= 1e-6 * np.abs(ref).max()
    idx = kernels_rocm.topk_indices(torch.from_numpy(ref).to(DEV), K, past).cpu().numpy()
    np.testing.assert_array_equal(idx, indexer.selection_indices_ref(indexer.topk_select_ref(ref, K, past), K))
    # sparse MLA over packed rows whose codes come from latent_quant
    H, C, R = 16, 128, 32
    kv = quant.bf16_round(rng.standard_normal((B, S, C)) * 3)
    pe = quant.bf16_round(rng.standard_normal((B, S, R)))
    cq, cs = kernels_rocm.latent_quant(torch.from_numpy(kv.reshape(-1, C)).to(DEV), arch=arch)
    assert cq.dtype == torch.float8_e4m3fn
    rows = torch.cat([cq.view(torch.uint8), cs.float().contiguous().view(torch.uint8),
                      torch.from_numpy(pe.reshape(-1, R)).to(DEV).to(torch.bfloat16).view(torch.uint8)], -1).reshape(B, S, -1)
    codes = cq.view(torch.uint8).cpu().numpy().view(quant.E4M3)            # the rows' values, decoded by ml_dtypes
    kv_vals = quant.act_dequant(codes, cs.float().cpu().numpy()).reshape(B, S, C).astype(np.float64)
    qa = quant.bf16_round(rng.standard_normal((B, T, H, C))).astype(np.float64)
    qp = quant.bf16_round(rng.standard_normal((B, T, H, R))).astype(np.float64)
    tq = [torch.from_numpy(a.astype(np.float32)).to(DEV) for a in (qa, qp)]
    for fn in (kernels_rocm.sparse_mla_decode, kernels_rocm.sparse_mla_prefill):
        o, _ = fn(*tq, rows, torch.from_numpy(idx).to(DEV), 0.1, past, arch=arch, out_dtype=torch.float32)
        o = o.cpu().numpy()
        for t in range(T):
            sel = idx[0, t][idx[0, t] >= 0]
            z = (qa[0, t] @ kv_vals[0, sel].T + qp[0, t] @ pe[0, sel].T) * 0.1
            p = np.exp(z - z.max(1, keepdims=True))
            want = (p / p.sum(1, keepdims=True)) @ kv_vals[0, sel]
            assert np.abs(o[0, t] - want).max() <= 2.0 ** -8 * np.abs(kv_vals).max(), (fn.__name__, t)
    # the indexer's per-token steps in the arch's FP8 flavour and maximum (gfx90a: no FP8 stores, unfused)
    assert kernels_rocm.fp8_stores(arch) == (arch != "gfx90a")
    xq = quant.bf16_round(rng.standard_normal((B, T, J, D)) * 4)
    cos, sin = (np.cos(np.arange(T * 32).reshape(T, 32)).astype(np.float32), np.sin(np.arange(T * 32).reshape(T, 32)).astype(np.float32))
    args = [torch.from_numpy(a).to(DEV) for a in (xq, quant.bf16_round(rng.standard_normal((B, T, D))), np.ones((B, T, J), np.float32),
                                                  cos, sin, np.ones(D, np.float32), np.zeros(D, np.float32))]
    kc, kcs = torch.zeros(B, S, D, dtype=dt, device=DEV), torch.zeros(B, S, device=DEV)
    if arch == "gfx90a":
        with pytest.raises(NotImplementedError):
            kernels_rocm.index_prep(*args, kc, kcs, past, arch=arch)
        return
    q8, _ = kernels_rocm.index_prep(*args, kc, kcs, past, arch=arch)
    assert q8.dtype == dt
    import rope
    qr = np.concatenate([quant.bf16_round(rope.rope_half_split(xq[..., :64], cos, sin)), xq[..., 64:]], -1)
    q8r, _ = quant.act_quant(quant.bf16_round(indexer.rotate_activation_ref(qr)), fp8=flavour)   # max 240 or 448
    assert_codes(q8, q8r, f"index_prep {arch}")


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


@gpu
def test_kernels_are_used_on_the_gpu():
    import backend_torch
    ops = backend_torch.torch_ops("cuda")
    assert ops.kernels is not None


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


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx90a"])
def test_rocm_moe_gemm(arch):
    if HAS_CUDA and not torch.version.hip:
        pytest.skip("ROCm variants run in the interpreter (or on an AMD GPU)")
    import backend_torch
    rng = np.random.default_rng(7)
    M, Kt, E, N, K = 5, 2, 4, 96, 256
    fnuz = kernels_rocm.ARCHS[arch]["fnuz"]
    idx = np.stack([rng.choice(E, Kt, replace=False) for _ in range(M)])
    a, sa = quant.act_quant((rng.standard_normal((M, K)) * 3).astype(np.float32), fp8=quant.E4M3FNUZ if fnuz else quant.E4M3)
    ws = [quant.weight_quant(rng.standard_normal((N, K)).astype(np.float32)) for _ in range(E)]
    prepared = [kernels_rocm.prepare_weight(t8(w), torch.from_numpy(s).to(DEV), arch=arch) for w, s in ws]
    W = torch.stack([w for w, _ in prepared]), torch.stack([s for _, s in prepared])
    rows, pair_at, block_expert = backend_torch.route(torch.from_numpy(idx).to(DEV), E, 16)
    got = kernels_rocm.moe_gemm(t8(a, torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn), torch.from_numpy(sa).to(DEV),
                                *W, rows, block_expert, out_dtype=torch.float32, arch=arch).cpu().numpy()
    rows_np, pair_np = rows.cpu().numpy(), pair_at.cpu().numpy()
    for p in np.nonzero(rows_np >= 0)[0]:
        t, slot = divmod(int(pair_np[p]), Kt)
        w, s = ws[idx[t, slot]]
        w, s = quant.to_e4m3fnuz(w, s) if fnuz else (w, s)
        ref = quant.fp8_gemm(a[t:t + 1], sa[t:t + 1], w, s)[0]
        assert_fp8_gemm_close(got[p], ref, a[t:t + 1], sa[t:t + 1], w, s)


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


SM90_COMPILE = """
import json, subprocess, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import kernels_hopper as kh
from triton.backends.nvidia.compiler import get_ptxas                # the ptxas Triton uses for sm_90
fn = kh._sparse_mla_prefill_kernel
got = {}
for packed, q in ((False, "bf16"), (True, "fp32")):                  # bf16 rows; packed FP8 rows, float32 queries
    sig = dict(QA=f"*{q}", QPE=f"*{q}", KV="*u8" if packed else "*bf16", KV32="*fp32" if packed else "*bf16",
               KV16="*bf16", IDX="*i32", POS="*i32", O="*bf16", LSE="*fp32", T="i32", H="i32", KSEL="i32", L="i32",
               qk_scale="fp32")
    const = dict(C=kh.C_MLA, R=kh.R_MLA, BH=kh.BLOCK_H, BN=kh.BLOCK_N, PACKED=packed, PDL=True)
    src = GluonASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}},
                         constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(9)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=168))
    ptx = Path(sys.argv[1]) / f"k{int(packed)}.ptx"
    ptx.write_text(k.asm["ptx"])
    r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                       capture_output=True, text=True, check=True)
    got["packed" if packed else "bf16"] = dict(shared=k.metadata.shared, ptxas=r.stdout + r.stderr)
print(json.dumps(got))
"""


def test_sparse_mla_prefill_hopper_compiles_for_sm90(tmp_path):
    """kernels_hopper's Gluon kernel cannot run without a Hopper GPU, but it compiles anywhere: for sm_90
    with the installed Triton, within an H100 / H200 block's 227 KB of shared memory, and (the ptxas
    Triton ships and uses) without spilling registers. CI catches here a source or Triton change that breaks it.
    (In a process of its own: under TRITON_INTERPRET=1 Gluon's functions are the interpreter's.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    import kernels_hopper
    if kernels_hopper.gluon is None:
        pytest.skip("this Triton has no Gluon of the form kernels_hopper uses")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kernels_hopper.__file__).parent), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", SM90_COMPILE, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for rows in ("bf16", "packed"):                                     # its bf16 and its packed FP8 producer
        assert got[rows]["shared"] <= 232448, rows                      # bytes a block may have on sm_90
        assert " 0 bytes spill stores" in got[rows]["ptxas"], got[rows]["ptxas"]


def _packed_rows(B, L, C, R, g, exponents=(-20, 5)):
    """Packed FP8 latent rows with every e4m3 code but NaN (subnormals and zeros among them), power-of-two
    scales (2^-20 to 2^5), bf16 rope values: kernels_cuda.latent_width(C, R) bytes a row."""
    codes = torch.randint(0, 256, (B, L, C), generator=g, device=DEV, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
    scales = torch.exp2(torch.randint(exponents[0], exponents[1] + 1, (B, L, C // 128), generator=g, device=DEV).float())
    pe = torch.randn(B, L, R, generator=g, device=DEV).bfloat16()
    return torch.cat([codes, scales.view(torch.uint8), pe.view(torch.uint8)], -1).contiguous()


@gpu
@settings(max_examples=16, deadline=None)
@given(st.integers(1, 2), st.integers(1, 40), st.sampled_from([64, 128]), st.integers(1, 3000), st.integers(0, 3000),
       st.sampled_from([1, 40, 64, 100, 512, 2048]), st.sampled_from([torch.bfloat16, torch.float32]),
       st.sampled_from(["bf16", "packed", "packed-wide"]), st.sampled_from([torch.bfloat16, torch.float32]),
       st.integers(0, 2 ** 31))
@example(1, 33, 128, 2500, 2000, 2048, torch.bfloat16, "bf16", torch.bfloat16, 0)     # 32 steps of 64 entries:
@example(1, 33, 128, 2500, 2000, 2048, torch.bfloat16, "packed", torch.float32, 0)    # both stages reused
def test_sparse_mla_prefill_hopper_equals_the_plain_kernel(B, T, H, L, past, K, out_dtype, rows, q_dtype, seed):
    """kernels_hopper's warp-specialised sparse MLA (Gluon) against the plain-Triton kernel it replaces on
    Hopper, with the latent whole (halves=False, late_sum=False: bf16 rows' default tiles): the same
    outputs and log-sum-exps bit for bit, at V3.2-Exp's widths (C = 512, R = 64), over bf16 rows and
    packed FP8 rows (every e4m3 code, power-of-two scales: its producer decodes them), bf16 or float32
    queries, for selections with -1 padding, rows with nothing selected, contexts shorter than K; and
    that the default dispatch of both entry points calls it (decode's where the set stays whole)."""
    import kernels_hopper
    if not kernels_hopper.available(DEV):
        pytest.skip("kernels_hopper runs on a Hopper GPU with Triton's Gluon")
    g = torch.Generator(device=DEV).manual_seed(seed)
    C, R = kernels_hopper.C_MLA, kernels_hopper.R_MLA
    past = past % L                                            # the first query's position
    T = min(T, L - past)
    if rows == "packed-wide":                                  # scales 2^-20 .. 2^5: every code's value, but
        cache = _packed_rows(B, L, C, R, g)                    # a softmax of one entry
    elif rows == "packed":                                     # scales 2^-9 .. 2^-7: a spread softmax
        cache = _packed_rows(B, L, C, R, g, exponents=(-9, -7))
    else:
        cache = (torch.randn(B, L, C + R, generator=g, device=DEV) * 2).bfloat16()
    qa = torch.randn(B, T, H, C, generator=g, device=DEV).to(q_dtype)
    qp = torch.randn(B, T, H, R, generator=g, device=DEV).to(q_dtype)
    idx = torch.full((B, T, K), -1, dtype=torch.int32, device=DEV)   # causal entries first, then -1
    for b in range(B):
        for t in range(T):
            n = int(torch.randint(0, min(K, past + t + 1) + 1, (1,), generator=g, device=DEV))
            idx[b, t, :n] = torch.randperm(past + t + 1, generator=g, device=DEV)[:n].int()
    args = (qa, qp, cache, idx, 0.07, past)
    assert kernels_hopper.takes(qa, qp, cache, idx)
    assert not kernels_hopper.takes(qa, qp, cache, idx[..., :0])    # no selected entry: the plain kernel
    o, lse = kernels_cuda.sparse_mla_prefill(*args, out_dtype=out_dtype, hopper=True)
    o_ref, lse_ref = kernels_cuda.sparse_mla_prefill(*args, out_dtype=out_dtype, hopper=False, halves=False,
                                                     late_sum=False)
    assert torch.equal(lse, lse_ref)
    assert torch.equal(o, o_ref), f"{(o != o_ref).float().mean().item():.2%} of the outputs differ"
    if rows == "bf16" or kernels_hopper.PACKED_BY_DEFAULT:      # the default dispatch takes the variant (counted:
        calls, variant = [], kernels_hopper.sparse_mla_prefill   # for bf16 rows the plain kernel has its bits)
        kernels_hopper.sparse_mla_prefill = lambda *a, **k: calls.append(1) or variant(*a, **k)
        try:                                                    # the position as a device tensor, int64 positions
            o_auto, _ = kernels_cuda.sparse_mla_prefill(qa, qp, cache, idx.long(), 0.07, torch.tensor(past, device=DEV),
                                                        out_dtype=out_dtype)
            assert torch.equal(o_auto, o) and len(calls) == 1
            if kernels_cuda._default_splits(qa, idx, None) == 1:   # decode's set whole: the variant there too
                o_dec, lse_dec = kernels_cuda.sparse_mla_decode(*args, out_dtype=out_dtype)
                assert torch.equal(o_dec, o) and torch.equal(lse_dec, lse) and len(calls) == 2
        finally:
            kernels_hopper.sparse_mla_prefill = variant
    with pytest.raises(ValueError, match="idx"):                # the plain kernel's shape checks hold here too
        kernels_cuda.sparse_mla_prefill(qa, qp, cache, idx[:, :0], 0.07, past, hopper=True)
    with pytest.raises(ValueError, match="hopper=True"):       # and where the variant does not apply, one line
        kernels_cuda.sparse_mla_prefill(*args, hopper=True, block_n=32)


@gpu
def test_sparse_mla_hopper_against_float64():
    """The variant over packed FP8 rows against float64 attention over the decoded rows (an oracle of
    its own, not the plain kernel): softmax(scale * (q^C . c + q^R . k^R)) c over each query's selection.
    Its only roundings are the bf16 queries (exact here), p taken to bf16 for the value MMA and
    float32 sums, so the outputs agree to bf16's resolution."""
    import kernels_hopper
    if not kernels_hopper.available(DEV):
        pytest.skip("kernels_hopper runs on a Hopper GPU with Triton's Gluon")
    g = torch.Generator(device=DEV).manual_seed(1)
    B, T, H, L, K, C, R = 2, 3, 128, 4096, 2048, kernels_hopper.C_MLA, kernels_hopper.R_MLA
    cache = _packed_rows(B, L, C, R, g, exponents=(-9, -7))          # values up to 3.5: a spread softmax
    scales = cache[..., C:C + 4 * (C // 128)].contiguous().view(torch.float32).double()
    codes = cache[..., :C].contiguous().view(torch.float8_e4m3fn).double()
    kv = (codes.reshape(B, L, C // 128, 128) * scales[..., None]).reshape(B, L, C)
    pe = cache[..., C + 4 * (C // 128):].contiguous().view(torch.bfloat16).double()
    qa = torch.randn(B, T, H, C, generator=g, device=DEV).bfloat16()
    qp = torch.randn(B, T, H, R, generator=g, device=DEV).bfloat16()
    idx = torch.stack([torch.stack([torch.randperm(L, generator=g, device=DEV)[:K] for _ in range(T)]) for _ in range(B)])
    idx[0, 1, 1000:] = -1                                      # a partial last step and -1 padding
    o, lse = kernels_cuda.sparse_mla_prefill(qa, qp, cache, idx.int(), 0.07, L - T, out_dtype=torch.float32, hopper=True)
    for b in range(B):
        for t in range(T):
            s = idx[b, t][idx[b, t] >= 0]
            z = (qa[b, t].double() @ kv[b, s].T + qp[b, t].double() @ pe[b, s].T) * 0.07   # [H, K]
            p = torch.softmax(z, -1)
            want = p @ kv[b, s]
            rel = ((o[b, t].double() - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
            assert rel < 1e-2, rel
            lse_want = torch.logsumexp(z, -1) / math.log(2)
            assert torch.allclose(lse[b, t].double(), lse_want, rtol=1e-5, atol=1e-3)


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
