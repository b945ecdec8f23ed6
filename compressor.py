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


def rms_norm(x, w, eps, rnd=quant.no_round):  # [..., c] -> [..., c]: rnd(w * x / rms(x)) in fp32 (w None: unweighted)
    x = np.asarray(x, np.float32)
    y = x * quant.rsqrt_f32(quant.mean_sq_f32(x) + np.float32(eps))                   # x * rsqrt, as both codes
    return rnd(y if w is None else w * y)


def rope_tail(x, cos, sin):  # the trailing R dims rotated in interleaved pairs: [B, T, H, c] -> [B, T, H, c]
    R = 2 * cos.shape[-1]
    return np.concatenate([x[..., :-R], rope.rope_interleaved(x[..., -R:], cos, sin)], -1)


class CompressorState:
    """What a compressor carries between calls (prefill chunks, decode steps): the projections
    [C_j | Z_j + B] of the tokens of the window not complete yet (fewer than m rows), for CSA those
    of the last complete window too (the next key's first m slots), and every key emitted so far (in a
    buffer that doubles when full, so that a decode step does not copy them all)."""

    def __init__(self, B, p, zeros=lambda shape: np.zeros(shape, np.float32)):  # p: the compressor's weights
        width, c = 2 * p["wkv"].w.shape[0], p["norm"].shape[0]
        self.zeros = zeros
        self.rows = zeros((B, 0, width))                          # [B, r < m, 2 (2) c]: C | Z of the open window
        self.prev = None                                          # ([B, m, 2c], [B, m, 2c]): the last complete window (CSA)
        self.buf, self.n = zeros((B, 0, c)), 0                    # keys: buf[:, :n]

    @property
    def keys(self):  # [B, n, c]: K_w of every complete window
        return self.buf[:, :self.n]

    def nbytes(self):
        return self.rows.nbytes + self.keys.nbytes + sum(a.nbytes for a in self.prev or ())

    def reserve(self, n):  # room for n keys
        if n > self.buf.shape[1]:
            B, _, c = self.buf.shape
            grown = self.zeros((B, n, c))
            grown[:, :self.n] = self.keys
            self.buf = grown

    def append(self, K):  # K [B, k, c]: the keys of the windows completed now
        k = K.shape[1]
        if self.n + k > self.buf.shape[1]:
            self.reserve(max(2 * self.buf.shape[1], self.n + k, 16))
        self.buf[:, self.n:self.n + k] = K
        self.n += k


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


def compress_ref(h, p, m, overlap, start_pos, freqs, eps, state, rnd=quant.no_round, stored=None):
    """h [B, T, d]: the layer's normed input at positions start_pos.. (continuing `state`); p: wkv, wgate
    (Weights [c or 2c, d]), ape [m, c or 2c], norm [c]; freqs [R/2]: the layer's RoPE frequencies.
    Appends the keys of the windows completed here to state.keys (RoPE at each window's first token,
    m w) and returns them [B, k, c]. Official numerics: the pooling in fp32, then bf16 (rnd) for the
    norm and RoPE, then `stored`, the fake quantisation of the cached keys (FP8 or Hadamard + FP4)."""
    B, T, _ = h.shape
    C = quant.matmul_f32(h, p["wkv"].dequant().T)                                      # C_j [B, T, (2)c], fp32
    Z = quant.matmul_f32(h, p["wgate"].dequant().T) + p["ape"][(start_pos + np.arange(T)) % m]   # Z_j + B_{j mod m}
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
    K = rnd(rope_tail(rms_norm(rnd(pooled), p["norm"], eps, rnd)[:, :, None], cos, sin)[:, :, 0])
    K = K if stored is None else stored(K)
    state.append(K)
    return K


def index_fp4_ref(x):  # not in paper: the official code's indexer fake quant, Hadamard then FP4 per 32, in bf16
    return quant.bf16_round(quant.fp4_roundtrip(quant.bf16_round(indexer.rotate_activation_ref(x))))


def indexer_select_ref(x, qr, p, K_idx, start_pos, cos, sin, args, official=False):  # -> [B, T, k] int
    """The CSA lightning indexer: x [B, T, d] the layer's normed input, qr [B, T, d_c] = c^Q, K_idx
    [B, n, c^I] every key of its compressor so far; cos, sin [T, R/2] at the query positions.
    Official numerics: q and the keys through index_fp4_ref, the head weights and the scores in bf16."""
    B, T, _ = x.shape
    J, D = args.index_n_heads, args.index_head_dim
    q = rope_tail(quant.linear_ref(qr, p["wq_b"], official).reshape(B, T, J, D), cos, sin)   # q^I [B, T, J, D]
    if not official:
        w = quant.linear_ref(x, p["weights_proj"], False) * np.float32(J ** -0.5) * np.float32(D ** -0.5)
        # not in paper: 1 / sqrt(c^I) folded into the head weights, as V3.2's (index_scores_ref has no scale)
    else:                                               # bf16 q and weights
        rnd = quant.bf16_round
        q = index_fp4_ref(rnd(q))
        xw = rnd(quant.matmul_f32(x, p["weights_proj"].dequant().T))                    # a bf16 GEMM
        w = rnd(xw * np.float32(J ** -0.5 * D ** -0.5))                                   # [B, T, J]
    I = index_scores_v4_ref(q, w, K_idx, official)                                       # eq. (16) [B, T, n]
    return indexer.topk_order_ref(I, args.index_topk, start_pos, ratio=4)   # eq. (17): complete windows, best first


def index_scores_v4_ref(q, w, K_idx, official=False):  # [B, T, J, D], [B, T, J], [B, n, D] -> I [B, T, n]
    """Eq. (16) with the scales folded into w. Official numerics (bf16 tensors in the official code):
    each head's q . K rounded to bf16, ReLU times w rounded to bf16, the heads summed in fp32 in head
    order and the sum rounded to bf16."""
    if not official:
        return indexer.index_scores_ref(q, w, K_idx, np.ones(K_idx.shape[:2], np.float32))
    rnd = quant.bf16_round
    qk = rnd(np.einsum("btjd,bsd->btjs", q, K_idx))                                      # [B, T, J, n]
    return rnd((rnd(np.maximum(qk, 0) * w[..., None])).sum(2))
