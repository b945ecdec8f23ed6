"""Lightning indexer and fine-grained token selection (DeepSeek-V3.2-Exp paper §2.1, eqs. (1)-(2)),
and the indexer's training objectives (§2.1, eqs. (3)-(4)).

    eq. (1)  I_{t,s} = sum_j w^I_{t,j} ReLU(q^I_{t,j} . k^I_s)
    eq. (2)  u_t = Attn(h_t, {c_s | I_{t,s} in Top-k(I_{t,:})})

Letters: B batch, T query tokens, S keys (cached + new), J indexer heads (H^I), D indexer head dim
(d^I), R rotary dims, K = index_topk. Indices follow the paper: t is the query, s the key (the
official code writes m/n or s/t for them).

Two precisions of one computation:
- fp8 (the official numerics): q and k are Hadamard-rotated, then FP8-quantized with ue8m0 scales
  (q one scale per head, k one per token); the key cache holds FP8 codes and their scales.
- exact (what transformers computes): float32 q and k, no rotation (it is orthogonal, so exact
  scores are the same), unit scales.
"""
import functools

import numpy as np

import quant
import rope


# -----------------------------------------------------------------------------
# not in paper: the Hadamard rotation before FP8 (official `rotate_activation`), which spreads
# outliers across the 128 dims so one ue8m0 scale per head loses less

@functools.lru_cache(maxsize=None)
def hadamard_matrix(n):  # -> [n, n] float64 Sylvester matrix, H[i, j] = (-1)^popcount(i & j)
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    i = np.arange(n)
    bits = np.bitwise_and(i[:, None], i[None, :])
    parity = np.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    H = (1 - 2 * parity).astype(np.float64)
    H.flags.writeable = False                     # cached: shared by every call
    return H


def rotate_activation_ref(x):  # [..., D] -> [..., D] float32, (x @ H) * D**-0.5 (H is symmetric)
    D = x.shape[-1]
    y = np.asarray(x, np.float64) @ hadamard_matrix(D)
    return (y * D ** -0.5).astype(np.float32)


# -----------------------------------------------------------------------------
# eq. (1): index scores

def index_scores_ref(q, w, k, k_scale):  # [B, T, J, D], [B, T, J], [B, S, D], [B, S] -> [B, T, S] f32
    """I[b,t,s] = k_scale[b,s] * sum_j w[b,t,j] * ReLU(q[b,t,j] . k[b,s]).
    q, k are FP8 codes (their dot products are exact in float64, then fp32 as the tensor-core
    accumulator) or float32; w carries the q scales and the folded constants."""
    B, T, J, D = q.shape
    dt = np.float32 if q.dtype == np.float32 else np.float64             # fp8 products: exact in float64
    qk = quant.decode(q, dt).reshape(B, T * J, D) @ quant.decode(k, dt).transpose(0, 2, 1)  # [B, T*J, S]
    qk = qk.astype(np.float32).reshape(B, T, J, -1)                     # q^I_{t,j} . k^I_s
    relu = np.maximum(qk, np.float32(0))                                # ReLU per head, before w
    I = np.einsum("btj,btjs->bts", np.asarray(w, np.float32), relu)      # eq. (1), sum over heads
    return (I * np.asarray(k_scale, np.float32)[:, None, :]).astype(np.float32)  # key scale last
# not in paper: w arrives as weights_proj(x) * J**-0.5 * q_scale * D**-0.5 (official Indexer.forward)


# -----------------------------------------------------------------------------
# eq. (2): causal top-k selection

def causal_ref(T, start_pos, S=None, ratio=1):  # -> [T, S] bool: key s visible to query t
    """V3.2: every key up to the query, s <= start_pos + t. V4's compressed keys (ratio m, one key per
    window of m tokens): only complete windows, s < floor((start_pos + t + 1) / m); m = 1 is V3.2's rule."""
    S = (start_pos + T) // ratio if S is None else S
    return np.arange(S)[None, :] < (start_pos + np.arange(T) + 1)[:, None] // ratio


def topk_order_ref(I, K, start_pos, ratio=1):  # [B, T, S] f32, top-k, offset -> [B, T, min(K, S)] int
    """Eq. (2)'s choice as a list, best first: min(K, S) keys per query among the causal ones (causal_ref:
    key s <= start_pos + t, or V4's complete windows of `ratio` tokens), ties toward the lower key index
    (a stable sort, as torch.topk on CUDA orders them), -1 where a query has fewer causal keys."""
    B, T, S = I.shape
    causal = np.broadcast_to(causal_ref(T, start_pos, S, ratio)[None], (B, T, S))   # [B, T, S]
    order = np.argsort(-np.where(causal, I, -np.inf), axis=-1, kind="stable")[..., :min(K, S)]
    return np.where(np.take_along_axis(causal, order, -1), order, -1)         # future keys stay out


def selection_mask_ref(picks, S):  # [B, T, k] int (-1 padded) -> [B, T, S] bool
    sel = np.zeros(picks.shape[:2] + (S + 1,), bool)
    np.put_along_axis(sel, np.where(picks >= 0, picks, S), True, axis=-1)
    return sel[..., :S]


def topk_select_ref(I, K, start_pos, ratio=1):  # [B, T, S] f32, top-k, offset -> [B, T, S] bool
    """topk_order_ref's choice as a mask: the same keys, so two runs always choose alike."""
    return selection_mask_ref(topk_order_ref(I, K, start_pos, ratio), I.shape[-1])


# The DSA kernels' contracts (kernels_cuda.index_scores, topk_indices), stated with the references above

def index_scores_causal_ref(q, w, k, k_scale, start_pos):  # -> [B, T, S] f32, -inf at future keys
    """kernels_cuda.index_scores: eq. (1), with every key after the query's position (start_pos + t) at -inf."""
    T, S = q.shape[1], k.shape[1]
    return np.where(causal_ref(T, start_pos, S)[None], index_scores_ref(q, w, k, k_scale), -np.inf).astype(np.float32)


def topk_indices_ref(I, K, start_pos):  # [B, T, S] f32 -> [B, T, K] int32
    """kernels_cuda.topk_indices: eq. (2)'s selection as positions, ascending, then -1 (selection_indices_ref)."""
    return selection_indices_ref(topk_select_ref(I, K, start_pos), K)


def index_prep_ref(q, k, xw, cos, sin, ln_w, ln_b, k_cache, k_scale_cache, start_pos):
    """kernels_cuda.index_prep: indexer_forward's official steps between the projections and eq. (1).
    q [B, T, J, D], k [B, T, D] (bf16 values), xw [B, T, J] = x weights_proj^T, cos, sin [T, R/2], the
    key LayerNorm's ln_w, ln_b [D] -> (q codes [B, T, J, D] e4m3, head weights w [B, T, J]); the keys'
    codes and scales are written to k_cache [B, CAP, D], k_scale_cache [B, CAP] at start_pos + t."""
    B, T, J, D = q.shape
    R, rnd = 2 * cos.shape[-1], quant.bf16_round
    q = np.concatenate([rnd(rope.rope_half_split(q[..., :R], cos, sin)), q[..., R:]], -1)   # rope part first
    k = rnd(layer_norm_ref(k, ln_w, ln_b))
    k = np.concatenate([rnd(rope.rope_half_split(k[:, :, None, :R], cos, sin))[:, :, 0], k[..., R:]], -1)
    q8, q_scale = quant.act_quant(rnd(rotate_activation_ref(q)))                  # [B,T,J,D], [B,T,J,1]
    k8, k_scale = quant.act_quant(rnd(rotate_activation_ref(k)))                  # [B,T,D], [B,T,1]
    k_cache[:B, start_pos:start_pos + T], k_scale_cache[:B, start_pos:start_pos + T] = k8, k_scale[..., 0]
    w = (np.asarray(xw, np.float32) * np.float32(J ** -0.5)) * q_scale[..., 0] * np.float32(D ** -0.5)  # head_weights_ref
    return q8, w


# -----------------------------------------------------------------------------
# The indexer layer: projections, RoPE, (rotation + FP8), key cache, scores, selection

def indexer_forward(x, q, k, p, cache, start_pos, S, cos, sin, args, opts):
    """x [B, T, d]; q [B, T, J * D] = W^IQ c^Q_t (wq_b of the MLA query latent) and k [B, T, D] = W^IK h_t
    (wk of x), projected by the caller with MLA's own projections of the same inputs (attention.
    mla_forward: one GEMM each on a GPU) -> selection [B, T, S] bool (the GPU's kernels: [B, T, K]
    selected positions, -1 padded).
    p: this layer's indexer weights; cache: its key cache (written at start_pos..start_pos+T; the
    first S slots are scored, S = start_pos + T except in a captured decode, where S is the cache's
    capacity and the causal mask hides the slots not written yet);
    opts: official, indexer_fp8 and ops, the backend's op table (ops.Ops)."""
    B, T, _ = x.shape
    J, D, R = args.index_n_heads, args.index_head_dim, args.qk_rope_head_dim
    ops, off = opts.ops, opts.official
    rnd = ops.bf16_round if off else ops.no_round
    q = q.reshape(B, T, J, D)                                                       # q^I_{t,j}; k: k^I_s before its norm
    if off and opts.indexer_fp8 and ops.index_prep is not None:
        # a GPU: the steps below as one kernel (index_prep_ref's contract), the keys written to the cache
        q, w = ops.index_prep(x, q, k, p, cache, start_pos, cos, sin)
        return ops.select(q, w, cache.k[:B, :S], cache.k_scale[:B, :S], args.index_topk, start_pos,
                          indices=ops.fused)                    # a mask unless attention takes indices
    # rope part FIRST here (MLA puts it last); half-split layout (official fix of 2025-11-17)
    q = ops.cat([rnd(ops.rope_half_split(q[..., :R], cos, sin)), q[..., R:]], -1)
    k = rnd(ops.layer_norm(k, p["k_norm"], p["k_norm_bias"]))                        # k^I_s [B, T, D]
    k = ops.cat([rnd(ops.rope_half_split(k[:, :, None, :R], cos, sin))[:, :, 0], k[..., R:]], -1)
    if opts.indexer_fp8:                          # not in paper: rotation + FP8 (official numerics)
        q, k = rnd(ops.rotate_activation(q)), rnd(ops.rotate_activation(k))
        q, q_scale = ops.act_quant(q)                                               # [B,T,J,D], [B,T,J,1]
        k, k_scale = ops.act_quant(k)                                               # [B,T,D], [B,T,1]
        q_scale, k_scale = q_scale[..., 0], k_scale[..., 0]
    else:
        q_scale, k_scale = 1.0, 1.0                                                 # exact: unit scales
    ops.store(cache.k, start_pos, k, B, T)
    ops.store(cache.k_scale, start_pos, k_scale, B, T)
    w = ops.head_weights(x, p["weights_proj"], q_scale, J, D)                     # w^I_{t,j} [B, T, J]
    return ops.select(q, w, cache.k[:B, :S], cache.k_scale[:B, :S], args.index_topk, start_pos,   # eqs. (1)-(2)
                      indices=ops.fused)


def select_ref(q, w, k, k_scale, K, start_pos, indices=False):  # eq. (1) then eq. (2)
    """-> [B, T, S] bool, or with indices=True the form the DSA kernels take: [B, T, K] selected
    positions. The op a fast backend replaces whole (its kernels score long prompts in query chunks)."""
    sel = topk_select_ref(index_scores_ref(q, w, k, k_scale), K, start_pos)
    return selection_indices_ref(sel, K) if indices else sel


def selection_indices_ref(sel, K):  # [B, T, S] bool -> [B, T, K] int32: the selected positions ascending, then -1
    B, T, S = sel.shape
    order = np.argsort(~sel, axis=-1, kind="stable")[..., :K]                 # True first, each in index order
    order = np.concatenate([order, np.zeros((B, T, max(0, K - S)), order.dtype)], -1)
    return np.where(np.arange(K) < sel.sum(-1, keepdims=True), order, -1).astype(np.int32)


def head_weights_ref(x, weights_proj, q_scale, J, D):  # [B, T, d], Weight [J, d], [B, T, J] -> [B, T, J] f32
    """w^I_{t,j} of eq. (1) from the fp32 projection weights_proj(x) (fp32 weights since the fix)."""
    w = (np.asarray(x, np.float32) @ weights_proj.dequant().T) * np.float32(J ** -0.5)
    return w * q_scale * np.float32(D ** -0.5)   # not in paper: J**-0.5, the q scale and D**-0.5 folded in


def layer_norm_ref(x, w, b, eps=1e-6):  # [..., D] -> [..., D] float32 (indexer k_norm: LayerNorm with bias)
    x = np.asarray(x, np.float32)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + np.float32(eps)) * w + b


# -----------------------------------------------------------------------------
# eqs. (3)-(4): the indexer's training objectives (spec/dsv32.md §8)

def _log_softmax(z, valid):  # [..., S] over the valid entries; invalid -> -inf
    z = np.where(valid, np.asarray(z, np.float64), -np.inf)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _kl(p, log_q, valid):  # sum over valid s of p (log p - log q), with 0 log 0 = 0
    logp = np.log(np.where(p > 0, p, 1))
    return np.where(valid & (p > 0), p * (logp - np.where(valid, log_q, 0)), 0).sum(-1)


def attention_target(A):  # [T, H, S] attention probabilities -> p [T, S]: head-summed, L1-normalised
    a = np.asarray(A, np.float64).sum(1)
    return a / a.sum(-1, keepdims=True)


def indexer_kl_dense(A, I):  # eq. (3): [T, H, S], [T, S] -> L_I = sum_t KL(p_t || softmax(I_t)) over s <= t
    T, _, S = A.shape
    causal = np.arange(S)[None, :] <= (S - T + np.arange(T))[:, None]
    p = np.where(causal, attention_target(A), 0)
    return float(_kl(p, _log_softmax(I, causal), causal).sum())


def indexer_kl_sparse(A, I, K):  # eq. (4): KL over the selected set S_t = Top-k(I_t) only
    T, _, S = A.shape
    sel = topk_select_ref(np.asarray(I, np.float32)[None], K, S - T)[0]       # [T, S]
    p = np.where(sel, attention_target(A), 0)
    p = p / p.sum(-1, keepdims=True)                                          # renormalised on S_t
    return float(_kl(p, _log_softmax(I, sel), sel).sum())
