"""Triton kernels for NVIDIA GPUs (and, with kernels_rocm.py's data, AMD): the hot ops of the fast path.
The model, the tests and kernels_rocm.py call them here: the number-format and GEMM kernels live in
kernels_fp8.py and are re-exported; the elementwise RoPE and the DSA kernels follow, in the paper's order.

Number formats and GEMMs, in kernels_fp8.py (its docstring has the details), re-exported here:
    act_quant   FP8 activations: 1x128 groups, ue8m0 scales        reference: quant.act_quant
    swiglu_quant  silu(a) * b, rounded, then act_quant: one launch  reference: moe.mlp_ref's steps
    fp8_gemm    the block-scaled FP8 GEMM, K split for decode      reference: quant.fp8_gemm
    moe_gemm    that GEMM for the routed experts, rows gathered    reference: quant.fp8_gemm per expert
    bf16_round  float32 -> the nearest bf16 values, one launch     reference: quant.bf16_round
    rms_norm    a row's RMSNorm (V3.2's and V4's), one launch     reference: attention.rms_norm_ref, compressor.rms_norm
    add_rms_norm  the residual add, the norm and the sum's rounding in one launch
                                                                  reference: model.Transformer._norm's steps
    matmul_f32  a @ b, exact products, float64 sums rounded once   reference: quant.matmul_f32
    heads_matmul_f32  the same per head, a decode step's absorbed q^C W^UK and o W^UV^T
                                                                  reference: quant.matmul_f32 per head

The routed experts' bookkeeping, in kernels_moe.py, re-exported here (a decode step's MoE layer ran it as
about forty small torch kernels):
    gate_topk   the experts' choice (groups, top-K, ties toward the lower index) and weights
                                                                  reference: moe.gate_ref after the scores
    route       the grouped GEMM's rows: pairs sorted by expert, padded to blocks
                                                                  reference: backend_torch.route
    moe_combine the weighted sum in expert-id order, + the shared experts, the bf16 rounding
                                                                  reference: moe.moe_ref's accumulation

RoPE, here (its jit helper _rope serves index_prep too):
    rope        RoPE in either layout: elementwise glue, one launch
                                                    reference: rope.rope_interleaved / rope.rope_half_split

DSA kernels (DeepSeek Sparse Attention; the model calls them on a GPU through backend_torch):
    index_prep          the indexer's per-token steps before eq. (1) in one kernel: RoPE, the key's
                        LayerNorm, the Hadamard rotation (float64 butterflies), FP8 quantisation, the
                        key cache write, the head weights    reference: indexer.index_prep_ref
    index_scores        eq. (1) for a prefill chunk or decode rows: keys on the MMA's M side, BQ queries
                        x all their heads on N (the head sum in registers), keys split over programs,
                        future key blocks skipped              reference: indexer.index_scores_causal_ref
    topk_indices        eq. (2), exact causal top-k: per-segment lists above a sampled threshold, then
                        radix select on them (or on the row), held in registers where they fit
                                                               reference: indexer.topk_indices_ref
    store_latent        the packed latent row (FP8 codes, scales, bf16 rope) into the cache in one launch
                                                               reference: backend_torch.store_latent
    sparse_mla_decode   absorbed MLA over the selected latent rows (packed FP8 656-byte rows, or bf16 /
    sparse_mla_prefill  float32), online softmax; decode splits the selected set and combines the
                        splits by log-sum-exp, prefill writes each query directly
                                                                    reference: attention.mqa_absorbed_ref
    On Hopper, sparse_mla_prefill (and sparse_mla_decode where its set stays whole: B=64 at 128 heads)
    over a bf16 or packed FP8 cache runs kernels_hopper's warp-specialised variant (Gluon: a producer
    warpgroup gathers bf16 rows, or decodes the packed FP8 rows one consumer copies in, while two consumers
    compute), the same bits as the kernel here with
    the latent whole (halves=False, late_sum=False: bf16 rows' defaults; FP8 rows' are the halves).

Every kernel is shared with kernels_rocm.py: what differs by architecture (the FP8 flavour
and its maximum, whether FP8 is decoded by hand, tile sizes) arrives as constexpr arguments and
wrapper data. Every kernel runs on the CPU under TRITON_INTERPRET=1 (tests/test_kernels_cuda.py), where
the interpreter's fp32->fp8 and fp32->bf16 casts are defective (spec/kernels.md §4.3): the tests there
allow exactly those defects and check bit-exactness on a GPU.
"""
import functools

import numpy as np

import torch
import triton
import triton.language as tl

import kernels_hopper
import quant
# the number formats and GEMMs, re-exported: callers name them kernels_cuda.act_quant, .fp8_gemm, ...
from kernels_fp8 import (FP8, FP8_MAX, GEMV_ROWS, MOE_BLOCK_M, RMS_NORM_MAX, act_quant, add_rms_norm,  # noqa: F401
                         bf16_round, fp8_gemm, heads_matmul_f32, matmul_f32, moe_gemm, rms_norm, sm_count,
                         swiglu_quant)
from kernels_fp8 import _await_inputs, _bf16_round, _e4m3_decode, _interpreted, _ue8m0_quant, pdl  # the DSA kernels' helpers
from kernels_moe import ROUTE_MAX, gate_topk, moe_combine, route  # noqa: F401  the routed experts' bookkeeping
from kernels_v4 import (compress_keys, fp4_gemm, fp4_moe_gemm, hc_mix_pre, hc_post, index_scores_v4,  # noqa: F401  V4
                       sparse_attention)


# -----------------------------------------------------------------------------
# What differs by GPU vendor, as kernels_rocm.py states it for AMD: on NVIDIA the checkpoint's own format

def prepare_weight(w, scale):  # checkpoint e4m3fn codes + scales -> this GPU's storage: unchanged
    return w, scale


def fp8_dtype():  # what the indexer's FP8 key cache holds
    return FP8


latent_quant = act_quant        # the packed latent rows' e4m3fn codes and scales (spec/kernels.md §3.4)


def latent_stores():  # store_latent runs here (it stores e4m3fn codes)
    return True


def fp8_stores():  # Triton stores FP8 here (index_prep runs)
    return True


# -----------------------------------------------------------------------------
# RoPE in either layout: official numerics' elementwise glue, one launch where PyTorch takes several.
# _rope, the rotation itself, serves index_prep too. The fp32 operations are PyTorch's, rounded alike.

@triton.jit
def _rope(x, cos, sin, ROWS: tl.constexpr, D: tl.constexpr, R: tl.constexpr, INTERLEAVED: tl.constexpr):
    """[ROWS, D] rows whose first R values are rotated pairwise, (a, b) -> (a cos - b sin, a sin + b cos):
    pairs (2i, 2i + 1) as rope.rope_interleaved, or (i, i + R/2) as rope.rope_half_split; the other
    D - R values pass. cos, sin [ROWS, R/2]."""
    if INTERLEAVED:                                                    # [ROWS, D/R, R/2, 2]
        y = tl.reshape(x, (ROWS, D // R, R // 2, 2))
    else:                                                              # [ROWS, D/R, 2, R/2] -> pairs last
        y = tl.permute(tl.reshape(x, (ROWS, D // R, 2, R // 2)), (0, 1, 3, 2))
    a, b = tl.split(y)                                                 # [ROWS, D/R, R/2] each
    c, s = cos[:, None, :], sin[:, None, :]
    rot = (tl.arange(0, D // R) == 0)[None, :, None]                  # the first R values only
    y = tl.join(tl.where(rot, a * c - b * s, a), tl.where(rot, a * s + b * c, b))
    if not INTERLEAVED:
        y = tl.permute(y, (0, 1, 3, 2))
    return tl.reshape(y, (ROWS, D))


@triton.jit
def _rope_kernel(X, COS, SIN, Y, ROWS, H, T, sb, st, sh, R: tl.constexpr, INTERLEAVED: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Reference: rope.rope_interleaved / rope.rope_half_split. X [B, T, H, R] with strides (sb, st, sh, 1),
    COS, SIN [T, R/2] -> Y [B, T, H, R] contiguous float32. BLOCK rows per program."""
    _await_inputs(PDL)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows[:, None] < ROWS
    bi, t, h = rows // (T * H), (rows // H) % T, rows % H
    rr, i = tl.arange(0, R)[None, :], tl.arange(0, R // 2)[None, :]
    x = tl.load(X + (bi.to(tl.int64) * sb + t.to(tl.int64) * st + h.to(tl.int64) * sh)[:, None] + rr, mask=ok,
                other=0.0).to(tl.float32)
    c = tl.load(COS + t[:, None] * (R // 2) + i, mask=ok, other=0.0)
    s = tl.load(SIN + t[:, None] * (R // 2) + i, mask=ok, other=0.0)
    tl.store(Y + rows.to(tl.int64)[:, None] * R + rr, _rope(x, c, s, BLOCK, R, R, INTERLEAVED), mask=ok)


def rope(x, cos, sin, interleaved):
    """x [B, T, H, R] (any strides, last one 1; float32 or bf16), cos, sin [T, R/2] -> [B, T, H, R] float32,
    the rotation of rope.rope_interleaved (interleaved) or rope.rope_half_split."""
    B, T, H, R = x.shape
    if cos.shape != (T, R // 2) or sin.shape != cos.shape or R & (R - 1) or x.stride(-1) != 1:
        raise ValueError(f"rope: x {tuple(x.shape)} (strides {x.stride()}), cos {tuple(cos.shape)} do not fit")
    y = torch.empty(B, T, H, R, dtype=torch.float32, device=x.device)
    rows = B * T * H
    block = max(1, min(64, 4096 // R))
    _rope_kernel[(triton.cdiv(rows, block),)](x, cos.float().contiguous(), sin.float().contiguous(), y, rows, H, T,
                                              *x.stride()[:3], R=R, INTERLEAVED=interleaved, BLOCK=block,
                                              num_warps=4, enable_fp_fusion=False, **pdl())
    return y


# -----------------------------------------------------------------------------
# DSA kernels. Positions arrive as a device integer [1] (POS, read as int32): a captured decode step
# reads its position from memory, so the same launch serves every step.

def _pos_tensor(start_pos, device):  # an int, or a 0-d device tensor (captured decode) -> an integer [1] on the device
    if isinstance(start_pos, torch.Tensor):
        if start_pos.device == torch.device(device) and start_pos.dtype in (torch.int32, torch.int64):
            return start_pos.reshape(1)                # a view: no conversion launch per kernel in a decode step
        return start_pos.reshape(1).to(device=device, dtype=torch.int32)
    return torch.full((1,), int(start_pos), dtype=torch.int32, device=device)


# -----------------------------------------------------------------------------
# The indexer's per-token steps between its projections and eq. (1), fused (official numerics): RoPE,
# the key's LayerNorm, the Hadamard rotation, FP8 quantisation, the key cache write and the head weights.
# Each fp32 operation is the reference's, rounded alike (no FMA contraction: enable_fp_fusion=False).

@triton.jit
def _hadamard(x, ROWS: tl.constexpr, D: tl.constexpr):  # [ROWS, D] float64 -> x H_D (Sylvester; symmetric)
    for i in tl.static_range(D.bit_length() - 1):                      # butterflies on pairs 2^i apart
        u, v = tl.split(tl.permute(tl.reshape(x, (ROWS, D >> (i + 1), 2, 1 << i)), (0, 1, 3, 2)))
        x = tl.reshape(tl.permute(tl.join(u + v, u - v), (0, 1, 3, 2)), (ROWS, D))
    return x


@triton.jit
def _rotate_quant(x, HS, ROWS: tl.constexpr, D: tl.constexpr, FP8_MAX: tl.constexpr):
    """indexer.rotate_activation_ref, bf16 rounding, then act_quant: [ROWS, D] -> (x / s clamped, s [ROWS]).
    The Hadamard sums run in float64 as the reference's (exact: +-1 times bf16 values); HS [1] float64
    holds D^-0.5 (a float argument would arrive as fp32)."""
    y = _bf16_round((_hadamard(x.to(tl.float64), ROWS, D) * tl.load(HS)).to(tl.float32))
    return _ue8m0_quant(y, FP8_MAX)


@triton.jit
def _index_prep_queries(Q, XW, COS, SIN, HS, Q8, QS, WQ, bt, h0, T, J, c_j, c_d,
                        D: tl.constexpr, R: tl.constexpr, HB: tl.constexpr, FP8_MAX: tl.constexpr):
    rd, rr, rh = tl.arange(0, D), tl.arange(0, R // 2), h0 + tl.arange(0, HB)
    ok = rh < J
    row = bt.to(tl.int64) * J + rh
    x = tl.load(Q + row[:, None] * D + rd[None, :], mask=ok[:, None], other=0.0)
    t = bt % T
    cos = tl.broadcast_to(tl.load(COS + t * (R // 2) + rr)[None, :], (HB, R // 2))
    sin = tl.broadcast_to(tl.load(SIN + t * (R // 2) + rr)[None, :], (HB, R // 2))
    y, s = _rotate_quant(_bf16_round(_rope(x, cos, sin, HB, D, R, False)), HS, HB, D, FP8_MAX)
    tl.store(Q8 + row[:, None] * D + rd[None, :], y.to(Q8.dtype.element_ty), mask=ok[:, None])
    tl.store(QS + row, s, mask=ok)
    tl.store(WQ + row, tl.load(XW + row, mask=ok, other=0.0) * c_j * s * c_d, mask=ok)   # head_weights_ref


@triton.jit
def _index_prep_keys(KR, COS, SIN, LNW, LNB, HS, K8, KS, POS, r0, BT, T, CAP, eps,
                     D: tl.constexpr, R: tl.constexpr, KB: tl.constexpr, FP8_MAX: tl.constexpr):
    rd, rr, rows = tl.arange(0, D), tl.arange(0, R // 2), r0 + tl.arange(0, KB)
    ok = rows < BT
    x = tl.load(KR + rows[:, None].to(tl.int64) * D + rd[None, :], mask=ok[:, None], other=0.0)
    mu = tl.sum(x, 1) * (1.0 / D)                                      # indexer.layer_norm_ref (D: a power of two)
    xc = x - mu[:, None]
    var = tl.sum(xc * xc, 1) * (1.0 / D)
    x = _bf16_round(tl.div_rn(xc, tl.sqrt_rn(var + eps)[:, None]) * tl.load(LNW + rd)[None, :]
                    + tl.load(LNB + rd)[None, :])
    t = rows % T
    cos = tl.load(COS + t[:, None] * (R // 2) + rr[None, :])
    sin = tl.load(SIN + t[:, None] * (R // 2) + rr[None, :])
    y, s = _rotate_quant(_bf16_round(_rope(x, cos, sin, KB, D, R, False)), HS, KB, D, FP8_MAX)
    at = (rows // T).to(tl.int64) * CAP + tl.load(POS).to(tl.int32) + t   # cache slots
    tl.store(K8 + at[:, None] * D + rd[None, :], y.to(K8.dtype.element_ty), mask=ok[:, None])
    tl.store(KS + at, s, mask=ok)


@triton.jit
def _index_prep_kernel(Q, KR, XW, COS, SIN, LNW, LNB, HS, Q8, QS, WQ, K8, KS, POS, BT, T, J, CAP, eps, c_j, c_d,
                       D: tl.constexpr, R: tl.constexpr, HB: tl.constexpr, KB: tl.constexpr, FP8_MAX: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Reference: indexer.index_prep_ref (indexer_forward's steps from q = wq_b(qr) and k = wk(x) to
    the scores' inputs).
    Q [BT, J, D] (bf16 values), KR [BT, D] (bf16 values), XW [BT, J] = x weights_proj^T (fp32), COS, SIN
    [T, R/2] -> Q8 [BT, J, D] fp8 and QS [BT, J]; WQ [BT, J] the head weights (eq. 1's w with J^-0.5,
    the q scale and D^-0.5 folded in, as head_weights_ref); the keys' codes and scales into the cache
    K8 [B, CAP, D], KS [B, CAP] at positions POS + t. Programs: one per (token, HB heads): RoPE,
    rotation, FP8, weights; then one per KB tokens' keys: LayerNorm, RoPE, rotation, FP8, cache."""
    _await_inputs(PDL)
    pid = tl.program_id(0)
    hbs = tl.cdiv(J, HB)
    if pid < BT * hbs:
        _index_prep_queries(Q, XW, COS, SIN, HS, Q8, QS, WQ, pid // hbs, (pid % hbs) * HB, T, J, c_j, c_d, D, R, HB, FP8_MAX)
    else:
        _index_prep_keys(KR, COS, SIN, LNW, LNB, HS, K8, KS, POS, (pid - BT * hbs) * KB, BT, T, CAP, eps, D, R, KB, FP8_MAX)


def index_prep(q, k, xw, cos, sin, ln_w, ln_b, k_cache, k_scale_cache, start_pos, eps=1e-6, fp8_max=FP8_MAX):
    """q [B, T, J, D], k [B, T, D] (the projections' bf16-valued outputs), xw [B, T, J] (x weights_proj^T,
    fp32), cos, sin [T, R/2], the key LayerNorm's ln_w, ln_b [D] -> (q codes [B, T, J, D] in k_cache's
    FP8 type, head weights w [B, T, J]); the keys' codes and scales go to k_cache [>=B, CAP, D],
    k_scale_cache [>=B, CAP] at start_pos + t (an int, or a 0-d device tensor: captured decode).
    Reference: indexer.index_prep_ref."""
    B, T, J, D = q.shape
    R = 2 * cos.shape[-1]
    if k.shape != (B, T, D) or xw.shape != (B, T, J) or cos.shape != (T, R // 2) or sin.shape != cos.shape \
            or k_cache.shape[0] < B or k_cache.shape[2] != D or k_scale_cache.shape[:2] != k_cache.shape[:2]:
        raise ValueError(f"index_prep: q {tuple(q.shape)}, k {tuple(k.shape)}, xw {tuple(xw.shape)}, cos {tuple(cos.shape)}, "
                         f"cache {tuple(k_cache.shape)} / {tuple(k_scale_cache.shape)} do not fit")
    if D != 128 or R & (R - 1) or not 4 <= R <= D:
        raise ValueError(f"index_prep: head dim {D} must be 128 (one FP8 scale group), rope dim {R} a power of two <= it")
    assert k_cache.is_contiguous() and k_scale_cache.is_contiguous() and k_scale_cache.dtype == torch.float32
    dev = q.device
    q8 = torch.empty(B, T, J, D, dtype=k_cache.dtype, device=dev)
    qs = torch.empty(B, T, J, dtype=torch.float32, device=dev)
    w = torch.empty(B, T, J, dtype=torch.float32, device=dev)
    hb, kb = min(16, triton.next_power_of_2(J)), 16
    grid = (B * T * triton.cdiv(J, hb) + triton.cdiv(B * T, kb),)
    _index_prep_kernel[grid](q.float().contiguous(), k.float().contiguous(), xw.float().contiguous(),
                             cos.float().contiguous(), sin.float().contiguous(), ln_w.float().contiguous(),
                             ln_b.float().contiguous(), _hadamard_scale(D, dev), q8, qs, w, k_cache, k_scale_cache,
                             _pos_tensor(start_pos, dev), B * T, T, J, k_cache.shape[1], eps,
                             float(np.float32(J ** -0.5)), float(np.float32(D ** -0.5)), D=D, R=R, HB=hb, KB=kb,
                             FP8_MAX=fp8_max, num_warps=4, enable_fp_fusion=False, **pdl())
    return q8, w


@functools.lru_cache(None)
def _hadamard_scale(D, device):  # D^-0.5 as a float64 [1] on the device (as indexer.rotate_activation_ref)
    return torch.tensor([D ** -0.5], dtype=torch.float64, device=device)


# -----------------------------------------------------------------------------
# eq. (1), the lightning indexer's scores: BQ query tokens x all their heads on the MMA's M side

@triton.jit
def _index_scores_kernel(Q, W, K, KS, OUT, POS, T, S, J, SPLIT,
                         BQ: tl.constexpr, JP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr, DECODE: tl.constexpr, FNUZ: tl.constexpr, PDL: tl.constexpr = False):
    """Reference: indexer.index_scores_causal_ref (index_scores_ref with -inf at each query's future
    keys). One program per (sequence, block of BQ queries, split of the keys): the queries' rows q [BQ * JP, D] (every head
    of each query) stay in registers while key blocks stream past. Keys on the MMA's M side (as
    DeepGEMM): logits [BLOCK_N, BQ * JP] in one MMA, ReLU per head, the signed head weights, the sum
    over each query's heads (within a thread's registers), then the key scale (> 0, so it commutes
    with the ReLU). Key blocks after the block's last query are not computed, only written -inf."""
    _await_inputs(PDL)
    b, sp = tl.program_id(0), tl.program_id(2)
    qb = tl.num_programs(1) - 1 - tl.program_id(1)                     # longest rows first: a shorter tail
    start_pos = tl.load(POS).to(tl.int32)
    rm = tl.arange(0, BQ * JP)
    t, j = qb * BQ + rm // JP, rm % JP                                 # each q row's query token and head
    ok = (t < T) & (j < J)
    bt = b.to(tl.int64) * T + t
    rd = tl.arange(0, D)
    if DECODE:                                                         # no FP8 hardware: fp16 operands
        q = _e4m3_decode(tl.load(Q + (bt * J + j)[:, None] * D + rd[None, :], mask=ok[:, None], other=0), FNUZ)
        q = q.to(tl.float16)
    else:
        q = tl.load(Q + (bt * J + j)[:, None] * D + rd[None, :], mask=ok[:, None], other=0.0)
    qt = tl.trans(q)                                                   # [D, BQ * JP], D contiguous (K-major)
    w = tl.load(W + bt * J + j, mask=ok, other=0.0)
    rq = qb * BQ + tl.arange(0, BQ)
    last = start_pos + rq                                              # each query's own position
    top = start_pos + tl.minimum(qb * BQ + BQ, T) - 1                  # the block's last position
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, S)
    live = tl.minimum(hi, top + 1)
    out = OUT + (b.to(tl.int64) * T + rq)[None, :] * S                 # [1, BQ] row starts
    row_ok = (rq < T)[None, :]
    for n0 in range(lo, live, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        k_at = K + (b.to(tl.int64) * S + rn)[:, None] * D + rd[None, :]
        if DECODE:
            k = _e4m3_decode(tl.load(k_at, mask=rn[:, None] < S, other=0), FNUZ).to(tl.float16)
        else:
            k = tl.load(k_at, mask=rn[:, None] < S, other=0.0)
        if IEEE:                                                       # float32 q, k (exact numerics): no tf32
            logits = tl.dot(k, qt, input_precision="ieee")
        else:                                                          # FP8 (or fp16) operands, fp32 accumulation
            logits = tl.dot(k, qt, out_dtype=tl.float32)
        z = tl.maximum(logits, 0.0) * w[None, :]                       # ReLU per head, then the signed weight
        score = tl.sum(tl.reshape(z, (BLOCK_N, BQ, JP)), axis=2)       # sum over heads -> [BLOCK_N, BQ]
        score = score * tl.load(KS + b.to(tl.int64) * S + rn, mask=rn < S, other=0.0)[:, None]
        tl.store(out + rn[:, None], tl.where(rn[:, None] <= last[None, :], score, float("-inf")),
                 mask=row_ok & (rn < hi)[:, None])
    f0 = lo + (tl.maximum(live - lo, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    for n0 in range(f0, hi, BLOCK_N):                                  # future key blocks: only -inf
        rn = n0 + tl.arange(0, BLOCK_N)
        tl.store(out + rn[:, None], tl.full((BLOCK_N, BQ), float("-inf"), tl.float32), mask=row_ok & (rn < hi)[:, None])


INDEX_TILES = {  # measured best on the H200 (bench/bench_dsa.py): many query rows / a few decode rows
    "prefill": dict(block_n=64, num_warps=4, num_stages=4),
    "decode": dict(block_n=128, num_warps=8, num_stages=3),
}


def index_scores(q, w, k, k_scale, start_pos, block_n=None, num_warps=None, num_stages=None, programs=264, bq=None,
                 decode=False, fnuz=False):
    """q [B, T, J, D] (FP8 or float32), w [B, T, J] f32, k [B, S, D] (q's dtype), k_scale [B, S] f32,
    start_pos (int or device tensor) -> [B, T, S] f32 scores, -inf at keys after each query's position
    (start_pos + t): indexer.index_scores_causal_ref. Prefill chunks and decode rows alike: the keys are
    split so that at least about `programs` programs run (one decode row then spreads over the GPU)."""
    B, T, J, D = q.shape
    S = k.shape[1]
    if k.shape != (B, S, D) or k.dtype != q.dtype or w.shape != (B, T, J) or k_scale.shape != (B, S):
        raise ValueError(f"index_scores: q {tuple(q.shape)} {q.dtype}, w {tuple(w.shape)}, k {tuple(k.shape)} "
                         f"{k.dtype}, k_scale {tuple(k_scale.shape)} do not fit")
    if D not in (64, 128, 256):
        raise ValueError(f"index_scores: head dim {D} (64, 128 or 256)")
    q, k, w, k_scale = q.contiguous(), k.contiguous(), w.float().contiguous(), k_scale.float().contiguous()
    if decode:                                                         # bytes, decoded in the kernel
        q, k = q.view(torch.uint8), k.view(torch.uint8)
    out = torch.empty(B, T, S, dtype=torch.float32, device=q.device)
    tiles = INDEX_TILES["prefill" if T >= 16 else "decode"]
    block_n, num_warps, num_stages = block_n or tiles["block_n"], num_warps or tiles["num_warps"], num_stages or tiles["num_stages"]
    jp = triton.next_power_of_2(J)
    block_n = max(16, min(block_n, triton.next_power_of_2(S)))
    bq = bq or max(16 // jp, min(max(128 // jp, 1), triton.next_power_of_2(T)), 1)   # BQ * JP rows: 16..128
    nq, nblocks = triton.cdiv(T, bq), triton.cdiv(S, block_n)
    splits = max(1, min(nblocks, triton.cdiv(programs, B * nq)))
    split = triton.cdiv(nblocks, splits) * block_n
    grid = (B, nq, triton.cdiv(S, split))
    _index_scores_kernel[grid](q, w, k, k_scale, out, _pos_tensor(start_pos, q.device), T, S, J, split,
                               BQ=bq, JP=jp, D=D, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
                               DECODE=decode, FNUZ=fnuz, num_warps=num_warps, num_stages=num_stages, **pdl())
    return out


# -----------------------------------------------------------------------------
# eq. (2): exact top-k over each query's causal keys by radix select

@triton.jit
def _ordered_key(x):  # fp32 -> int64 in [0, 2^32) whose order is the float order (larger score, larger key)
    x = tl.where(x == 0.0, 0.0, x)                                     # -0 ties with +0, as in a float sort
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)


@triton.jit
def _bucket(hist, need):
    """256-bin histogram (counts under 2^24), rank -> (the bin holding the need-th largest, the rank
    within it, the keys in that bin)."""
    bins = tl.arange(0, 256)
    ge = tl.cumsum(hist, axis=0, reverse=True)                         # keys in this bin or a higher one
    # the highest bin with ge >= need, the keys above it and in it, from one reduction over (bin, above, in) triples
    v = tl.max(tl.where(ge >= need, (bins.to(tl.int64) << 48) | ((ge - hist).to(tl.int64) << 24) | hist.to(tl.int64), -1),
               axis=0)
    return (v >> 48).to(tl.int32), need - ((v >> 24) & 0xFFFFFF).to(tl.int32), (v & 0xFFFFFF).to(tl.int32)


@triton.jit
def _topk_list_kernel(SCORES, CAND, CSCORE, CNT, POS, T, S, K, CAPS, BLOCK: tl.constexpr, SAMPLE: tl.constexpr,
                      STAGES: tl.constexpr, DIGITS: tl.constexpr, PDL: tl.constexpr = False):
    """Top-k, step 1, for rows of at least 4 * SAMPLE causal keys (others write count -1). One program
    per (query row, segment of the row): a threshold from a strided sample of SAMPLE scores (its
    r-th largest key by radix select in registers, r safely above the k-th largest's expected rank;
    every program of a row finds the same one, and compares scores with it as a float, which costs
    fewer integer operations per key; DIGITS < 4 stops the radix select early and takes the lowest key
    of the r-th largest's bucket: a lower threshold, longer lists, fewer passes), then the segment's
    keys at or above it, listed in index order
    in CAND[row, segment] (at most CAPS) with their scores in CSCORE (so that step 2 reads them
    contiguously), and their count in CNT[row, segment]."""
    _await_inputs(PDL)
    row, seg, segs = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    n = tl.minimum(tl.load(POS).to(tl.int32) + row % T + 1, S)            # causal keys of this query
    kk = tl.minimum(K, n)
    src = SCORES + row.to(tl.int64) * S
    cand = CAND + (row.to(tl.int64) * segs + seg) * CAPS
    cscore = CSCORE + (row.to(tl.int64) * segs + seg) * CAPS
    cnt = tl.full((), -1, tl.int32)
    if n >= 4 * SAMPLE:
        rs = tl.arange(0, SAMPLE)
        u = _ordered_key(tl.load(src + rs.to(tl.int64) * (n // SAMPLE)))
        want = kk.to(tl.float32) * SAMPLE / n.to(tl.float32)           # the k-th largest's expected sample rank
        r = tl.minimum((want + 4.0 * tl.sqrt(want) + 8.0).to(tl.int32), SAMPLE)
        tau = tl.zeros((), tl.int64)                                   # the r-th largest sampled key
        tau_mask = tl.zeros((), tl.int64)
        for p in range(DIGITS):
            hist = tl.histogram(((u >> (24 - 8 * p)) & 0xFF).to(tl.int32), 256, mask=(u & tau_mask) == tau)
            b, r, _ = _bucket(hist, r)
            tau |= b.to(tl.int64) << (24 - 8 * p)
            tau_mask |= 0xFF << (24 - 8 * p)
        thr = tl.where(tau >= 0x80000000, tau - 0x80000000, 0xFFFFFFFF - tau).to(tl.uint32).to(tl.float32, bitcast=True)
        per = (n + segs * 128 - 1) // (segs * 128) * 128               # this segment's keys: [lo, hi), every
        lo = seg * per                                                 # segment a share (not whole BLOCKs)
        hi = tl.minimum(lo + per, n)
        cnt = tl.zeros((), tl.int32)
        for s0 in tl.range(lo, hi, BLOCK, num_stages=STAGES):
            rb = s0 + tl.arange(0, BLOCK)
            x = tl.load(src + rb, mask=rb < hi, other=0.0)
            sel = (rb < hi) & (x >= thr)                               # key >= tau, as floats (-0 == +0)
            at = cnt + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(cand + at, rb, mask=sel & (at < CAPS))
            tl.store(cscore + at, x, mask=sel & (at < CAPS))
            cnt += tl.sum(sel.to(tl.int32), axis=0)
    tl.store(CNT + row * segs + seg, cnt)


@triton.jit
def _listed(CNT, row, j, CAPS, SEGS: tl.constexpr):  # positions j of a row's joined lists -> their offsets
    seg = tl.zeros_like(j)
    start = tl.zeros_like(j)                                           # where j's segment starts in the join
    acc = tl.zeros((), tl.int32)
    for s in tl.static_range(SEGS - 1):
        acc += tl.load(CNT + row * SEGS + s)
        past = j >= acc
        seg += past.to(tl.int32)
        start = tl.where(past, acc, start)
    return (row.to(tl.int64) * SEGS + seg) * CAPS + (j - start)


@triton.jit
def _keys_at(SCORES, CSCORE, CNT, row, S, rb, ok, listed, CAPS, SEGS: tl.constexpr):  # -> (offset or index, key)
    if listed > 0:
        at = _listed(CNT, row, rb, CAPS, SEGS)
        u = _ordered_key(tl.load(CSCORE + at, mask=ok, other=0.0))
    else:
        at = rb.to(tl.int64)
        u = _ordered_key(tl.load(SCORES + row.to(tl.int64) * S + rb, mask=ok, other=0.0))
    return at, u


@triton.jit
def _row_keys(CNT, row, n, kk, CAPS, SEGS: tl.constexpr, LISTS: tl.constexpr):
    """-> (m, listed, widest): a row's keys to select from: the join of its step-1 lists (listed = 1)
    when they hold at least kk keys and none overflowed (almost always), else its n causal keys; and
    the longest list."""
    total = tl.zeros((), tl.int32)
    fits = tl.zeros((), tl.int32)
    widest = tl.zeros((), tl.int32)
    if LISTS:
        fits += 1
        for s in tl.static_range(SEGS):
            c = tl.load(CNT + row * SEGS + s)
            total += c
            fits = fits & ((c >= 0) & (c <= CAPS)).to(tl.int32)
            widest = tl.maximum(widest, c)
    listed = fits & (total >= kk).to(tl.int32)
    return tl.where(listed > 0, total, n), listed, widest


@triton.jit
def _stream_hist(SCORES, CSCORE, CNT, row, S, m, prefix, hi_mask, shift, listed, CAPS, BLOCK: tl.constexpr,
                 SEGS: tl.constexpr):  # 256-bin histogram of digit `shift` over a row's m keys that match prefix
    hist = tl.zeros((256,), tl.int32)
    for s0 in range(0, m, BLOCK):
        rb = s0 + tl.arange(0, BLOCK)
        _, u = _keys_at(SCORES, CSCORE, CNT, row, S, rb, rb < m, listed, CAPS, SEGS)
        ok = (rb < m) & ((u & hi_mask) == prefix)
        hist += tl.histogram(((u >> shift) & 0xFF).to(tl.int32), 256, mask=ok)
    return hist


@triton.jit
def _compact(SCORES, CSCORE, CNT, SMALL, row, S, m, prefix, hi_mask, listed, CAPS, BLOCK: tl.constexpr,
             SEGS: tl.constexpr, NS: tl.constexpr):  # the keys that match prefix (at most NS) -> [NS] keys, in registers
    base = tl.zeros((), tl.int32)
    for s0 in range(0, m, BLOCK):
        rb = s0 + tl.arange(0, BLOCK)
        _, u = _keys_at(SCORES, CSCORE, CNT, row, S, rb, rb < m, listed, CAPS, SEGS)
        keep = (rb < m) & ((u & hi_mask) == prefix)
        at = base + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(SMALL + row.to(tl.int64) * NS + at, u.to(tl.uint32).to(tl.int32, bitcast=True), mask=keep)
        base += tl.sum(keep.to(tl.int32), axis=0)
    return _reload(SMALL, row, base, NS)


@triton.jit
def _copy_out(SMALL, row, u, keep, NS: tl.constexpr):  # _compact for keys held in registers: the kept ones -> [NS]
    at = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(SMALL + row.to(tl.int64) * NS + at, u.to(tl.uint32).to(tl.int32, bitcast=True), mask=keep)
    return _reload(SMALL, row, tl.sum(keep.to(tl.int32), axis=0), NS)


@triton.jit
def _reload(SMALL, row, n, NS: tl.constexpr):  # the n keys stored at SMALL[row] -> [NS] keys in registers
    tl.debug_barrier()                                                 # the stores before, visible to every thread
    rs = tl.arange(0, NS)
    return tl.load(SMALL + row.to(tl.int64) * NS + rs, mask=rs < n, other=0).to(tl.int64) & 0xFFFFFFFF


@triton.jit
def _radix_select(SCORES, CSCORE, CNT, SMALL, row, S, m, need, listed, CAPS, u_regs, ok_regs, BLOCK: tl.constexpr,
                  SEGS: tl.constexpr, NS: tl.constexpr, IN_REGS: tl.constexpr):
    """The need-th largest of a row's m keys by radix select, one 8-bit digit at a time (four 256-bin
    histograms over the keys whose higher digits match so far) -> (its key, its rank among equal keys).
    The keys are streamed from memory for each digit, or (IN_REGS) already held in registers (u_regs,
    ok_regs). Once the chosen bin holds at most NS keys they are copied out (SMALL[row], NS words) and
    the later digits are counted over those NS registers instead of the whole row: a histogram costs
    Triton a few instructions per key, and after one or two digits the bin usually holds a few dozen."""
    prefix = tl.zeros((), tl.int64)
    hi_mask = tl.zeros((), tl.int64)
    few = tl.zeros((NS,), tl.int64)                                    # the copied-out keys
    n_few = tl.full((), -1, tl.int32)                                  # how many (-1: not copied out yet)
    for p in range(4):                                                 # most significant digit first
        shift = 24 - 8 * p
        if n_few < 0:
            if IN_REGS:
                hist = tl.histogram(((u_regs >> shift) & 0xFF).to(tl.int32), 256,
                                    mask=ok_regs & ((u_regs & hi_mask) == prefix))
            else:
                hist = _stream_hist(SCORES, CSCORE, CNT, row, S, m, prefix, hi_mask, shift, listed, CAPS, BLOCK, SEGS)
        else:
            ok = (tl.arange(0, NS) < n_few) & ((few & hi_mask) == prefix)
            hist = tl.histogram(((few >> shift) & 0xFF).to(tl.int32), 256, mask=ok)
        b, need, in_bin = _bucket(hist, need)
        prefix |= b.to(tl.int64) << shift
        hi_mask |= 0xFF << shift
        if (n_few < 0) & (in_bin <= NS) & (p < 3):
            if IN_REGS:
                few = _copy_out(SMALL, row, u_regs, ok_regs & ((u_regs & hi_mask) == prefix), NS)
            else:
                few = _compact(SCORES, CSCORE, CNT, SMALL, row, S, m, prefix, hi_mask, listed, CAPS, BLOCK, SEGS, NS)
            n_few = in_bin
    return prefix, need


@triton.jit
def _write_selected(dst, idx, u, ok, prefix, need, K, base, taken_eq):
    """One tile of a row's keys (idx: their indices, in index order) -> the ones in its top K written at
    dst[base:]: keys above the K-th largest (prefix) and the first `need` equal to it (ties toward the
    lower index) -> (base, taken_eq) after the tile. Both running counts (keys above, keys equal) come
    from one scan of a packed pair (a tile holds at most 2^14 keys); the equal keys written before key i
    are then min(rank, need) less those written before the tile."""
    above, eq = ok & (u > prefix), ok & (u == prefix)
    both = tl.cumsum(above.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)
    eq_rank = taken_eq + (both >> 16)                                  # 1-based rank among equal keys, in index order
    before = tl.minimum(taken_eq, need)                                # equal keys written by earlier tiles
    sel = above | (eq & (eq_rank <= need))
    pos = base + (both & 0xFFFF) + tl.minimum(eq_rank, need) - before - 1
    tl.store(dst + pos, idx.to(tl.int32), mask=sel & (pos < K))        # (never past the row, even if wrong)
    tile = tl.sum(above.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)
    return base + (tile & 0xFFFF) + tl.minimum(taken_eq + (tile >> 16), need) - before, taken_eq + (tile >> 16)


@triton.jit
def _select_registers(SCORES, CAND, CSCORE, CNT, SMALL, row, S, m, kk, listed, dst, K, CAPS, BLOCK: tl.constexpr,
                      SEGS: tl.constexpr, NS: tl.constexpr, REGS: tl.constexpr):  # step 2, the row's m <= REGS keys read once
    rb = tl.arange(0, REGS)
    ok = rb < m
    _, u = _keys_at(SCORES, CSCORE, CNT, row, S, rb, ok, listed, CAPS, SEGS)
    prefix, need = _radix_select(SCORES, CSCORE, CNT, SMALL, row, S, m, kk, listed, CAPS, u, ok, BLOCK, SEGS, NS, True)
    if listed > 0:                                                     # the keys' indices (not held through the select)
        idx = tl.load(CAND + _listed(CNT, row, rb, CAPS, SEGS), mask=ok, other=0)
    else:
        idx = rb
    _write_selected(dst, idx, u, ok, prefix, need, K, tl.zeros((), tl.int32), tl.zeros((), tl.int32))


@triton.jit
def _select_strided(CAND, CSCORE, CNT, SMALL, row, kk, dst, K, CAPS, SEGS: tl.constexpr, NS: tl.constexpr,
                    REGS: tl.constexpr, STRIDE: tl.constexpr):
    """Step 2 on a listed row whose every list holds at most STRIDE keys: slot j of the register tile is
    entry j % STRIDE of segment j // STRIDE's list (segments in index order, so the tile is too, with
    gaps), which spares _select_registers' search for each key's segment in the joined lists."""
    j = tl.arange(0, REGS)
    seg, at_seg = j // STRIDE, j % STRIDE
    ok = (seg < SEGS) & (at_seg < tl.load(CNT + row * SEGS + seg, mask=seg < SEGS, other=0))
    at = (row.to(tl.int64) * SEGS + seg) * CAPS + at_seg
    u = _ordered_key(tl.load(CSCORE + at, mask=ok, other=0.0))
    prefix, need = _radix_select(CSCORE, CSCORE, CNT, SMALL, row, 0, 0, kk, 1, CAPS, u, ok, 16, SEGS, NS,
                                 True)                                 # (in registers: the streaming arguments unused)
    idx = tl.load(CAND + at, mask=ok, other=0)
    _write_selected(dst, idx, u, ok, prefix, need, K, tl.zeros((), tl.int32), tl.zeros((), tl.int32))


@triton.jit
def _select_whole(SCORES, CAND, CSCORE, CNT, SMALL, row, S, m, kk, listed, dst, K, CAPS, BLOCK: tl.constexpr,
                  SEGS: tl.constexpr, NS: tl.constexpr, REGS: tl.constexpr):  # step 2 on the joined lists, or the row
    if m <= REGS:
        _select_registers(SCORES, CAND, CSCORE, CNT, SMALL, row, S, m, kk, listed, dst, K, CAPS, BLOCK, SEGS, NS, REGS)
    else:
        _select_streamed(SCORES, CAND, CSCORE, CNT, SMALL, row, S, m, kk, listed, dst, K, CAPS, BLOCK, SEGS, NS)


@triton.jit
def _select_streamed(SCORES, CAND, CSCORE, CNT, SMALL, row, S, m, kk, listed, dst, K, CAPS, BLOCK: tl.constexpr,
                     SEGS: tl.constexpr, NS: tl.constexpr):  # step 2, the row's m keys read again for each pass
    none = tl.zeros((NS,), tl.int64)
    prefix, need = _radix_select(SCORES, CSCORE, CNT, SMALL, row, S, m, kk, listed, CAPS, none, none == 0, BLOCK,
                                 SEGS, NS, False)
    base = tl.zeros((), tl.int32)
    taken_eq = tl.zeros((), tl.int32)
    for s0 in range(0, m, BLOCK):
        rb = s0 + tl.arange(0, BLOCK)
        ok = rb < m
        at, u = _keys_at(SCORES, CSCORE, CNT, row, S, rb, ok, listed, CAPS, SEGS)
        if listed > 0:
            at = tl.load(CAND + at, mask=ok, other=0).to(tl.int64)       # the list's key indices
        base, taken_eq = _write_selected(dst, at, u, ok, prefix, need, K, base, taken_eq)


@triton.jit
def _topk_kernel(SCORES, OUT, CAND, CSCORE, CNT, SMALL, POS, T, S, K, CAPS, BLOCK: tl.constexpr, SEGS: tl.constexpr,
                 LISTS: tl.constexpr, NS: tl.constexpr, REGS: tl.constexpr, STRIDE: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Reference: indexer.topk_indices_ref (topk_select_ref as indices). Top-k, step 2, one program per
    query row, over its step-1 lists or its whole row (_row_keys; LISTS = False: step 1 did not run): the K-th largest
    key by _radix_select, then every key above it and the lowest-indexed keys equal to it (ties toward
    the lower index) are written out in index order; the row is padded with -1 when it has fewer than
    K causal keys. With REGS > 0, a row of at most REGS keys is read once into registers; a longer one
    (every row, REGS = 0) is read again for each pass. With STRIDE > 0, a listed row whose lists each
    hold at most STRIDE keys is read into registers by fixed stride (_select_strided)."""
    _await_inputs(PDL)
    row = tl.program_id(0)
    n = tl.minimum(tl.load(POS).to(tl.int32) + row % T + 1, S)            # causal keys of this query
    kk = tl.minimum(K, n)
    dst = OUT + row.to(tl.int64) * K
    m, listed, widest = _row_keys(CNT, row, n, kk, CAPS, SEGS, LISTS)
    if STRIDE > 0:
        if (listed > 0) & (widest <= STRIDE):
            _select_strided(CAND, CSCORE, CNT, SMALL, row, kk.to(tl.int32), dst, K, CAPS, SEGS, NS, REGS, STRIDE)
        else:
            _select_whole(SCORES, CAND, CSCORE, CNT, SMALL, row, S, m, kk.to(tl.int32), listed, dst, K, CAPS, BLOCK,
                          SEGS, NS, REGS)
    elif REGS > 0:
        _select_whole(SCORES, CAND, CSCORE, CNT, SMALL, row, S, m, kk.to(tl.int32), listed, dst, K, CAPS, BLOCK,
                      SEGS, NS, REGS)
    else:
        _select_streamed(SCORES, CAND, CSCORE, CNT, SMALL, row, S, m, kk.to(tl.int32), listed, dst, K, CAPS, BLOCK,
                         SEGS, NS)
    for s0 in range(0, K, BLOCK):                                      # pad the rest with -1
        rk = s0 + tl.arange(0, BLOCK)
        tl.store(dst + rk, tl.full((BLOCK,), -1, tl.int32), mask=(rk >= kk) & (rk < K))


def topk_indices(scores, K, start_pos, block=None, num_warps=None, sample=None, cap=None, segments=None, programs=264,
                 stages=3, digits=2, few=256, regs=None, strided=None):
    """scores [B, T, S] f32, start_pos (int or device tensor) -> [B, T, K] int32: each query's top-K
    causal keys (ties toward the lower index) in index order, then -1 where it has fewer than K:
    indexer.topk_indices_ref.
    Rows of at least 4 * sample keys first list the keys above a sampled threshold, in `segments`
    equal pieces per row, each list at most cap keys (segments, default: enough programs to fill the
    GPU twice, once where step 2 runs in registers and joins the lists: 2 lists, not 4, at 64 rows of
    16K, 33 against 36 us on an H200).
    Then the K-th largest key of each row's lists (or whole row) by radix select, one program per row,
    the later digits over the keys left in the chosen bin once it holds at most `few` (a power of two).
    With regs (a power of two; 0: never), a row (or its lists) of at most regs keys is read once into
    registers; a longer one is read again for each radix digit. strided: a listed row whose lists each
    hold at most regs / segments keys (segments rounded up to a power of two) is read by fixed stride,
    without joining its lists (None: for up to 4 rows in registers; 4-5 us less a decode row at
    8K-128K on an H200, and 12 us more at 64 rows of 64K, bench/RESULTS.md). Tiles (block, regs) of
    at most 16384 keys, rows of fewer than 2^24: the select packs its counts.
    Tiles (H200 sweeps): 1024 keys a step (2048 past 64K) with 8 warps for decode rows, 512 with 4 for
    many (1024 rather than 2048: 0.7-1 us less at one row of 8K-20K, 6 us at 64 rows of 64K);
    decode rows (up to 4 rows, or contexts up to 64K): step 2 in registers where the keys fit in 4096
    (2-4 us less at 4K-64K, 5.5 us in a whole 128K layer step), past 64K a sample of 4096 so that the
    lists do (2.4-3.3K keys; a sample of 2048 lists about 4K at 128K); more rows at 128K and prefill rows:
    every row streamed (at 128K some of 16-64 rows' lists outgrow the registers, and their streamed pass,
    compiled beside the register path, ran up to 1.4x slower: bench/RESULTS.md);
    step 1 streams its row through `stages` pipelined loads and finds its threshold with `digits` 8-bit
    radix passes over the sample (fewer: a coarser, lower threshold, slightly longer lists, the same
    result; 2 rather than 4: 3-6 us less for decode rows of 16K-128K and 2% for prefill rows on an H200)."""
    if scores.dim() != 3 or K < 1:
        raise ValueError(f"topk_indices: scores {tuple(scores.shape)} is not [B, T, S] or K = {K} < 1")
    if digits not in (1, 2, 3, 4):
        raise ValueError(f"topk_indices: digits = {digits}; the threshold takes 1-4 radix digits of 8 bits")
    for name, v in (("few", few), ("sample", 16 if sample is None else sample), ("block", block or 16),
                    ("regs", regs or 16)):                             # (regs = 0: never in registers)
        if v < 1 or v & (v - 1):
            raise ValueError(f"topk_indices: {name} = {v} is not a power of two")
    if (segments is not None and segments < 1) or (cap is not None and cap < 1):
        raise ValueError(f"topk_indices: segments = {segments} and cap = {cap} must be at least 1")
    B, T, S = scores.shape
    if S >= 1 << 24:
        raise ValueError(f"topk_indices: {S} keys a row; the radix select counts up to 2^24 - 1")
    rows = B * T
    many = rows >= 1024
    block, num_warps = block or (512 if many else 1024 if S <= 65536 else 2048), num_warps or (4 if many else 8)
    in_regs = not many and (rows <= 4 or S <= 65536)                 # step 2 in registers (H200 sweeps)
    segs = segments or max(1, min(8, (programs // 2 if in_regs else programs) // rows))   # (fewer lists to join)
    sample = sample or (4096 if in_regs and S > 65536 else 2048)      # (lists that fit 4096 registers)
    regs = (512 * num_warps if in_regs else 0) if regs is None else regs
    caps = cap or 2 * (4 * K + 1024) // segs                           # room for the sampled threshold's list
    if max(block, regs) > 16384:                                       # (regs: also as num_warps made it)
        raise ValueError(f"topk_indices: block = {block}, regs = {regs}: at most 16384 (a tile's two counts share an int32)")
    block = max(16, min(block, triton.next_power_of_2(S)))
    scores, pos = scores.float().contiguous(), _pos_tensor(start_pos, scores.device)
    out = torch.empty(B, T, K, dtype=torch.int32, device=scores.device)
    lists_ = S >= 4 * sample                           # some row is long enough for step 1's lists
    cand = torch.empty(2, rows * segs if lists_ else 1, caps, dtype=torch.int32, device=scores.device)  # indices, scores
    cnt = torch.empty(rows, segs, dtype=torch.int32, device=scores.device)
    lists, listed = cand[0], cand[1].view(torch.float32)
    if lists_:
        _topk_list_kernel[(rows, segs)](scores, lists, listed, cnt, pos, T, S, K, caps, BLOCK=block, SAMPLE=sample,
                                        STAGES=stages, DIGITS=digits, num_warps=num_warps, **pdl())
    small = torch.empty(rows, few, dtype=torch.int32, device=scores.device)   # step 2's copied-out keys
    strided = regs > 0 and rows <= 4 if strided is None else strided
    stride = regs // triton.next_power_of_2(segs) if strided and lists_ else 0
    _topk_kernel[(rows,)](scores, out, lists, listed, cnt, small, pos, T, S, K, caps, BLOCK=block, SEGS=segs, LISTS=lists_,
                          NS=few, REGS=regs, STRIDE=stride, num_warps=num_warps, **pdl())
    return out


# -----------------------------------------------------------------------------
# Sparse MLA in the absorbed (MQA) form, decode and prefill: each query's heads attend to the
# selected rows of the latent cache. A cache row is one token: either the packed FP8 layout
# (spec/kernels.md §3.4: C e4m3 codes, C/128 fp32 scales, R bf16 rope values; 656 bytes for
# C = 512, R = 64) or C + R plain values (bf16, or float32 for exact numerics).

latent_width = quant.latent_width                                      # bytes of one packed FP8 row


@triton.jit
def _store_latent_kernel(CKV, KPE, ROWS, POS, T, CAP, C: tl.constexpr, R: tl.constexpr, FP8_MAX: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Reference: backend_torch.store_latent's steps (act_quant of c^KV, k^R to bf16, the row packed and
    stored). One program per token m = b T + t: its packed row goes to ROWS [>=B, CAP, W] at slot
    POS + t of batch b; a slot outside [0, CAP) is not written (never another batch's row)."""
    _await_inputs(PDL)
    m = tl.program_id(0)
    slot = tl.load(POS).to(tl.int32) + m % T
    row = ROWS + ((m // T).to(tl.int64) * CAP + slot) * (C + 4 * (C // 128) + 2 * R)
    rc, rg, rr = tl.arange(0, C), tl.arange(0, C // 128), tl.arange(0, R)
    sc, sg, sr = rc * 0 + slot, rg * 0 + slot, rr * 0 + slot         # the slot as tensors (the interpreter's masks)
    x = tl.reshape(tl.load(CKV + m.to(tl.int64) * C + rc), (C // 128, 128))
    y, s = _ue8m0_quant(x, FP8_MAX)                                    # act_quant's codes and scales
    codes = tl.reshape(y, (C,)).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(row + rc, codes, mask=(sc >= 0) & (sc < CAP))
    tl.store((row + C).to(tl.pointer_type(tl.float32)) + rg, s, mask=(sg >= 0) & (sg < CAP))
    pe = _bf16_round(tl.load(KPE + m.to(tl.int64) * R + rr))          # k^R to bf16: the top half of its bits
    tl.store((row + C + 4 * (C // 128)).to(tl.pointer_type(tl.int16)) + rr,
             (pe.to(tl.int32, bitcast=True) >> 16).to(tl.int16), mask=(sr >= 0) & (sr < CAP))


def store_latent(rows, start_pos, c_kv, k_pe):
    """c^KV [B, T, C], k^R [B, T, R] (float32) -> their packed rows (C e4m3fn codes, C/128 ue8m0 scales,
    R bf16: spec/kernels.md §3.4) written into rows [>=B, CAP, W] uint8 at slots start_pos + t (an int,
    or a 0-d device tensor: captured decode), in one launch. An int start that does not fit is refused; a
    device one cannot be read without a sync, so its slots outside the cache are skipped (the model's
    reserve keeps them inside). Reference: backend_torch.store_latent."""
    B, T, C = c_kv.shape
    R = k_pe.shape[-1]
    if k_pe.shape != (B, T, R) or rows.dtype != torch.uint8 or rows.dim() != 3 or rows.shape[0] < B \
            or rows.shape[2] != latent_width(C, R) or C % 128 or C & (C - 1) or R & (R - 1):
        raise ValueError(f"store_latent: c_kv {tuple(c_kv.shape)}, k_pe {tuple(k_pe.shape)}, rows {tuple(rows.shape)} "
                         f"{rows.dtype} do not fit (C a power of two and a multiple of 128, R a power of two)")
    if not isinstance(start_pos, torch.Tensor) and not 0 <= start_pos <= rows.shape[1] - T:
        raise ValueError(f"store_latent: slots {start_pos}..{start_pos + T - 1} outside the cache's {rows.shape[1]}")
    assert rows.is_contiguous()
    if B * T:
        _store_latent_kernel[(B * T,)](c_kv.float().contiguous(), k_pe.float().contiguous(), rows,
                                       _pos_tensor(start_pos, rows.device), T, rows.shape[1], C=C, R=R, FP8_MAX=FP8_MAX,
                                       **pdl())


@triton.jit
def _mma(a, b, DOT: tl.constexpr, acc=None):  # DOT 0: float32 operands, exact products; 1, 2: bf16 / fp16
    if DOT == 0:
        c = tl.dot(a, b, acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc, out_dtype=tl.float32)
    return c


@triton.jit
def _operand(x, DOT: tl.constexpr):  # a loaded value -> the MMA operand type (via fp32 where bf16 is not native)
    if DOT == 1:
        y = x.to(tl.bfloat16)
    elif DOT == 2:                                                     # interpreter: no bf16 arithmetic
        y = x.to(tl.float32).to(tl.float16)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _latent_cols(C8, C32, row, ok, c0: tl.constexpr, CW: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                 PACKED: tl.constexpr, DECODE: tl.constexpr, DOT: tl.constexpr, CLAMP: tl.constexpr):
    """Gather latent columns c0 .. c0 + CW of cache rows -> [BLOCK_N, CW] MMA operands. Packed rows:
    e4m3 codes times their group's scale (GW = the 128-value group, or CW if smaller), exact in
    bf16; C8 is the cache as FP8 (bytes when DECODE), C32 as float32 words. Plain rows: as stored.
    Rows not ok read as 0, or (CLAMP) are read unmasked: the caller points them at a written row."""
    GW: tl.constexpr = 128 if CW > 128 else CW
    rc = c0 + tl.arange(0, CW)
    if PACKED:
        W: tl.constexpr = C + 4 * (C // 128) + 2 * R                   # bytes per row
        at = C8 + row[:, None] * W + rc[None, :]
        g = c0 // 128 + tl.arange(0, CW // GW)                         # these columns' scale groups
        at_s = C32 + row[:, None, None] * (W // 4) + C // 4 + g[None, :, None]
        if CLAMP:
            codes, scale = tl.load(at), tl.load(at_s)
        else:
            codes = tl.load(at, mask=ok[:, None], other=0 if DECODE else 0.0)
            scale = tl.load(at_s, mask=ok[:, None, None], other=0.0)
        if DECODE:                                                     # bytes decoded by integer arithmetic
            codes = _e4m3_decode(codes, False)
        if DOT == 1:                                                   # bf16 product: exact (power-of-two scale)
            kv = tl.reshape(tl.reshape(codes.to(tl.bfloat16), (row.shape[0], CW // GW, GW)) * scale.to(tl.bfloat16),
                            (row.shape[0], CW))
        else:
            kv = _operand(tl.reshape(tl.reshape(codes.to(tl.float32), (row.shape[0], CW // GW, GW)) * scale,
                                     (row.shape[0], CW)), DOT)
    else:
        at = C8 + row[:, None] * (C + R) + rc[None, :]
        kv = _operand(tl.load(at) if CLAMP else tl.load(at, mask=ok[:, None], other=0.0), DOT)
    return kv


@triton.jit
def _rope_rows(C16, row, ok, C: tl.constexpr, R: tl.constexpr, PACKED: tl.constexpr, DOT: tl.constexpr,
               CLAMP: tl.constexpr):
    """Gather the rope part of cache rows -> [BLOCK_N, R] MMA operands (C16: the cache as 16-bit words,
    or the plain cache); rows not ok as in _latent_cols."""
    rr = tl.arange(0, R)
    if PACKED:
        W: tl.constexpr = C + 4 * (C // 128) + 2 * R
        at = C16 + row[:, None] * (W // 2) + (C + 4 * (C // 128)) // 2 + rr[None, :]
    else:
        at = C16 + row[:, None] * (C + R) + C + rr[None, :]
    return _operand(tl.load(at) if CLAMP else tl.load(at, mask=ok[:, None], other=0.0), DOT)


@triton.jit
def _sparse_mla_kernel(QA, QPE, C8, C32, C16, IDX, POS, O, LSE, T, H, KSEL, L, SPLIT, qk_scale,
                       C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       PACKED: tl.constexpr, DENSE: tl.constexpr, DOT: tl.constexpr, DECODE: tl.constexpr,
                       QLOOP: tl.constexpr, HALVES: tl.constexpr, LATE_SUM: tl.constexpr, AHEAD: tl.constexpr,
                       CLAMP: tl.constexpr, ROW64: tl.constexpr, PDL: tl.constexpr = False):
    """Reference: attention.mqa_absorbed_ref's softmax(scale * (q^C W^UK . c + q^R . k^R)) c over the
    selected s. One program per (query token, block of heads, split of the selected set): gather the
    selected rows by index (DENSE: walk the causal positions instead), scores z = q^C . c + q^R . k^R
    in two MMAs (three with HALVES: the latent as two halves with an accumulator each, smaller tiles
    for the FP8 cache's dequantised rows), online softmax in base 2 (running max m, sum l), the same
    gathered latent rows as the values; writes the split's normalised output and its log2-sum-exp.
    QLOOP re-reads the query tile every step (from L2) instead of holding it; LATE_SUM keeps the
    softmax sum per head and column and adds the columns up once after the loop (one reduction
    across warpgroups less per step: faster for the FP8 rows, slower for bf16 ones on the H200).
    AHEAD loads each step's selected positions one step early; CLAMP gathers without load masks,
    unselected entries reading the sequence's row 0 (their scores are -inf either way); rows are
    indexed from the sequence's own base, in 32-bit offsets unless ROW64.

    Two things here are for Triton's Hopper code generation, not for the maths. Triton lays a dot
    whose result reaches another dot with all warps along its rows; with 64 heads and 8 warps both
    warpgroups would then compute the same 64 x 64 score tile (1.5x the MMA work). So the score MMAs
    start from accumulators the compiler cannot see to be zero (the selected-entry mask 0 / -inf, and
    0 * n0), which keeps it from chaining them into one accumulator, and p and alpha are computed
    under a branch it cannot fold (n0 < hi always holds in the loop): it no longer sees the chain,
    splits the score tile by columns between the warpgroups and exchanges p through shared memory,
    as FlashMLA does by hand. Measured on an H200: prefill 253 -> 320-331 TFLOP/s (bench/RESULTS.md)."""
    _await_inputs(PDL)
    bt, hb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, t = bt // T, bt % T
    last = tl.load(POS).to(tl.int32) + t                                  # the query's position
    CH: tl.constexpr = C // 2
    rh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = rh < H
    rc, rr, rf = tl.arange(0, CH), tl.arange(0, R), tl.arange(0, C)
    head = bt.to(tl.int64) * H + rh
    if HALVES:
        qa0 = _operand(tl.load(QA + head[:, None] * C + rc[None, :], mask=hm[:, None], other=0.0), DOT)
        qa1 = _operand(tl.load(QA + head[:, None] * C + CH + rc[None, :], mask=hm[:, None], other=0.0), DOT)
        acc0 = tl.zeros((BLOCK_H, CH), tl.float32)
        acc1 = tl.zeros((BLOCK_H, CH), tl.float32)
    else:
        qa = _operand(tl.load(QA + head[:, None] * C + rf[None, :], mask=hm[:, None], other=0.0), DOT)
        acc = tl.zeros((BLOCK_H, C), tl.float32)
    qp = _operand(tl.load(QPE + head[:, None] * R + rr[None, :], mask=hm[:, None], other=0.0), DOT)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    l_cols = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)                  # LATE_SUM: l per head and column
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, last + 1)                              # at most position + 1 causal entries
    if not DENSE:
        hi = tl.minimum(hi, KSEL)
    W: tl.constexpr = C + 4 * (C // 128) + 2 * R if PACKED else C + R   # elements (PACKED: bytes) per row
    C8 += b.to(tl.int64) * L * W                                       # this sequence's rows, indexed from
    C32 += b.to(tl.int64) * L * (W // 4 if PACKED else W)              # here in 32 bits (64 if ROW64)
    C16 += b.to(tl.int64) * L * (W // 2 if PACKED else W)
    rb = tl.arange(0, BLOCK_N)
    sel = IDX + bt.to(tl.int64) * KSEL                                 # this query's selected positions
    if AHEAD and not DENSE:                                            # the first step's positions
        s_next = tl.load(sel + lo + rb, mask=lo + rb < hi, other=-1)
    for n0 in range(lo, hi, BLOCK_N):
        rn = n0 + rb
        if DENSE:
            s = rn
            ok = rn < hi
        else:                                                          # selected positions (-1: none)
            if AHEAD:                                                  # loaded one step early
                s = s_next
                s_next = tl.load(sel + BLOCK_N + rn, mask=BLOCK_N + rn < hi, other=-1)
            else:
                s = tl.load(sel + rn, mask=rn < hi, other=-1)
            ok = s >= 0
        row = tl.where(ok, s, 0)
        if ROW64:
            row = row.to(tl.int64)
        pe = _rope_rows(C16, row, ok, C, R, PACKED, DOT, CLAMP)
        if QLOOP:                                                      # registers for the accumulators instead
            qp = _operand(tl.load(QPE + head[:, None] * R + rr[None, :], mask=hm[:, None], other=0.0), DOT)
        z_mask = tl.where(ok[None, :], tl.zeros((BLOCK_H, BLOCK_N), tl.float32), float("-inf"))
        z_zero = tl.zeros((BLOCK_H, BLOCK_N), tl.float32) + n0 * 0.0   # see the docstring
        if HALVES:
            kv0 = _latent_cols(C8, C32, row, ok, 0, CH, C, R, PACKED, DECODE, DOT, CLAMP)
            kv1 = _latent_cols(C8, C32, row, ok, CH, CH, C, R, PACKED, DECODE, DOT, CLAMP)
            if QLOOP:
                qa0 = _operand(tl.load(QA + head[:, None] * C + rc[None, :], mask=hm[:, None], other=0.0), DOT)
                qa1 = _operand(tl.load(QA + head[:, None] * C + CH + rc[None, :], mask=hm[:, None], other=0.0), DOT)
            z = _mma(qa0, tl.trans(kv0), DOT, z_mask) + _mma(qa1, tl.trans(kv1), DOT, z_zero) \
                + _mma(qp, tl.trans(pe), DOT, z_zero)
        else:
            kv = _latent_cols(C8, C32, row, ok, 0, C, C, R, PACKED, DECODE, DOT, CLAMP)
            if QLOOP:
                qa = _operand(tl.load(QA + head[:, None] * C + rf[None, :], mask=hm[:, None], other=0.0), DOT)
            z = _mma(qa, tl.trans(kv), DOT, z_mask) + _mma(qp, tl.trans(pe), DOT, z_zero)
        z = z * qk_scale                                               # qk_scale = softmax scale * log2(e)
        m_new = tl.maximum(m, tl.max(z, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)          # nothing valid yet: no NaN
        if n0 < hi:                                                    # always: see the docstring
            p = tl.exp2(z - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
        else:
            p = tl.exp2(z - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
        if LATE_SUM:
            l_cols = l_cols * alpha[:, None] + p
        else:
            l = l * alpha + tl.sum(p, 1)
        pd = _operand(p, DOT)
        if HALVES:                                                     # the latent rows are the values
            acc0 = acc0 * alpha[:, None] + _mma(pd, kv0, DOT)
            acc1 = acc1 * alpha[:, None] + _mma(pd, kv1, DOT)
        else:
            acc = acc * alpha[:, None] + _mma(pd, kv, DOT)
        m = m_new
    if LATE_SUM:
        l = tl.sum(l_cols, 1)
    inv = 1.0 / tl.where(l > 0, l, 1.0)
    lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
    part = (bt.to(tl.int64) * tl.num_programs(2) + sp) * H + rh
    if HALVES:
        tl.store(O + part[:, None] * C + rc[None, :], (acc0 * inv[:, None]).to(O.dtype.element_ty), mask=hm[:, None])
        tl.store(O + part[:, None] * C + CH + rc[None, :], (acc1 * inv[:, None]).to(O.dtype.element_ty), mask=hm[:, None])
    else:
        tl.store(O + part[:, None] * C + rf[None, :], (acc * inv[:, None]).to(O.dtype.element_ty), mask=hm[:, None])
    tl.store(LSE + part, lse, mask=hm)


@triton.jit
def _mla_combine_kernel(O_PART, LSE_PART, O, LSE, POS, T, H, SPLITS, SPLIT, KSEL, C: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, DENSE: tl.constexpr,
                        PDL: tl.constexpr = False):
    """The splits of one query's heads -> its output: o = sum_s 2^(lse_s - lse) o_s, lse = log2 sum_s 2^lse_s
    (a query with no keys anywhere: o = 0, lse = -inf). Only the splits that can hold entries of the
    query (up to its position + 1, or K) are read, all BLOCK_S >= SPLITS of them in one load (no
    loop of dependent loads: batch-1 decode waits on this kernel). One program per (query, heads,
    BLOCK_C columns)."""
    _await_inputs(PDL)
    bt, hb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    rc = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    rs = tl.arange(0, BLOCK_S)
    hm = rh < H
    base = bt.to(tl.int64) * SPLITS * H
    n = tl.load(POS).to(tl.int32) + bt % T + 1                            # entries this query can have
    if not DENSE:
        n = tl.minimum(n, KSEL)
    live = tl.minimum((n + SPLIT - 1) // SPLIT, SPLITS)
    sm = (rs < live)[:, None] & hm[None, :]                            # [S, BLOCK_H]
    lse_s = tl.load(LSE_PART + base + rs[:, None] * H + rh[None, :], mask=sm, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wt = tl.exp2(lse_s - m_safe[None, :])                              # [S, BLOCK_H], 0 where not live
    l = tl.sum(wt, 0)
    o_s = tl.load(O_PART + ((base + rs[:, None] * H + rh[None, :]) * C)[:, :, None] + rc[None, None, :],
                  mask=sm[:, :, None], other=0.0)                      # [S, BLOCK_H, BLOCK_C]
    o = tl.sum(wt[:, :, None] * o_s, 0) / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(O + (bt.to(tl.int64) * H + rh)[:, None] * C + rc[None, :], o.to(O.dtype.element_ty), mask=hm[:, None])
    if cb == 0:
        tl.store(LSE + bt.to(tl.int64) * H + rh, tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf")),
                 mask=hm)


ROW32_LIMIT = 2 ** 31                                  # cache elements a sequence can hold with 32-bit row offsets


def _check_mla(qa, q_pe, cache, idx):  # the shapes both sparse MLA paths (and kernels_hopper's) rely on
    B, T, H, C = qa.shape
    R = q_pe.shape[-1]
    packed = cache.dtype == torch.uint8
    width = latent_width(C, R) if packed else C + R
    if q_pe.shape[:3] != (B, T, H) or cache.shape[0] < B or cache.shape[2] != width:
        raise ValueError(f"sparse_mla: qa {tuple(qa.shape)}, q_pe {tuple(q_pe.shape)}, cache {tuple(cache.shape)} "
                         f"{cache.dtype} (rows of {width}) do not fit")
    if packed and C % 128:
        raise ValueError(f"sparse_mla: a packed FP8 cache needs the latent width ({C}) in 128-value groups")
    if C % 32 or R % 16 or (C // 2) & (C // 2 - 1) or R & (R - 1):
        raise ValueError(f"sparse_mla: latent {C} and rope {R} widths must be powers of two (C >= 32, R >= 16)")
    if idx is not None and (idx.shape[:2] != (B, T) or idx.dim() != 3):
        raise ValueError(f"sparse_mla: idx {tuple(idx.shape)} is not [B, T, K] for B={B}, T={T}")


def _sparse_mla(qa, q_pe, cache, idx, scale, start_pos, S, splits, out_dtype, block_h, block_n, num_warps,
                num_stages, decode, q_in_loop, halves, late_sum, ahead, clamp):  # (shapes checked by the caller)
    B, T, H, C = qa.shape
    R, L = q_pe.shape[-1], cache.shape[1]
    packed = cache.dtype == torch.uint8
    width = latent_width(C, R) if packed else C + R
    cache = cache.contiguous()
    if packed:
        c8 = cache if decode else cache.view(FP8)
        c32, c16 = cache.view(torch.float32), cache.view(torch.bfloat16)
    else:
        c8 = c32 = c16 = cache
    dot = 0 if cache.dtype == torch.float32 else (2 if _interpreted() else 1)   # the interpreter's bf16 dot is wrong
    dense = idx is None
    ksel = S if dense else idx.shape[-1]
    idx = cache if dense else idx.to(torch.int32).contiguous()       # DENSE: IDX unused
    block_h = block_h or max(16, min(64, triton.next_power_of_2(H)))
    if halves is None:                                 # H200: FP8 rows dequantised in halves, bf16 rows whole
        halves = cache.dtype != torch.bfloat16         # (float32 rows: half the shared memory)
    late_sum = packed if late_sum is None else late_sum
    num_stages = num_stages or (2 if cache.dtype == torch.bfloat16 else 1)
    hb = triton.cdiv(H, block_h)
    if splits is None:
        if dense:                                      # the walk's length is known only on the device: two
            splits = max(1, min(triton.cdiv(ksel, 128), triton.cdiv(2 * sm_count(qa.device), B * T * hb)))  # waves
        else:
            splits = _default_splits(qa, idx, block_h)
    per, splits = _split_length(ksel, splits, block_n)
    o = torch.empty(B * T, splits, H, C, dtype=out_dtype if splits == 1 else torch.float32, device=qa.device)
    lse = torch.empty(B * T, splits, H, dtype=torch.float32, device=qa.device)
    _sparse_mla_kernel[(B * T, hb, splits)](
        qa.contiguous(), q_pe.contiguous(), c8, c32, c16, idx, _pos_tensor(start_pos, qa.device), o, lse,
        T, H, ksel, L, per, scale * 1.4426950408889634, C=C, R=R, BLOCK_H=block_h, BLOCK_N=block_n,
        PACKED=packed, DENSE=dense, DOT=dot, DECODE=decode, QLOOP=q_in_loop, HALVES=halves, LATE_SUM=late_sum,
        AHEAD=ahead, CLAMP=clamp, ROW64=L * width >= ROW32_LIMIT, num_warps=num_warps, num_stages=num_stages, **pdl())
    if splits > 1:                                     # combine the splits by their log-sum-exp
        o_part, lse_part = o, lse
        o = torch.empty(B * T, H, C, dtype=out_dtype, device=qa.device)
        lse = torch.empty(B * T, H, dtype=torch.float32, device=qa.device)
        bs = triton.next_power_of_2(splits)            # a [bs, bh, bc] tile of partial outputs: <= 8192 values
        bc = min(C, max(16, 8192 // bs // 4))
        bh = max(1, min(4, 8192 // (bs * bc)))
        _mla_combine_kernel[(B * T, triton.cdiv(H, bh), C // bc)](o_part, lse_part, o, lse, _pos_tensor(start_pos, qa.device),
                                                                  T, H, splits, per, ksel, C=C, BLOCK_S=bs, BLOCK_H=bh,
                                                                  BLOCK_C=bc, DENSE=dense, num_warps=4, **pdl())
    return o.reshape(B, T, H, C), lse.reshape(B, T, H)


def _default_splits(qa, idx, block_h):  # a selection's splits: one wave, at least 64 entries each (H200 sweep)
    B, T, H = qa.shape[:3]
    hb = triton.cdiv(H, block_h or max(16, min(64, triton.next_power_of_2(H))))
    return max(1, min(triton.cdiv(idx.shape[-1], 64), sm_count(qa.device) // (B * T * hb), 32))


def _split_length(ksel, splits, block_n):  # entries a split takes (whole steps) -> (that, the splits it makes)
    per = triton.cdiv(triton.cdiv(ksel, splits), block_n) * block_n
    return per, triton.cdiv(ksel, per)


def _hopper_takes(hopper, defaults, qa, q_pe, cache, idx, name):
    """Whether a sparse MLA call goes to kernels_hopper: hopper=None where it takes the call at the
    default tiles, True there or a one-line error, False never."""
    if hopper is False:
        return False
    packed_ok = hopper or cache.dtype != torch.uint8 or kernels_hopper.PACKED_BY_DEFAULT
    if defaults and packed_ok and kernels_hopper.takes(qa, q_pe, cache, idx):
        return True
    if hopper:
        raise ValueError(f"sparse_mla_{name}: hopper=True, but kernels_hopper does not take this call (it needs a "
                         "Hopper GPU with Gluon, bf16 or packed FP8 rows of 512 + 64 values, bf16 or float32 "
                         "queries, heads in 64s, a selection, no decode flag, the default tiles"
                         + (" and the set whole: one split)" if name == "decode" else ")"))
    return False


DECODE_TILES = dict(block_h=None, block_n=64, num_warps=8, num_stages=None, q_in_loop=False, halves=None, late_sum=None,
                    ahead=None, clamp=None)                            # sparse_mla_decode's defaults


def sparse_mla_decode(qa, q_pe, cache, idx, scale, start_pos, S=None, splits=None, out_dtype=torch.float32,
                      block_h=None, block_n=64, num_warps=8, num_stages=None, decode=False, q_in_loop=False,
                      halves=None, late_sum=None, ahead=None, clamp=None, hopper=None):
    """qa [B, T, H, C] (the query absorbed into the latent space, q^C W^UK), q_pe [B, T, H, R], cache
    [>=B, L, W] one row per token (packed FP8 uint8 rows of latent_width(C, R) bytes, or bf16 / float32
    [C + R]), idx [B, T, K] selected positions or None (dense: every position <= start_pos + t, S
    bounding the walk) -> (o [B, T, H, C] = softmax_s(scale * scores) c_s, lse [B, T, H] base 2).
    idx rows are topk_indices's: causal positions (<= start_pos + t) first, then -1, so a query reads
    at most start_pos + t + 1 entries. A query with nothing selected gets o = 0, lse = -inf.
    For a few query tokens the selected set is split so that one wave of programs fills the GPU, and
    the splits are combined by their log-sum-exp; with many (B=64) each query's set stays whole.
    Tiles: block_h heads x block_n entries per step, num_stages (None: 2 for bf16 rows, else 1),
    halves (None: all but bf16 rows) = the latent in two halves, q_in_loop = re-read the query,
    late_sum (None: FP8 rows) = the softmax sum reduced once at the end (see _sparse_mla_kernel),
    ahead (None: all but FP8 rows) = each step's positions loaded one step early, clamp (None: FP8
    rows) = unselected entries (-1) read the sequence's row 0 without load masks, their scores at
    -inf (row 0 is written before any query can attend, so it holds finite values). The defaults are
    the fastest on an H200 for FP8 and bf16 rows (bench/RESULTS.md); float32 rows (exact numerics)
    take bf16's, unmeasured.
    hopper (None: where the set stays whole, kernels_hopper takes the call and the tiles are the
    defaults) = kernels_hopper's warp-specialised variant: this kernel's bits with halves=False and
    late_sum=False (for packed FP8 rows not the defaults: those differ; and where this kernel clamps,
    as for packed rows, its unselected entries read row 0, which must hold finite values, while the
    variant reads zeros); False: this kernel.
    Reference: attention.mqa_absorbed_ref up to its weighted latent o (before W^UV), allowed = the
    selected positions (or, dense, the causal ones)."""
    _check_mla(qa, q_pe, cache, idx)
    tiles = dict(block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages, q_in_loop=q_in_loop,
                 halves=halves, late_sum=late_sum, ahead=ahead, clamp=clamp)
    whole = idx is not None and _split_length(idx.shape[-1], splits or _default_splits(qa, idx, block_h),
                                              block_n)[1] == 1                     # the set in one split
    if _hopper_takes(hopper, whole and not decode and tiles == DECODE_TILES, qa, q_pe, cache, idx, "decode"):
        return kernels_hopper.sparse_mla_prefill(qa, q_pe, cache, idx, scale, _pos_tensor(start_pos, qa.device),
                                                  out_dtype=out_dtype)
    packed = cache.dtype == torch.uint8
    ahead = not packed if ahead is None else ahead
    clamp = packed if clamp is None else clamp
    return _sparse_mla(qa, q_pe, cache, idx, scale, start_pos, S if S is not None else cache.shape[1], splits,
                       out_dtype, block_h, block_n, num_warps, num_stages, decode, q_in_loop, halves, late_sum, ahead, clamp)


PREFILL_TILES = dict(block_h=None, block_n=64, num_warps=8, num_stages=2, q_in_loop=True, halves=None, late_sum=None,
                     ahead=False, clamp=False)                         # sparse_mla_prefill's defaults


def sparse_mla_prefill(qa, q_pe, cache, idx, scale, start_pos, S=None, out_dtype=torch.bfloat16,
                       block_h=None, block_n=64, num_warps=8, num_stages=2, decode=False, q_in_loop=True,
                       halves=None, late_sum=None, ahead=False, clamp=False, hopper=None):
    """sparse_mla_decode's arguments for a chunk of many queries: one program per (query, block of
    heads) over its whole selected set, the output written directly in out_dtype (no combine).
    hopper (None: where it takes the call and the tiles are the defaults) = kernels_hopper's
    warp-specialised variant: this kernel's bits with halves=False and late_sum=False (for bf16 rows the
    defaults; packed FP8 rows' defaults are the halves, other bits); False: this kernel.
    Reference: attention.mqa_absorbed_ref, as sparse_mla_decode."""
    tiles = dict(block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages, q_in_loop=q_in_loop,
                 halves=halves, late_sum=late_sum, ahead=ahead, clamp=clamp)
    _check_mla(qa, q_pe, cache, idx)
    if _hopper_takes(hopper, not decode and tiles == PREFILL_TILES, qa, q_pe, cache, idx, "prefill"):
        return kernels_hopper.sparse_mla_prefill(qa, q_pe, cache, idx, scale, _pos_tensor(start_pos, qa.device),
                                                  out_dtype=out_dtype)
    return _sparse_mla(qa, q_pe, cache, idx, scale, start_pos, S if S is not None else cache.shape[1], 1,
                       out_dtype, block_h, block_n, num_warps, num_stages, decode, q_in_loop, halves, late_sum, ahead, clamp)
