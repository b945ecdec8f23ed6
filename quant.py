"""Number formats: FP8 (e4m3fn, e4m3fnuz), ue8m0 scales, 128x128 weight blocks, the official
`act_quant`, the block-scaled FP8 GEMM, bf16 rounding, and FP4 e2m1 with MX block scales.

Everything here is the NumPy reference; ml_dtypes supplies the number formats, so a cast here is
the format's own round-to-nearest-even. Sources: spec/dsv32.md §4 (the official `kernel.py`:
act_quant, weight_dequant, fp8_gemm), the OCP MX spec for FP4 e2m1 with e8m0 block scales.

Letters: M rows of activations, N output features, K input features, Kb = K / 128 blocks.
"""
from typing import NamedTuple

import ml_dtypes
import numpy as np

BLOCK = 128                                   # weight block (128 x 128) and activation group (1 x 128)
E4M3 = ml_dtypes.float8_e4m3fn                # the checkpoint's FP8 flavour (max 448)
E4M3FNUZ = ml_dtypes.float8_e4m3fnuz          # gfx942's flavour (max 240, no negative zero)
FP8_MAX = {E4M3: 448.0, E4M3FNUZ: 240.0}
BF16 = ml_dtypes.bfloat16
FP4 = ml_dtypes.float4_e2m1fn                 # MX FP4: values 0, .5, 1, 1.5, 2, 3, 4, 6
MX_BLOCK = 32                                 # MX scale block along the input dimension


# -----------------------------------------------------------------------------
# bf16 rounding points

def bf16_round(x):  # any float array -> float32 holding bf16 values (round to nearest even)
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def no_round(x):  # the exact-numerics twin of bf16_round: float32, untouched
    return np.asarray(x, np.float32)


def round_once(x, fmt):  # float64 array -> `fmt` (bf16, fp8, float32), ONE rounding to nearest even
    """The exact value rounded once, whatever ml_dtypes' own float64 path does (0.5 went through
    float32, rounding twice; 0.7 rounds once): round to odd into float32, then float32 -> fmt
    rounds to nearest even, which equals one rounding of the float64 value because float32 keeps
    at least two bits more than `fmt` (round-to-odd, Boldo and Melquiond 2008)."""
    x = np.asarray(x, np.float64)
    f = x.astype(np.float32)                                             # nearest float32
    inexact = f.astype(np.float64) != x
    down = np.where(np.abs(f.astype(np.float64)) > np.abs(x), np.nextafter(f, np.float32(0)), f)  # toward 0
    odd = (down.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)  # sticky bit in the last place
    return odd.astype(fmt)


# -----------------------------------------------------------------------------
# FP8 codes -> floats through a 256-entry table (the same values as ml_dtypes' cast, 6x faster)

_DECODE = {}


def fp8_decode(q, dtype=np.float32):  # fp8 array -> its values in float32 / float64
    key = (np.dtype(q.dtype), np.dtype(dtype))
    if key not in _DECODE:
        _DECODE[key] = np.arange(256, dtype=np.uint8).view(q.dtype).astype(dtype)
    return np.take(_DECODE[key], np.asarray(q).view(np.uint8))


def decode(x, dtype=np.float32):  # any array (fp8 codes, bf16, f32) -> float values
    if np.dtype(x.dtype).itemsize == 1 and x.dtype != np.uint8 and x.dtype != np.int8:
        return fp8_decode(x, dtype)
    return np.asarray(x, dtype)


# -----------------------------------------------------------------------------
# act_quant: 1 x 128 groups, ue8m0 (power-of-two) scales, spec §4.1

def ue8m0_ceil(v):  # float32 > 0 -> float32 2^ceil(log2 v), read from the bits as the kernel does
    bits = np.asarray(v, np.float32).view(np.uint32)
    e = ((bits >> 23) & 0xFF).astype(np.int64) - 127 + ((bits & 0x7FFFFF) != 0)
    return ((e + 127).astype(np.uint32) << 23).view(np.float32)


def act_quant(x, block_size=BLOCK, scale_fmt="ue8m0", fp8=E4M3):  # [..., N] -> [..., N] fp8, [..., N/bs]
    """Official activation quantization: one scale per `block_size` values of the last axis."""
    x = np.asarray(x, np.float32)
    if x.shape[-1] % block_size:
        raise ValueError(f"act_quant: last dim {x.shape[-1]} is not a multiple of {block_size}")
    fp8_max = np.float32(FP8_MAX[fp8])
    xb = x.reshape(*x.shape[:-1], -1, block_size)                       # [..., N/bs, bs]
    amax = np.maximum(np.abs(xb).max(-1), np.float32(1e-4))             # clamp: all-zero block -> 1e-4
    v = (amax * (np.float32(1) / fp8_max)).astype(np.float32)           # one fp32 multiply, as the kernel
    s = ue8m0_ceil(v) if scale_fmt == "ue8m0" else v                    # power of two, or plain
    y = np.clip(xb / s[..., None], -fp8_max, fp8_max)                   # fp32 divide, exact for 2^e
    return y.astype(fp8).reshape(x.shape), s.astype(np.float32)


def act_dequant(q, s, block_size=BLOCK):  # [..., N] fp8, [..., N/bs] -> [..., N] float32
    qb = decode(q).reshape(*q.shape[:-1], -1, block_size)
    return (qb * s[..., None]).reshape(q.shape)


# -----------------------------------------------------------------------------
# 128 x 128 weight blocks (`weight_scale_inv` is a multiplier despite its name)

def expand_blocks(s, shape, block_size=BLOCK):  # [ceil(N/bs), ceil(K/bs)] -> [N, K]
    N, K = shape
    return np.repeat(np.repeat(s, block_size, 0)[:N], block_size, 1)[:, :K]


def weight_dequant(w, s, block_size=BLOCK):  # [N, K] fp8, [ceil(N/bs), ceil(K/bs)] -> [N, K] float32
    return decode(w) * expand_blocks(np.asarray(s, np.float32), w.shape, block_size)


def weight_quant(w, block_size=BLOCK, fp8=E4M3):  # [N, K] float -> [N, K] fp8, [ceil(N/bs), ceil(K/bs)]
    """Block quantization with power-of-two scales (what a ue8m0 checkpoint stores): the smallest
    2^e with amax / 2^e <= fp8 max, so nothing saturates."""
    w = np.asarray(w, np.float32)
    N, K = w.shape
    nb, kb = -(-N // block_size), -(-K // block_size)
    pad = np.zeros((nb * block_size, kb * block_size), np.float32)
    pad[:N, :K] = np.abs(w)
    amax = pad.reshape(nb, block_size, kb, block_size).max((1, 3))      # [nb, kb]
    amax = np.where(amax > 0, amax, np.float32(1))
    s = ue8m0_ceil((amax / np.float32(FP8_MAX[fp8])).astype(np.float32))
    return (w / expand_blocks(s, w.shape, block_size)).astype(fp8), s


def to_e4m3fnuz(w, s):  # e4m3fn codes + scale -> e4m3fnuz codes + scale (gfx942), same values
    """Same bytes read as e4m3fnuz are worth half, so the scale doubles. 0x80 is -0 in e4m3fn
    but NaN in e4m3fnuz: map it to 0."""
    bits = np.asarray(w).view(np.uint8).copy()
    bits[bits == 0x80] = 0
    return bits.view(E4M3FNUZ), np.asarray(s, np.float32) * np.float32(2)


# -----------------------------------------------------------------------------
# The FP8 GEMM y = x W^T with per-block promotion, spec §4.3

def fp8_gemm(a, sa, b, sb, block_size=BLOCK):  # [M, K] fp8, [M, Kb], [N, K] fp8, [Nb, Kb] -> [M, N] f32
    """Per 128-wide K block: the fp8 x fp8 partial sum (exact here: float64 holds every product of
    two fp8 values and their sum over 128 terms), rounded to fp32 as the tensor-core accumulator,
    then promoted by the product of the two scales into an fp32 accumulator, K blocks ascending.
    The caller rounds to bf16 (the kernel's output dtype)."""
    M, K = a.shape
    N = b.shape[0]
    a64, b64 = decode(a, np.float64), decode(b, np.float64)
    sb_rows = np.repeat(np.asarray(sb, np.float32), block_size, 0)[:N]  # [N, Kb]
    acc = np.zeros((M, N), np.float32)
    for kb in range(-(-K // block_size)):
        k = slice(kb * block_size, (kb + 1) * block_size)
        partial = (a64[:, k] @ b64[:, k].T).astype(np.float32)            # [M, N] exact, then fp32
        acc += partial * (sa[:, kb, None] * sb_rows[None, :, kb])         # "2xAcc" promotion
    return acc


# -----------------------------------------------------------------------------
# A linear layer as the checkpoint stores it: FP8 codes + block scales, or plain float weights

class Weight(NamedTuple):
    w: np.ndarray                  # [N, K]: fp8 codes (e4m3fn) or float (bf16 / f32); or [N, K/2] uint8: FP4 pairs
    scale: np.ndarray | None       # [ceil(N/128), ceil(K/128)] float32 (FP8), [N, K/32] (FP4), or None

    def dequant(self):  # -> [N, K] float32
        if self.scale is None:
            return np.asarray(self.w, np.float32)
        if self.w.dtype == np.uint8:                                      # MXFP4, two e2m1 codes per byte
            return fp4_dequant(self.w, self.scale)
        return weight_dequant(self.w, self.scale)


def matmul_f32(a, b):  # a @ b of float32 arrays, summed in float64 and rounded once to float32
    """The fp32-accumulator GEMMs of V4's reference: a definite result whatever the number of rows (BLAS
    sums one row in another order than many, so a decode step would not equal its prefill row)."""
    return (np.asarray(a, np.float64) @ np.asarray(b, np.float64)).astype(np.float32)


# fp32 functions rounded once, as the official code's traces take them (tests/fixtures/README.md): computed
# in float64, then rounded to fp32 (a second rounding that differs from a correctly rounded fp32 result
# about once in 2^29 inputs)
def rsqrt_f32(x):  # 1 / sqrt(x)
    return (1 / np.sqrt(np.asarray(x, np.float64))).astype(np.float32)


def exp_f32(x):
    return np.exp(np.asarray(x, np.float64)).astype(np.float32)


def mean_sq_f32(x):  # mean(x²) over the last axis: fp32 squares, their mean rounded once (the same bits in any batch)
    x = np.asarray(x, np.float32)
    return (x * x).mean(-1, keepdims=True, dtype=np.float64).astype(np.float32)


def linear_ref(x, W, official):  # [..., K], Weight [N, K] -> [..., N] float32
    """official: act_quant(x) then the FP8 GEMM (FP4 weights: fp4_gemm), bf16 out (every FP8 linear of
    the official code); exact: x @ dequant(W)^T in float32."""
    if not official or W.scale is None:
        y = np.asarray(x, np.float32) @ W.dequant().T
        return bf16_round(y) if official else y
    lead = x.shape[:-1]
    q, s = act_quant(x.reshape(-1, x.shape[-1]))
    gemm = fp4_gemm if W.w.dtype == np.uint8 else fp8_gemm                # V4's routed experts are FP4
    return bf16_round(gemm(q, s, W.w, W.scale)).reshape(*lead, -1)


def linears_ref(x, Ws, official):  # several linears of one input -> [linear_ref(x, W) for W in Ws]
    return [linear_ref(x, W, official) for W in Ws]


# -----------------------------------------------------------------------------
# FP4 e2m1 with MX block scales (32 values, e8m0), packed two per byte (for later models' experts)

def fp4_quant(w):  # [N, K] float -> [N, K/2] uint8 packed, [N, K/32] float32 power-of-two scales
    """scale = 2^(floor(log2 amax) - 2): e2m1's largest binade starts at 4 = 2^2; values above
    6 x scale saturate at +-6. Low nibble holds the even index along K."""
    w = np.asarray(w, np.float32)
    N, K = w.shape
    if K % MX_BLOCK:
        raise ValueError(f"fp4_quant: K={K} is not a multiple of {MX_BLOCK}")
    wb = w.reshape(N, K // MX_BLOCK, MX_BLOCK)
    amax = np.abs(wb).max(-1)
    e = np.where(amax > 0, np.frexp(np.where(amax > 0, amax, 1))[1] - 1 - 2, 0)     # floor(log2 amax) - 2, exact
    s = np.exp2(e).astype(np.float32)                                    # e8m0 value
    q = np.clip(wb / s[..., None], -6, 6).astype(FP4).reshape(N, K)
    nib = q.view(np.uint8) & 0xF
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8), s


def fp4_dequant(packed, s):  # [N, K/2] uint8, [N, K/32] -> [N, K] float32
    N = packed.shape[0]
    nib = np.stack([packed & 0xF, packed >> 4], -1).reshape(N, -1)       # even index from the low nibble
    v = nib.astype(np.uint8).view(FP4).astype(np.float32)
    return (v.reshape(N, -1, MX_BLOCK) * s[..., None]).reshape(N, -1)


FP4_FP8_SPREAD = 14  # binades of 1x32 scales one 128x128 FP8 block holds exactly (below)


def fp4_to_fp8_blocks(packed, s):  # [N, K/2] uint8, [N, K/32] -> [N, K] e4m3, [N/128, K/128] float32, exactly
    """The FP4 experts re-encoded once at load for the block-FP8 GEMM (the second route: twice the
    bytes, the GEMM V3.2 already has). An e2m1 value times its scale 2^e is c 2^e, c in {0.5, 1, ..., 6};
    with a block scale S = 2^(e_max - 6) each becomes c 2^(e - e_max + 6): at most 6 2^6 = 384 <= 448, and
    exact in e4m3 down to its smallest subnormal 2^-9, i.e. while e_max - e <= 14 (FP4_FP8_SPREAD) for
    every 1x32 scale of the block. A block whose scales spread wider would round: refused (ValueError),
    naming it, so the loader keeps the FP4 route."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    if N % BLOCK or K % BLOCK or s.shape != (N, K // MX_BLOCK):
        raise ValueError(f"fp4_to_fp8_blocks: weights [{N}, {K}] must be whole {BLOCK}x{BLOCK} blocks, scales {s.shape}")
    e = np.log2(np.asarray(s, np.float64))                                       # [N, K/32] integer exponents
    eb = e.reshape(N // BLOCK, BLOCK, K // BLOCK, BLOCK // MX_BLOCK)
    e_max, e_min = eb.max((1, 3)), eb.min((1, 3))                                # [N/128, K/128]
    wide = np.argwhere(e_max - e_min > FP4_FP8_SPREAD)
    if len(wide):
        (i, j), = wide[:1]
        raise ValueError(f"fp4_to_fp8_blocks: the 1x32 scales of block ({i}, {j}) span {e_max[i, j] - e_min[i, j]:.0f} "
                         f"binades (> {FP4_FP8_SPREAD}): not exact in one e4m3 block")
    S = np.exp2(e_max - 6)                                                       # [N/128, K/128] block scales
    v = fp4_dequant(packed, s).astype(np.float64)                                # exact values [N, K]
    codes = round_once(v / np.repeat(np.repeat(S, BLOCK, 0), BLOCK, 1), E4M3)      # exact by the bound above
    return codes, S.astype(np.float32)


def fp4_gemm(a, sa, packed, sb):  # [M, K] fp8, [M, K/128], [N, K/2] e2m1 pairs, [N, K/32] -> [M, N] f32
    """V4's expert GEMM: the FP4 weights widened to FP8 (exact), then per 32-wide K block the fp8 x fp8
    partial sum (exact in float64, rounded to fp32 as the accumulator), promoted by the activation's
    scale (one per 128) and then the weight's (one per 32), K blocks ascending (the official fp4_gemm)."""
    M, K = a.shape
    a64 = decode(a, np.float64)
    nib = np.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)   # even k: the low nibble
    b64 = nib.astype(np.uint8).view(FP4).astype(np.float64)                    # [N, K] e2m1 values
    acc = np.zeros((M, packed.shape[0]), np.float32)
    for kb in range(K // MX_BLOCK):
        k = slice(kb * MX_BLOCK, (kb + 1) * MX_BLOCK)
        partial = (a64[:, k] @ b64[:, k].T).astype(np.float32)
        acc += (partial * sa[:, kb * MX_BLOCK // BLOCK, None]) * sb[None, :, kb]
    return acc


def fp4_roundtrip(x):  # [..., N] -> [..., N] float32: V4's indexer fake quant, e2m1 per 32 with a 2^e scale
    """s = 2^ceil(log2(amax / 6)) from amax >= 6 * 2^-126 (one fp32 multiply by fp32(1/6), as act_quant's
    1/448), codes e2m1(clip(x / s, -6, 6)) rounded to nearest even, then fp32(code) * s."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(*x.shape[:-1], -1, MX_BLOCK)
    amax = np.maximum(np.abs(xb).max(-1), np.float32(6 * 2.0 ** -126))
    s = ue8m0_ceil((amax * (np.float32(1) / np.float32(6))).astype(np.float32))
    q = np.clip(xb / s[..., None], -6, 6).astype(FP4)
    return (q.astype(np.float32) * s[..., None]).reshape(x.shape)


def latent_width(C, R, group=BLOCK):  # bytes of one packed FP8 latent cache row (spec/kernels.md §3.4)
    return C + 4 * (C // group) + 2 * R   # C e4m3 codes, C/128 fp32 scales, R bf16 rope values: 656 for 512 + 64
