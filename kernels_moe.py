"""Triton kernels for the bookkeeping around the routed experts (DeepSeek-V3 report §2.1.2, eqs. (12)-(16)):
what a decode step of a MoE layer ran as about forty small torch kernels (sorts, scatters, cumsums,
gathers, a loop of multiply-adds) in three launches. kernels_cuda.py and kernels_rocm.py re-export them
(nothing here depends on the architecture); backend_torch.moe and moe_v4 call them on the path of the
grouped expert GEMMs (official numerics, quantised experts stacked at load).

    gate_topk    eq. (16)'s choice: the top-K experts by s + b within the best topk_group groups (a group
                 scores its top-2 biased scores' sum, its top-1 without a bias), ties toward the lower
                 index; their weights s / sum s * routed_scaling_factor, eqs. (13)-(14). One program a token.
                                                    reference: moe.gate_ref after the scores (backend_torch.gate)
    route        the grouped GEMM's rows: the token-expert pairs sorted by expert (stable) and padded to
                 16-row blocks of one expert. One program for all pairs (a decode step's few hundred).
                                                    reference: backend_torch.route
    moe_combine  eq. (12)'s sum: each token's expert outputs times their weights added in fp32 in expert-id
                 order, then the shared expert's output, then the bf16 rounding of official numerics: the
                 reference's additions in the reference's order, bit for bit.
                                                    reference: moe.moe_ref's accumulation (backend_torch.weighted_sum)
"""
import torch
import triton
import triton.language as tl

from kernels_fp8 import _await_inputs, _bf16_round, pdl

ROUTE_MAX = 2048                                       # the most token-expert pairs route takes in its one program


# -----------------------------------------------------------------------------
# eqs. (13)-(16): the choice of experts and their weights, from the scores s [M, E]

@triton.jit
def _gate_topk_kernel(S, BIAS, W, IDX, E, scale, HAS_BIAS: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr,
                      K: tl.constexpr, NORM: tl.constexpr, E_P: tl.constexpr, G_P: tl.constexpr, K_P: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Reference: moe.gate_ref from its scores on (backend_torch.gate). One program a token: its E scores
    in registers, every choice a max and then the lowest index holding it (a stable sort's tie rule)."""
    _await_inputs(PDL)
    m = tl.program_id(0)
    e = tl.arange(0, E_P)
    ok = e < E
    s = tl.load(S + m.to(tl.int64) * E + e, mask=ok, other=0.0)                      # s_{i,t}
    if HAS_BIAS:
        choice = s + tl.load(BIAS + e, mask=ok, other=0.0)                           # s_{i,t} + b_i: choice only
    else:
        choice = s
    if G > 1:                                                        # group-limited: the best TOPK_GROUP groups
        g = tl.arange(0, G_P)
        in_g = ((e[None, :] // (E // G)) == g[:, None]) & ok[None, :]                # [G_P, E_P]
        c2 = tl.where(in_g, choice[None, :], float("-inf"))
        top1 = tl.max(c2, 1)                                                          # [G_P]
        if HAS_BIAS and E // G > 1:                                  # + the group's second best (top-1 removed once)
            first = tl.min(tl.where(c2 == top1[:, None], e[None, :], E_P), 1)
            score = tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), c2), 1) + top1
        else:                                                        # (a group of one: its top-2 is its top-1)
            score = top1
        kept = g < 0
        for _ in tl.static_range(TOPK_GROUP):                        # the best left, ties toward the lower group
            live = (g < G) & ~kept
            best = tl.max(tl.where(live, score, float("-inf")), 0)
            kept = kept | (g == tl.min(tl.where(live & (score == best), g, G_P), 0))
        choice = tl.where(tl.max(tl.where(in_g & kept[:, None], 1, 0), 0) > 0, choice, float("-inf"))
    k = tl.arange(0, K_P)
    idx = tl.zeros((K_P,), tl.int32)                                                  # [K_P], best first
    w = tl.zeros((K_P,), tl.float32)
    total = tl.zeros((), tl.float32)
    avail = ok
    for j in tl.static_range(K):                                     # the best left, ties toward the lower index
        best = tl.max(tl.where(avail, choice, float("-inf")), 0)
        i = tl.min(tl.where(avail & (choice == best), e, E_P), 0)
        s_i = tl.sum(tl.where(e == i, s, 0.0), 0)                                     # its s, not s + b
        idx = tl.where(k == j, i, idx)
        w = tl.where(k == j, s_i, w)
        total = total + s_i                                          # summed in this order, as backend_torch.gate_weights
        avail = avail & (e != i)
    if NORM:
        w = tl.div_rn(w, total)                                                       # eq. (14), no epsilon
    tl.store(W + m * K + k, w * scale, mask=k < K)
    tl.store(IDX + m * K + k, idx.to(tl.int64), mask=k < K)


def gate_topk(s, bias, k, n_group=1, topk_group=1, norm=True, scale=1.0):
    """s [M, E] float32 scores (sigmoid or softmax of the router's logits), bias [E] or None -> w [M, k]
    float32, idx [M, k] int64 (best first): moe.gate_ref's choice (the same, from the same scores) and
    weights (the k scores summed best first, as backend_torch.gate_weights: bit for bit that, within
    fp32 rounding of NumPy's pairwise sum)."""
    M, E = s.shape
    if E % n_group or k > E or topk_group > n_group:
        raise ValueError(f"gate_topk: {E} experts in {n_group} groups, top-{k} of the best {topk_group} groups")
    w = torch.empty(M, k, dtype=torch.float32, device=s.device)
    idx = torch.empty(M, k, dtype=torch.int64, device=s.device)
    if M:
        b = bias.float().contiguous() if bias is not None else s
        _gate_topk_kernel[(M,)](s.float().contiguous(), b, w, idx, E, float(scale), HAS_BIAS=bias is not None, G=n_group,
                                TOPK_GROUP=topk_group, K=k, NORM=norm, E_P=triton.next_power_of_2(E),
                                G_P=triton.next_power_of_2(n_group), K_P=triton.next_power_of_2(k), num_warps=2,
                                **pdl())
    return w, idx


# -----------------------------------------------------------------------------
# The grouped GEMM's rows: pairs sorted by expert, each expert's run padded to whole blocks

@triton.jit
def _route_kernel(IDX, ROWS, PAIR_AT, BLOCK_EXPERT, n, Kt, P, BM: tl.constexpr, E_P: tl.constexpr, CH: tl.constexpr,
                  FILL: tl.constexpr, PDL: tl.constexpr = False):
    """Reference: backend_torch.route. One program for all n pairs: the padding first, then the pairs
    per expert (a one-hot [CH, E_P] sum) and each expert's first row, then the pairs CH at a time, each
    to its expert's first row + the pairs of that expert before it (earlier chunks: seen; this chunk:
    a [CH, CH] comparison)."""
    _await_inputs(PDL)
    for p0 in range(0, P, FILL):                                     # padding rows: no token, the trash pair n
        rp = p0 + tl.arange(0, FILL)
        tl.store(ROWS + rp, tl.full((FILL,), -1, tl.int32), mask=rp < P)
        tl.store(PAIR_AT + rp, tl.full((FILL,), 0, tl.int64) + n, mask=rp < P)
        tl.store(BLOCK_EXPERT + rp, tl.full((FILL,), -1, tl.int32), mask=rp < P // BM)   # unused blocks
    bins = tl.arange(0, E_P)
    counts = tl.zeros((E_P,), tl.int32)                              # pairs per expert
    for c0 in range(0, n, CH):
        i = c0 + tl.arange(0, CH)
        ex = tl.load(IDX + i, mask=i < n, other=E_P).to(tl.int32)                   # [CH] experts (E_P: none)
        counts += tl.sum((ex[:, None] == bins[None, :]).to(tl.int32), 0)
    padded = (counts + BM - 1) // BM * BM
    start = tl.cumsum(padded, 0) - padded                            # each expert's first row
    tl.debug_barrier()                                               # the fills above, before the rows below
    seen = tl.zeros((E_P,), tl.int32)                                # pairs of each expert placed so far
    j = tl.arange(0, CH)
    for c0 in range(0, n, CH):
        i = c0 + j
        live = i < n
        ex = tl.load(IDX + i, mask=live, other=E_P).to(tl.int32)                    # [CH]
        hit = ex[:, None] == bins[None, :]                                            # [CH, E_P]
        before = tl.sum(((ex[None, :] == ex[:, None]) & (j[None, :] < j[:, None])).to(tl.int32), 1)  # [CH]: same
        dest = tl.sum(tl.where(hit, (start + seen)[None, :], 0), 1) + before          # expert, earlier in the chunk
        tl.store(ROWS + dest, (i // Kt).to(tl.int32), mask=live)
        tl.store(PAIR_AT + dest, i.to(tl.int64), mask=live)
        tl.store(BLOCK_EXPERT + dest // BM, ex, mask=live)
        seen += tl.sum(hit.to(tl.int32), 0)


def route(idx, E, bm):
    """[M, Kt] expert ids in 0..E-1 -> rows_tok [P] int32 (-1: padding), pair_at [P] int64 (padding: M*Kt),
    block_expert [P / bm] int32 (-1: unused): backend_torch.route's tables, in one launch, for at most
    ROUTE_MAX pairs."""
    M, Kt = idx.shape
    pairs = M * Kt
    if pairs > ROUTE_MAX:
        raise ValueError(f"route: {pairs} token-expert pairs; one program takes at most {ROUTE_MAX}")
    P = -(-(pairs + min(pairs, E) * (bm - 1)) // bm) * bm
    rows = torch.empty(P, dtype=torch.int32, device=idx.device)
    pair_at = torch.empty(P, dtype=torch.int64, device=idx.device)
    block_expert = torch.empty(P // bm, dtype=torch.int32, device=idx.device)
    _route_kernel[(1,)](idx.contiguous(), rows, pair_at, block_expert, pairs, Kt, P, BM=bm,
                        E_P=triton.next_power_of_2(E + 1), CH=32, FILL=1024, num_warps=4, **pdl())
    return rows, pair_at, block_expert


# -----------------------------------------------------------------------------
# eq. (12): h'_t = u_t + sum_i g_{i,t} FFN^r_i(u_t) + FFN^s(u_t), the routed part in expert-id order

@triton.jit
def _moe_combine_kernel(OUT, W, IDX, SHARED, Y, d, KT: tl.constexpr, KT_P: tl.constexpr, BLOCK: tl.constexpr,
                        ROUND: tl.constexpr, PDL: tl.constexpr = False):
    """Reference: backend_torch.weighted_sum + the shared part + bf16_round (moe.moe_ref's order). One
    program a token and BLOCK columns: its slots ranked by expert id (ties: slot order), then added."""
    _await_inputs(PDL)
    m, cb = tl.program_id(0), tl.program_id(1)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    okc = cols < d
    k = tl.arange(0, KT_P)
    ex = tl.load(IDX + m * KT + k, mask=k < KT, other=2 ** 31 - 1)                # padding: after every expert
    w = tl.load(W + m * KT + k, mask=k < KT, other=0.0)
    earlier = (ex[None, :] < ex[:, None]) | ((ex[None, :] == ex[:, None]) & (k[None, :] < k[:, None]))
    rank = tl.sum(earlier.to(tl.int32), 1)                           # slot k's place in expert-id order
    y = tl.zeros((BLOCK,), tl.float32)
    for r in tl.static_range(KT):
        slot = tl.sum(tl.where(rank == r, k, 0), 0)
        g = tl.sum(tl.where(k == slot, w, 0.0), 0)
        o = tl.load(OUT + (m * KT + slot).to(tl.int64) * d + cols, mask=okc, other=0.0)
        y = y + o * g                                                # a product, then a sum: both rounded (no FMA)
    y = y + tl.load(SHARED + m.to(tl.int64) * d + cols, mask=okc, other=0.0)
    if ROUND:
        y = _bf16_round(y)
    tl.store(Y + m.to(tl.int64) * d + cols, y, mask=okc)


def moe_combine(out, w, idx, shared, official):
    """out [M, Kt, d] the routed experts' outputs, w [M, Kt] their weights, idx [M, Kt] their experts,
    shared [M, d] the shared experts' output -> [M, d] float32: sum over each token's experts in id
    order of out * w (fp32), + shared, bf16-rounded in official numerics (moe.moe_ref's order)."""
    M, Kt, d = out.shape
    y = torch.empty(M, d, dtype=torch.float32, device=out.device)
    BLOCK = min(1024, triton.next_power_of_2(d))
    if M:
        _moe_combine_kernel[(M, triton.cdiv(d, BLOCK))](out.float().contiguous(), w.float().contiguous(), idx.contiguous(),
                                                         shared.float().contiguous(), y, d, KT=Kt,
                                                         KT_P=triton.next_power_of_2(Kt), BLOCK=BLOCK, ROUND=official,
                                                         num_warps=4, enable_fp_fusion=False, **pdl())
    return y
