"""Triton kernels for NVIDIA GPUs (and, with kernels_rocm.py's data, AMD): the hot ops of the fast path.

    act_quant   1x128 groups, ue8m0 scales, e4m3 codes            reference: quant.act_quant
    fp8_gemm    y = (a * sa) (b * sb)^T, 1x128 activation groups, 128x128 weight blocks, fp32
                promotion of each 128-wide K block's partial sum   reference: quant.fp8_gemm
    moe_gemm    the same GEMM for the routed experts: all experts' weights stacked [E, N, K], token
                rows gathered by index, one expert per 16-row block   reference: quant.fp8_gemm per expert

First DSA kernels (tested against their references; not yet called by the model):
    index_scores        eq. (1), heads on the MMA's M side, keys split over the context
                                                                    reference: indexer.index_scores_ref
    topk_indices        exact causal top-k by radix select         reference: indexer.topk_select_ref
    sparse_mla_decode   absorbed MLA over the selected latent rows, split + log-sum-exp combine
                                                                    reference: attention.mqa_absorbed_ref (exact)

act_quant, fp8_gemm and moe_gemm are shared with kernels_rocm.py: what differs by architecture (the FP8 flavour
and its maximum, whether FP8 is decoded by hand, tile sizes) arrives as constexpr arguments and
wrapper data. Every kernel runs on the CPU under TRITON_INTERPRET=1 (tests/test_kernels.py), where
the interpreter's fp32->fp8 and fp32->bf16 casts are defective (spec/kernels.md §4.3): the tests there
allow exactly those defects and check bit-exactness on a GPU.
"""
import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


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
def _act_quant_kernel(X, Q, S, M, N, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr):
    """Reference: quant.act_quant (scale_fmt "ue8m0")."""
    pid_m, g = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = rows[:, None] < M
    x = tl.load(X + rows[:, None] * N + cols[None, :], mask=ok, other=0.0).to(tl.float32)   # fp32 at once
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)                # all-zero group -> 1e-4
    v = amax * (1.0 / FP8_MAX)                                        # one fp32 multiply, as the official kernel
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)   # ceil(log2 v) from the bits
    s = ((e + 127) << 23).to(tl.float32, bitcast=True)                # 2^e: the ue8m0 scale
    y = tl.minimum(tl.maximum(x / s[:, None], -FP8_MAX), FP8_MAX)      # exact divide by a power of two
    tl.store(Q + rows[:, None] * N + cols[None, :], y.to(Q.dtype.element_ty), mask=ok)
    tl.store(S + rows * (N // GROUP) + g, s, mask=rows < M)


def act_quant(x, fp8=FP8, fp8_max=FP8_MAX, block_m=None):
    """x [..., N] (bf16, or float32 holding any values) -> (q [..., N] fp8, s [..., N/128] float32)."""
    assert x.shape[-1] % 128 == 0, f"act_quant: last dim {x.shape[-1]} is not a multiple of 128"
    assert x.dtype in (torch.bfloat16, torch.float32, torch.float16), f"act_quant: dtype {x.dtype}"
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, N = x2.shape
    q = torch.empty(M, N, dtype=fp8, device=x.device)
    s = torch.empty(M, N // 128, dtype=torch.float32, device=x.device)
    bm = block_m or (16 if M >= 16 else 1 << max(M - 1, 0).bit_length())
    if M:
        _act_quant_kernel[(triton.cdiv(M, bm), N // 128)](x2, q, s, M, N, BLOCK_M=bm, GROUP=128, FP8_MAX=fp8_max)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], N // 128)


# -----------------------------------------------------------------------------
# Block-scaled FP8 GEMM: C[M, N] = sum over K blocks of (A_kb B_kb^T) * sa[m, kb] * sb[n // 128, kb]

@triton.jit
def _fp8_gemm_kernel(A, B, C, SA, SB, M, N, K, NUM_KB,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     DECODE: tl.constexpr, FNUZ: tl.constexpr):
    """Reference: quant.fp8_gemm. A [M, K] fp8 (row-major), B [N, K] fp8 (K contiguous, as stored),
    SA [M, NUM_KB], SB [ceil(N/128), NUM_KB] float32, C [M, N]."""
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_n)                                     # grouped order: reuse B tiles in L2
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(NUM_KB):
        k = kb * BLOCK_K + rk
        a_ok = (rm[:, None] < M) & (k[None, :] < K)
        b_ok = (rn[None, :] < N) & (k[:, None] < K)
        if DECODE:                       # no FP8 hardware: decode bytes to fp16 (exact for every e4m3 value)
            a = _e4m3_decode(tl.load(A + rm[:, None] * K + k[None, :], mask=a_ok, other=0), FNUZ).to(tl.float16)
            b = _e4m3_decode(tl.load(B + rn[None, :] * K + k[:, None], mask=b_ok, other=0), FNUZ).to(tl.float16)
        else:
            a = tl.load(A + rm[:, None] * K + k[None, :], mask=a_ok, other=0.0)
            b = tl.load(B + rn[None, :] * K + k[:, None], mask=b_ok, other=0.0)      # [BLOCK_K, BLOCK_N]
        partial = tl.dot(a, b, out_dtype=tl.float32)                   # one K block, fresh fp32 accumulator
        sa = tl.load(SA + rm * NUM_KB + kb, mask=rm < M, other=0.0)
        sb = tl.load(SB + (rn // 128) * NUM_KB + kb, mask=rn < N, other=0.0)
        acc += partial * (sa[:, None] * sb[None, :])                   # "2xAcc" promotion in fp32
    tl.store(C + rm[:, None] * N + rn[None, :], acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


# Tile configurations by M (data): small M is weight-bandwidth bound, large M compute bound
GEMM_CONFIGS = [  # (max M, BLOCK_M, BLOCK_N, num_warps, num_stages)
    (16, 16, 64, 4, 4),
    (64, 32, 128, 4, 4),
    (256, 64, 128, 4, 3),
    (1 << 62, 128, 128, 8, 3),
]


def gemm_config(M, configs=GEMM_CONFIGS):
    for max_m, bm, bn, warps, stages in configs:
        if M <= max_m:
            return bm, bn, warps, stages


def fp8_gemm(a, sa, b, sb, out_dtype=torch.bfloat16, configs=GEMM_CONFIGS, decode=False, fnuz=False):
    """a [M, K] fp8, sa [M, K/128] f32, b [N, K] fp8, sb [ceil(N/128), ceil(K/128)] f32 -> [M, N] out_dtype."""
    M, K = a.shape
    N = b.shape[0]
    assert b.shape[1] == K and K % 128 == 0, f"fp8_gemm: shapes {tuple(a.shape)} x {tuple(b.shape)}"
    assert sa.shape == (M, K // 128) and sb.shape == (-(-N // 128), K // 128), "fp8_gemm: scale shapes"
    assert a.is_contiguous() and b.is_contiguous() and sa.is_contiguous() and sb.is_contiguous()
    assert sa.dtype == torch.float32 and sb.dtype == torch.float32
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    bm, bn, warps, stages = gemm_config(M, configs)
    if decode:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _fp8_gemm_kernel[grid](a, b, c, sa, sb, M, N, K, K // 128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8,
                           DECODE=decode, FNUZ=fnuz, num_warps=warps, num_stages=stages)
    return c


# -----------------------------------------------------------------------------
# Grouped block-FP8 GEMM for the routed experts: rows gathered by index, one expert per row block

@triton.jit
def _moe_gemm_kernel(A, SA, B, SB, C, ROWS, BLOCK_EXPERT, N, K, NUM_KB,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DECODE: tl.constexpr, FNUZ: tl.constexpr):
    """Reference: quant.fp8_gemm on each row block's expert. A [*, K] fp8 with SA [*, NUM_KB];
    B [E, N, K] fp8 with SB [E, ceil(N/128), NUM_KB] (all experts stacked); ROWS [P] the A row of
    each output row (-1: padding); BLOCK_EXPERT [P / BLOCK_M] the expert of each row block (-1: none).
    C [P, N]: output row p = A[ROWS[p]] @ B[expert]^T."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BLOCK_EXPERT + pid_m)
    if e >= 0:                                                         # blocks past the routed rows: nothing
        p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row = tl.load(ROWS + p)
        valid = row >= 0
        row = tl.where(valid, row, 0)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        b_base = B + e.to(tl.int64) * N * K
        sb_base = SB + e.to(tl.int64) * tl.cdiv(N, 128) * NUM_KB
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(NUM_KB):
            k = kb * BLOCK_K + rk
            a_ok = valid[:, None] & (k[None, :] < K)
            b_ok = (rn[None, :] < N) & (k[:, None] < K)
            if DECODE:
                a = _e4m3_decode(tl.load(A + row[:, None] * K + k[None, :], mask=a_ok, other=0), FNUZ).to(tl.float16)
                b = _e4m3_decode(tl.load(b_base + rn[None, :] * K + k[:, None], mask=b_ok, other=0), FNUZ).to(tl.float16)
            else:
                a = tl.load(A + row[:, None] * K + k[None, :], mask=a_ok, other=0.0)   # gathered token rows
                b = tl.load(b_base + rn[None, :] * K + k[:, None], mask=b_ok, other=0.0)
            partial = tl.dot(a, b, out_dtype=tl.float32)
            sa = tl.load(SA + row * NUM_KB + kb, mask=valid, other=0.0)
            sb = tl.load(sb_base + (rn // 128) * NUM_KB + kb, mask=rn < N, other=0.0)
            acc += partial * (sa[:, None] * sb[None, :])
        tl.store(C + p[:, None] * N + rn[None, :], acc.to(C.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))


MOE_BLOCK_M = 16


def moe_gemm(a, sa, b, sb, rows, block_expert, out_dtype=torch.bfloat16, decode=False, fnuz=False, block_n=64):
    """a [R, K] fp8, sa [R, K/128], b [E, N, K] fp8, sb [E, ceil(N/128), K/128], rows [P] int (P a multiple of
    MOE_BLOCK_M), block_expert [P / MOE_BLOCK_M] int -> [P, N]; padding rows are left unwritten."""
    R, K = a.shape
    E, N, _ = b.shape
    P = rows.shape[0]
    assert P % MOE_BLOCK_M == 0 and block_expert.shape[0] == P // MOE_BLOCK_M and K % 128 == 0
    assert a.is_contiguous() and b.is_contiguous() and sa.is_contiguous() and sb.is_contiguous()
    c = torch.empty(P, N, dtype=out_dtype, device=a.device)
    if decode:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    grid = (P // MOE_BLOCK_M, triton.cdiv(N, block_n))
    _moe_gemm_kernel[grid](a, sa, b, sb, c, rows, block_expert, N, K, K // 128, BLOCK_M=MOE_BLOCK_M, BLOCK_N=block_n,
                           BLOCK_K=128, DECODE=decode, FNUZ=fnuz, num_warps=4, num_stages=3)
    return c


# -----------------------------------------------------------------------------
# eq. (1), the lightning indexer's scores: heads on the MMA's M side, keys split over the context

@triton.jit
def _index_scores_kernel(Q, W, K, KS, OUT, T, S, J, start_pos,
                         JP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr):
    """Reference: indexer.index_scores_ref (+ the causal mask of topk_select_ref). One program per
    (query token, block of BLOCK_S keys): logits [heads, keys] = q_t k^T in one MMA (heads padded to
    JP >= 16 rows), ReLU per head, then the signed head weights, then the key scale. Key blocks wholly
    after the query's position are skipped and written as -inf, like every masked key."""
    bt, sb = tl.program_id(0), tl.program_id(1)
    b, t = bt // T, bt % T
    rs = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    last = start_pos + t                                               # the query's own position
    out = OUT + bt.to(tl.int64) * S + rs
    if sb * BLOCK_S > last:                                            # all future keys: nothing to compute
        tl.store(out, tl.full((BLOCK_S,), float("-inf"), tl.float32), mask=rs < S)
    else:
        rj, rd = tl.arange(0, JP), tl.arange(0, D)
        q = tl.load(Q + (bt.to(tl.int64) * J + rj[:, None]) * D + rd[None, :], mask=rj[:, None] < J, other=0.0)
        k = tl.load(K + (b.to(tl.int64) * S + rs[None, :]) * D + rd[:, None], mask=rs[None, :] < S, other=0.0)
        if IEEE:                                                       # float32 q, k (exact numerics): no tf32
            logits = tl.dot(q, k, input_precision="ieee")
        else:                                                          # FP8 q, k: one MMA with fp32 accumulation
            logits = tl.dot(q, k, out_dtype=tl.float32)
        w = tl.load(W + bt.to(tl.int64) * J + rj, mask=rj < J, other=0.0)
        score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)   # ReLU per head, before the signed weights
        score = score * tl.load(KS + b.to(tl.int64) * S + rs, mask=rs < S, other=0.0)
        tl.store(out, tl.where(rs <= last, score, float("-inf")), mask=rs < S)


def index_scores(q, w, k, k_scale, start_pos, block_s=64):
    """q [B, T, J, D] (FP8 or float32), w [B, T, J] f32, k [B, S, D] (same dtype as q), k_scale [B, S] f32
    -> [B, T, S] f32 scores, -inf at keys after each query's position (start_pos + t)."""
    B, T, J, D = q.shape
    S = k.shape[1]
    assert k.shape == (B, S, D) and k.dtype == q.dtype and w.shape == (B, T, J) and k_scale.shape == (B, S)
    assert D in (64, 128, 256), f"index_scores: head dim {D}"
    q, k, w, k_scale = q.contiguous(), k.contiguous(), w.float().contiguous(), k_scale.float().contiguous()
    out = torch.empty(B, T, S, dtype=torch.float32, device=q.device)
    jp = max(16, triton.next_power_of_2(J))
    grid = (B * T, triton.cdiv(S, block_s))
    _index_scores_kernel[grid](q, w, k, k_scale, out, T, S, J, start_pos, JP=jp, D=D, BLOCK_S=block_s,
                               IEEE=q.dtype == torch.float32, num_warps=4)
    return out


# -----------------------------------------------------------------------------
# Sparse MLA decode (absorbed form): each head attends to its token's selected latent entries

@triton.jit
def _sparse_mla_decode_kernel(QA, QPE, KV, PE, IDX, O_PART, LSE_PART, H, KSEL, L, SPLIT, scale,
                              C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Reference: attention.mqa_absorbed_ref's softmax(q.k) v over the selected keys (exact numerics).
    One program per (sequence, block of heads, split of the selected set): gather the selected
    latent rows [BLOCK_N, C + R] by index, scores in one MMA per part, online softmax (running max m,
    sum l), and write the split's normalised output with its log-sum-exp for the combine step."""
    b, hb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = rh < H
    rc, rr = tl.arange(0, C), tl.arange(0, R)
    qa = tl.load(QA + (b * H + rh[:, None]) * C + rc[None, :], mask=hm[:, None], other=0.0)
    qp = tl.load(QPE + (b * H + rh[:, None]) * R + rr[None, :], mask=hm[:, None], other=0.0)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, C), tl.float32)
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, KSEL)
    for n0 in range(lo, hi, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        s = tl.load(IDX + b * KSEL + rn, mask=rn < hi, other=-1)          # selected positions (-1: none)
        ok = s >= 0
        row = b.to(tl.int64) * L + tl.where(ok, s, 0)
        kv = tl.load(KV + row[:, None] * C + rc[None, :], mask=ok[:, None], other=0.0).to(tl.float32)  # gathered
        pe = tl.load(PE + row[:, None] * R + rr[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        z = (tl.dot(qa, tl.trans(kv), input_precision="ieee") + tl.dot(qp, tl.trans(pe), input_precision="ieee")) * scale
        z = tl.where(ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)            # all masked so far: no NaN
        p = tl.exp(z - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
        m = m_new
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))
    base = (b * tl.num_programs(2) + sp) * H
    tl.store(O_PART + (base + rh[:, None]) * C + rc[None, :], o, mask=hm[:, None])
    tl.store(LSE_PART + base + rh, lse, mask=hm)


def sparse_mla_decode(qa, q_pe, kv, pe, idx, scale, splits=None, block_h=16, block_n=16):
    """qa [B, H, C] (the query absorbed into the latent space), q_pe [B, H, R], kv [B, L, C] latent cache,
    pe [B, L, R], idx [B, K] selected positions (-1: none) -> [B, H, C] float32 = softmax_s(scale *
    (qa . kv_s + q_pe . pe_s)) kv_s over the selected s. Splits over the selected set are combined by
    their log-sum-exp, so one sequence can fill the GPU."""
    B, H, C = qa.shape
    R, L, K = q_pe.shape[-1], kv.shape[1], idx.shape[1]
    assert kv.shape == (B, L, C) and pe.shape == (B, L, R) and q_pe.shape == (B, H, R) and idx.shape[0] == B
    qa, q_pe = qa.float().contiguous(), q_pe.float().contiguous()      # the cache stays in its dtype (bf16 / f32)
    kv, pe = kv.contiguous(), pe.contiguous()
    idx = idx.to(torch.int32).contiguous()
    splits = splits or max(1, min(triton.cdiv(K, block_n), 132 // max(1, B * triton.cdiv(H, block_h))))
    per = triton.cdiv(triton.cdiv(K, splits), block_n) * block_n
    splits = triton.cdiv(K, per)
    o_part = torch.empty(B, splits, H, C, dtype=torch.float32, device=qa.device)
    lse = torch.empty(B, splits, H, dtype=torch.float32, device=qa.device)
    _sparse_mla_decode_kernel[(B, triton.cdiv(H, block_h), splits)](
        qa, q_pe, kv, pe, idx, o_part, lse, H, K, L, per, scale, C=C, R=R, BLOCK_H=block_h, BLOCK_N=block_n,
        num_warps=8)
    w = torch.softmax(lse, dim=1).nan_to_num(0.0)                       # combine the splits (all -inf: 0)
    return (o_part * w[..., None]).sum(1)


# -----------------------------------------------------------------------------
# eq. (2): exact top-k over each query's causal keys by radix select

@triton.jit
def _ordered_key(x):  # fp32 -> int64 in [0, 2^32) whose order is the float order (larger score, larger key)
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)


@triton.jit
def _topk_kernel(SCORES, OUT, T, S, K, start_pos, BLOCK: tl.constexpr):
    """Reference: indexer.topk_select_ref (as indices). One program per query row: the K-th largest
    key among the causal ones is found digit by digit (four 8-bit passes, histogram per pass), then
    every key above it and the lowest-indexed keys equal to it (ties toward the lower index) are
    written out; the row is padded with -1 when it has fewer than K causal keys."""
    row = tl.program_id(0)
    t = row % T
    n = tl.minimum(start_pos + t + 1, S)                               # causal keys of this query
    kk = tl.minimum(K, n)
    bins = tl.arange(0, 256)
    prefix = tl.zeros((), tl.int64)
    hi_mask = tl.zeros((), tl.int64)
    need = kk.to(tl.int64)
    for p in range(4):                                                 # radix select, most significant digit first
        shift = 24 - 8 * p
        hist = tl.zeros((256,), tl.int64)
        for s0 in range(0, n, BLOCK):
            rs = s0 + tl.arange(0, BLOCK)
            u = _ordered_key(tl.load(SCORES + row.to(tl.int64) * S + rs, mask=rs < n, other=0.0))
            cand = (rs < n) & ((u & hi_mask) == prefix)
            d = (u >> shift) & 0xFF
            hist += tl.sum(((d[:, None] == bins[None, :]) & cand[:, None]).to(tl.int64), axis=0)
        above = tl.sum(tl.where(bins[None, :] > bins[:, None], hist[None, :], 0), axis=1)   # keys in higher buckets
        b = tl.max(tl.where(above + hist >= need, bins, -1), axis=0)   # the bucket holding the need-th largest
        need -= tl.sum(tl.where(bins > b, hist, 0), axis=0)
        prefix |= b.to(tl.int64) << shift
        hi_mask |= 0xFF << shift
    # prefix is now the K-th largest key; take all keys above it and the first `need` equal to it
    base = tl.zeros((), tl.int64)
    taken_eq = tl.zeros((), tl.int64)
    for s0 in range(0, n, BLOCK):
        rs = s0 + tl.arange(0, BLOCK)
        ok = rs < n
        u = _ordered_key(tl.load(SCORES + row.to(tl.int64) * S + rs, mask=ok, other=0.0))
        eq = ok & (u == prefix)
        eq_rank = taken_eq + tl.cumsum(eq.to(tl.int64), axis=0)         # 1-based rank among equal keys, in index order
        sel = (ok & (u > prefix)) | (eq & (eq_rank <= need))
        pos = base + tl.cumsum(sel.to(tl.int64), axis=0) - 1
        tl.store(OUT + row.to(tl.int64) * K + pos, rs, mask=sel)
        base += tl.sum(sel.to(tl.int64), axis=0)
        taken_eq += tl.sum(eq.to(tl.int64), axis=0)
    for s0 in range(0, K, BLOCK):                                      # pad the rest with -1
        rk = s0 + tl.arange(0, BLOCK)
        tl.store(OUT + row.to(tl.int64) * K + rk, tl.full((BLOCK,), -1, tl.int32), mask=(rk >= kk) & (rk < K))


def topk_indices(scores, K, start_pos, block=256):
    """scores [B, T, S] f32 -> [B, T, K] int32: each query's top-K causal keys (ties toward the lower
    index), -1 where it has fewer than K causal keys."""
    B, T, S = scores.shape
    out = torch.empty(B, T, K, dtype=torch.int32, device=scores.device)
    _topk_kernel[(B * T,)](scores.float().contiguous(), out, T, S, K, start_pos, BLOCK=block, num_warps=4)
    return out
