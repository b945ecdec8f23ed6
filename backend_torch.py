"""The PyTorch backend: the op table of model.py written in torch, on the CPU or a GPU.

Every op here has the same name and contract as its NumPy reference in NUMPY_OPS (model.py), so the
model's wiring is written once. Activations are float32 tensors holding bf16 values where the
official model holds bf16 (the reference's convention), FP8 weights stay FP8 on the device (one byte
per weight plus the 128x128 block scales).

On a CUDA or ROCm GPU the hot ops go to Triton kernels (kernels_cuda.py / kernels_rocm.py):
act_quant, the block-scaled FP8 GEMM and the grouped expert GEMM (experts stacked per layer, routed
on the device), RoPE and bf16 rounding, and DSA (fused = True): the indexer's per-token steps in one
kernel (index_prep), the selection as [B, T, K] indices (select), one packed
row per token of latent cache (latent_cache, store_latent, unpack_latent), the absorbed attention
over the selected rows for every chunk length (latent_attention; dense prefill through PyTorch's
scaled_dot_product_attention, dense_prefill). On the CPU, and for ops without a kernel, plain torch
computes what the reference computes (FP8 products in float64, which holds them exactly).
On every device, FP8 linears that share an input are laid out at load as row blocks of one weight
(fuse_rows, called by model.Transformer) and run as one GEMM (linears), with the same bits.
GraphDecoder, at the end, replays decode steps from a captured CUDA graph.
"""
import contextlib
from types import SimpleNamespace

import numpy as np
import torch

import quant
from quant_torch import F8, act_dequant, act_quant as act_quant_torch, dequant, fp8_gemm as fp8_gemm_torch, fp8_values, to_torch, unpack_latent

F8 = torch.float8_e4m3fn
SCORE_BYTES = 1 << 30       # the indexer's scores of a long prompt are computed in query chunks of this size


def kernels_for(device):  # the kernel module of a GPU, or None (CPU; or Triton missing)
    if device.type != "cuda":
        return None
    try:
        if torch.version.hip:
            import kernels_rocm as k
        else:
            import kernels_cuda as k
    except ImportError:
        return None
    return k


def torch_ops(device, kernels=True, dsa=None):
    """The op table for one device (see model.NUMPY_OPS for the contracts); kernels=False: plain torch.
    dsa: the module whose DSA kernels to use (default: the GPU's kernel module, when it has them);
    tests pass kernels_cuda on the CPU to run the model's DSA path in the Triton interpreter."""
    device = torch.device(device)
    kern = kernels_for(device) if kernels else None
    dsa = dsa or (kern if hasattr(kern, "sparse_mla_decode") else None)

    def bf16_round(x):  # bf16 values as float32 (a bf16 tensor: one copy, nothing to round)
        if x.dtype == torch.bfloat16:
            return x.float()
        if kern is not None and x.dtype == torch.float32:                # one launch instead of two
            return kern.bf16_round(x)
        return x.float().to(torch.bfloat16).float()

    def no_round(x):
        return x.float()

    def act_quant(x, block_size=128, scale_fmt="ue8m0"):
        if kern is not None and block_size == 128 and scale_fmt == "ue8m0":
            return kern.act_quant(x)
        return act_quant_torch(x, block_size, scale_fmt)

    def linear(x, W, official):
        if official and W.scale is None and W.w.dtype == torch.bfloat16:   # bf16 weights: a bf16 GEMM, bf16 out
            return (x.to(torch.bfloat16) @ W.w.T).float()
        if not official or W.scale is None:
            y = x.float() @ dequant(W).T
            return bf16_round(y) if official else y
        lead = x.shape[:-1]
        q, s = act_quant(x.reshape(-1, x.shape[-1]))
        return fp8_linear(q, s, W).reshape(*lead, -1)

    def fp8_linear(q, s, W):  # act_quant's [M, K] codes and scales times an FP8 weight -> [M, N] bf16 values
        if kern is not None:
            y = kern.fp8_gemm(q, s, W.w, W.scale)                       # bf16 out, as the official kernel
        else:
            y = fp8_gemm_torch(q, s, W.w, W.scale)
        return bf16_round(y)

    def fuse_rows(Ws):  # FP8 weights of one input -> the same Weights, as row blocks of one (linears: one GEMM)
        """At load. Every block but one must fill whole 128-row scale blocks; that one goes last.
        Anything else (plain or unscaled weights, different K, a marked subclass such as parallel's
        RowShard) comes back as it was."""
        whole = _whole(Ws) if len(Ws) > 1 else None
        if whole is not None and whole[0].w.shape[0] == sum(W.w.shape[0] for W in Ws):
            return list(Ws)                                                            # laid out so already
        ragged = sum(W.w.shape[0] % 128 > 0 for W in Ws)
        if len(Ws) < 2 or ragged > 1 or len({(W.w.shape[1], W.w.dtype) for W in Ws}) > 1 \
                or any(type(W) is not quant.Weight or W.scale is None for W in Ws):
            return list(Ws)
        order = sorted(range(len(Ws)), key=lambda i: Ws[i].w.shape[0] % 128 > 0)      # the ragged block last
        w, s = torch.cat([Ws[i].w for i in order]), torch.cat([Ws[i].scale for i in order])
        out, r = [None] * len(Ws), 0
        for i in order:
            n = Ws[i].w.shape[0]
            out[i] = quant.Weight(w[r:r + n], s[r // 128:-(-(r + n) // 128)])
            r += n
        return out

    def _whole(Ws):  # row blocks of one weight, as fuse_rows lays them out -> (that weight, row offsets), or None
        w, s = Ws[0].w._base, None if Ws[0].scale is None else Ws[0].scale._base
        if w is None or s is None or w.dim() != 2 or s.dim() != 2 or s.shape[0] != -(-w.shape[0] // 128):
            return None
        rows = []
        for W in Ws:
            if W.scale is None or W.w._base is not w or W.scale._base is not s or W.w.dtype != w.dtype \
                    or W.w.shape[1] != w.shape[1] or not W.w.is_contiguous() or s.shape[1] != W.scale.shape[1]:
                return None
            r = (W.w.data_ptr() - w.data_ptr()) // (w.stride(0) * w.element_size())
            if r % 128 or (W.scale.data_ptr() - s.data_ptr()) // (s.stride(0) * s.element_size()) != r // 128:
                return None
            rows.append(r)
        return quant.Weight(w, s), rows

    def linears(x, Ws, official):  # x times several weights: one GEMM when fuse_rows made them one weight's rows
        whole = _whole(Ws) if official and len(Ws) > 1 else None
        if whole is None:
            return [linear(x, W, official) for W in Ws]
        y = linear(x, whole[0], official)                # each output column depends on its own weight row only
        return [y[..., r:r + W.w.shape[0]] for W, r in zip(Ws, whole[1])]

    def rms_norm(x, w, eps, rnd):
        x = x.float()
        return rnd(w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)))

    def layer_norm(x, w, b, eps=1e-6):
        x = x.float()
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * w + b

    def rope_interleaved(x, cos, sin):
        if kern is not None and x.stride(-1) == 1:                       # one launch instead of seven
            return kern.rope(x, cos, sin, interleaved=True)
        x = x.float()
        a, b = x[..., 0::2], x[..., 1::2]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)

    def rope_half_split(x, cos, sin):
        if kern is not None and x.stride(-1) == 1:
            return kern.rope(x, cos, sin, interleaved=False)
        x = x.float()
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([a * c - b * s, a * s + b * c], -1)

    hadamard = {}

    def rotate_activation(x):
        D = x.shape[-1]
        if D not in hadamard:
            import indexer
            hadamard[D] = torch.from_numpy(np.array(indexer.hadamard_matrix(D))).to(device)
        return ((x.double() @ hadamard[D]) * D ** -0.5).float()

    def head_weights(x, weights_proj, q_scale, J, D):
        w = (x.float() @ dequant(weights_proj).T) * np.float32(J ** -0.5)
        return w * q_scale * np.float32(D ** -0.5)

    def index_scores(q, w, k, k_scale):  # [B,T,J,D], [B,T,J], [B,S,D], [B,S] -> [B,T,S]
        B, T, J, D = q.shape
        dt = torch.float32 if q.dtype == torch.float32 else torch.float64
        qk = (q.to(dt).reshape(B, T * J, D) @ k.to(dt).transpose(1, 2)).float().reshape(B, T, J, -1)
        I = torch.einsum("btj,btjs->bts", w.float(), qk.clamp_min(0))
        return I * k_scale.float()[:, None, :]

    def causal(T, start_pos, S):  # start_pos: an int, or a 0-d device tensor (captured decode)
        return torch.arange(S, device=device)[None, :] <= (start_pos + torch.arange(T, device=device))[:, None]

    def topk_select(I, K, start_pos):
        B, T, S = I.shape
        c = causal(T, start_pos, S)
        masked = I.masked_fill(~c[None], -float("inf"))
        order = torch.sort(-masked, dim=-1, stable=True).indices[..., :min(K, S)]   # ties: lower index first
        sel = torch.zeros(B, T, S, dtype=torch.bool, device=device).scatter_(-1, order, True)
        return sel & c[None]

    fused = dsa is not None                                              # the DSA kernels: indices, packed cache

    def select(q, w, k, k_scale, K, start_pos, indices=False):  # eqs. (1)-(2): indexer.select_ref
        if not indices:
            return topk_select(index_scores(q, w, k, k_scale), K, start_pos)
        if not fused:                                                    # the mask's positions, ascending
            sel = topk_select(index_scores(q, w, k, k_scale), K, start_pos)
            order = torch.sort(sel.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :K]
            pad = torch.zeros(*order.shape[:2], max(0, K - order.shape[-1]), dtype=order.dtype, device=device)
            order = torch.cat([order, pad], -1)
            return torch.where(torch.arange(K, device=device) < sel.sum(-1, keepdim=True), order, -1).int()
        B, T, S = q.shape[0], q.shape[1], k.shape[1]
        rows = max(1, SCORE_BYTES // (4 * B * S))                        # fp32 scores of bounded size at a time
        if T <= rows:
            return dsa.topk_indices(dsa.index_scores(q, w, k, k_scale, start_pos), K, start_pos)
        out = torch.empty(B, T, K, dtype=torch.int32, device=device)
        for t0 in range(0, T, rows):                                     # long prompts: query chunks
            t1 = min(T, t0 + rows)
            I = dsa.index_scores(q[:, t0:t1], w[:, t0:t1], k, k_scale, start_pos + t0)
            out[:, t0:t1] = dsa.topk_indices(I, K, start_pos + t0)
        return out

    prep = getattr(dsa, "index_prep", None)                             # gfx90a has no FP8 stores in Triton
    prep = prep if prep is not None and getattr(dsa, "fp8_stores", lambda: True)() else None

    def index_prep(x, q, k, p, cache, start_pos, cos, sin):  # indexer_forward's per-token steps in one kernel
        B, T, J = q.shape[:3]
        if "weights_proj_f32" not in p:                                  # fp32 once, not every step
            p["weights_proj_f32"] = dequant(p["weights_proj"])
        xw = (x.float() @ p["weights_proj_f32"].T).reshape(B, T, J)     # as head_weights, which then scales it
        return prep(q, k, xw, cos, sin, p["k_norm"], p["k_norm_bias"], cache.k, cache.k_scale, start_pos)

    def selection_mask(idx, start_pos, S):  # [B, T, K] indices (-1 padded) -> [B, T, S] bool, for --verify
        at = torch.where(idx >= 0, idx, S).long()
        return torch.zeros(*idx.shape[:2], S + 1, dtype=torch.bool, device=device).scatter_(-1, at, True)[..., :S]

    def latent_cache(B, cap, a, official):  # the kernels' latent cache: one row per token
        C, R = a.kv_lora_rank, a.qk_rope_head_dim
        if official:                        # FP8 codes, their ue8m0 scales, bf16 rope (spec/kernels.md §3.4)
            return torch.zeros(B, cap, quant.latent_width(C, R), dtype=torch.uint8, device=device)
        return torch.zeros(B, cap, C + R, dtype=torch.float32, device=device)   # exact numerics: float32

    def store_latent(buf, start_pos, c_kv, k_pe, B, T):  # c^KV [B, T, C], k^R [B, T, R] -> rows at start_pos
        if buf.dtype == torch.uint8:        # the official FP8 round trip's codes and scales: lossless
            flat = c_kv.reshape(B * T, -1)  # e4m3fn codes on every GPU (the format; kernels_rocm.latent_quant)
            q, sc = kern.latent_quant(flat) if hasattr(kern, "latent_quant") else act_quant(flat)
            rows = torch.cat([q.view(torch.uint8), sc.float().contiguous().view(torch.uint8),
                              k_pe.reshape(B * T, -1).to(torch.bfloat16).view(torch.uint8)], -1)
        else:
            rows = torch.cat([c_kv, k_pe], -1).float()
        store(buf, start_pos, rows.reshape(B, T, -1), B, T)

    def latent_attention(q_nope, q_pe, latent, sel, p, start_pos, S, args, rnd):
        """MLA over the packed latent cache through the kernels, absorbed form: q^C W^UK, attention
        over the selected rows (sel [B, T, K]; None: every causal key), then W^UV. Dense prefill
        chunks go through PyTorch's fused attention in the MHA form instead (dense_prefill)."""
        H, N, V, C = args.num_attention_heads, args.qk_nope_head_dim, args.v_head_dim, args.kv_lora_rank
        dt = torch.bfloat16 if latent.dtype == torch.uint8 else torch.float32   # official: bf16 operands
        if "wkv_b_kernels" not in p:                                     # W^UK [H, N, C], W^UV [H, V, C], once
            Wb = rnd(dequant(p["wkv_b"])).reshape(H, N + V, C).to(dt)
            p["wkv_b_kernels"] = (Wb[:, :N].contiguous(), Wb[:, N:].contiguous())   # no copy per call
        W_UK, W_UV = p["wkv_b_kernels"]
        B, T = q_nope.shape[:2]
        if sel is None and T > 1:
            return dense_prefill(q_nope, q_pe, latent, p, start_pos, S, args, rnd, dt)
        qa = torch.einsum("bthn,hnc->bthc", q_nope.to(dt), W_UK)         # [B, T, H, C] in dt (bf16: rnd's rounding)
        many = B * T * -(-H // 64) >= dsa.sm_count(device)               # one wave of programs without splits
        fn = dsa.sparse_mla_prefill if many else dsa.sparse_mla_decode
        o, _ = fn(qa, q_pe.to(dt), latent, sel, args.softmax_scale, start_pos, S=S, out_dtype=dt)   # weighted latent
        return rnd(torch.einsum("bthc,hvc->bthv", o, W_UV))

    def dense_prefill(q_nope, q_pe, latent, p, start_pos, S, args, rnd, dt):
        """Dense attention of a prefill chunk, MHA form: expand the cached latent with W^UKV, then
        PyTorch's scaled_dot_product_attention in query chunks with a lower-right causal mask."""
        from torch.nn.attention.bias import causal_lower_right
        H, N, R, V = args.num_attention_heads, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        B, T = q_nope.shape[:2]
        c_kv, k_pe = unpack_latent(latent[:B, :S], args.kv_lora_rank)
        kvb = linear(c_kv, p["wkv_b"], dt == torch.bfloat16).reshape(B, S, H, N + V)
        q = torch.cat([q_nope, q_pe], -1).to(dt).transpose(1, 2)                        # [B, H, T, N + R]
        k = torch.cat([kvb[..., :N], k_pe[:, :, None].expand(B, S, H, R)], -1).to(dt).transpose(1, 2)
        v = torch.nn.functional.pad(kvb[..., N:], (0, N + R - V)).to(dt).transpose(1, 2)  # padded to q's width
        o = torch.empty(B, H, T, N + R, dtype=dt, device=device)
        step = 4096
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            end = int(start_pos) + t1
            o[:, :, t0:t1] = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, t0:t1], k[:, :, :end], v[:, :, :end], attn_mask=causal_lower_right(t1 - t0, end),
                scale=args.softmax_scale)
        return rnd(o[..., :V].transpose(1, 2))

    def act_dequant(q, s):
        return (q.float().reshape(*q.shape[:-1], -1, 128) * s[..., None]).reshape(q.shape)

    def latent_fp8_roundtrip(c_kv):
        return bf16_round(act_dequant(*act_quant(c_kv)))

    def causal_mask(B, T, start_pos, S):
        return causal(T, start_pos, S)[None].expand(B, T, S)

    def store(buf, start_pos, value, B, T):  # cache write; a device start_pos keeps it capturable
        if isinstance(start_pos, torch.Tensor):
            if not isinstance(value, torch.Tensor):
                value = torch.full((B, T) + tuple(buf.shape[2:]), value, device=device)
            value = value.to(buf.dtype)
            if buf.element_size() == 1:                                  # FP8 keys: copy their bytes
                buf, value = buf.view(torch.uint8), value.view(torch.uint8)
            buf[:B].index_copy_(1, start_pos + torch.arange(T, device=device), value)
        else:
            buf[:B, start_pos:start_pos + T] = value

    def softmax(z):
        return torch.softmax(z.float(), -1)

    def mha(q_nope, q_pe, k_nope, k_pe, v, allowed, scale, rnd):
        H = q_nope.shape[2]
        q = torch.cat([q_nope, q_pe], -1).transpose(1, 2)                       # [B, H, T, N+R]
        k = torch.cat([k_nope, k_pe[:, :, None].expand(*k_pe.shape[:2], H, k_pe.shape[-1])], -1)
        scores = rnd(q @ k.permute(0, 2, 3, 1))
        scores = rnd(scores * np.float32(scale))
        scores = scores.masked_fill(~allowed[:, None], -float("inf"))
        p = rnd(softmax(scores))
        return rnd(p @ v.float().transpose(1, 2)).transpose(1, 2)

    def mqa_absorbed(q_nope, q_pe, kv, pe, Wb, allowed, scale, rnd):
        N = q_nope.shape[-1]
        qa = rnd(torch.einsum("bthn,hnc->bthc", q_nope, Wb[:, :N]))
        s_c = rnd(torch.einsum("bthc,bsc->bhts", qa, kv))
        s_r = rnd(torch.einsum("bthr,bsr->bhts", q_pe, pe))
        scores = rnd(rnd(s_c + s_r) * np.float32(scale))
        scores = scores.masked_fill(~allowed[:, None], -float("inf"))
        p = rnd(softmax(scores))
        o = rnd(torch.einsum("bhts,bsc->bthc", p, kv))
        return rnd(torch.einsum("bthc,hvc->bthv", o, Wb[:, N:]))

    def mlp(x, p, official):
        rnd = bf16_round if official else no_round
        if kern is None and official and p["w1"].scale is not None and p["w3"].scale is not None:
            q, s = act_quant(x.reshape(-1, x.shape[-1]))                 # CPU: w1 and w3 share one act_quant
            a, b = fp8_linear(q, s, p["w1"]), fp8_linear(q, s, p["w3"])
            return linear(rnd(torch.nn.functional.silu(a) * b), p["w2"], official).reshape(*x.shape[:-1], -1)
        a = linear(x, p["w1"], official)
        b = linear(x, p["w3"], official)
        return linear(rnd(torch.nn.functional.silu(a) * b), p["w2"], official)

    def gate(x, weight, bias, args):
        logits = x.float() @ weight.float().T
        if args.scoring_func == "sigmoid":
            s = torch.sigmoid(logits)
        else:
            s = torch.softmax(logits, -1)
        choice = s if bias is None else s + bias
        M, E = s.shape
        G = args.n_group
        if G > 1:
            grouped = choice.reshape(M, G, E // G)
            group_score = grouped.amax(-1) if bias is None else grouped.topk(2, -1).values.sum(-1)
            keep = torch.sort(-group_score, dim=-1, stable=True).indices[:, :args.topk_group]
            in_kept = torch.zeros(M, G, dtype=torch.bool, device=device).scatter_(1, keep, True)
            choice = choice.masked_fill(~in_kept.repeat_interleave(E // G, 1), -float("inf"))
        idx = torch.sort(-choice, dim=-1, stable=True).indices[:, :args.num_experts_per_tok]
        w = s.gather(1, idx)
        if args.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w * np.float32(args.routed_scaling_factor), idx

    def experts(mlps):  # the routed experts' MLPs -> all stacked: w13 [E, 2I, d] (gate rows, then up), w2 [E, d, I]
        I = mlps[0]["w1"].w.shape[0]
        assert I % 128 == 0, f"moe_intermediate_size {I} is not a multiple of 128 (one scale block per row block)"
        stack = {}
        for name, parts in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            ws = [torch.cat([weight(m[k]).w for k in parts]) for m in mlps]
            ss = [torch.cat([weight(m[k]).scale for k in parts]) for m in mlps]
            stack[name] = quant.Weight(torch.stack(ws), torch.stack(ss))
        return stack

    def route(idx, E, bm):
        """[M, Kt] expert ids -> the grouped GEMM's rows, on the device, no host synchronisation:
        token-expert pairs sorted by expert and padded to bm-row blocks of one expert each.
        -> rows_tok [P] (token of each row, -1 padding), pair_at [P] (pair of each row; padding ->
        the trash index M*Kt), block_expert [P / bm] (-1: unused block)."""
        M, Kt = idx.shape
        pairs = M * Kt
        P = -(-(pairs + min(pairs, E) * (bm - 1)) // bm) * bm          # enough for any routing
        flat = idx.reshape(-1)
        sorted_e, order = torch.sort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))  # no sync
        padded = (counts + bm - 1) // bm * bm
        start_pad, start = torch.cumsum(padded, 0) - padded, torch.cumsum(counts, 0) - counts
        dest = start_pad[sorted_e] + torch.arange(pairs, device=device) - start[sorted_e]
        rows_tok = torch.full((P,), -1, dtype=torch.int32, device=device)
        rows_tok[dest] = (order // Kt).to(torch.int32)
        pair_at = torch.full((P,), pairs, dtype=torch.int64, device=device)
        pair_at[dest] = order
        block_expert = torch.full((P // bm,), -1, dtype=torch.int32, device=device)
        block_expert[dest // bm] = sorted_e.to(torch.int32)
        return rows_tok, pair_at, block_expert

    def grouped(q, s, W, rows, block_expert):  # -> [P, N] bf16 values (float32); padding rows garbage
        if kern is not None:
            return kern.moe_gemm(q, s, W.w, W.scale, rows, block_expert).float()
        P, bm = rows.shape[0], rows.shape[0] // block_expert.shape[0]
        out = torch.zeros(P, W.w.shape[1], device=device)
        be = block_expert.repeat_interleave(bm)
        for e in torch.unique(be[(rows >= 0) & (be >= 0)]).tolist():     # CPU: one GEMM per expert present
            sel = torch.nonzero((rows >= 0) & (be == e)).squeeze(1)
            r = rows[sel].long()
            out[sel] = bf16_round(fp8_gemm_torch(q[r], s[r], W.w[e], W.scale[e]))
        return out

    def moe(x, p, args, official):
        """Routed experts through the grouped GEMM over all experts' stacked weights (on the CPU: one
        GEMM per chosen expert, the same rows' products); the per-token sum over its experts in
        expert-id order in fp32, the shared experts last (as the reference)."""
        w, idx = gate(x, p["gate"].w, p.get("gate_bias"), args)
        M, Kt = idx.shape
        D = x.shape[1]
        if not official or p["w13"].scale is None:                       # exact numerics / bf16 weights
            out = torch.zeros(M * Kt + 1, D, device=device)
            for e in torch.unique(idx).tolist():
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                W1, W2 = p["w13"].w[e], p["w2"].w[e]
                S1 = None if p["w13"].scale is None else p["w13"].scale[e]
                S2 = None if p["w2"].scale is None else p["w2"].scale[e]
                I = W1.shape[0] // 2
                g = linear(x[tok], quant.Weight(W1, S1), official)
                h = (bf16_round if official else no_round)(torch.nn.functional.silu(g[:, :I]) * g[:, I:])
                out[tok * Kt + slot] = linear(h, quant.Weight(W2, S2), official)
        elif kern is None:      # CPU: each chosen expert on its tokens' rows (no padded routing table to build)
            q, s = act_quant(x)                                          # per row: the same codes as x[tok]'s
            out = torch.zeros(M * Kt + 1, D, device=device)
            for e in torch.unique(idx).tolist():                         # as grouped: one GEMM per expert present
                tok, slot = torch.nonzero(idx == e, as_tuple=True)
                g = fp8_linear(q[tok], s[tok], quant.Weight(p["w13"].w[e], p["w13"].scale[e]))   # gate | up
                I = g.shape[1] // 2
                h = bf16_round(torch.nn.functional.silu(g[:, :I]) * g[:, I:])
                out[tok * Kt + slot] = fp8_linear(*act_quant(h), quant.Weight(p["w2"].w[e], p["w2"].scale[e]))
        else:
            E = p["w13"].w.shape[0]
            rows_tok, pair_at, block_expert = route(idx, E, 16)
            q, s = act_quant(x)
            g = grouped(q, s, p["w13"], rows_tok, block_expert)             # [P, 2I]: gate | up
            I = g.shape[1] // 2
            h = bf16_round(torch.nn.functional.silu(g[:, :I]) * g[:, I:])
            q2, s2 = act_quant(h)
            rows_self = torch.where(rows_tok >= 0, torch.arange(rows_tok.shape[0], device=device, dtype=torch.int32), -1)
            o = grouped(q2, s2, p["w2"], rows_self, block_expert)           # [P, d]
            out = torch.zeros(M * Kt + 1, D, device=device).index_copy_(0, pair_at, o)   # padding -> the trash row
        out = out[:M * Kt].view(M, Kt, D)
        perm = torch.argsort(idx, dim=1, stable=True)                    # each token's experts by id
        ws, outs = w.gather(1, perm), out.gather(1, perm[..., None].expand(M, Kt, D))
        y = torch.zeros(M, D, device=device)
        for k in range(Kt):                                              # fp32, expert-id order
            y += outs[:, k] * ws[:, k, None]
        y += mlp(x, p["shared_experts"], official)
        return bf16_round(y) if official else y

    def expert_linear(x, ffn, e, name):  # one expert's w1 / w3 / w2 product through the fast path's own layout
        M = x.shape[0]
        P = -(-M // 16) * 16
        rows = torch.full((P,), -1, dtype=torch.int32, device=device)
        rows[:M] = torch.arange(M, dtype=torch.int32, device=device)
        be = torch.full((P // 16,), e, dtype=torch.int32, device=device)
        q, s = act_quant(x)
        W = ffn["w2"] if name == "w2" else ffn["w13"]
        y = grouped(q, s, W, rows, be)[:M]
        I = W.w.shape[1] // 2
        return y if name == "w2" else (y[:, :I] if name == "w1" else y[:, I:])

    def weight(W):  # a checkpoint Weight -> device tensors, in the kernels' storage (e4m3fnuz on gfx942)
        w, s = to_torch(W.w, device), None if W.scale is None else to_torch(W.scale, device)
        if s is not None and hasattr(kern, "prepare_weight"):
            w, s = kern.prepare_weight(w, s)
        return quant.Weight(w, s)

    def zeros(shape, fp8):  # cache storage; FP8 keys in this GPU's flavour (e4m3fnuz on gfx942)
        f8 = kern.fp8_dtype() if hasattr(kern, "fp8_dtype") else F8
        return torch.zeros(shape, dtype=f8 if fp8 else torch.float32, device=device)

    return SimpleNamespace(
        name="torch", device=device, kernels=kern,
        bf16_round=bf16_round, no_round=no_round, act_quant=act_quant, linear=linear, dequant=dequant,
        linears=linears, fuse_rows=fuse_rows, rms_norm=rms_norm, layer_norm=layer_norm, rope_interleaved=rope_interleaved, rope_half_split=rope_half_split,
        rotate_activation=rotate_activation, head_weights=head_weights, index_scores=index_scores,
        topk_select=topk_select, select=select, selection_mask=selection_mask, fused=fused, latent_cache=latent_cache,
        index_prep=index_prep if prep is not None else None,
        store_latent=store_latent, latent_attention=latent_attention, latent_fp8_roundtrip=latent_fp8_roundtrip, causal_mask=causal_mask, store=store,
        mha=mha, mqa_absorbed=mqa_absorbed, mlp=mlp, moe=moe, gate=gate, experts=experts, expert_linear=expert_linear,
        route=route, grouped=grouped,
        cat=lambda xs, axis: torch.cat(xs, axis), zeros=zeros,
        tokens=lambda t: torch.as_tensor(np.asarray(t), device=device),
        angles=lambda cos, sin: (torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)),
        embed=lambda table, tokens: table[tokens].float(),
        head=lambda h, w: h @ w.T, head_weight=lambda w: w.float(),
        param=lambda a: to_torch(a, device), weight=weight, act_dequant=act_dequant,
        plain_weight=lambda W: quant.Weight(to_torch(W.w, device), None if W.scale is None else to_torch(W.scale, device)),
    )


# -----------------------------------------------------------------------------
# Decode replayed from a captured CUDA graph

class GraphDecoder:
    """Decode steps of a loaded torch model replayed from one CUDA graph of Transformer.decode_static:
    the caches are preallocated (model.reserve), the token and the position sit in device buffers, and
    a step is two small copies, a replay and nothing read back but what the caller reads. Built after
    the prefill, at the first position to decode (its warm-up runs write only that slot, which the
    first real step overwrites). Official numerics only: the exact path's expert loop reads back
    which experts were chosen, which a graph cannot hold."""

    def __init__(self, model, batch, first_pos):
        dev = model.caches[0].idx.k_scale.device
        self.model = model
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.full((), first_pos, dtype=torch.long, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):                                    # compile kernels, fill lazy tables
            for _ in range(2):
                model.decode_static(self.tok, self.pos)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.decode_static(self.tok, self.pos)

    def __call__(self, tokens, pos):  # tokens [B, 1] (device or host) at position pos -> logits [B, V]
        self.tok.copy_(torch.as_tensor(tokens).reshape(self.tok.shape), non_blocking=True)
        self.pos.fill_(pos)
        self.graph.replay()
        self.model.cached_len = pos + 1
        return self.logits
