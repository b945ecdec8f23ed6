"""The KV compressors of DeepSeek-V4's hybrid attention and the CSA indexer (DeepSeek-V4 paper §2.3.1,
eqs. (9)-(17): compressed sparse attention, CSA; §2.3.2, eqs. (20)-(23): heavily compressed attention,
HCA; spec/v4_flash.md §2.4-2.5).

A compressor pools each window of m tokens into one key (keys are values in V4) by a learned,
per-channel softmax gate:

    C_j = W^KV h_j,  Z_j = W^Z h_j + B_{j mod m}              per token j (B: ape, the position bias)
    Ĉ_w = Σ_{j in window w} softmax_j(Z_j) ⊙ C_j               HCA (m' = 128): the window alone
    Ĉ_w = Σ over [C^a_j of window w-1 | C^b_j of window w]     CSA (m = 4): 2m slots, the windows
                                                                overlap; C = [C^a | C^b] is 2c wide
    K_w = RoPE_{m w}( RMSNorm(Ĉ_w) )                            rotated at the window's first token

Query t may use key w only once its window is complete: w < floor((t + 1) / m) (indexer.causal_ref).
HCA layers attend to all of them; CSA layers to the k the lightning indexer picks (eqs. (13)-(17)),
scored as V3.2's eq. (1) (indexer.index_scores_ref) against the keys of the indexer's own, narrower
compressor:

    q^I_{t,h} = RoPE_t(W^IUQ c^Q_t)_h,  w^I_{t,h} = (W^w h_t)_h / sqrt(n_h^I)
    I_{t,w}   = Σ_h w^I_{t,h} ReLU(q^I_{t,h} . K^I_w) / sqrt(c^I)          w < floor((t + 1) / m)

Letters: B batch, T tokens, d hidden size, m window (compression rate), n = T // m complete windows,
c key width (head_dim, or index_head_dim for the indexer's compressor), R rotary dims (trailing).
"""
import numpy as np

import indexer
import quant
import rope


def rms_norm(x, w, eps):  # [..., c] -> [..., c] float32 (w None: unweighted)
    x = np.asarray(x, np.float32)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))
    return y if w is None else y * w


def rope_tail(x, cos, sin):  # the trailing R dims rotated in interleaved pairs: [B, T, H, c] -> [B, T, H, c]
    R = 2 * cos.shape[-1]
    return np.concatenate([x[..., :-R], rope.rope_interleaved(x[..., -R:], cos, sin)], -1)


def compress_ref(h, p, m, overlap, cos, sin, eps):  # h [B, T, d] -> K [B, n, c], n = T // m complete windows
    """p: wkv, wgate (Weights [c or 2c, d]), ape [m, c or 2c], norm [c]; cos, sin [n, R/2] at positions m w."""
    B, T, _ = h.shape
    n = T // m
    if n == 0:                                                                         # no complete window yet
        return np.zeros((B, 0, p["norm"].shape[0]), np.float32)
    C = quant.linear_ref(h[:, :n * m], p["wkv"], False).reshape(B, n, m, -1)            # C_j  [B, n, m, (2)c]
    Z = quant.linear_ref(h[:, :n * m], p["wgate"], False).reshape(B, n, m, -1) + p["ape"]   # Z_j + B_{j mod m}
    if overlap:                                         # CSA: slots [C^a of window w-1 | C^b of window w]
        c = C.shape[-1] // 2
        kv = np.zeros((B, n, 2 * m, c), np.float32)
        z = np.full((B, n, 2 * m, c), -np.inf, np.float32)                               # window -1: no slots
        kv[:, 1:, :m], z[:, 1:, :m] = C[:, :-1, :, :c], Z[:, :-1, :, :c]
        kv[:, :, m:], z[:, :, m:] = C[..., c:], Z[..., c:]
    else:
        kv, z = C, Z
    g = np.exp(z - z.max(2, keepdims=True))
    pooled = ((g / g.sum(2, keepdims=True)) * kv).sum(2)                               # Ĉ_w [B, n, c], eq. (11)
    K = rms_norm(pooled, p["norm"], eps)
    return rope_tail(K[:, :, None], cos, sin)[:, :, 0].astype(np.float32)              # RoPE at m w


def indexer_select_ref(x, qr, p, K_idx, start_pos, cos, sin, args):  # -> [B, T, n] bool: the picked keys
    """The CSA lightning indexer: x [B, T, d] the layer's normed input, qr [B, T, d_c] = c^Q, K_idx
    [B, n, c^I] its compressor's keys; cos, sin [T, R/2] at the query positions."""
    B, T, _ = x.shape
    J, D = args.index_n_heads, args.index_head_dim
    q = rope_tail(quant.linear_ref(qr, p["wq_b"], False).reshape(B, T, J, D), cos, sin)   # q^I [B, T, J, D]
    w = quant.linear_ref(x, p["weights_proj"], False) * np.float32(J ** -0.5) * np.float32(D ** -0.5)
    # not in paper: 1 / sqrt(c^I) folded into the head weights, as V3.2's (index_scores_ref has no scale)
    I = indexer.index_scores_ref(q, w, K_idx, np.ones(K_idx.shape[:2], np.float32))   # eq. (16) [B, T, n]
    return indexer.topk_select_ref(I, args.index_topk, start_pos, ratio=4)           # eq. (17), complete windows
