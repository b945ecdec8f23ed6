"""DeepSeek-V4's attention layer (DeepSeek-V4 paper §2.3; spec/v4_flash.md §2.3): shared-KV multi-query
attention over a sliding window of the latest n_win tokens plus compressed keys (compressor.py: every
complete window of the HCA layers, or the indexer's top-k of the CSA layers), with a per-head sink logit,
the inverse rotation of the outputs and a grouped low-rank output projection.

    c^Q_t   = RMSNorm(W^DQ h_t)                                  the query latent (also the indexer's)
    q_{t,i} = RoPE_t(RMSNorm₀((W^UQ c^Q_t)_i))                   head i; RMSNorm₀: per head, no weight
    κ_t     = RoPE_t(RMSNorm(W^KV h_t))                          one key per token; values = keys
    S_t     = {κ_j : t - n_win < j <= t} ∪ Comp_t                window + compressed keys
    o_{t,i} = Σ_{s in S_t} softmax_s(q_{t,i} . s / sqrt(c); sink_i) s      (the sink's value is zero)
    õ_{t,i} = RoPE_{-t}(o_{t,i})                                 the inverse rotation at the query's position
    u_t     = W^OB [W^OA_γ õ_{t,γ} for the g groups γ of n_h / g heads]

RoPE rotates the trailing R dims in interleaved pairs; sliding-window-only layers use rope_theta,
compressed layers compress_rope_theta with YaRN (and no mscale: the scale is 1 / sqrt(c)).

Letters: B batch, T tokens, H heads, c = head_dim, R rotary dims, W = n_win, n compressed keys,
g output groups.
"""
import numpy as np

import attention
import compressor
import indexer
import quant
import rope
from compressor import rms_norm, rope_tail


def window_mask_ref(T, start_pos, pos, W):  # -> [T, S] bool: key at position pos[s] visible to query t
    t = start_pos + np.arange(T)[:, None]                                      # iff t - W < pos <= t
    return (pos[None, :] <= t) & (pos[None, :] > t - W)


class V4LayerCache:
    """One layer's caches, growing by one key per m tokens of context, not one per token: the keys of the
    last n_win positions (a ring: position j in slot j mod n_win), and each compressor's state (the open
    window, every key so far; compressor.CompressorState, or the torch path's fixed-shape
    backend_torch.CompressorRing)."""

    def __init__(self, B, args, kind, p, zeros=lambda shape: np.zeros(shape, np.float32),
                 state=compressor.CompressorState):      # zeros, state: the backend's storage and compressor state
        self.ring = zeros((B, args.sliding_window, args.head_dim))
        self.selected = None                            # the CSA indexer's last picks [B, T, n] (--verify)
        self.comp = state(B, p["compressor"], zeros) if kind != "sliding_attention" else None
        self.idx = state(B, p["indexer"]["compressor"], zeros) if kind == "compressed_sparse_attention" else None

    def nbytes(self):
        return self.ring.nbytes + sum(s.nbytes() for s in (self.comp, self.idx) if s is not None)


BLOCK = 64  # not in paper: the official sparse_attn kernel walks a query's index list 64 columns at a time


def attention_ref(q, keys, allowed, sink, scale):  # [B,T,H,c], [B,S,c], [B,T,S], [H] -> [B,T,H,c]
    """Exact numerics: every head against the one shared key set, the sink in the denominator; values are
    the keys themselves."""
    z = np.einsum("bthc,bsc->bhts", q, keys) * np.float32(scale)               # [B, H, T, S]
    z = np.where(allowed[:, None], z, -np.inf)
    p = attention.softmax_ref(z, sink=sink)                                     # sink in the denominator
    return np.einsum("bhts,bsc->bthc", p, keys).astype(np.float32)


def blocked_attention_ref(q, keys, idx, sink, scale):  # [B,T,H,c], [B,S,c], [B,T,K] int, [H] -> [B,T,H,c]
    """Official numerics, as the official sparse_attn kernel rounds: query t's keys are the rows idx[b, t]
    of `keys` (-1: none), walked BLOCK columns at a time in list order. Per block: the scores z =
    fp32(q . κ) · scale, the running max m over the blocks so far, e = exp(z - m) in fp32, the accumulator
    rescaled by a = exp(m_old - m) and bf16(e) · κ added (summed exactly, rounded once), the denominator
    l = fma(l, a, Σ e); after the last block the sink's exp(sink - m) joins l; out = bf16(acc / l).
    So a probability rounds against the max of the blocks seen so far, not the row's: the order of the
    list and where its blocks fall are part of the result. q and the keys hold bf16 values."""
    B, T, H, c = q.shape
    f64 = np.float64
    m = np.full((B, T, H), -np.inf, np.float32)
    l = np.zeros((B, T, H), np.float32)
    acc = np.zeros((B, T, H, c), np.float32)
    b = np.arange(B)[:, None, None]
    for j in range(0, idx.shape[-1], BLOCK):
        cols = idx[..., j:j + BLOCK]                                                # [B, T, k]
        kb = keys[b, np.maximum(cols, 0)].astype(f64)                               # [B, T, k, c]
        z = np.einsum("bthc,btkc->bthk", q.astype(f64), kb).astype(np.float32) * np.float32(scale)
        z = np.where(cols[:, :, None] >= 0, z, -np.inf)                             # [B, T, H, k]
        m_new = np.maximum(m, z.max(-1))
        ref = np.where(np.isfinite(m_new), m_new, 0)                                # no key yet: nothing to scale
        a = quant.exp_f32(m - ref)                                                        # [B, T, H]
        e = quant.exp_f32(z - ref[..., None])
        l = (l.astype(f64) * a + e.sum(-1, dtype=f64).astype(np.float32)).astype(np.float32)   # one fma
        pv = np.einsum("bthk,btkc->bthc", quant.bf16_round(e).astype(f64), kb)
        acc = ((acc * a[..., None]).astype(f64) + pv).astype(np.float32)
        m = m_new
    l = l + quant.exp_f32(np.asarray(sink, np.float32) - np.where(np.isfinite(m), m, 0))
    return quant.bf16_round(acc / l[..., None])


def sparse_attention_ref(q, KW, KC, idx, n_dense, sink, scale, official=False):
    """The sparse kernel's contract (kernels_v4.sparse_attention): the attention with its keys named by
    position instead of by a mask. q [B, T, H, c]; KW [B, P, c] the window's keys (the ring's and the
    chunk's own), KC [B, n, c] the compressed keys; idx [B, T, K] int: query t's keys in the joined rows
    [KW | KC] (a window key s, a selected compressed key P + w), -1 padded, each at most once; n_dense
    [T] int: query t also attends KC[:n_dense[t]] (HCA's complete windows; 0 for CSA, whose picks are in
    idx, and for sliding-window layers). -> [B, T, H, c]. Official numerics: blocked_attention_ref over
    the columns idx, then the dense keys in ascending order (the official index layout)."""
    B, T, _, _ = q.shape
    P, n = KW.shape[1], KC.shape[1]
    keys = np.concatenate([KW, KC], 1)                                           # [B, P + n, c]
    dense = np.arange(n)[None, :] < np.asarray(n_dense)[:, None]                 # [T, n]
    if official:
        cols = np.concatenate([idx, np.broadcast_to(np.where(dense, P + np.arange(n), -1), (B, T, n))], -1)
        return blocked_attention_ref(q, keys, cols, sink, scale)
    allowed = np.zeros((B, T, P + n), bool)
    b, t, j = np.nonzero(idx >= 0)
    allowed[b, t, idx[b, t, j]] = True
    allowed[:, :, P:] |= dense[None]
    return attention_ref(q, keys, allowed, sink, scale)


def window_indices_ref(T, start_pos, P, W):  # -> [T, cols] int: query t's window as rows of KW = [P ring keys | T chunk keys]
    """Query t (position start_pos + t) sees positions max(0, t - W + 1) .. t (window_mask_ref), listed
    oldest first and -1 padded at the end, in the official index layout's columns: min(T, W) for a
    prefill from position 0, W otherwise (the decode ring's). Row s of KW holds position start_pos - P + s."""
    cols = min(T, W) if start_pos == 0 else W
    t = start_pos + np.arange(T)[:, None]                                      # query positions [T, 1]
    pos = np.maximum(t - W + 1, 0) + np.arange(cols)[None, :]                  # [T, cols]
    return np.where(pos <= t, pos - (start_pos - P), -1)


def rms_norm_bf16(x, eps):  # [..., c] -> [..., c]: the official per-head q norm, every step in bf16
    """q * rsqrt(mean(q²) + eps) on a bf16 tensor: q² rounded to bf16, the mean accumulated in fp32 and
    rounded, + eps, rsqrt and the product each rounded to bf16."""
    r = quant.bf16_round
    ms = r(r(x * x).mean(-1, keepdims=True, dtype=np.float64).astype(np.float32))
    return r(x * r(quant.rsqrt_f32(r(ms + np.float32(eps)))))


def kv_fp8_ref(kv, R):  # not in paper: the official code's KV fake quant, FP8 per 64 on the nope dims, in bf16
    nope = quant.bf16_round(quant.act_dequant(*quant.act_quant(kv[..., :-R], 64), 64))
    return np.concatenate([nope, kv[..., -R:]], -1)


def grouped_output_ref(o, wo_a, wo_b, g, official=False):  # [B, T, H, c] -> [B, T, d]: W^OB [W^OA_γ õ_γ]_γ
    """Official numerics: W^OA dequantized to bf16 (exact) for a bf16 einsum, then W^OB's FP8 linear."""
    B, T, H, c = o.shape
    og = o.reshape(B, T, g, H // g * c)                                        # õ_{t,γ}: heads of group γ
    Wa = wo_a.dequant().reshape(g, -1, og.shape[-1])                           # W^OA_γ [g, d_g, H/g c]
    if official:                                        # the bf16 einsum's sums, rounded once
        z = np.einsum("btgk,gok->btgo", og.astype(np.float64), Wa.astype(np.float64)).astype(np.float32)
        return quant.linear_ref(quant.bf16_round(z.reshape(B, T, -1)), wo_b, official)
    z = np.einsum("btgk,gok->btgo", og, Wa).reshape(B, T, -1)                  # [B, T, g d_g]
    return quant.linear_ref(z, wo_b, official)


def attention_v4_forward(x, p, kind, m, start_pos, freqs, args, cache, sparse=True, official=False):
    """One attention layer over a chunk of T tokens at positions start_pos.. (a prefill, a chunk after
    the cache, or one decode token): x [B, T, d] (the normed input) -> [B, T, d]; updates `cache`.
    kind: sliding_attention, compressed_sparse_attention or heavily_compressed_attention, m its
    compression rate; freqs [R/2] the layer's RoPE frequencies (config.V4Args.freqs). sparse=False:
    CSA layers attend every complete window, as HCA layers do (the indexer is not run). official: the
    official code's rounding points (bf16 activations, FP8 linears, the FP8 / FP4 fake quant of keys)."""
    B, T, _ = x.shape
    H, c, W, R, eps = args.num_attention_heads, args.head_dim, args.sliding_window, args.qk_rope_head_dim, args.rms_norm_eps
    rnd = quant.bf16_round if official else quant.no_round
    cos, sin = rope.rope_angles(freqs, start_pos + np.arange(T))                        # [T, R/2]
    qr = rms_norm(quant.linear_ref(x, p["wq_a"], official), p["q_norm"], eps, rnd)      # c^Q [B, T, d_c]
    q = quant.linear_ref(qr, p["wq_b"], official).reshape(B, T, H, c)
    q = rms_norm_bf16(q, eps) if official else rms_norm(q, None, eps)                   # RMSNorm₀ per head
    q = rnd(rope_tail(q, cos, sin))                                                     # [B, T, H, c]
    kv = rms_norm(quant.linear_ref(x, p["wkv"], official), p["kv_norm"], eps, rnd)
    kv = rnd(rope_tail(kv[:, :, None], cos, sin)[:, :, 0])                              # κ [B, T, c]
    kv = kv_fp8_ref(kv, R) if official else kv

    # the window: the ring's last W - 1 positions before this chunk, then the chunk's own keys
    P = min(start_pos, W - 1)
    pos = start_pos - P + np.arange(P + T)                                              # key positions
    KW = np.concatenate([cache.ring[:, pos[:P] % W], kv], 1)                            # [B, P + T, c]
    last = pos[-min(T, W):]
    cache.ring[:, last % W] = kv[:, -len(last):]                                        # the ring keeps n_win
    idx = window_indices_ref(T, start_pos, P, W)                                        # [T, cols]
    idx = np.broadcast_to(idx, (B,) + idx.shape)
    K, n_dense = KW[:, :0], np.zeros(T, int)

    if kind != "sliding_attention":                     # compressed keys: every complete window so far
        compressor.compress_ref(x, p["compressor"], m, m == 4, start_pos, freqs, eps, cache.comp, rnd,
                                (lambda K: kv_fp8_ref(K, R)) if official else None)
        K = cache.comp.keys                                                             # [B, n, c]
        if kind == "heavily_compressed_attention" or not sparse:
            n_dense = (start_pos + np.arange(T) + 1) // m                               # indexer.causal_ref
        else:                                           # CSA: the indexer's top-k of them, best first
            compressor.compress_ref(x, p["indexer"]["compressor"], m, True, start_pos, freqs, eps, cache.idx, rnd,
                                    compressor.index_fp4_ref if official else None)
            picks = compressor.indexer_select_ref(x, qr, p["indexer"], cache.idx.keys, start_pos, cos, sin, args,
                                                  official)                             # [B, T, k]
            cache.selected = indexer.selection_mask_ref(picks, K.shape[1])             # for --verify
            idx = np.concatenate([idx, np.where(picks >= 0, picks + P + T, -1)], -1)
    o = sparse_attention_ref(q, KW, K, idx, n_dense, p["attn_sink"], args.softmax_scale, official)
    o = rnd(rope_tail(o, cos, -sin))                                                    # RoPE_{-t}
    return grouped_output_ref(o, p["wo_a"], p["wo_b"], args.o_groups, official)
