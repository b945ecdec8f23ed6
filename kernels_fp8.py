"""Triton kernels for the number formats and GEMMs of the fast path: FP8 quantisation, the block-scaled
FP8 GEMM and its grouped form for the routed experts, bf16 rounding and RMSNorm. kernels_cuda.py, the entry
point, re-exports them beside the DSA kernels, which use the jit helpers _e4m3_decode, _ue8m0_quant and
_bf16_round from here.

    act_quant   1x128 groups, ue8m0 scales, e4m3 codes            reference: quant.act_quant
    swiglu_quant  a SwiGLU's silu(a) * b, its bf16 rounding and act_quant in one launch
                                                                  reference: moe.mlp_ref's steps
    fp8_gemm    y = (a * sa) (b * sb)^T, 1x128 activation groups, 128x128 weight blocks, fp32
                promotion of each 128-wide K block's partial sum; K split over programs for
                decode's few output tiles, the same bits          reference: quant.fp8_gemm
    moe_gemm    the same GEMM for the routed experts: all experts' weights stacked [E, N, K], token
                rows gathered by index (or a SwiGLU's own rows), one expert per 16-row block, bf16
                values out (or in float32)                reference: quant.fp8_gemm per expert
    matmul_f32  a @ b with exact products and float64 sums, rounded once to float32: the fp32
                projections (router, indexer head weights, output head), bf16 weights read as stored
                                                                  reference: quant.matmul_f32
    heads_matmul_f32  the same per head for a decode step's few rows: the absorbed MLA's q^C W^UK and
                o W^UV^T, bf16 values out in official numerics     reference: quant.matmul_f32 per head
    bf16_round  float32 -> the nearest bf16 values (from the bits), elementwise glue in one launch
                                                                  reference: quant.bf16_round
    rms_norm    a row's RMSNorm, weighted, bf16-rounded in official numerics, one launch instead of a
                chain of torch kernels       reference: attention.rms_norm_ref (V3.2), compressor.rms_norm (V4)
    add_rms_norm  the residual add before it, in the same launch, the sum rounded out as well
                                             reference: model.Transformer._norm's steps

Every kernel here and in kernels_cuda.py, kernels_moe.py, kernels_v4.py and kernels_hopper.py (Gluon's
form of it there) begins with _await_inputs(PDL),
and every launch passes **pdl(): programmatic dependent launch on Hopper (below), the same bits.

Every kernel is shared with kernels_rocm.py: what differs by architecture (the FP8 flavour and its
maximum, whether FP8 is decoded by hand, tile sizes) arrives as constexpr arguments and wrapper data.
Every kernel runs on the CPU under TRITON_INTERPRET=1 (tests/test_kernels_fp8.py), where the interpreter's
fp32->fp8 and fp32->bf16 casts are defective (spec/kernels.md §4.3): act_quant's codes and the GEMMs'
bf16 outputs go through them (bf16_round does not: it rounds from the bits), so the tests there allow
exactly the codes' defects and compare the bf16 outputs with the reference only on a GPU.
"""
import functools
import os

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@functools.lru_cache(None)
def sm_count(device):  # streaming multiprocessors (132 on an H200; the interpreter: as an H200)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _interpreted():
    return os.environ.get("TRITON_INTERPRET") == "1"


# -----------------------------------------------------------------------------
# Programmatic dependent launch (Hopper and later). In a CUDA graph a kernel normally starts only when
# the one before it has finished: its blocks are scheduled, then its prologue runs, while the GPU idles.
# Launched with launch_pdl, a kernel starts as soon as every block of the one before has begun, and
# waits (griddepcontrol.wait) until that kernel has finished and its writes are visible. Every kernel
# here waits first, before any load or store, so no kernel reads an input early or overwrites what the
# kernel before it still reads; only the launch overlaps. A batch-1 decode step is some 50 small
# launches, so the gaps add up. Off (USE_PDL = False) it is the plain launch, bit for bit.

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:                   # a Triton without them: pdl() is empty, so PDL stays False
    gdc_launch_dependents = gdc_wait = None

USE_PDL = True


@triton.jit
def _await_inputs(PDL: tl.constexpr):  # each kernel's first statement
    if PDL:
        gdc_wait()                    # the kernel before has finished; its writes are visible
        gdc_launch_dependents()       # the next kernel may start launching (it waits the same way)


@functools.lru_cache(None)
def _pdl_device(index):  # an NVIDIA GPU of compute capability 9.0 or later, with a Triton that has gdc_wait
    return (gdc_wait is not None and torch.version.hip is None
            and torch.cuda.get_device_capability(index)[0] >= 9)


def pdl():
    """The launch options that turn programmatic dependent launch on: every launch passes **pdl()."""
    if not USE_PDL or _interpreted() or not torch.cuda.is_available() or not _pdl_device(torch.cuda.current_device()):
        return {}
    return dict(PDL=True, launch_pdl=True)


# -----------------------------------------------------------------------------
# FP8 e4m3 bytes -> fp32 by integer arithmetic, for GPUs without FP8 (gfx90a). The GEMM then feeds
# fp16 to the matrix cores: every e4m3 / e4m3fnuz value is exact in fp16 (as in bf16), fp16 matrix
# math runs at the bf16 rate on gfx90a, and the CPU interpreter multiplies fp16 correctly (not bf16).

@triton.jit
def _e4m3_decode(bits, FNUZ: tl.constexpr):
    """uint8 e4m3 code -> fp32 value. e4m3fn: bias 7, 0x7F/0xFF NaN; e4m3fnuz: bias 8, 0x80 NaN."""
    b = bits.to(tl.int32)
    sign = tl.where((b & 0x80) != 0, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = (b & 0x7).to(tl.float32)
    bias = 8 if FNUZ else 7
    normal = (1.0 + m * 0.125) * tl.exp2((e - bias).to(tl.float32))
    sub = m * 0.125 * tl.exp2((1 - bias) * 1.0)                       # e == 0: subnormal
    v = sign * tl.where(e == 0, sub, normal)
    if FNUZ:
        v = tl.where(b == 0x80, float("nan"), v)
    else:
        v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    return v


# -----------------------------------------------------------------------------
# act_quant: one program per BLOCK_M rows x one 128-wide group

@triton.jit
def _ue8m0_quant(x, FP8_MAX: tl.constexpr):  # [R, 128] fp32 -> (x / s clamped to +-FP8_MAX, s [R] = 2^e)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)                # all-zero group -> 1e-4
    v = amax * (1.0 / FP8_MAX)                                        # one fp32 multiply, as the official kernel
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)   # ceil(log2 v) from the bits
    s = ((e + 127) << 23).to(tl.float32, bitcast=True)                # 2^e: the ue8m0 scale
    return tl.minimum(tl.maximum(x / s[:, None], -FP8_MAX), FP8_MAX), s     # exact divide by a power of two


@triton.jit
def _act_quant_kernel(X, Q, S, M, N, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Reference: quant.act_quant (scale_fmt "ue8m0")."""
    _await_inputs(PDL)
    pid_m, g = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = rows[:, None] < M
    x = tl.load(X + rows[:, None] * N + cols[None, :], mask=ok, other=0.0).to(tl.float32)   # fp32 at once
    y, s = _ue8m0_quant(x, FP8_MAX)
    tl.store(Q + rows[:, None] * N + cols[None, :], y.to(Q.dtype.element_ty), mask=ok)
    tl.store(S + rows * (N // GROUP) + g, s, mask=rows < M)


@triton.jit
def _swiglu_quant_kernel(A, B, Q, S, M, I, stride_a, stride_b, BLOCK_M: tl.constexpr, ROUND: tl.constexpr,
                         FP8_MAX: tl.constexpr, PDL: tl.constexpr = False):
    """Reference: moe.mlp_ref's h = silu(a) * b in fp32 (silu(a) = a / (1 + exp(-a))), rounded to bf16
    in official numerics, then quant.act_quant(h). A, B [M, I] rows strided, Q [M, I], S [M, I/128]."""
    _await_inputs(PDL)
    pid_m, g = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * 128 + tl.arange(0, 128)
    ok = rows[:, None] < M
    a = tl.load(A + rows[:, None].to(tl.int64) * stride_a + cols[None, :], mask=ok, other=0.0)
    b = tl.load(B + rows[:, None].to(tl.int64) * stride_b + cols[None, :], mask=ok, other=0.0)
    h = tl.div_rn(a, 1.0 + tl.exp(-a)) * b
    if ROUND:
        h = _bf16_round(h)
    y, s = _ue8m0_quant(h, FP8_MAX)
    tl.store(Q + rows[:, None].to(tl.int64) * I + cols[None, :], y.to(Q.dtype.element_ty), mask=ok)
    tl.store(S + rows.to(tl.int64) * (I // 128) + g, s, mask=rows < M)


def swiglu_quant(a, b, official, fp8=FP8, fp8_max=FP8_MAX):
    """a, b [M, I] float32 (the gate's and the up projection's outputs; rows may be strided, as two
    halves of one GEMM's output) -> act_quant(rnd(silu(a) * b)): q [M, I] fp8, s [M, I/128] float32, in
    one launch where torch takes three before act_quant. The exp is Triton's (on NVIDIA from ex2.approx:
    a few ulp, more for large |a|), not torch's expf: the product may differ from the reference's, or
    from torch's silu on the same GPU, in its last bits before the rounding. Reference: moe.mlp_ref's steps."""
    if a.shape != b.shape or a.dim() != 2 or a.shape[1] % 128 or a.dtype != torch.float32 or b.dtype != torch.float32 \
            or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"swiglu_quant: float32 [M, I] halves with I a multiple of 128 expected, got "
                         f"{a.dtype} {tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    M, I = a.shape
    q = torch.empty(M, I, dtype=fp8, device=a.device)
    s = torch.empty(M, I // 128, dtype=torch.float32, device=a.device)
    bm = 16 if M >= 16 else 1 << max(M - 1, 0).bit_length()
    if M:
        _swiglu_quant_kernel[(triton.cdiv(M, bm), I // 128)](a, b, q, s, M, I, a.stride(0), b.stride(0), BLOCK_M=bm,
                                                            ROUND=bool(official), FP8_MAX=fp8_max, **pdl())
    return q, s


def act_quant(x, fp8=FP8, fp8_max=FP8_MAX, block_m=None):
    """x [..., N] (bf16, or float32 holding any values) -> (q [..., N] fp8, s [..., N/128] float32).
    Reference: quant.act_quant (scale_fmt "ue8m0")."""
    assert x.shape[-1] % 128 == 0, f"act_quant: last dim {x.shape[-1]} is not a multiple of 128"
    assert x.dtype in (torch.bfloat16, torch.float32, torch.float16), f"act_quant: dtype {x.dtype}"
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, N = x2.shape
    q = torch.empty(M, N, dtype=fp8, device=x.device)
    s = torch.empty(M, N // 128, dtype=torch.float32, device=x.device)
    bm = block_m or (16 if M >= 16 else 1 << max(M - 1, 0).bit_length())
    if M:
        _act_quant_kernel[(triton.cdiv(M, bm), N // 128)](x2, q, s, M, N, BLOCK_M=bm, GROUP=128, FP8_MAX=fp8_max,
                                                          **pdl())
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], N // 128)


# -----------------------------------------------------------------------------
# Block-scaled FP8 GEMM: C[M, N] = sum over K blocks of (A_kb B_kb^T) * sa[m, kb] * sb[n // 128, kb]

@triton.jit
def _block_operands(a_at, b_at, kb, a_ok, MASK_A: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr,
                    FNUZ: tl.constexpr):
    """K block kb's [BLOCK_M, BLOCK_K] and [BLOCK_K, BLOCK_N] operands, from the addresses of block 0's;
    MASK_A: only A's rows a_ok [BLOCK_M, 1] loaded, the others read as 0. (A tile of few live rows loads
    only those: H200, batch-1 decode, the experts' GEMMs took 134 us reading row 0 for each padding row,
    98 us masked; mlp_w1 at M = 1 59 against 48 us.)"""
    if MASK_A:
        a = tl.load(a_at + kb * BLOCK_K, mask=a_ok, other=0 if DECODE else 0.0)    # (bytes, or fp8 values)
    else:
        a = tl.load(a_at + kb * BLOCK_K)
    b = tl.load(b_at + kb * BLOCK_K)
    if DECODE:                           # no FP8 hardware: decode bytes to fp16 (exact for every e4m3 value)
        a, b = _e4m3_decode(a, FNUZ).to(tl.float16), _e4m3_decode(b, FNUZ).to(tl.float16)
    return a, b


@triton.jit
def _tile_span(pid, L, BLOCK: tl.constexpr, WHOLE: tl.constexpr):  # rows (or columns) of tile pid over L of them
    """The tile's indices r and the indices it reads, r_in, every one inside [0, L), so that its loads need
    no mask: WHOLE (L >= BLOCK): the last tile is moved back to end at L, over its neighbour's last
    indices, which both compute and store alike, and r stays contiguous; else indices past L address
    L - 1 and are never stored (A's rows there are masked in its loads, _block_operands; B's columns
    there read row L - 1). The same bits: an output reads its own row of A and row of B only (that its
    place inside the tensor core's tile does not change its sum is the GPU's: the ragged-tiles test)."""
    if WHOLE:
        r = tl.minimum(pid * BLOCK, L - BLOCK) + tl.arange(0, BLOCK)
        return r, r
    r = pid * BLOCK + tl.arange(0, BLOCK)
    return r, tl.minimum(r, L - 1)


@triton.jit
def _tile_addresses(A, B, pid_m, pid_n, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, WHOLE_M: tl.constexpr, WHOLE_N: tl.constexpr):
    """A tile's rows rm and columns rn, those it reads (rm_in, rn_in: _tile_span), the addresses of their
    K block 0 (K is whole 128-blocks always), and the mask of A's rows (needed when not WHOLE_M)."""
    rm, rm_in = _tile_span(pid_m, M, BLOCK_M, WHOLE_M)
    rn, rn_in = _tile_span(pid_n, N, BLOCK_N, WHOLE_N)
    k = tl.arange(0, BLOCK_K)
    a_at = A + rm_in[:, None].to(tl.int64) * K + k[None, :]             # [BLOCK_M, BLOCK_K] (int64: long prompts)
    b_at = B + rn_in[None, :] * K + k[:, None]                          # [BLOCK_K, BLOCK_N]
    a_ok = rm[:, None] < M                                             # a tile of few rows loads only those
    return rm, rn, rm_in, rn_in, a_at, b_at, a_ok


@triton.jit
def _fp8_gemm_kernel(A, B, C, SA, SB, M, N, K, NUM_KB,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     DECODE: tl.constexpr, FNUZ: tl.constexpr, ROUND: tl.constexpr,
                     WHOLE_M: tl.constexpr, WHOLE_N: tl.constexpr, PDL: tl.constexpr = False):
    """Reference: quant.fp8_gemm. A [M, K] fp8 (row-major), B [N, K] fp8 (K contiguous, as stored),
    SA [M, NUM_KB], SB [ceil(N/128), NUM_KB] float32, C [M, N] (ROUND: rounded to bf16 values, C float32).
    Every tile runs the K loop without masks (but A's rows in a GEMM of fewer than BLOCK_M), its addresses
    made once (_tile_addresses): H200, bench_gemm.py, M = 2048 / 8192, o 600 / 575 -> 813 / 822 TFLOP/s,
    mlp_w1 587 / 585 -> 798 / 796 against a loop masked by rows and columns (with 4 stages for 3); the
    same bits."""
    _await_inputs(PDL)
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)                                     # grouped order: reuse B tiles in L2
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    rm, rn, rm_in, rn_in, a_at, b_at, a_ok = _tile_addresses(A, B, pid_m, pid_n, M, N, K, BLOCK_M, BLOCK_N,
                                                             BLOCK_K, WHOLE_M, WHOLE_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(NUM_KB):
        a, b = _block_operands(a_at, b_at, kb, a_ok, not WHOLE_M, BLOCK_K, DECODE, FNUZ)
        partial = tl.dot(a, b, out_dtype=tl.float32)                   # A_kb B_kb^T in a fresh fp32 accumulator
        sa = tl.load(SA + rm_in * NUM_KB + kb)
        sb = tl.load(SB + (rn_in // 128) * NUM_KB + kb)
        acc += partial * (sa[:, None] * sb[None, :])                   # "2xAcc" promotion in fp32
    if ROUND:
        acc = _bf16_round(acc)
    tl.store(C + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


# Split K, for few output tiles (decode: small M, narrow weights): the blocks' partial products are
# computed in parallel, then scaled and added in K order by the same fp32 operations as above, so the
# output is bit for bit the unsplit kernel's.

@triton.jit
def _fp8_gemm_partials_kernel(A, B, P, M, N, K, NUM_KB, KB_PER,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              DECODE: tl.constexpr, FNUZ: tl.constexpr, WHOLE_M: tl.constexpr, WHOLE_N: tl.constexpr,
                              PDL: tl.constexpr = False):
    """P [NUM_KB, M, N] float32 = A_kb B_kb^T, unscaled, for KB_PER consecutive K blocks per program."""
    _await_inputs(PDL)
    tile, ks = tl.program_id(0), tl.program_id(1)
    n_n = tl.cdiv(N, BLOCK_N)
    rm, rn, _, _, a_at, b_at, a_ok = _tile_addresses(A, B, tile // n_n, tile % n_n, M, N, K, BLOCK_M, BLOCK_N,
                                                     BLOCK_K, WHOLE_M, WHOLE_N)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    for kb in range(ks * KB_PER, tl.minimum(NUM_KB, ks * KB_PER + KB_PER)):
        a, b = _block_operands(a_at, b_at, kb, a_ok, not WHOLE_M, BLOCK_K, DECODE, FNUZ)
        partial = tl.dot(a, b, out_dtype=tl.float32)
        tl.store(P + (kb * M + rm[:, None]).to(tl.int64) * N + rn[None, :], partial, mask=ok)


@triton.jit
def _fp8_gemm_combine_kernel(P, SA, SB, C, M, N, NUM_KB, BLOCK_N: tl.constexpr, KB_TILE: tl.constexpr,
                             ROUND: tl.constexpr, PDL: tl.constexpr = False):
    """C [M, N] = sum over kb in order of P[kb] * (sa[m, kb] sb[n // 128, kb]), the fp32 operations of
    _fp8_gemm_kernel's loop. One warp per (row, BLOCK_N columns within one weight scale block); the
    KB_TILE blocks' partials of a step are KB_TILE independent loads, issued together (one trip to L2
    a step, not one a block), then added in order. Blocks past NUM_KB read as 0 and add +0, which
    leaves the sum as it is (it starts at +0 and, rounding to nearest, never becomes -0)."""
    _await_inputs(PDL)
    m, nb = tl.program_id(0), tl.program_id(1)
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rn < N
    sb = SB + (nb * BLOCK_N // 128) * NUM_KB                           # this block's weight scales
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for kb0 in range(0, NUM_KB, KB_TILE):
        for j in tl.static_range(KB_TILE):
            live = kb0 + j < NUM_KB
            # (live as a tensor here: the interpreter refuses a scalar mask combined into a tensor load's)
            p = tl.load(P + ((kb0 + j) * M + m).to(tl.int64) * N + rn, mask=ok & (rn * 0 + kb0 + j < NUM_KB), other=0.0)
            s = tl.load(SA + m * NUM_KB + kb0 + j, mask=live, other=0.0) * tl.load(sb + kb0 + j, mask=live, other=0.0)
            acc += p * s
    if ROUND:
        acc = _bf16_round(acc)
    tl.store(C + m.to(tl.int64) * N + rn, acc.to(C.dtype.element_ty), mask=ok)


# Tile configurations by M (data): small M is weight-bandwidth bound, large M compute bound
GEMM_CONFIGS = [  # (max M, BLOCK_M, BLOCK_N, num_warps, num_stages)
    (16, 16, 64, 4, 4),
    (64, 32, 128, 4, 4),
    (256, 64, 128, 4, 3),
    (1 << 62, 128, 128, 8, 4),
]
SPLIT_WAVES = 2                                        # split K until about this many waves of programs run,
SPLIT_MIN_KB = 32                                      # when the K loop has this many blocks and the partials
SPLIT_MAX_BYTES = 16 << 20                             # stay well inside L2 (H200 measurements, bench/RESULTS.md)
COMBINE_TILE = (64, 32)                                # the combine's columns per warp (<= 128) and K blocks per load


def gemm_config(M, configs=GEMM_CONFIGS):
    for max_m, bm, bn, warps, stages in configs:
        if M <= max_m:
            return bm, bn, warps, stages


def fp8_gemm(a, sa, b, sb, out_dtype=torch.bfloat16, configs=GEMM_CONFIGS, decode=False, fnuz=False, split_k=None,
             bf16_values=False):
    """a [M, K] fp8, sa [M, K/128] f32, b [N, K] fp8, sb [ceil(N/128), ceil(K/128)] f32 -> [M, N] out_dtype.
    split_k: how many programs share one output tile's K blocks (None: enough to fill the GPU when the
    output has fewer tiles than it has multiprocessors, K is long and the fp32 partials, nkb x M x N,
    are small: decode; the result is the same either way). bf16_values: float32 out holding the bf16
    rounding (what the bf16 output widened gives, without the copy; a NaN keeps its payload).
    Reference: quant.fp8_gemm."""
    M, K = a.shape
    N = b.shape[0]
    assert b.shape[1] == K and K % 128 == 0, f"fp8_gemm: shapes {tuple(a.shape)} x {tuple(b.shape)}"
    assert sa.shape == (M, K // 128) and sb.shape == (-(-N // 128), K // 128), "fp8_gemm: scale shapes"
    assert a.is_contiguous() and b.is_contiguous() and sa.is_contiguous() and sb.is_contiguous()
    assert sa.dtype == torch.float32 and sb.dtype == torch.float32
    if bf16_values and out_dtype != torch.float32:
        raise ValueError(f"fp8_gemm: bf16_values writes float32, not {out_dtype}")
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if c.numel() == 0:                                                 # no rows or no columns: nothing to launch
        return c
    bm, bn, warps, stages = gemm_config(M, configs)
    if decode:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    nkb, tiles = K // 128, triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if split_k is not None and split_k < 1:
        raise ValueError(f"fp8_gemm: split_k = {split_k} < 1")
    if split_k is None:
        sms = sm_count(a.device)
        few = tiles < sms and nkb >= SPLIT_MIN_KB and nkb * M * N * 4 <= SPLIT_MAX_BYTES
        split_k = triton.cdiv(SPLIT_WAVES * sms, tiles) if few else 1
    kb_per = triton.cdiv(nkb, max(1, min(split_k, nkb)))
    split_k = triton.cdiv(nkb, kb_per)
    if split_k == 1:
        _fp8_gemm_kernel[(tiles,)](a, b, c, sa, sb, M, N, K, nkb, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8,
                                   DECODE=decode, FNUZ=fnuz, ROUND=bf16_values, WHOLE_M=M >= bm, WHOLE_N=N >= bn,
                                   num_warps=warps, num_stages=stages, **pdl())
        return c
    p = torch.empty(nkb, M, N, dtype=torch.float32, device=a.device)
    _fp8_gemm_partials_kernel[(tiles, split_k)](a, b, p, M, N, K, nkb, kb_per, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128,
                                                DECODE=decode, FNUZ=fnuz, WHOLE_M=M >= bm, WHOLE_N=N >= bn,
                                                num_warps=warps, num_stages=stages, **pdl())
    bn, kbt = COMBINE_TILE
    _fp8_gemm_combine_kernel[(M, triton.cdiv(N, bn))](p, sa, sb, c, M, N, nkb, BLOCK_N=bn,
                                                      KB_TILE=min(kbt, triton.next_power_of_2(nkb)), ROUND=bf16_values,
                                                      num_warps=1, **pdl())
    return c


# -----------------------------------------------------------------------------
# Grouped block-FP8 GEMM for the routed experts: rows gathered by index, one expert per row block

@triton.jit
def _moe_gemm_kernel(A, SA, B, SB, C, ROWS, BLOCK_EXPERT, OUT_AT, N, K, NUM_KB,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DECODE: tl.constexpr, FNUZ: tl.constexpr, SELF_ROWS: tl.constexpr, ROUND: tl.constexpr,
                     SCATTER: tl.constexpr, WHOLE_N: tl.constexpr, PDL: tl.constexpr = False):
    """Reference: quant.fp8_gemm on each row block's expert. A [*, K] fp8 with SA [*, NUM_KB];
    B [E, N, K] fp8 with SB [E, ceil(N/128), NUM_KB] (all experts stacked); ROWS [P] the A row of
    each output row (-1: padding; SELF_ROWS: A's row is the output row itself, ROWS only says which
    are live); BLOCK_EXPERT [P / BLOCK_M] the expert of each row block (-1: none).
    C [P, N]: output row p = A[ROWS[p]] @ B[expert]^T (ROUND: rounded to bf16 values, C float32);
    SCATTER: written to C's row OUT_AT[p] instead."""
    _await_inputs(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e >= 0:                                                         # blocks past the routed rows: nothing
        p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row = tl.load(ROWS + p)
        valid = row >= 0
        row = tl.where(valid, p if SELF_ROWS else row, 0)              # padding: row 0's address, masked, never stored
        a_ok = valid[:, None]
        rn, rn_in = _tile_span(pid_n, N, BLOCK_N, WHOLE_N)
        k = tl.arange(0, BLOCK_K)
        a_at = A + row[:, None].to(tl.int64) * K + k[None, :]          # gathered rows, K block 0
        b_at = B + e.to(tl.int64) * N * K + rn_in[None, :] * K + k[:, None]
        sb_at = SB + e.to(tl.int64) * tl.cdiv(N, 128) * NUM_KB + (rn_in // 128) * NUM_KB
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(NUM_KB):                                       # no masks but the live rows'
            a, b = _block_operands(a_at, b_at, kb, a_ok, True, BLOCK_K, DECODE, FNUZ)
            partial = tl.dot(a, b, out_dtype=tl.float32)
            sa = tl.load(SA + row * NUM_KB + kb)
            sb = tl.load(sb_at + kb)
            acc += partial * (sa[:, None] * sb[None, :])
        if ROUND:
            acc = _bf16_round(acc)
        dst = tl.load(OUT_AT + p, mask=valid, other=0).to(tl.int64) if SCATTER else p.to(tl.int64)
        tl.store(C + dst[:, None] * N + rn[None, :], acc.to(C.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))


MOE_BLOCK_M = 16


def moe_gemm(a, sa, b, sb, rows, block_expert, out_dtype=torch.bfloat16, decode=False, fnuz=False, block_n=64,
             self_rows=False, bf16_values=False, out_at=None, out_rows=None):
    """a [R, K] fp8, sa [R, K/128], b [E, N, K] fp8, sb [E, ceil(N/128), K/128], rows [P] int (P a multiple of
    MOE_BLOCK_M), block_expert [P / MOE_BLOCK_M] int -> [P, N]; padding rows are left unwritten.
    self_rows: output row p multiplies a's row p (rows < 0 still marks padding: the second GEMM of a
    SwiGLU, over the first one's rows). bf16_values: float32 out holding the bf16 rounding (what a bf16
    output widened gives, without the copy). out_at [P] int: live row p is written to row out_at[p] of an
    [out_rows, N] output instead (the pairs' own order: no index_copy after), other rows left unwritten.
    Reference: quant.fp8_gemm on each row block's expert."""
    R, K = a.shape
    E, N, _ = b.shape
    P = rows.shape[0]
    assert P % MOE_BLOCK_M == 0 and block_expert.shape[0] == P // MOE_BLOCK_M and K % 128 == 0
    assert a.is_contiguous() and b.is_contiguous() and sa.is_contiguous() and sb.is_contiguous()
    if bf16_values and out_dtype != torch.float32:
        raise ValueError(f"moe_gemm: bf16_values writes float32, not {out_dtype}")
    if (out_at is None) != (out_rows is None) or (out_at is not None and out_at.shape != (P,)):
        raise ValueError("moe_gemm: out_at [P] and out_rows go together")
    c = torch.empty(P if out_at is None else out_rows, N, dtype=out_dtype, device=a.device)
    if decode:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    grid = (P // MOE_BLOCK_M, triton.cdiv(N, block_n))
    _moe_gemm_kernel[grid](a, sa, b, sb, c, rows, block_expert, rows if out_at is None else out_at, N, K, K // 128,
                           BLOCK_M=MOE_BLOCK_M, BLOCK_N=block_n, BLOCK_K=128, DECODE=decode, FNUZ=fnuz,
                           SELF_ROWS=self_rows, ROUND=bf16_values, SCATTER=out_at is not None, WHOLE_N=N >= block_n,
                           num_warps=4, num_stages=3, **pdl())
    return c


# -----------------------------------------------------------------------------
# The fp32 projections (the router's gate, the indexer's head weights, the output head): y = a b with
# every product exact and the sums in float64, rounded once to float32: quant.matmul_f32's numbers, the
# same bits whatever the row count or tiles (fp32 sums, as cuBLAS's, depend on both). A bf16 operand is
# read as it is stored and widened in registers: half the bytes of a float32 copy, the same values.

@triton.jit
def _matmul_f32_kernel(A, B, C, M, N, K, sam, sak, sbk, sbn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """C [M, N] float32 = a b for a [M, K] and b [K, N] (any strides): every product exact (two float32
    values multiply exactly in float64), float64 FMAs into [BLOCK_M, BLOCK_N, BLOCK_K] sums (k last: a
    thread's own registers), added up over k once at the end, rounded once. (Not tl.dot on float64:
    Triton 3.6 fails to lower it for sm_90, "fp64 don't support largeK MMA"; Triton 3.9 compiles it.)"""
    _await_inputs(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float64)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(A + rm[:, None].to(tl.int64) * sam + k[None, :] * sak, mask=(rm[:, None] < M) & (k[None, :] < K),
                    other=0.0)                                                          # [BLOCK_M, BLOCK_K]
        w = tl.load(B + k[None, :] * sbk + rn[:, None].to(tl.int64) * sbn, mask=(k[None, :] < K) & (rn[:, None] < N),
                    other=0.0)                                                          # [BLOCK_N, BLOCK_K] = b^T
        acc += a.to(tl.float64)[:, None, :] * w.to(tl.float64)[None, :, :]
    tl.store(C + rm[:, None].to(tl.int64) * N + rn[None, :], tl.sum(acc, 2).to(tl.float32),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _gemv_f32_kernel(A, B, C, M, N, K, sam, sak, sah, sbk, sbn, sbh, scm, sch,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, ROUND: tl.constexpr,
                     PDL: tl.constexpr = False):
    """The same numbers for a few rows of a (a decode step): one program per row and BLOCK_N outputs, the
    rows of one weight tile side by side (its bytes come once from memory); per head h (program_id(1))
    of a batched product, a[:, h] b[h] into c[:, h] (the strides sah, sbh, sch; 0 for one product). The
    row's K in K_STEPS unrolled tiles, so every load is issued before the sums need it (a GEMV waits on
    memory, not on arithmetic); float64 FMAs into [BLOCK_N, BLOCK_K] sums, added up over k once at the
    end, rounded once (ROUND: then to bf16 values)."""
    _await_inputs(PDL)
    m, nb, h = tl.program_id(0) % M, tl.program_id(0) // M, tl.program_id(1)
    A, B, C = A + h.to(tl.int64) * sah, B + h.to(tl.int64) * sbh, C + h.to(tl.int64) * sch
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float64)
    for i in tl.static_range(K_STEPS):
        k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(A + m.to(tl.int64) * sam + k * sak, mask=k < K, other=0.0)
        w = tl.load(B + k[None, :] * sbk + rn[:, None].to(tl.int64) * sbn, mask=(rn[:, None] < N) & (k[None, :] < K),
                    other=0.0)
        acc += x.to(tl.float64)[None, :] * w.to(tl.float64)
    y = tl.sum(acc, 1).to(tl.float32)
    if ROUND:
        y = _bf16_round(y)
    tl.store(C + m.to(tl.int64) * scm + rn, y.to(C.dtype.element_ty), mask=rn < N)


GEMV_ROWS = 4                                          # up to this many rows of a: _gemv_f32_kernel
GEMV_SMALL_ROWS, GEMV_SMALL_B = 64, 8 << 20            # and up to 64 rows where b (router, head weights) fits in L2
GEMV_MAX_K = 32 * 1024                                 # its unrolled K at most (tiles 1024 wide, or 128 for b [K, N])


def _gemv(a, b, c, M, N, K, H, sam, sak, sah, sbk, sbn, sbh, scm, sch, bf16_values):  # _gemv_f32_kernel's launch
    """Tiles by b's layout: k contiguous (a weight W [N, K] as b = W.T), one or two outputs a program
    with K in 1024-wide steps; n contiguous (b [K, N] row-major), 64 outputs a program, each k's 64
    values one coalesced read. Per head (H > 1: the absorbed MLA's, K <= 1024), one warp a program, k
    contiguous 4 outputs: H200, 128 heads of 128 x 512 bf16 (16.8 MB), W^UK 13.0 -> 11.8 us and W^UV^T
    12.2 -> 10.3 us at one row, 25.9 / 35.1 -> 17.4 / 17.6 us at four, graph-replayed, L2 flushed, against
    4 warps (cuBLAS's bf16 einsum 12.2 / 14.0 us, its casts not counted)."""
    n_contiguous = sbn == 1 and sbk != 1
    if n_contiguous:
        bn, bk = min(64, triton.next_power_of_2(N)), min(128, triton.next_power_of_2(K))
    else:
        bk = min(1024, triton.next_power_of_2(K))
        bn = 2 if H * M * triton.cdiv(N, 2) >= 2 * sm_count(a.device) else 1       # enough programs to stream
    warps = 4
    if H > 1:
        warps, bn = 1, (bn if n_contiguous else min(4, triton.next_power_of_2(N)))
    _gemv_f32_kernel[(M * triton.cdiv(N, bn), H)](a, b, c, M, N, K, sam, sak, sah, sbk, sbn, sbh, scm, sch,
                                                  BLOCK_N=bn, BLOCK_K=bk, K_STEPS=triton.cdiv(K, bk),
                                                  ROUND=bf16_values, num_warps=warps, **pdl())
    return c


def matmul_f32(a, b):  # a [M, K], b [K, N] (float32 or bf16, any strides) -> [M, N] float32
    """a @ b summed in float64 and rounded once to float32 (reference: quant.matmul_f32): the same bits
    for any row count and tiles. A projection whose weight W [N, K] is stored row-major is b = W.T (a
    view, k along W's rows); a bf16 W is read as stored and widened in registers. Up to GEMV_ROWS rows,
    and up to GEMV_SMALL_ROWS where b is at most GEMV_SMALL_B bytes (the router's and the indexer's head
    weights, which stay in L2 from row to row), the GEMV kernel in one launch; else tiles of 8 x 64 (up to
    8 rows) or 16 x 32 outputs. (H200, 2026-12-03, graph-replayed, L2 flushed, 32 rows: the router's
    logits took 519 us in 16 x 32 tiles, 8 programs for its 256 outputs, against cuBLAS fp32's 21; the
    output head 9.6 ms with k in the middle of the tile's sums, 7.5 with k last, cuBLAS fp32 2.4.)"""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul_f32: [M, K] @ [K, N] expected, got {tuple(a.shape)} @ {tuple(b.shape)}")
    if {a.dtype, b.dtype} - {torch.float32, torch.bfloat16}:
        raise ValueError(f"matmul_f32: float32 or bf16 operands expected, got {a.dtype} and {b.dtype}")
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    if c.numel() == 0 or K == 0:
        return c.zero_()
    small_b = M <= GEMV_SMALL_ROWS and b.numel() * b.element_size() <= GEMV_SMALL_B
    if (M <= GEMV_ROWS or small_b) and K <= GEMV_MAX_K:
        return _gemv(a, b, c, M, N, K, 1, *a.stride(), 0, *b.stride(), 0, N, 0, False)
    bm, bn, bk = (8, 64, 16) if M <= 8 else (16, 32, 8)
    _matmul_f32_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](a, b, c, M, N, K, a.stride(0), a.stride(1),
                                                                   b.stride(0), b.stride(1), BLOCK_M=bm,
                                                                   BLOCK_N=bn, BLOCK_K=bk, num_warps=4, **pdl())
    return c


def heads_matmul_f32(a, b, out_dtype=torch.float32, bf16_values=False):  # a [M, H, K], b [H, K, N] -> [M, H, N]
    """Per head h, a[:, h] @ b[h] summed in float64 and rounded once to float32 (reference: quant.matmul_f32
    per head), then to bf16 values with bf16_values (exact in a bf16 out_dtype): the absorbed MLA's
    q^C W^UK (b = W^UK [H, N, C]) and o W^UV^T (b = W^UV [H, V, C] transposed, a view) for a decode
    step's few rows (up to GEMV_ROWS), float32 or bf16 operands (any strides), bf16 read as stored."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[1:] != (b.shape[0], b.shape[1]):
        raise ValueError(f"heads_matmul_f32: [M, H, K] @ [H, K, N] expected, got {tuple(a.shape)} @ {tuple(b.shape)}")
    if {a.dtype, b.dtype} - {torch.float32, torch.bfloat16} or out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"heads_matmul_f32: float32 or bf16 expected, got {a.dtype}, {b.dtype} -> {out_dtype}")
    if out_dtype == torch.bfloat16 and not bf16_values:
        raise ValueError("heads_matmul_f32: a bf16 output holds the bf16 rounding: bf16_values=True")
    (M, H, K), N = a.shape, b.shape[2]
    if M > GEMV_ROWS or K > 1024:
        raise ValueError(f"heads_matmul_f32: up to {GEMV_ROWS} rows and K <= 1024 (a decode step), got {M} and {K}")
    c = torch.empty(M, H, N, dtype=out_dtype, device=a.device)
    if c.numel() == 0 or K == 0:
        return c.zero_()
    (sam, sah, sak), (sbh, sbk, sbn), (scm, sch, _) = a.stride(), b.stride(), c.stride()
    return _gemv(a, b, c, M, N, K, H, sam, sak, sah, sbk, sbn, sbh, scm, sch, bf16_values)


# -----------------------------------------------------------------------------
# Rounding float32 to bf16 values: official numerics' elementwise glue, one launch where PyTorch takes
# several. _bf16_round, the rounding itself, serves the DSA kernels of kernels_cuda.py too.

@triton.jit
def _bf16_round(x):  # fp32 -> the nearest bf16 value (ties to even) as fp32, from the bits; NaN stays NaN
    b = x.to(tl.int32, bitcast=True)
    return tl.where(x != x, x, ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))


@triton.jit
def _bf16_round_kernel(X, Y, N, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    _await_inputs(PDL)
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + at, _bf16_round(tl.load(X + at, mask=at < N, other=0.0)), mask=at < N)


def bf16_round(x):  # float32 tensor -> the nearest bf16 values, as float32 (quant.bf16_round), one launch
    if x.dtype != torch.float32:
        raise ValueError(f"bf16_round: float32 input expected, got {x.dtype}")
    x = x.contiguous()
    y = torch.empty_like(x)
    _bf16_round_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096, num_warps=4, **pdl())
    return y


@triton.jit
def _rms_norm_kernel(X, W, Y, D, eps, HAS_W: tl.constexpr, RECIP: tl.constexpr, ROUND: tl.constexpr,
                     BLOCK: tl.constexpr, RES=None, SUM=None, ADD: tl.constexpr = False, PDL: tl.constexpr = False):
    _await_inputs(PDL)
    d = tl.arange(0, BLOCK)
    at = tl.program_id(0).to(tl.int64) * D + d
    x = tl.load(X + at, mask=d < D, other=0.0)
    if ADD:                                                            # the residual stream: s = x + r, rounded out
        x += tl.load(RES + at, mask=d < D, other=0.0)
        tl.store(SUM + at, _bf16_round(x) if ROUND else x, mask=d < D)
    rms = tl.sqrt_rn(tl.div_rn(tl.sum(x * x, 0), D * 1.0) + eps)                      # sqrt(mean(x²) + eps)
    y = x * tl.div_rn(1.0, rms) if RECIP else tl.div_rn(x, rms)
    if HAS_W:
        y = tl.load(W + d, mask=d < D, other=0.0).to(tl.float32) * y                   # (a bf16 weight widened here)
    if ROUND:
        y = _bf16_round(y)
    tl.store(Y + at, y, mask=d < D)


RMS_NORM_MAX = 16384                                # the widest row rms_norm holds in one program


def _norm_warps(BLOCK):  # a row is one program: more warps, more loads in flight (H200, one row, graph-replayed:
    # 7168 wide 4.07 us at 8 warps, 3.12 at 32; 1536 wide 3.66 at 2, 2.09 at 16); AMD's 64-lane warps: 16 at most
    return min(16 if torch.version.hip else 32, max(8, BLOCK // 128))


def rms_norm(x, w, eps, official, recip=False):  # [..., D] float32, [D] or None -> [..., D] float32, one launch
    """RMSNorm of each row in the reference's fp32 steps (IEEE division and square root), w times
    x / rms (attention.rms_norm_ref, V3.2) or, recip, w times x · (1 / rms) (compressor.rms_norm, V4),
    rounded to bf16 in official numerics. The sum of squares is a tree, not the reference's order:
    within an ulp or so of it, not bit for bit (tests/test_kernels_fp8.py states the bound)."""
    D = x.shape[-1] if x.dim() else 0
    if x.dtype != torch.float32 or not 0 < D <= RMS_NORM_MAX or (w is not None and w.shape != (D,)):
        raise ValueError(f"rms_norm: float32 rows of 1 to {RMS_NORM_MAX} and a weight of their width expected, got "
                         f"{x.dtype} {tuple(x.shape)}, weight {None if w is None else tuple(w.shape)}")
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        BLOCK = triton.next_power_of_2(D)
        _rms_norm_kernel[(x.numel() // D,)](x, x if w is None else w.contiguous(), y, D, float(eps),
                                            HAS_W=w is not None, RECIP=bool(recip), ROUND=bool(official), BLOCK=BLOCK,
                                            num_warps=_norm_warps(BLOCK), **pdl())
    return y


def add_rms_norm(x, residual, w, eps, official):  # [..., D] float32 twice, [D] -> (rms_norm of s, s rounded), s = x + r
    """A pre-norm block's entry in one launch (model._norm): s = x + residual in fp32, then rms_norm(s)
    as above, and s itself rounded to bf16 in official numerics (the next residual). Three launches
    otherwise: the add, the norm, the rounding."""
    if residual.dtype != torch.float32 or residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: a float32 residual of x's shape {tuple(x.shape)} expected, got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    D = x.shape[-1] if x.dim() else 0
    if x.dtype != torch.float32 or not 0 < D <= RMS_NORM_MAX or w is None or w.shape != (D,):
        raise ValueError(f"add_rms_norm: float32 rows of 1 to {RMS_NORM_MAX} and a weight of their width expected, got "
                         f"{x.dtype} {tuple(x.shape)}, weight {None if w is None else tuple(w.shape)}")
    x, residual = x.contiguous(), residual.contiguous()
    y, s = torch.empty_like(x), torch.empty_like(x)
    if x.numel():
        BLOCK = triton.next_power_of_2(D)
        _rms_norm_kernel[(x.numel() // D,)](x, w.contiguous(), y, D, float(eps), HAS_W=True, RECIP=False,
                                            ROUND=bool(official), BLOCK=BLOCK, RES=residual, SUM=s, ADD=True,
                                            num_warps=_norm_warps(BLOCK), **pdl())
    return y, s
