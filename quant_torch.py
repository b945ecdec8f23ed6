"""Number formats in torch: quant.py's references computed on torch tensors, on the CPU or a GPU,
giving the same bits. The torch backend (backend_torch.py) and the kernels' torch fallbacks
(kernels_rocm.py on GPUs without FP8 stores) both take them from here, so nothing below the model
imports the backend.

    to_torch        ml_dtypes arrays -> tensors without a float copy         (FP8, bf16 bytes kept)
    ue8m0_ceil      2^ceil(log2 v) from the bits                              quant.ue8m0_ceil
    act_quant       1x128 groups, ue8m0 scales, e4m3 codes                    quant.act_quant
    act_dequant     codes x group scales                                     quant.act_dequant
    fp8_values      FP8 codes -> values (a 256-entry table on the CPU)        quant.fp8_decode
    fp8_gemm        block-scaled FP8 GEMM, float64 partials (exact)           quant.fp8_gemm
    dequant         a Weight -> [N, K] float32                                quant.Weight.dequant
    unpack_latent   packed FP8 latent cache rows -> c^KV, k^R                 spec/kernels.md §3.4
    fp4_quant       [N, K] -> e2m1 codes two a byte, 2^e scales per 32         quant.fp4_quant

Letters: M rows of activations, N output features, K input features, Kb = K / 128 blocks.
"""
import contextlib
import functools

import numpy as np
import torch

import quant

F8 = torch.float8_e4m3fn
SERIAL_BELOW = 1 << 22      # CPU work on fewer elements runs on one thread (cpu_threads_for)
PARTIAL_BYTES = 1 << 26     # fp8_gemm's float64 partials of every K block, [Kb, rows, N], are made this many bytes at a time


# -----------------------------------------------------------------------------
# NumPy (ml_dtypes) arrays -> torch tensors, without a float copy for FP8 and bf16

def to_torch(a, device):  # one host copy (the source may be a read-only memory map), then to the device
    if isinstance(a, torch.Tensor):                                     # already torch (bench/: made on the device)
        return a.to(device)
    a = np.asarray(a)
    if a.dtype == quant.E4M3:
        t = torch.from_numpy(np.array(a.view(np.uint8))).view(F8)
    elif a.dtype == quant.BF16:
        t = torch.from_numpy(np.array(a.view(np.uint16))).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.array(a))
    return t.to(device)


# -----------------------------------------------------------------------------
# act_quant: 1x128 groups, ue8m0 scales

def ue8m0_ceil(v):  # float32 tensor > 0 -> 2^ceil(log2 v), from the bits (as quant.ue8m0_ceil)
    bits = v.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((e + 127) << 23).view(torch.float32)


def act_quant(x, block_size=128, scale_fmt="ue8m0"):  # [..., N] -> [..., N] fp8, [..., N/bs] (quant.act_quant)
    x = x.float()
    xb = x.reshape(*x.shape[:-1], -1, block_size)
    amax = xb.abs().amax(-1).clamp_min(1e-4)
    v = amax * (1 / 448)                          # one fp32 multiply by fp32(1/448) (no host tensor: capturable)
    s = ue8m0_ceil(v) if scale_fmt == "ue8m0" else v
    q = (xb / s[..., None]).clamp(-448, 448).to(F8)
    return q.reshape(x.shape), s


def act_dequant(q, s):  # [..., N] fp8, [..., N/128] -> [..., N] float32 (quant.act_dequant)
    return (q.float().reshape(*q.shape[:-1], -1, 128) * s[..., None]).reshape(q.shape)


# -----------------------------------------------------------------------------
# The block-scaled FP8 GEMM and weight dequantisation (quant.fp8_gemm, quant.weight_dequant)

@contextlib.contextmanager
def cpu_threads_for(t):
    """CPU work on a tensor t of fewer than SERIAL_BELOW elements on one intra-op thread, then the
    caller's count again. Such work takes well under a scheduler's time slice on one core, and a
    parallel region waits for every thread of the pool: on a loaded machine one descheduled thread
    stalls it (the tiny checkpoint's decode ran 10x slower on 2 threads than on 1 while other
    processes ran). Bits do not change: the ops this wraps sum per element or in exact float64."""
    n = torch.get_num_threads()
    if t.device.type != "cpu" or n == 1 or t.numel() >= SERIAL_BELOW:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


_FP8_TABLES = {}            # (fp8 dtype, float dtype) -> the 256 values of its codes, on the CPU


def fp8_values(codes, dtype=torch.float32):  # fp8 tensor -> its values in dtype (quant.fp8_decode)
    """On the CPU through a 256-entry table, as quant.fp8_decode: torch's own fp8 -> float cast is
    scalar there (about 6x slower than this gather). The table is that cast of every code, so the bits
    are the cast's, NaN (0x7F, 0xFF) and subnormals included. Elsewhere the device's own cast."""
    if codes.device.type != "cpu" or codes.element_size() != 1:
        return codes.to(dtype)
    key = (codes.dtype, dtype)
    if key not in _FP8_TABLES:
        _FP8_TABLES[key] = torch.arange(256, dtype=torch.uint8).view(codes.dtype).to(dtype)
    flat = codes.reshape(-1).view(torch.uint8).int()                      # int32 indices: no int64 copy
    return _FP8_TABLES[key].index_select(0, flat).view(codes.shape)


def fp8_gemm(a, sa, b, sb, block_size=128):  # [M, K] fp8, [M, Kb], [N, K] fp8, [Nb, Kb] -> [M, N] f32 (quant.fp8_gemm)
    """Every K block's partial sum in one batched float64 GEMM: a product of two fp8 values has 8
    significant bits and is a multiple of 2^-18, and 128 of them sum to less than 2^25, so each
    partial is exact in float64 whatever the order of summation (BLAS's blocking included). Then, as
    the reference: fp32 rounding, the fp32 product of the two scales, fp32 accumulation K blocks
    ascending."""
    with cpu_threads_for(b):
        return _fp8_gemm(a, sa, b, sb, block_size)


def _fp8_gemm(a, sa, b, sb, block_size):
    M, K = a.shape
    N = b.shape[0]
    Kb = -(-K // block_size)
    b64 = fp8_values(b, torch.float64)
    if K % block_size:                                                   # a ragged last block: zero products
        b64 = torch.nn.functional.pad(b64, (0, Kb * block_size - K))
    b64 = b64.reshape(N, Kb, block_size).permute(1, 2, 0)                # [Kb, bs, N]
    sb_rows = sb.repeat_interleave(block_size, 0)[:N]                  # [N, Kb]
    acc = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    rows = max(1, PARTIAL_BYTES // (8 * Kb * N))                         # rows are independent: chunks, same bits
    for m0 in range(0, M, rows):
        m = slice(m0, min(M, m0 + rows))
        a64 = fp8_values(a[m], torch.float64)
        if K % block_size:
            a64 = torch.nn.functional.pad(a64, (0, Kb * block_size - K))
        partial = torch.bmm(a64.reshape(-1, Kb, block_size).transpose(0, 1), b64).float()   # [Kb, rows, N], fp32
        promoted = partial * (sa[m].T[:, :, None] * sb_rows.T[:, None, :])  # "2xAcc" promotion, per block
        for kb in range(Kb):                                             # K blocks ascending, as the reference
            acc[m] += promoted[kb]
    return acc


def dequant(W):  # quant.Weight of tensors -> [N, K] float32 (quant.Weight.dequant)
    if W.scale is None:
        return W.w.float()
    if W.w.dtype == torch.uint8:                                        # V4's FP4 experts: a scale per 32
        v = fp4_values(W.w)
        return (v.view(v.shape[0], -1, 32) * W.scale[:, :, None]).view(v.shape)
    with cpu_threads_for(W.w):
        return _dequant(W)


def _dequant(W):
    N, K = W.w.shape
    if K % 128 == 0:            # the column blocks by broadcasting, not an [N, K] copy of the scales
        s = W.scale.repeat_interleave(128, 0)[:N]                                     # [N, K/128]
        return (fp8_values(W.w).view(N, -1, 128) * s[:, :, None]).view(N, K)       # the same products
    s = W.scale.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return fp8_values(W.w) * s


# -----------------------------------------------------------------------------
# The packed latent cache row: FP8 codes of c^KV, their ue8m0 scales, bf16 k^R (spec/kernels.md §3.4)

def unpack_latent(rows, C):  # [..., W] latent cache rows -> c^KV [..., C], k^R [..., R] float32
    if rows.dtype != torch.uint8:
        return rows[..., :C].float(), rows[..., C:].float()
    G = C // 128
    codes = rows[..., :C].contiguous().view(F8).float()
    scale = rows[..., C:C + 4 * G].contiguous().view(torch.float32)
    c = (codes.reshape(*codes.shape[:-1], G, 128) * scale[..., None]).reshape(codes.shape)
    return c, rows[..., C + 4 * G:].contiguous().view(torch.bfloat16).float()


# -----------------------------------------------------------------------------
# DeepSeek-V4's numbers: FP4 e2m1 experts (two codes per byte, low nibble first, a 2^e scale per 32),
# the indexer's FP4 round trip, fp32 GEMMs summed in float64, and the experts' FP4 quantization that
# random real-width checkpoints are drawn with (quant.fp4_gemm, fp4_roundtrip, matmul_f32, fp4_quant)

_FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp4_values(packed, dtype=torch.float32):  # [N, K/2] uint8 -> [N, K] e2m1 values (quant.fp4_dequant's codes)
    table = torch.tensor(_FP4_GRID + tuple(-v for v in _FP4_GRID), dtype=dtype, device=packed.device)
    nib = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)       # even k: the low nibble
    return table[nib.long()]


def fp4_gemm(a, sa, packed, sb):  # quant.fp4_gemm: [M, K] fp8, [M, K/128], [N, K/2], [N, K/32] -> [M, N] f32
    M, K = a.shape
    a64, b64 = fp8_values(a, torch.float64), fp4_values(packed, torch.float64)
    acc = torch.zeros(M, packed.shape[0], dtype=torch.float32, device=a.device)
    for kb in range(K // 32):                                           # exact partials per 32, fp32 promotion
        k = slice(kb * 32, (kb + 1) * 32)
        partial = (a64[:, k] @ b64[:, k].T).float()
        acc += (partial * sa[:, kb * 32 // 128, None]) * sb[None, :, kb]
    return acc


@functools.lru_cache(None)
def _fp4_tables(device):  # the e2m1 grid and the midpoints between grid neighbours, made once per device
    return (torch.tensor(_FP4_GRID, device=device),                    # (not inside a CUDA graph's capture)
            torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=device))


def fp4_roundtrip(x):  # quant.fp4_roundtrip: [..., N] -> e2m1 per 32 with a 2^e scale, back to float32
    x = x.float()
    xb = x.reshape(*x.shape[:-1], -1, 32)
    amax = xb.abs().amax(-1).clamp_min(6 * 2.0 ** -126)
    s = ue8m0_ceil(amax * (1 / 6))
    y = (xb / s[..., None]).clamp(-6, 6)
    grid, _ = _fp4_tables(x.device)
    return (torch.sign(y) * grid[_e2m1_index(y)] * s[..., None]).reshape(x.shape)


def _e2m1_index(y):  # values in [-6, 6] -> the index in _FP4_GRID of |y| rounded to nearest, ties to even
    _, mid = _fp4_tables(y.device)
    i = torch.bucketize(y.abs(), mid)                                   # a tie goes to the lower neighbour...
    tie = (i < 7) & (y.abs() == mid[i.clamp_max(6)]) & (i % 2 == 1)
    return i + tie.long()                                               # ...unless that one is odd: to even


def fp4_quant(w):  # quant.fp4_quant on a device: [N, K] float -> [N, K/2] uint8 packed, [N, K/32] float32 scales
    N, K = w.shape
    wb = w.float().reshape(N, K // 32, 32)
    amax = wb.abs().amax(-1)
    e = torch.where(amax > 0, torch.frexp(torch.where(amax > 0, amax, 1.0))[1] - 1 - 2, 0)   # floor(log2 amax) - 2
    s = torch.exp2(e.float())
    y = (wb / s[..., None]).clamp(-6, 6).reshape(N, K)
    code = (_e2m1_index(y) | (torch.signbit(y).long() << 3)).to(torch.uint8)   # sign bit 8, -0 too (as ml_dtypes)
    return code[:, 0::2] | (code[:, 1::2] << 4), s                      # low nibble: the even index along K


def matmul_f32(a, b):  # quant.matmul_f32: summed in float64, rounded once to float32
    return (a.double() @ b.double()).float()
