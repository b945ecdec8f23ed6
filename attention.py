"""Multi-head latent attention (MLA, DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1) under DeepSeek Sparse
Attention (V3.2-Exp paper §2.1, eq. (2)): each query attends only to the keys its indexer selected.

    c^Q = W^DQ h,  q = W^UQ RMSNorm(c^Q)              q = [q^C (nope) | q^R (rope)] per head
    c^KV = W^DKV h, k^R = RoPE(W^KR h)                the cache holds c^KV (r_kv) and k^R (R) per token
    k^C, v = W^UK c^KV, W^UV c^KV                     (MHA mode: expanded per head)
    o_t = sum_s softmax_s(q_t . k_s / sqrt(d_qk) * mscale^2) v_s   over the selected s

Two formulations of one attention (official code's split, spec/dsv32.md §3.7-3.8):
- MHA mode (prefill chunks): expand the latent to per-head k^C and v with W^UKV, then attend.
- absorbed MQA mode (single-token decode): fold W^UK into the query and W^UV after the weighted sum,
  so attention runs against the latent cache itself (one "KV head" of width r_kv + R).
They agree in exact arithmetic; in official numerics they round differently (both reproduced).
On a GPU with the DSA kernels (ops.fused) the absorbed form serves every chunk, over the selected
rows of a packed latent cache (backend_torch.latent_attention), as deployed engines run it.

Letters: B batch, T query tokens, S keys (start_pos + T), H heads, C = r_kv latent width,
N = qk_nope_head_dim, R = qk_rope_head_dim, V = v_head_dim.
"""
import numpy as np

import indexer
import quant


def softmax_ref(z, axis=-1, sink=None):  # float32, max subtracted; -inf entries get probability 0
    """sink (V4): one more logit per row whose value vector is zero, z [..., H, T, S] with sink [H]:
    it joins the denominator only, so a row's probabilities sum to less than 1."""
    z = np.asarray(z, np.float32)
    m = z.max(axis, keepdims=True)
    if sink is not None:
        s = np.asarray(sink, np.float32)[:, None, None]                     # [H, 1, 1]
        m = np.maximum(m, s)
    e = np.exp(z - m)
    denom = e.sum(axis, keepdims=True) + (0 if sink is None else np.exp(s - m))
    return e / denom


def mha_ref(q_nope, q_pe, k_nope, k_pe, v, allowed, scale, rnd):
    """MHA mode: [B,T,H,N], [B,T,H,R], [B,S,H,N], [B,S,R], [B,S,H,V], [B,T,S] -> [B,T,H,V].
    Official rounding points: bf16 scores (one GEMM over the N + R dims, fp32 accumulation), bf16
    scaled scores, bf16 probabilities, bf16 output."""
    H = q_nope.shape[2]
    q = np.concatenate([q_nope, q_pe], -1).transpose(0, 2, 1, 3)                 # [B, H, T, N+R]
    k = np.concatenate([k_nope, np.broadcast_to(k_pe[:, :, None], k_pe.shape[:2] + (H, k_pe.shape[-1]))], -1)
    scores = rnd(q @ k.transpose(0, 2, 3, 1))                                    # [B, H, T, S]
    scores = rnd(scores * np.float32(scale))
    scores = np.where(allowed[:, None], scores, -np.inf)                         # sparse + causal mask
    p = rnd(softmax_ref(scores))
    return rnd(p @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)                # [B, T, H, V]


def absorb_ref(wkv_b, H, N, official):  # Weight [H (N + V), C] -> W^UK [H, N, C], W^UV [H, V, C] (at load)
    """W^UKV per head, split into its key and value halves for the absorbed form; official numerics
    hold it in bf16 (the official code's dequantized wkv_b)."""
    Wb = (quant.bf16_round if official else quant.no_round)(wkv_b.dequant())
    Wb = Wb.reshape(H, -1, Wb.shape[-1])                                  # [H, N + V, C]
    return Wb[:, :N], Wb[:, N:]


def mqa_absorbed_ref(q_nope, q_pe, kv, pe, W_UK, W_UV, allowed, scale, rnd):
    """Absorbed mode: [B,T,H,N], [B,T,H,R], [B,S,C], [B,S,R], [H,N,C], [H,V,C], [B,T,S] -> [B,T,H,V]."""
    qa = rnd(np.einsum("bthn,hnc->bthc", q_nope, W_UK))                   # q^C W^UK: query in latent space
    s_c = rnd(np.einsum("bthc,bsc->bhts", qa, kv))                        # against the latent cache
    s_r = rnd(np.einsum("bthr,bsr->bhts", q_pe, pe))                      # against the shared rope key
    scores = rnd(rnd(s_c + s_r) * np.float32(scale))
    scores = np.where(allowed[:, None], scores, -np.inf)
    p = rnd(softmax_ref(scores))                                          # [B, H, T, S]
    o = rnd(np.einsum("bhts,bsc->bthc", p, kv))                           # weighted latent
    return rnd(np.einsum("bthc,hvc->bthv", o, W_UV))                      # W^UV after the sum


def rms_norm_ref(x, w, eps, rnd):  # [..., D] -> [..., D]: rnd(w * x / rms(x)), computed in fp32
    x = np.asarray(x, np.float32)
    return rnd(w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))))


def latent_fp8_roundtrip_ref(c_kv):  # [..., C] bf16 values -> [..., C] bf16 values on the FP8 grid
    # not in paper: the official code (fix of 2025-11-17) simulates the deployed FP8 latent cache
    return quant.bf16_round(quant.act_dequant(*quant.act_quant(c_kv)))   # exact: power-of-two scales


def causal_mask_ref(B, T, start_pos, S):  # -> [B, T, S] bool: dense attention, every causal key
    return np.broadcast_to(indexer.causal_ref(T, start_pos, S), (B, T, S))


def store_ref(buf, start_pos, value, B, T):  # cache[:B, start_pos:start_pos+T] = value ([B, T, ...] or a scalar)
    buf[:B, start_pos:start_pos + T] = value


def mla_forward(x, p, cache, start_pos, S, cos, sin, args, opts):
    """One attention layer: x [B, T, d] -> [B, T, d]; writes this chunk into `cache` at start_pos and
    attends over its first S slots (S = start_pos + T; a captured decode passes the capacity).
    p: this layer's weights, with W^UK, W^UV made at load; opts: official, sparse, indexer_fp8 (bools),
    record (None, or --verify's dict) and ops, the backend's op table (ops.Ops)."""
    B, T, _ = x.shape
    H, N, R, V, C = (args.num_attention_heads, args.qk_nope_head_dim, args.qk_rope_head_dim,
                     args.v_head_dim, args.kv_lora_rank)
    ops, off = opts.ops, opts.official
    rnd = ops.bf16_round if off else ops.no_round

    # the down-projections of h = x: W^DQ h (-> c^Q), W^DKV h and W^KR h as one [B, T, C + R] (kv), and
    # the indexer's W^IK h; then from c^Q the queries W^UQ c^Q and the indexer's W^IQ c^Q. ops.linears
    # takes each group of one input as one GEMM on a GPU (the same bits as one GEMM per weight)
    idx = p["indexer"] if opts.sparse else None
    dq, kv, *k_idx = ops.linears(x, [p["wq_a"], p["wkv_a"]] + ([idx["wk"]] if idx else []), off)

    # queries: the low-rank path c^Q -> q
    qr = ops.rms_norm(dq, p["q_norm"], args.rms_norm_eps, rnd)                     # c^Q [B, T, r_q]
    q, *q_idx = ops.linears(qr, [p["wq_b"]] + ([idx["wq_b"]] if idx else []), off)
    q = q.reshape(B, T, H, N + R)
    q_nope, q_pe = q[..., :N], rnd(ops.rope_interleaved(q[..., N:], cos, sin))  # MLA: nope first, interleaved

    # keys and values: the compressed latent c^KV [B, T, C] and the shared rope key k^R [B, T, R]
    c_kv = ops.rms_norm(kv[..., :C], p["kv_norm"], args.rms_norm_eps, rnd)        # [B, T, C]
    k_pe = rnd(ops.rope_interleaved(kv[:, :, None, C:], cos, sin))[:, :, 0]       # [B, T, R]
    if ops.fused:  # the GPU's DSA kernels: one packed row per token, FP8 latent + scales (official; lossless) + rope
        ops.store_latent(cache.latent, start_pos, c_kv, k_pe, B, T)
    else:
        if off:
            c_kv = ops.latent_fp8_roundtrip(c_kv)
        ops.store(cache.kv, start_pos, c_kv, B, T)
        ops.store(cache.pe, start_pos, k_pe, B, T)

    # eq. (2): which keys each query may see
    if opts.sparse:
        allowed = indexer.indexer_forward(x, q_idx[0], k_idx[0], idx, cache.idx, start_pos, S, cos, sin, args, opts)
        if opts.record is not None:                     # --verify: the selection, layer by layer
            opts.record.setdefault("selected", []).append(
                ops.selection_mask(allowed, start_pos, S) if ops.fused else allowed)
    else:  # dense: V3.1-Terminus behaviour on the same weights (the indexer is not run)
        allowed = None if ops.fused else ops.causal_mask(B, T, start_pos, S)      # [B, T, S]; None: all causal

    if ops.fused:  # absorbed form for every chunk (as deployed engines), over the selected rows (DESIGN.md)
        o = ops.latent_attention(q_nope, q_pe, cache.latent, allowed, p, start_pos, S, args, rnd)
        return ops.linear(o.reshape(B, T, H * V), p["wo"], off)                    # W^O
    kv_all, pe_all = cache.kv[:B, :S], cache.pe[:B, :S]
    if T > 1:  # MHA mode: expand the whole cached latent (chunks after position 0 see the cache too)
        kvb = ops.linear(kv_all, p["wkv_b"], off).reshape(B, S, H, N + V)         # W^UK c, W^UV c
        o = ops.mha(q_nope, q_pe, kvb[..., :N], pe_all, kvb[..., N:], allowed, args.softmax_scale, rnd)
    else:      # absorbed MQA mode: W^UK and W^UV made at load (model.derive_weights)
        o = ops.mqa_absorbed(q_nope, q_pe, kv_all, pe_all, p["W_UK"], p["W_UV"], allowed, args.softmax_scale, rnd)
    return ops.linear(o.reshape(B, T, H * V), p["wo"], off)                        # W^O
