"""Triton kernels for DeepSeek-V4-Flash: mHC (V4 paper §2.2, mhc.py) in a GEMM and two kernels per
sub-layer instead of a chain of about twenty small launches, the CSA indexer's scores (§2.3.1, compressor.py), the
shared-KV sparse attention with its sink (§2.3, attention_v4.py), the compressors' pooling (§2.3.1-2.3.2,
compressor.py) and the FP4 expert GEMM.

    hc_mix_pre        μ = Φ x̄ · rsqrt(mean(x̄²) + eps) (Φ x̄ one cuBLAS GEMM), then in one kernel the
                      pre / post mixes, Sinkhorn on the comb mix and the collapse u = Σ_i a_i X_i
                                                 reference: mhc.hc_mix_pre_ref
    hc_post           X'_j = c_j y + Σ_i B_ij X_i, the streams re-rounded to bf16 (official numerics)
                                                 reference: mhc.hc_post_ref
    compress_keys     a compressor's keys from its windows' projections: the gated pooling Ĉ_w = Σ_j
                      softmax_j(Z_j) ⊙ C_j over the window's slots (CSA: 2m, overlapping), eqs. (11) /
                      (21), then RMSNorm and RoPE at the window's first token, one program a key
                                                 reference: compressor.compress_ref's steps
    index_scores_v4   I_{t,w} = Σ_h w_{t,h} ReLU(q_{t,h} . K_w), eq. (16), -inf where window w is not
                      complete at t; the top-k is kernels_cuda.topk_indices (V3.2's, the same arithmetic)
                                                 reference: compressor.index_scores_v4_ref
    sparse_attention  every head against the keys a query names (its window's rows, the CSA picks)
                      and HCA's complete windows, the sink in the denominator; exact numerics in two
                      launches (the max, then the sums) split over the keys for decode's few queries;
                      official numerics as the official kernel, 64 columns at a time in list order
                      with a running max, one program a query and head block
                                                 reference: attention_v4.sparse_attention_ref
    fp4_gemm          the routed experts' GEMM: FP8 activations (1x128 scales) times MXFP4 weights (two
                      e2m1 codes a byte, the low nibble first; one E8M0 scale per 32), per 32-wide K
                      block the partial sum promoted by both scales; the fp16 route or the int8 one
                      (gfx90a's; bit for bit)                            reference: quant.fp4_gemm
    fp4_moe_gemm      the same over a layer's stacked experts, token rows gathered, one expert per
                      16-row block (as kernels_fp8.moe_gemm); for decode a GEMV, a routed row a program
                                                                         reference: quant.fp4_gemm per expert

Numerics: fp32 sums, as the official code. The references sum in float64 (quant.matmul_f32) where the
official code's order is not defined, so results agree to float32 rounding, not bit for bit, and a bf16
output may differ by one ulp where the fp32 sum sits on a rounding boundary; index_scores_v4 in official
numerics is bit for bit for 16 queries or more (FP4 operands: exact products and sums; the heads summed
in the reference's order), within an ulp for decode's few (the heads summed as a tree). tests/test_kernels_v4.py states each
bound. backend_torch dispatches them (torch_ops: hc_mix_pre, hc_post, v4_attention, the FP4 linears).
bf16 operands go to the MMA only where they are bf16 values (official numerics) and not in the
interpreter (its bf16 dot is wrong: spec/kernels.md §4.3); otherwise fp32 operands with IEEE products.
Nothing here is vendor-specific: kernels_rocm.py re-exports these.

Letters: M tokens, n = hc_mult streams, d hidden size, K = n d, R = (2 + n) n mix rows; B batch, T
queries, H heads, c head width, P window rows, n compressed keys, J indexer heads, D their width.
"""
import torch
import triton
import triton.language as tl

from kernels_fp8 import _await_inputs, _bf16_round, _e4m3_decode, _interpreted, pdl, sm_count


# -----------------------------------------------------------------------------
# mhc.hc_mix_pre_ref: the mixes, Sinkhorn and the collapse of the streams

@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _hc_mix_pre_kernel(MU, SS, X, BASE, ALPHA, PRE, POST, COMB, U, M, d, K, R, eps_rms, hc_eps,
                       N: tl.constexpr, ITERS: tl.constexpr, ROUND: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PAD: tl.constexpr, PDL: tl.constexpr = False):
    """Reference: mhc.hc_mix_pre_ref, given Φ x̄ (MU [M, R]) and Σ x̄² (SS [M]). One program per (BLOCK_M
    tokens, BLOCK_D columns of u): each computes its tokens' mixes and Sinkhorn (a few hundred flops a
    token, cheaper than a second launch), the first column block stores them, each collapses its slice."""
    _await_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                  # tokens m
    in_m = rows < M
    j = tl.arange(0, PAD)                                                       # a mix's columns, padded
    ii = tl.arange(0, N * N)                                                    # the comb mix, row-major
    mu = MU + rows[:, None].to(tl.int64) * R
    r = 1.0 / tl.sqrt(tl.load(SS + rows, mask=in_m, other=0.0) / K + eps_rms)   # RMSNorm₀'s scale, [BLOCK_M]
    mu_pre = tl.load(mu + j[None, :], mask=in_m[:, None] & (j[None, :] < N), other=0.0) * r[:, None]
    mu_post = tl.load(mu + N + j[None, :], mask=in_m[:, None] & (j[None, :] < N), other=0.0) * r[:, None]
    mu_comb = tl.load(mu + 2 * N + ii[None, :], mask=in_m[:, None], other=0.0) * r[:, None]
    # the mixes: a = σ(α0 μ + b) + ε, c = 2 σ(α1 μ + b), B = Sinkhorn(softmax(α2 μ + b) + ε)
    s0, s1, s2 = tl.load(ALPHA), tl.load(ALPHA + 1), tl.load(ALPHA + 2)        # α read here: no host copy
    b_pre = tl.load(BASE + j, mask=j < N, other=0.0)
    b_post = tl.load(BASE + N + j, mask=j < N, other=0.0)
    b_comb = tl.load(BASE + 2 * N + ii)
    a = _sigmoid(s0 * mu_pre + b_pre[None, :]) + hc_eps                          # [BLOCK_M, PAD]
    c = 2.0 * _sigmoid(s1 * mu_post + b_post[None, :])
    z = tl.reshape(s2 * mu_comb + b_comb[None, :], (BLOCK_M, N, N))             # [m, i, j]
    B = tl.exp(z - tl.max(z, 2)[:, :, None])
    B = B / tl.sum(B, 2)[:, :, None] + hc_eps                                   # softmax over j, + eps
    B = B / (tl.sum(B, 1)[:, None, :] + hc_eps)                                 # columns
    for _ in range(ITERS - 1):
        B = B / (tl.sum(B, 2)[:, :, None] + hc_eps)                             # rows
        B = B / (tl.sum(B, 1)[:, None, :] + hc_eps)                             # columns
    if tl.program_id(1) == 0:
        out = rows[:, None] * N + j[None, :]
        tl.store(PRE + out, a, mask=in_m[:, None] & (j[None, :] < N))
        tl.store(POST + out, c, mask=in_m[:, None] & (j[None, :] < N))
        tl.store(COMB + rows[:, None] * (N * N) + ii[None, :], tl.reshape(B, (BLOCK_M, N * N)), mask=in_m[:, None])
    # u = Σ_i a_i X_i on this program's columns
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m2 = in_m[:, None] & (cols[None, :] < d)
    u = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for i in tl.static_range(N):
        a_i = tl.sum(tl.where(j[None, :] == i, a, 0.0), 1)                      # [BLOCK_M]
        x_i = tl.load(X + rows[:, None].to(tl.int64) * K + i * d + cols[None, :], mask=m2, other=0.0)
        u += a_i[:, None] * x_i
    if ROUND:
        u = _bf16_round(u)
    tl.store(U + rows[:, None].to(tl.int64) * d + cols[None, :], u, mask=m2)


def hc_mix_pre(X, fn, base, scale, args, official=False):  # X [M, n, d] -> pre, post [M, n], comb [M, n, n], u [M, d]
    """mhc.hc_mix_pre_ref (u rounded to bf16 in official numerics): Φ x̄ and Σ x̄² as one fp32 GEMM and a sum
    (cuBLAS streams x̄ at the memory's rate however few tokens there are), then one kernel for the rest."""
    M, n, d = X.shape
    R = (2 + n) * n
    if fn.shape != (R, n * d) or base.shape != (R,) or n & (n - 1) or n < 2:
        raise ValueError(f"hc_mix_pre: streams {n} (a power of two), Φ {tuple(fn.shape)} != ({R}, {n * d}) "
                         f"or base {tuple(base.shape)} != ({R},)")
    X = X.float().contiguous()
    x = X.reshape(M, n * d)
    mu = (x @ fn.float().T).contiguous()                                        # Φ x̄ [M, R], fp32
    ss = (x * x).sum(-1)                                                        # Σ x̄² [M]
    pre, post = (torch.empty(M, n, dtype=torch.float32, device=X.device) for _ in range(2))
    comb = torch.empty(M, n, n, dtype=torch.float32, device=X.device)
    u = torch.empty(M, d, dtype=torch.float32, device=X.device)
    alpha = torch.as_tensor(scale, dtype=torch.float32, device=X.device).contiguous()   # [3]: a device tensor (the model's)
    BLOCK_M, BLOCK_D = 16, 128
    _hc_mix_pre_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(d, BLOCK_D))](
        mu, ss, X, base.float().contiguous(), alpha, pre, post, comb, u, M, d, n * d, R,
        float(args.rms_norm_eps), float(args.hc_eps), N=n, ITERS=int(args.hc_sinkhorn_iters), ROUND=bool(official),
        BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, PAD=max(16, n), num_warps=4, **pdl())
    return pre, post, comb, u


# -----------------------------------------------------------------------------
# mhc.hc_post_ref: the sub-layer's output expanded back into the streams, mixed by B

@triton.jit
def _hc_post_kernel(X, Y, POST, COMB, OUT, d, N: tl.constexpr, ROUND: tl.constexpr, BLOCK_D: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Reference: mhc.hc_post_ref. One program per token and BLOCK_D columns, all n streams."""
    _await_inputs(PDL)
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.arange(0, N)
    ok = cols[None, :] < d
    x = tl.load(X + m * N * d + i[:, None] * d + cols[None, :], mask=ok, other=0.0)      # [n (i), BLOCK_D]
    y = tl.load(Y + m * d + cols, mask=cols < d, other=0.0)                               # [BLOCK_D]
    c = tl.load(POST + m * N + i)                                                         # [n (j)]
    B = tl.load(COMB + m * N * N + i[:, None] * N + i[None, :])                           # [n (i), n (j)]
    out = c[:, None] * y[None, :] + tl.sum(B[:, :, None] * x[:, None, :], 0)              # [n (j), BLOCK_D]
    if ROUND:
        out = _bf16_round(out)
    tl.store(OUT + m * N * d + i[:, None] * d + cols[None, :], out, mask=ok)


def hc_post(X, y, post, comb, official=False):  # [M, n, d], [M, d], [M, n], [M, n, n] -> X' [M, n, d]
    """mhc.hc_post_ref; official: the streams rounded to bf16, as the official code holds them."""
    M, n, d = X.shape
    if y.shape != (M, d) or post.shape != (M, n) or comb.shape != (M, n, n) or n & (n - 1) or n < 2:
        raise ValueError(f"hc_post: X {tuple(X.shape)} (streams a power of two), y {tuple(y.shape)}, "
                         f"post {tuple(post.shape)}, comb {tuple(comb.shape)} do not agree")
    out = torch.empty(M, n, d, dtype=torch.float32, device=X.device)
    BLOCK_D = 256
    _hc_post_kernel[(M, triton.cdiv(d, BLOCK_D))](
        X.float().contiguous(), y.float().contiguous(), post.float().contiguous(), comb.float().contiguous(), out, d,
        N=n, ROUND=bool(official), BLOCK_D=BLOCK_D, num_warps=4, **pdl())
    return out


# -----------------------------------------------------------------------------
# compressor.compress_ref after its two GEMMs: the gated pooling of each window's rows into a key,
# eqs. (11) / (21), then RMSNorm and RoPE at the window's first token; one program a key

@triton.jit
def _compress_slots(rows, CP, ZP, prev, s, i, m, S, ch, C: tl.constexpr, H: tl.constexpr, OVERLAP: tl.constexpr):
    """[BLOCK_S, C] values (kv) and gate logits (z) of window i's slots s: CSA's s < m are window i-1's
    C^a (for window 0, CP and ZP's), s >= m window i's C^b; HCA's are window i's rows."""
    ok = (s < S)[:, None]
    if OVERLAP:
        early = s < m
        row = tl.where(early, (i - 1) * m + s, i * m + s - m)
        off = row[:, None] * (2 * H) + tl.where(early, 0, C)[:, None] + ch[None, :]
        before = (early & (i == 0))[:, None]
        at_p = prev + s[:, None] * H + ch[None, :]
        kv = tl.load(tl.where(before, CP + at_p, rows + off), mask=ok, other=0.0)
        z = tl.load(tl.where(before, ZP + at_p, rows + off + H), mask=ok, other=-float("inf"))
    else:
        off = (i * m + s)[:, None] * (2 * H) + ch[None, :]
        kv = tl.load(rows + off, mask=ok, other=0.0)
        z = tl.load(rows + off + H, mask=ok, other=-float("inf"))
    return kv, z


@triton.jit
def _compress_kernel(ROWS, CP, ZP, NORM, COS, SIN, OUT, k, m, eps, C: tl.constexpr, R: tl.constexpr,
                     OVERLAP: tl.constexpr, ROUND: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    """Reference: compressor.pool_ref, rms_norm, rope_tail (backend_torch.compress's steps). ROWS [B, k m,
    2 h] the windows' [C_j | Z_j + B] (h = 2c where windows overlap, else c), CP, ZP [B, m, h] the window
    before the first (Z -inf: none), NORM [c], COS, SIN [k, R/2] -> OUT [B, k, c]. Program (b, i): window
    i's S slots (CSA: 2m, [C^a of window i-1 | C^b of window i]; HCA: m), the softmax over them per
    channel in three passes (max, sum, then the probabilities times the values, as the reference)."""
    _await_inputs(PDL)
    b = tl.program_id(0)
    i = tl.program_id(1)
    ch = tl.arange(0, C)
    H: tl.constexpr = 2 * C if OVERLAP else C                                    # width of C_j (and of Z_j)
    S = 2 * m if OVERLAP else m
    rows = ROWS + (b * k * m).to(tl.int64) * (2 * H)
    prev = (b * m).to(tl.int64) * H
    mx = tl.full((C,), -float("inf"), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        _, z = _compress_slots(rows, CP, ZP, prev, s0 + tl.arange(0, BLOCK_S), i, m, S, ch, C, H, OVERLAP)
        mx = tl.maximum(mx, tl.max(z, 0))
    tot = tl.zeros((C,), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        _, z = _compress_slots(rows, CP, ZP, prev, s0 + tl.arange(0, BLOCK_S), i, m, S, ch, C, H, OVERLAP)
        tot += tl.sum(tl.exp(z - mx[None, :]), 0)
    pooled = tl.zeros((C,), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        kv, z = _compress_slots(rows, CP, ZP, prev, s0 + tl.arange(0, BLOCK_S), i, m, S, ch, C, H, OVERLAP)
        pooled += tl.sum(tl.exp(z - mx[None, :]) / tot[None, :] * kv, 0)           # Ĉ_i [C]
    if ROUND:
        pooled = _bf16_round(pooled)
    y = pooled * (1.0 / tl.sqrt(tl.sum(pooled * pooled, 0) / C + eps))             # RMSNorm, then its weight
    y = tl.load(NORM + ch) * y
    if ROUND:
        y = _bf16_round(y)
    a, b2 = tl.split(tl.reshape(y, (C // 2, 2)))                                    # interleaved pairs
    pair = tl.arange(0, C // 2) - (C - R) // 2                                      # the trailing R dims rotate
    cos = tl.load(COS + i * (R // 2) + pair, mask=pair >= 0, other=1.0)
    sin = tl.load(SIN + i * (R // 2) + pair, mask=pair >= 0, other=0.0)
    y = tl.reshape(tl.join(a * cos - b2 * sin, a * sin + b2 * cos), (C,))
    if ROUND:
        y = _bf16_round(y)
    tl.store(OUT + (b * k + i).to(tl.int64) * C + ch, y)


def compress_keys(rows, Cp, Zp, norm, cos, sin, eps, m, overlap, official=False):
    """backend_torch.compress's pooling, RMSNorm and RoPE: rows [B, k m, 2h] of k complete windows, Cp, Zp
    [B, m, h] the window before (CSA; Zp -inf: none), norm [c], cos, sin [k, R/2] at each window's first
    token -> K [B, k, c] float32 (bf16 values in official numerics), before the cache's fake quantisation."""
    B, km, width = rows.shape
    k, c, R = km // m, norm.shape[0], 2 * cos.shape[-1]
    h = 2 * c if overlap else c
    if c & (c - 1) or width != 2 * h or km != k * m or cos.shape != (k, R // 2) or sin.shape != cos.shape \
            or (overlap and (Cp.shape != (B, m, h) or Zp.shape != (B, m, h))):
        raise ValueError(f"compress_keys: rows {tuple(rows.shape)}, windows of {m}, norm {tuple(norm.shape)} (a power "
                         f"of two), cos {tuple(cos.shape)}, prev {tuple(Cp.shape) if overlap else None} do not agree")
    out = torch.empty(B, k, c, dtype=torch.float32, device=rows.device)
    if k:
        dummy = rows[:, :0]
        _compress_kernel[(B, k)](
            rows.float().contiguous(), Cp.float().contiguous() if overlap else dummy,
            Zp.float().contiguous() if overlap else dummy, norm.float().contiguous(), cos.float().contiguous(),
            sin.float().contiguous(), out, k, m, float(eps), C=c, R=R, OVERLAP=bool(overlap), ROUND=bool(official),
            BLOCK_S=min(16, triton.next_power_of_2(2 * m if overlap else m)), num_warps=4, **pdl())
    return out


# -----------------------------------------------------------------------------
# quant.fp4_gemm: V4's expert GEMM. The reference's partial sum of a 32-wide K block is exact, rounded once
# to fp32; then promoted by the activation's scale and the weight's, the blocks added in order. Two routes:
#   fp16   both operands decoded from their bytes to fp16 (every e4m3 and e2m1 value is exact there), the
#          FP4 codes by integer operations on their bits; the MMA sums the exact products in fp32, so a
#          partial may round differently where it needs more than 24 bits
#   int8   the gfx90a report's: FP4 codes x 2 are the integers 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12 and the 0.5
#          goes into the scale; an e4m3 activation is an integer times 2^-9 (e4m3fnuz: 2^-10) of at most
#          18 bits, split into three signed 7-bit limbs, so three INT8 MMAs give the partial as an exact
#          int32 (|sum| < 2^18 · 12 · 32 < 2^28), rounded once to fp32: bit for bit the reference's partial
# The decode GEMV (_fp4_gemv_kernel) sums the same integers on the CUDA cores, exact on every GPU. Where
# K is split over programs (decode), the splits' sums are added after: within fp32 rounding, not bit for bit.

@triton.jit
def _e2m1_f16(code):
    """4-bit e2m1 code (sign, 2 exponent bits of bias 1, 1 mantissa bit: 0, .5, 1, 1.5, 2, 3, 4, 6) -> fp16,
    built as fp16's bits: sign << 15 | (e + 14) << 10 | m << 9, and for e = 0 (0 or 0.5) 0 or 14 << 10."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    mag = tl.where(e > 0, ((e + 14) << 10) | (m << 9), m * (14 << 10))
    return (((c & 8) << 12) | mag).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _subnormal_units(code, E: tl.constexpr, M: tl.constexpr):
    """A sign | E exponent bits | M mantissa bits code -> its value in units of the format's smallest
    subnormal, an integer: m for e = 0, (2^M + m) << (e - 1) otherwise. e2m1 (E 2, M 1): twice the value,
    0, ±1, ±2, ±3, ±4, ±6, ±8, ±12; e4m3 (E 4, M 3): the value · 2^9 (e4m3fnuz: · 2^10), |.| < 2^18. A NaN
    code has no integer and comes out as a number (act_quant writes none)."""
    c = code.to(tl.int32)
    e = (c >> M) & ((1 << E) - 1)
    m = c & ((1 << M) - 1)
    mag = tl.where(e > 0, ((1 << M) + m) << tl.maximum(e - 1, 0), m)
    return tl.where((c & (1 << (E + M))) != 0, -mag, mag)


@triton.jit
def _limb(v, i: tl.constexpr):
    """Signed 7-bit limb i of an integer of at most 21 bits: v = limb 0 + 2^7 limb 1 + 2^14 limb 2, as int8."""
    mag = (tl.abs(v) >> (7 * i)) & 127
    return tl.where(v < 0, -mag, mag).to(tl.int8)


@triton.jit
def _fp4_gemm_kernel(A, SA, B, SB, C, ROWS, BLOCK_EXPERT, M, N, K, KB_SPLIT, GROUPED: tl.constexpr,
                     FNUZ: tl.constexpr, INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Reference: quant.fp4_gemm. A [*, K] e4m3 bytes, SA [*, K/128], B [E, N, K/2] e2m1 pairs, SB [E, N, K/32].
    Program (i, j, s) sums the 32-wide K blocks [s KB_SPLIT, (s + 1) KB_SPLIT) into C[s] (split K).
    GROUPED (the routed experts, as kernels_fp8.moe_gemm): output row p is A[ROWS[p]] times expert
    BLOCK_EXPERT[p / BLOCK_M]'s weights (ROWS -1: padding; BLOCK_EXPERT -1: an unused block); else
    output row p is A[p] times B[0], for p < M. INT8: the int8 route, else the fp16 one."""
    _await_inputs(PDL)
    pid_m = tl.program_id(0)
    p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                                        # output rows
    nkb = K // 32
    if GROUPED:
        e = tl.load(BLOCK_EXPERT + pid_m)
        rows = tl.load(ROWS + p)
        in_m = rows >= 0                                                               # an unused block's are all -1
        rows = tl.where(in_m, rows, 0)
        nkb = tl.where(e >= 0, nkb, 0)                                                 # unused block: no work
        B += tl.maximum(e, 0).to(tl.int64) * N * (K // 2)
        SB += tl.maximum(e, 0).to(tl.int64) * N * (K // 32)
    else:
        rows, in_m = p, p < M
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    k16 = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    kb0 = tl.program_id(2) * KB_SPLIT
    for kb in range(kb0, tl.minimum(kb0 + KB_SPLIT, nkb)):                          # 32-wide K blocks
        pairs = tl.load(B + cols[:, None].to(tl.int64) * (K // 2) + kb * 16 + k16[None, :], mask=in_n[:, None], other=0)
        a_at = A + rows[:, None].to(tl.int64) * K + kb * 32
        if INT8:
            lo, hi = _subnormal_units(pairs & 0xF, 2, 1), _subnormal_units(pairs >> 4, 2, 1)   # w · 2, [BLOCK_N, 16]
            # byte j holds k = 2j (low nibble) and 2j + 1 (high): joined back into k order
            w = tl.trans(tl.reshape(tl.join(lo, hi), (BLOCK_N, 32)).to(tl.int8))                # [32, BLOCK_N]
            a = _subnormal_units(tl.load(a_at + tl.arange(0, 32)[None, :], mask=in_m[:, None], other=0), 4, 3)
            exact = (tl.dot(_limb(a, 0), w, out_dtype=tl.int32) + 128 * tl.dot(_limb(a, 1), w, out_dtype=tl.int32)
                     + 16384 * tl.dot(_limb(a, 2), w, out_dtype=tl.int32))     # Σ a·2^9 · w·2 over [BLOCK_M, 32], exact
            partial = exact.to(tl.float32) * (2.0 ** -11 if FNUZ else 2.0 ** -10)        # one rounding, then exact
        else:
            a_even = _e4m3_decode(tl.load(a_at + 2 * k16[None, :], mask=in_m[:, None], other=0), FNUZ).to(tl.float16)
            a_odd = _e4m3_decode(tl.load(a_at + 2 * k16[None, :] + 1, mask=in_m[:, None], other=0), FNUZ).to(tl.float16)
            # byte j holds k = 2j (low nibble) and 2j + 1 (high): the even k against the low codes, the odd the high
            partial = tl.dot(a_odd, tl.trans(_e2m1_f16(pairs >> 4)),
                             tl.dot(a_even, tl.trans(_e2m1_f16(pairs & 0xF))))         # fp32 sums of exact products
        sa = tl.load(SA + rows * (K // 128) + (kb * 32) // 128, mask=in_m, other=0.0)
        sb = tl.load(SB + cols * (K // 32) + kb, mask=in_n, other=0.0)
        acc += (partial * sa[:, None]) * sb[None, :]                                     # as the reference, in order
    C += tl.program_id(2).to(tl.int64) * M * N
    tl.store(C + p[:, None].to(tl.int64) * N + cols[None, :], acc, mask=in_m[:, None] & in_n[None, :])


def fp4_gemm(a, sa, packed, sb, fnuz=False, int8=False):  # [M, K] e4m3, [M, K/128], [N, K/2] uint8, [N, K/32] -> [M, N] f32
    """quant.fp4_gemm: a as torch float8 (or its uint8 bytes), packed the checkpoint's FP4 pairs; int8: the
    int8 route (else fp16). K is split over programs where the output tiles alone would not fill the GPU
    (decode; never below 8 blocks of 32 a split), the splits' fp32 partial sums added after (the reference
    adds the 32-wide blocks in order: within fp32 rounding). Without a split the int8 route is the
    reference bit for bit."""
    M, K = a.shape
    N = packed.shape[0]
    if K % 128 or packed.shape != (N, K // 2) or sa.shape != (M, K // 128) or sb.shape != (N, K // 32):
        raise ValueError(f"fp4_gemm: a {tuple(a.shape)} (K a multiple of 128), scales {tuple(sa.shape)}, "
                         f"weights {tuple(packed.shape)}, scales {tuple(sb.shape)} do not agree")
    BLOCK_M, BLOCK_N = 16, 64
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    splits = max(1, min(triton.cdiv(2 * sm_count(a.device), tiles), K // 32 // 8))   # at least 8 blocks a split
    kb_split = triton.cdiv(K // 32, splits)
    splits = triton.cdiv(K // 32, kb_split)
    c = torch.empty(splits, M, N, dtype=torch.float32, device=a.device)
    _fp4_gemm_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), splits)](
        a.contiguous().view(torch.uint8), sa.float().contiguous(), packed.contiguous().view(torch.uint8),
        sb.float().contiguous(), c, c, c, M, N, K, kb_split, GROUPED=False, FNUZ=fnuz, INT8=bool(int8),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4, **pdl())
    return c[0] if splits == 1 else c.sum(0)


@triton.jit
def _fp4_gemv_kernel(A, SA, B, SB, C, ROWS, BLOCK_EXPERT, P, N, K, KT_SPLIT, BLOCK_M: tl.constexpr, FNUZ: tl.constexpr,
                     BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """_fp4_gemm_kernel's GROUPED mode for decode, where a routed row block holds a row or two and the rest is
    padding: no MMA (whose 16 rows would be mostly padding), one output row a program, the weights streamed
    64 bytes (K = 128, one activation scale) a row per step through the CUDA cores, each 32-wide block's
    partial an exact integer sum (the int8 route's integers) rounded once, the blocks added in order: bit
    for bit the reference without a K split. Program (p, j, s) sums the K tiles [s KT_SPLIT, (s + 1) KT_SPLIT)
    into C[s, p] (split K); a padding row (ROWS -1) does no work."""
    _await_inputs(PDL)
    p = tl.program_id(0)
    row = tl.load(ROWS + p)
    e = tl.load(BLOCK_EXPERT + p // BLOCK_M)
    live = tl.minimum(row, e) >= 0                                                     # a routed row of a used block
    B += tl.maximum(e, 0).to(tl.int64) * N * (K // 2)
    SB += tl.maximum(e, 0).to(tl.int64) * N * (K // 32)
    A += tl.maximum(row, 0).to(tl.int64) * K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    j = tl.arange(0, 64)                                                               # byte j: k = 2j, 2j + 1
    blk = tl.arange(0, 4)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    kt0 = tl.program_id(2) * KT_SPLIT
    kt1 = tl.where(live, tl.minimum(kt0 + KT_SPLIT, K // 128), kt0)
    for kt in range(kt0, kt1):                                                         # 128-wide K tiles
        pairs = tl.load(B + cols[:, None].to(tl.int64) * (K // 2) + kt * 64 + j[None, :], mask=in_n[:, None], other=0)
        a_even = _subnormal_units(tl.load(A + kt * 128 + 2 * j), 4, 3)                        # [64]: a · 2^9
        a_odd = _subnormal_units(tl.load(A + kt * 128 + 2 * j + 1), 4, 3)
        terms = _subnormal_units(pairs & 0xF, 2, 1) * a_even[None, :] + _subnormal_units(pairs >> 4, 2, 1) * a_odd[None, :]   # [BLOCK_N, 64]
        exact = tl.sum(tl.reshape(terms, (BLOCK_N, 4, 16)), axis=2)                   # [BLOCK_N, 4]: the 32-wide blocks
        partial = exact.to(tl.float32) * (2.0 ** -11 if FNUZ else 2.0 ** -10)
        sa = tl.load(SA + tl.maximum(row, 0) * (K // 128) + kt)
        sb = tl.load(SB + cols[:, None] * (K // 32) + kt * 4 + blk[None, :], mask=in_n[:, None], other=0.0)
        t = (partial * sa) * sb
        for i in tl.static_range(4):                                                   # the blocks in order
            acc += tl.sum(tl.where(blk[None, :] == i, t, 0.0), axis=1)
    # a routed row of an unused block (an expert on another rank) gets zeros, as from the MMA kernel; the
    # row test as a vector (the interpreter takes no scalar mask)
    tl.store(C + (tl.program_id(2).to(tl.int64) * P + p) * N + cols, acc, mask=in_n & (tl.zeros_like(cols) + row >= 0))


def fp4_moe_gemm(a, sa, packed, sb, rows, block_expert, fnuz=False, gemv=None, int8=False):
    """The routed experts' FP4 GEMM, grouped as kernels_fp8.moe_gemm: a [R, K] e4m3, sa [R, K/128],
    packed [E, N, K/2] uint8, sb [E, N, K/32], rows [P] int32 (-1 padding), block_expert [P / 16] int32
    (-1 unused) -> [P, N] float32 (padding rows: unspecified; a routed row of an unused block: 0).
    Reference: quant.fp4_gemm on each row block's expert. gemv (None: chosen from the shapes) picks
    _fp4_gemv_kernel, for decode: route() pads each used expert to 16 rows, so P = pairs + 15 min(pairs, E)
    rounded up, and P <= 16 E + 16 means about one routed row an expert, where the MMA's 16-row tiles would
    be mostly padding (measured at 1 and 32 tokens of V4-Flash: 176 against 255 us, 3.9 against 4.7 ms;
    the crossover, from those costs a row and an expert, near 1.2 E pairs). Otherwise the MMA kernel, int8:
    its int8 route, else fp16. The GEMV and the int8 route are bit for bit the reference where K is not
    split (the MMA kernel never splits it here; the GEMV does for decode's few rows at K >= 512)."""
    R, K = a.shape
    E, N = packed.shape[:2]
    P = rows.shape[0]
    BLOCK_M, BLOCK_N = 16, 64
    if K % 128 or packed.shape != (E, N, K // 2) or sb.shape != (E, N, K // 32) or P % BLOCK_M \
            or block_expert.shape != (P // BLOCK_M,):
        raise ValueError(f"fp4_moe_gemm: a {tuple(a.shape)}, weights {tuple(packed.shape)}, scales {tuple(sb.shape)}, "
                         f"rows {tuple(rows.shape)}, block_expert {tuple(block_expert.shape)} do not agree")
    a, sa = a.contiguous().view(torch.uint8), sa.float().contiguous()
    packed, sb = packed.contiguous().view(torch.uint8), sb.float().contiguous()
    rows, block_expert = rows.to(torch.int32).contiguous(), block_expert.to(torch.int32).contiguous()
    use_gemv = P <= 16 * E + 16 if gemv is None else gemv
    if use_gemv:
        used = min(P // BLOCK_M, E) * triton.cdiv(N, BLOCK_N)                     # programs with work, about
        splits = max(1, min(triton.cdiv(4 * sm_count(a.device), used), K // 128 // 4))   # 4 tiles a split at least
        kt_split = triton.cdiv(K // 128, splits)
        splits = triton.cdiv(K // 128, kt_split)
        c = torch.empty(splits, P, N, dtype=torch.float32, device=a.device)
        _fp4_gemv_kernel[(P, triton.cdiv(N, BLOCK_N), splits)](
            a, sa, packed, sb, c, rows, block_expert, P, N, K, kt_split, BLOCK_M=BLOCK_M, FNUZ=fnuz, BLOCK_N=BLOCK_N,
            num_warps=4, **pdl())
        return c[0] if splits == 1 else c.sum(0)
    c = torch.empty(P, N, dtype=torch.float32, device=a.device)
    _fp4_gemm_kernel[(P // BLOCK_M, triton.cdiv(N, BLOCK_N), 1)](
        a, sa, packed, sb, c, rows, block_expert, P, N, K, K // 32, GROUPED=True, FNUZ=fnuz, INT8=bool(int8),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4, **pdl())
    return c


# -----------------------------------------------------------------------------
# attention_v4.sparse_attention_ref: shared-KV attention with a sink over listed and dense keys.
# Exact numerics: a split softmax in two launches (each split's max, then with the max over splits the
# sums Σ e and Σ e κ), the splits combined in torch; decode's few queries split over the keys.
# Official numerics round each probability against the running max of the blocks of 64 columns seen so
# far (attention_v4.blocked_attention_ref): one program walks a query's whole list in order, unsplit,
# since a split would round its first block against its own max instead.

BLOCK = 64  # attention_v4.BLOCK: the official kernel's columns a block

@triton.jit
def _query_keys(KW, KC, IDX, bt, b, v, v1, P, NC, KSEL, C: tl.constexpr):
    """The rows of [KW | KC] that columns v of query bt's list name: v < KSEL the listed row IDX[v], then
    KC[v - KSEL] (the dense keys); -> κ [BS, c], ok [BS] (False: -1, or past v1)."""
    cs = tl.arange(0, C)
    listed = v < KSEL
    row = tl.load(IDX + bt.to(tl.int64) * KSEL + v, mask=listed & (v < v1), other=-1)
    row = tl.where(listed, row, P + v - KSEL)                                        # dense: KC[v - KSEL]
    ok = (v < v1) & (row >= 0)
    in_w = row < P
    kw = tl.load(KW + (b * P + row[:, None]).to(tl.int64) * C + cs[None, :], mask=(ok & in_w)[:, None], other=0.0)
    kc = tl.load(KC + (b * NC + row[:, None] - P).to(tl.int64) * C + cs[None, :], mask=(ok & ~in_w)[:, None],
                 other=0.0)
    return kw + kc, ok


@triton.jit
def _sink_attention_kernel(Q, KW, KC, IDX, ND, MX, L, ACC, T, H, P, NC, KSEL, CHUNK, scale,
                           C: tl.constexpr, PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Reference: attention_v4.sparse_attention_ref (exact numerics). One program per (query, BLOCK_H
    heads, split); the split covers CHUNK of the query's columns. PASS 1 stores the split's max logit in
    MX [B T, H, splits]; PASS 2 reads the row's max from MX [B T, H] (the max over splits, made by the
    caller) and stores Σ e and Σ e κ (e = exp(z - m))."""
    _await_inputs(PDL)
    bt = tl.program_id(0)
    b, t = bt // T, bt % T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    cs = tl.arange(0, C)
    in_h = h < H
    q = tl.load(Q + (bt * H + h[:, None]).to(tl.int64) * C + cs[None, :], mask=in_h[:, None], other=0.0)   # [BH, c]
    v0 = split * CHUNK
    v1 = tl.minimum(v0 + CHUNK, KSEL + tl.load(ND + t))
    if PASS == 1:
        mx = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    else:
        mx = tl.load(MX + bt * H + h, mask=in_h, other=0.0)                          # the row's max [BH]
        l = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, C), tl.float32)
    for s0 in range(v0, v1, BLOCK_S):
        k, ok = _query_keys(KW, KC, IDX, bt, b, s0 + tl.arange(0, BLOCK_S), v1, P, NC, KSEL, C)
        z = tl.dot(q, tl.trans(k), input_precision="ieee")
        z = tl.where(ok[None, :], z * scale, float("-inf"))                          # [BH, BS]
        if PASS == 1:
            mx = tl.maximum(mx, tl.max(z, 1))
        else:
            e = tl.exp(z - mx[:, None])                                              # 0 where masked
            l += tl.sum(e, 1)
            acc = tl.dot(e, k, acc, input_precision="ieee")
    part = (bt * H + h) * tl.num_programs(2) + split                                 # [B T, H, splits]
    if PASS == 1:
        tl.store(MX + part, mx, mask=in_h)
    else:
        tl.store(L + part, l, mask=in_h)
        tl.store(ACC + part[:, None].to(tl.int64) * C + cs[None, :], acc, mask=in_h[:, None])


@triton.jit
def _blocked_attention_kernel(Q, KW, KC, IDX, ND, SINK, O, T, H, P, NC, KSEL, scale, C: tl.constexpr,
                              BF16: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    """Reference: attention_v4.blocked_attention_ref (official numerics). One program per (query, BLOCK_H
    heads) walks the query's columns BLOCK at a time in list order, each block in BLOCK_S-column tiles
    twice: first its max (the running max m), then e = exp(z - m), Σ e and bf16(e) κ into the
    accumulator rescaled by exp(m_old - m); the sink after the last block; o = bf16(acc / l)."""
    _await_inputs(PDL)
    bt = tl.program_id(0)
    b, t = bt // T, bt % T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cs = tl.arange(0, C)
    in_h = h < H
    q = tl.load(Q + (bt * H + h[:, None]).to(tl.int64) * C + cs[None, :], mask=in_h[:, None], other=0.0)   # [BH, c]
    if BF16:
        q = q.to(tl.bfloat16)
    nv = KSEL + tl.load(ND + t)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, C), tl.float32)
    for j0 in range(0, nv, BLOCK):
        mb = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        for s0 in range(j0, j0 + BLOCK, BLOCK_S):                                    # the block's max
            k, ok = _query_keys(KW, KC, IDX, bt, b, s0 + tl.arange(0, BLOCK_S), nv, P, NC, KSEL, C)
            if BF16:
                z = tl.dot(q, tl.trans(k.to(tl.bfloat16)), out_dtype=tl.float32)
            else:
                z = tl.dot(q, tl.trans(k), input_precision="ieee")
            mb = tl.maximum(mb, tl.max(tl.where(ok[None, :], z * scale, float("-inf")), 1))
        m_new = tl.maximum(m, mb)
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)                            # no key yet: nothing to scale
        a = tl.exp(m - ref)
        acc = acc * a[:, None]
        ls = tl.zeros((BLOCK_H,), tl.float32)
        for s0 in range(j0, j0 + BLOCK, BLOCK_S):                                    # its sums, against m
            k, ok = _query_keys(KW, KC, IDX, bt, b, s0 + tl.arange(0, BLOCK_S), nv, P, NC, KSEL, C)
            if BF16:
                k = k.to(tl.bfloat16)
                z = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
            else:
                z = tl.dot(q, tl.trans(k), input_precision="ieee")
            e = tl.exp(tl.where(ok[None, :], z * scale, float("-inf")) - ref[:, None])   # [BH, BS], 0 where masked
            ls += tl.sum(e, 1)
            if BF16:
                acc = tl.dot(e.to(tl.bfloat16), k, acc, out_dtype=tl.float32)
            else:
                acc = tl.dot(_bf16_round(e), k, acc, input_precision="ieee")
        l = l * a + ls
        m = m_new
    l += tl.exp(tl.load(SINK + h, mask=in_h, other=0.0) - tl.where(m > float("-inf"), m, 0.0))
    o = _bf16_round(acc / l[:, None])
    tl.store(O + (bt * H + h[:, None]).to(tl.int64) * C + cs[None, :], o, mask=in_h[:, None])


def sparse_attention(q, KW, KC, idx, n_dense, sink, scale, official=False, splits=None, n_max=None):
    """attention_v4.sparse_attention_ref: q [B, T, H, c], KW [B, P, c], KC [B, n, c], idx [B, T, K] int
    (-1 padded), n_dense [T] int, sink [H] -> o [B, T, H, c] float32 (bf16 values when official).
    splits (exact numerics): programs per (query, head block) over its keys (default: enough to fill the
    GPU); n_max: a bound on n_dense known to the caller (else read from the device: a sync, not capturable)."""
    B, T, H, c = q.shape
    K = idx.shape[-1]
    if c & (c - 1) or KW.shape[::2] != (B, c) or KC.shape[::2] != (B, c) or idx.shape[:2] != (B, T) \
            or n_dense.shape != (T,) or sink.shape != (H,):
        raise ValueError(f"sparse_attention: q {tuple(q.shape)} (c a power of two), KW {tuple(KW.shape)}, "
                         f"KC {tuple(KC.shape)}, idx {tuple(idx.shape)}, n_dense {tuple(n_dense.shape)}, "
                         f"sink {tuple(sink.shape)} do not agree")
    dev = q.device
    BLOCK_H, BLOCK_S = 16, (32 if c <= 128 else 16)                               # [16, c] tiles: q, κ, acc
    hb = triton.cdiv(H, BLOCK_H)
    args = (q.float().contiguous(), KW.float().contiguous(), KC.float().contiguous(),
            idx.to(torch.int32).contiguous(), n_dense.to(torch.int32).contiguous())
    if official:
        o = torch.empty(B, T, H, c, dtype=torch.float32, device=dev)
        bf16 = not _interpreted()                                                  # bf16 values: exact products
        _blocked_attention_kernel[(B * T, hb)](*args, sink.float().contiguous(), o, T, H, KW.shape[1], KC.shape[1], K,
                                               float(scale), C=c, BF16=bf16, BLOCK=BLOCK, BLOCK_H=BLOCK_H,
                                               BLOCK_S=BLOCK_S, num_warps=8 if c > 128 else 4, **pdl())
        return o
    n_max = (int(n_dense.max()) if T else 0) if n_max is None else n_max
    keys = K + n_max                                                              # the longest query's keys
    if splits is None:
        splits = max(1, min(triton.cdiv(keys, BLOCK_S), triton.cdiv(2 * sm_count(dev), B * T * hb)))  # 2 programs an SM
    chunk = triton.cdiv(triton.cdiv(max(keys, 1), splits), BLOCK_S) * BLOCK_S
    splits = triton.cdiv(max(keys, 1), chunk)
    mx = torch.empty(B * T, H, splits, dtype=torch.float32, device=dev)
    l = torch.empty(B * T, H, splits, dtype=torch.float32, device=dev)
    acc = torch.empty(B * T, H, splits, c, dtype=torch.float32, device=dev)
    meta = dict(C=c, BLOCK_H=BLOCK_H, BLOCK_S=BLOCK_S, num_warps=8 if c > 128 else 4)
    grid = (B * T, hb, splits)
    _sink_attention_kernel[grid](*args, mx, l, acc, T, H, KW.shape[1], KC.shape[1], K, chunk, float(scale), PASS=1,
                                 **meta, **pdl())
    sink = sink.float()
    m = torch.maximum(mx.amax(-1), sink[None])                                     # [B T, H]
    _sink_attention_kernel[grid](*args, m.contiguous(), l, acc, T, H, KW.shape[1], KC.shape[1], K, chunk,
                                 float(scale), PASS=2, **meta, **pdl())
    o = acc.sum(2) / (l.sum(2) + torch.exp(sink[None] - m))[..., None]               # [B T, H, c]
    return o.reshape(B, T, H, c)


# -----------------------------------------------------------------------------
# compressor.index_scores_v4_ref: the CSA indexer's scores over compressed keys, eq. (16), with V4's
# causal rule (key w once its window of m tokens is complete) applied here: -inf beyond it, so that
# kernels_cuda.topk_indices can pick from the scores as they are.

@triton.jit
def _index_scores_v4_kernel(Q, W, KI, I, T, J, N, start_pos, m, D: tl.constexpr, OFFICIAL: tl.constexpr,
                            BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                            PDL: tl.constexpr = False):
    """Reference: compressor.index_scores_v4_ref (then -inf where w >= (start_pos + t + 1) // m). One
    program per (batch row, BLOCK_T queries, BLOCK_N keys); the heads in order, summed in fp32."""
    _await_inputs(PDL)
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    w_ = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ds = tl.arange(0, D)
    in_t = t < T
    vis = (start_pos + t + 1) // m                                                # complete windows [BLOCK_T]
    I_ptr = I + (b * T + t[:, None]).to(tl.int64) * N + w_[None, :]
    if tl.program_id(2) * BLOCK_N >= tl.max(tl.where(in_t, vis, 0), 0):          # no query sees this block
        tl.store(I_ptr, tl.full((BLOCK_T, BLOCK_N), float("-inf"), tl.float32), mask=in_t[:, None] & (w_[None, :] < N))
    else:
        k = tl.load(KI + (b * N + w_[:, None]).to(tl.int64) * D + ds[None, :], mask=(w_ < N)[:, None], other=0.0)
        if BF16:
            k = k.to(tl.bfloat16)
        acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
        for j in range(J):
            q = tl.load(Q + ((b * T + t[:, None]) * J + j).to(tl.int64) * D + ds[None, :], mask=in_t[:, None], other=0.0)
            wj = tl.load(W + (b * T + t) * J + j, mask=in_t, other=0.0)               # [BLOCK_T]
            if BF16:
                qk = tl.dot(q.to(tl.bfloat16), tl.trans(k), out_dtype=tl.float32)
            else:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")                   # [BLOCK_T, BLOCK_N]
            if OFFICIAL:
                acc += _bf16_round(tl.maximum(_bf16_round(qk), 0.0) * wj[:, None])
            else:
                acc += tl.maximum(qk, 0.0) * wj[:, None]
        if OFFICIAL:
            acc = _bf16_round(acc)
        acc = tl.where(w_[None, :] < vis[:, None], acc, float("-inf"))
        tl.store(I_ptr, acc, mask=in_t[:, None] & (w_[None, :] < N))


@triton.jit
def _index_scores_v4_decode_kernel(Q, W, KI, I, T, J, N, start_pos, m, D: tl.constexpr, OFFICIAL: tl.constexpr,
                                   BF16: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr,
                                   PDL: tl.constexpr = False):
    """Reference: compressor.index_scores_v4_ref, for a few queries: one program per (query, BLOCK_N keys),
    all heads as the rows of one MMA, the heads summed as a tree (in fp32; not the reference's order)."""
    _await_inputs(PDL)
    bt = tl.program_id(0)
    t = bt % T
    b = bt // T
    w_ = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    js = tl.arange(0, BLOCK_J)
    ds = tl.arange(0, D)
    vis = (start_pos + t + 1) // m
    I_ptr = I + bt.to(tl.int64) * N + w_
    if tl.program_id(1) * BLOCK_N >= vis:
        tl.store(I_ptr, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=w_ < N)
    else:
        q = tl.load(Q + (bt * J + js[:, None]).to(tl.int64) * D + ds[None, :], mask=(js < J)[:, None], other=0.0)
        wj = tl.load(W + bt * J + js, mask=js < J, other=0.0)                       # [BLOCK_J]
        k = tl.load(KI + (b * N + w_[:, None]).to(tl.int64) * D + ds[None, :], mask=(w_ < N)[:, None], other=0.0)
        if BF16:
            qk = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)), out_dtype=tl.float32)
        else:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")                     # [BLOCK_J, BLOCK_N]
        if OFFICIAL:
            acc = _bf16_round(tl.sum(_bf16_round(tl.maximum(_bf16_round(qk), 0.0) * wj[:, None]), 0))
        else:
            acc = tl.sum(tl.maximum(qk, 0.0) * wj[:, None], 0)
        tl.store(I_ptr, tl.where(w_ < vis, acc, float("-inf")), mask=w_ < N)


def index_scores_v4(q, w, K_idx, start_pos, m=4, official=False):
    """compressor.index_scores_v4_ref with the causal rule: q [B, T, J, D], w [B, T, J], K_idx [B, n, D]
    -> I [B, T, n] float32, -inf where key w's window is not complete at query t (w >= (start_pos+t+1)//m).
    Fewer than 16 queries (decode): the heads as the MMA's rows, summed as a tree (official numerics:
    within fp32 rounding of the reference's head-order sum, then bf16); more: BLOCK_T queries a head at
    a time, the heads summed in order, as the reference (bit for bit in official numerics)."""
    B, T, J, D = q.shape
    n = K_idx.shape[1]
    if D & (D - 1) or w.shape != (B, T, J) or K_idx.shape != (B, n, D):
        raise ValueError(f"index_scores_v4: q {tuple(q.shape)} (D a power of two), w {tuple(w.shape)}, "
                         f"keys {tuple(K_idx.shape)} do not agree")
    out = torch.empty(B, T, n, dtype=torch.float32, device=q.device)
    BLOCK_T, BLOCK_N = 16, 64
    bf16 = bool(official) and not _interpreted()
    if n and T < 16:
        _index_scores_v4_decode_kernel[(B * T, triton.cdiv(n, BLOCK_N))](
            q.float().contiguous(), w.float().contiguous(), K_idx.float().contiguous(), out, T, J, n, int(start_pos),
            m, D=D, OFFICIAL=bool(official), BF16=bf16, BLOCK_J=max(16, triton.next_power_of_2(J)), BLOCK_N=BLOCK_N,
            num_warps=4, **pdl())
    elif n:
        _index_scores_v4_kernel[(B, triton.cdiv(T, BLOCK_T), triton.cdiv(n, BLOCK_N))](
            q.float().contiguous(), w.float().contiguous(), K_idx.float().contiguous(), out, T, J, n, int(start_pos),
            m, D=D, OFFICIAL=bool(official), BF16=bf16, BLOCK_T=BLOCK_T,
            BLOCK_N=BLOCK_N, num_warps=4, **pdl())
    return out
