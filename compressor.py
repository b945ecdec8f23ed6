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


class CompressorState:
    """What a compressor carries between calls (prefill chunks, decode steps): the projections
    [C_j | Z_j + B] of the tokens of the window not complete yet (fewer than m rows), for CSA those
    of the last complete window too (the next key's first m slots), and every key emitted so far."""

    def __init__(self, B, p):  # p: the compressor's weights
        width, c = 2 * p["wkv"].w.shape[0], p["norm"].shape[0]
        self.rows = np.zeros((B, 0, width), np.float32)           # [B, r < m, 2 (2) c]: C | Z of the open window
        self.prev = None                                          # ([B, m, 2c], [B, m, 2c]): the last complete window (CSA)
        self.keys = np.zeros((B, 0, c), np.float32)               # [B, n, c]: K_w of every complete window


def pool_ref(C, Z, prev, m, overlap):  # complete windows' C, Z [B, k m, (2)c] -> Ĉ [B, k, c], eq. (11) / (21)
    """prev: (C, Z) [B, m, 2c] of the window before the first one (CSA), or None (none: weight 0)."""
    B, k = C.shape[0], C.shape[1] // m
    C, Z = C.reshape(B, k, m, -1), Z.reshape(B, k, m, -1)
    if overlap:                                         # CSA: slots [C^a of window w-1 | C^b of window w]
        c = C.shape[-1] // 2
        kv = np.zeros((B, k, 2 * m, c), np.float32)
        z = np.full((B, k, 2 * m, c), -np.inf, np.float32)                              # no window before: no slots
        kv[:, 1:, :m], z[:, 1:, :m] = C[:, :-1, :, :c], Z[:, :-1, :, :c]
        if prev is not None:
            kv[:, 0, :m], z[:, 0, :m] = prev[0][..., :c], prev[1][..., :c]
        kv[:, :, m:], z[:, :, m:] = C[..., c:], Z[..., c:]
    else:
        kv, z = C, Z
    g = np.exp(z - z.max(2, keepdims=True))
    return ((g / g.sum(2, keepdims=True)) * kv).sum(2).astype(np.float32)               # per-channel softmax


def compress_ref(h, p, m, overlap, start_pos, freqs, eps, state):  # h [B, T, d] -> the new keys [B, k, c]
    """h: the layer's normed input at positions start_pos.. (continuing `state`); p: wkv, wgate (Weights
    [c or 2c, d]), ape [m, c or 2c], norm [c]; freqs [R/2]: the layer's RoPE frequencies. Appends the
    keys of the windows completed here to state.keys (RoPE at each window's first token, m w)."""
    B, T, _ = h.shape
    C = quant.linear_ref(h, p["wkv"], False)                                           # C_j [B, T, (2)c]
    Z = quant.linear_ref(h, p["wgate"], False) + p["ape"][(start_pos + np.arange(T)) % m]   # Z_j + B_{j mod m}
    rows = np.concatenate([state.rows, np.concatenate([C, Z], -1)], 1)                 # the open window first
    k = rows.shape[1] // m
    full, state.rows = rows[:, :k * m], rows[:, k * m:]
    if k == 0:
        return state.keys[:, :0]
    half = C.shape[-1]
    pooled = pool_ref(full[..., :half], full[..., half:], state.prev, m, overlap)       # Ĉ_w [B, k, c]
    if overlap:
        last = full[:, -m:]
        state.prev = (last[..., :half], last[..., half:])
    w0 = state.keys.shape[1]                                                           # windows emitted before
    cos, sin = rope.rope_angles(freqs, m * (w0 + np.arange(k)))                        # at m w
    K = rope_tail(rms_norm(pooled, p["norm"], eps)[:, :, None], cos, sin)[:, :, 0]
    state.keys = np.concatenate([state.keys, K], 1)
    return K


def indexer_select_ref(x, qr, p, K_idx, start_pos, cos, sin, args):  # -> [B, T, n] bool: the picked keys
    """The CSA lightning indexer: x [B, T, d] the layer's normed input, qr [B, T, d_c] = c^Q, K_idx
    [B, n, c^I] every key of its compressor so far; cos, sin [T, R/2] at the query positions."""
    B, T, _ = x.shape
    J, D = args.index_n_heads, args.index_head_dim
    q = rope_tail(quant.linear_ref(qr, p["wq_b"], False).reshape(B, T, J, D), cos, sin)   # q^I [B, T, J, D]
    w = quant.linear_ref(x, p["weights_proj"], False) * np.float32(J ** -0.5) * np.float32(D ** -0.5)
    # not in paper: 1 / sqrt(c^I) folded into the head weights, as V3.2's (index_scores_ref has no scale)
    I = indexer.index_scores_ref(q, w, K_idx, np.ones(K_idx.shape[:2], np.float32))   # eq. (16) [B, T, n]
    return indexer.topk_select_ref(I, args.index_topk, start_pos, ratio=4)           # eq. (17), complete windows
