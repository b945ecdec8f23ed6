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


def attention_ref(q, keys, allowed, sink, scale, official=False):  # [B,T,H,c], [B,S,c], [B,T,S], [H] -> [B,T,H,c]
    """Every head against the one shared key set; values are the keys themselves. Official numerics
    (the official sparse_attn kernel): fp32 scores and softmax with the max over the keys only, the sink
    joining the denominator last, the probabilities rounded to bf16 for the weighted sum (not for the
    denominator), the output in bf16."""
    z = np.einsum("bthc,bsc->bhts", q, keys) * np.float32(scale)               # [B, H, T, S]
    z = np.where(allowed[:, None], z, -np.inf)
    if not official:
        p = attention.softmax_ref(z, sink=sink)                                 # sink in the denominator
        return np.einsum("bhts,bsc->bthc", p, keys).astype(np.float32)
    m = z.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)                                          # a query with no key
    e = np.exp(z - m)                                                           # [B, H, T, S] fp32
    # sums over the keys in float64, rounded once: the same result however many keys a chunk's rows
    # carry (fp32 sums of different lengths associate differently)
    denom = e.sum(-1, keepdims=True, dtype=np.float64).astype(np.float32) + np.exp(np.asarray(sink, np.float32)[:, None, None] - m)
    o = np.einsum("bhts,bsc->bhtc", quant.bf16_round(e).astype(np.float64), keys.astype(np.float64))
    return quant.bf16_round(o.astype(np.float32) / denom).transpose(0, 2, 1, 3)   # bf16 P, fp32 sums


def sparse_attention_ref(q, KW, KC, idx, n_dense, sink, scale, official=False):
    """The sparse kernel's contract (kernels_v4.sparse_attention): the same attention as attention_ref,
    its keys named by position instead of by a mask. q [B, T, H, c]; KW [B, P, c] the window's keys
    (the ring's and the chunk's own), KC [B, n, c] the compressed keys; idx [B, T, K] int: query t's
    keys in the joined rows [KW | KC] (a window key s, a selected compressed key P + w), -1 padded, each
    at most once; n_dense [T] int: query t also attends KC[:n_dense[t]] (HCA's complete windows; 0 for
    CSA, whose picks are in idx, and for sliding-window layers). -> [B, T, H, c]."""
    B, T, _, _ = q.shape
    P, n = KW.shape[1], KC.shape[1]
    keys = np.concatenate([KW, KC], 1)                                           # [B, P + n, c]
    allowed = np.zeros((B, T, P + n), bool)
    b, t, j = np.nonzero(idx >= 0)
    allowed[b, t, idx[b, t, j]] = True
    allowed[:, :, P:] |= np.arange(n)[None, None, :] < np.asarray(n_dense)[None, :, None]
    return attention_ref(q, keys, allowed, sink, scale, official)


def window_indices_ref(T, P, W):  # -> [T, W] int: query t's window keys as rows of KW = [P ring keys | T chunk keys]
    """Row s of KW holds position start_pos - P + s; query t (position start_pos + t) sees rows
    t + P - W < s <= t + P (window_mask_ref), -1 where that runs before the first row."""
    s = np.arange(T)[:, None] + P - W + 1 + np.arange(W)[None, :]
    return np.where(s >= 0, s, -1)


def rms_norm_bf16(x, eps):  # [..., c] -> [..., c]: the official per-head q norm, every step in bf16
    """q * rsqrt(mean(q²) + eps) on a bf16 tensor: q² rounded to bf16, the mean accumulated in fp32 and
    rounded, + eps, rsqrt and the product each rounded to bf16."""
    r = quant.bf16_round
    ms = r(r(x * x).mean(-1, keepdims=True))
    return r(x * r(np.float32(1) / np.sqrt(r(ms + np.float32(eps)))))


def kv_fp8_ref(kv, R):  # not in paper: the official code's KV fake quant, FP8 per 64 on the nope dims, in bf16
    nope = quant.bf16_round(quant.act_dequant(*quant.act_quant(kv[..., :-R], 64), 64))
    return np.concatenate([nope, kv[..., -R:]], -1)


def grouped_output_ref(o, wo_a, wo_b, g, official=False):  # [B, T, H, c] -> [B, T, d]: W^OB [W^OA_γ õ_γ]_γ
    """Official numerics: W^OA dequantized to bf16 (exact) for a bf16 einsum, then W^OB's FP8 linear."""
    B, T, H, c = o.shape
    og = o.reshape(B, T, g, H // g * c)                                        # õ_{t,γ}: heads of group γ
    Wa = wo_a.dequant().reshape(g, -1, og.shape[-1])                           # W^OA_γ [g, d_g, H/g c]
    z = np.einsum("btgk,gok->btgo", og, Wa).reshape(B, T, -1)                  # [B, T, g d_g]
    return quant.linear_ref(quant.bf16_round(z) if official else z, wo_b, official)


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
    keys = np.concatenate([cache.ring[:, pos[:P] % W], kv], 1)                          # [B, P + T, c]
    allowed = np.broadcast_to(window_mask_ref(T, start_pos, pos, W), (B, T, P + T))
    last = pos[-min(T, W):]
    cache.ring[:, last % W] = kv[:, -len(last):]                                        # the ring keeps n_win

    if kind != "sliding_attention":                     # compressed keys: every complete window so far
        compressor.compress_ref(x, p["compressor"], m, m == 4, start_pos, freqs, eps, cache.comp, rnd,
                                (lambda K: kv_fp8_ref(K, R)) if official else None)
        K = cache.comp.keys                                                             # [B, n, c]
        if kind == "heavily_compressed_attention" or not sparse:
            comp = np.broadcast_to(indexer.causal_ref(T, start_pos, K.shape[1], m), (B, T, K.shape[1]))
        else:                                           # CSA: the indexer's top-k of them
            compressor.compress_ref(x, p["indexer"]["compressor"], m, True, start_pos, freqs, eps, cache.idx, rnd,
                                    compressor.index_fp4_ref if official else None)
            comp = compressor.indexer_select_ref(x, qr, p["indexer"], cache.idx.keys, start_pos, cos, sin, args,
                                                 official)
            cache.selected = comp                                                       # for --verify
        keys = np.concatenate([keys, K], 1)                                             # [B, P + T + n, c]
        allowed = np.concatenate([allowed, comp], -1)
    o = attention_ref(q, keys, allowed, p["attn_sink"], args.softmax_scale, official)
    o = rnd(rope_tail(o, cos, -sin))                                                    # RoPE_{-t}
    return grouped_output_ref(o, p["wo_a"], p["wo_b"], args.o_groups, official)
