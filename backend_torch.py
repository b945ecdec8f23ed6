"""The PyTorch backend: the op table of model.py written in torch, on the CPU or a GPU.

Every op here has the same name and contract as its NumPy reference in NUMPY_OPS (model.py), so the
model's wiring is written once. Activations are float32 tensors holding bf16 values where the
official model holds bf16 (the reference's convention), FP8 weights stay FP8 on the device (one byte
per weight plus the 128x128 block scales).

On a CUDA or ROCm GPU the hot ops go to Triton kernels (kernels_cuda.py / kernels_rocm.py):
act_quant and the block-scaled FP8 GEMM. On the CPU, and for ops without a kernel yet, plain torch
computes what the reference computes (FP8 products in float64, which holds them exactly).
"""
from types import SimpleNamespace

import numpy as np
import torch

import quant

F8 = torch.float8_e4m3fn


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


# -----------------------------------------------------------------------------
# NumPy (ml_dtypes) arrays -> torch tensors, without a float copy for FP8 and bf16

def to_torch(a, device):  # one host copy (the source may be a read-only memory map), then to the device
    a = np.asarray(a)
    if a.dtype == quant.E4M3:
        t = torch.from_numpy(np.array(a.view(np.uint8))).view(F8)
    elif a.dtype == quant.BF16:
        t = torch.from_numpy(np.array(a.view(np.uint16))).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.array(a))
    return t.to(device)


def ue8m0_ceil(v):  # float32 tensor > 0 -> 2^ceil(log2 v), from the bits (as quant.ue8m0_ceil)
    bits = v.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((e + 127) << 23).view(torch.float32)


def act_quant_torch(x, block_size=128, scale_fmt="ue8m0"):  # quant.act_quant in torch: [..., N] -> fp8, [..., N/bs]
    x = x.float()
    xb = x.reshape(*x.shape[:-1], -1, block_size)
    amax = xb.abs().amax(-1).clamp_min(1e-4)
    v = amax * torch.tensor(1 / 448, dtype=torch.float32, device=x.device)   # one fp32 multiply
    s = ue8m0_ceil(v) if scale_fmt == "ue8m0" else v
    q = (xb / s[..., None]).clamp(-448, 448).to(F8)
    return q.reshape(x.shape), s


def fp8_gemm_torch(a, sa, b, sb, block_size=128):  # quant.fp8_gemm in torch (float64 partials: exact)
    M, K = a.shape
    N = b.shape[0]
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    sb_rows = sb.repeat_interleave(block_size, 0)[:N]                  # [N, Kb]
    acc = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    for kb in range(-(-K // block_size)):
        k = slice(kb * block_size, (kb + 1) * block_size)
        partial = (a64[:, k] @ b64[:, k].T).float()
        acc += partial * (sa[:, kb, None] * sb_rows[None, :, kb])
    return acc


def dequant(W):  # quant.Weight of tensors -> [N, K] float32
    if W.scale is None:
        return W.w.float()
    N, K = W.w.shape
    s = W.scale.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return W.w.float() * s


def torch_ops(device, kernels=True):
    """The op table for one device (see model.NUMPY_OPS for the contracts); kernels=False: plain torch."""
    device = torch.device(device)
    kern = kernels_for(device) if kernels else None

    def bf16_round(x):
        return x.float().to(torch.bfloat16).float()

    def no_round(x):
        return x.float()

    def act_quant(x, block_size=128, scale_fmt="ue8m0"):
        if kern is not None and block_size == 128 and scale_fmt == "ue8m0":
            return kern.act_quant(x)
        return act_quant_torch(x, block_size, scale_fmt)

    def linear(x, W, official):
        if not official or W.scale is None:
            y = x.float() @ dequant(W).T
            return bf16_round(y) if official else y
        lead = x.shape[:-1]
        q, s = act_quant(x.reshape(-1, x.shape[-1]))
        if kern is not None:
            y = kern.fp8_gemm(q, s, W.w, W.scale)                       # bf16 out, as the official kernel
        else:
            y = fp8_gemm_torch(q, s, W.w, W.scale)
        return bf16_round(y).reshape(*lead, -1)

    def rms_norm(x, w, eps, rnd):
        x = x.float()
        return rnd(w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)))

    def layer_norm(x, w, b, eps=1e-6):
        x = x.float()
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * w + b

    def rope_interleaved(x, cos, sin):
        x = x.float()
        a, b = x[..., 0::2], x[..., 1::2]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)

    def rope_half_split(x, cos, sin):
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

    def causal(T, start_pos):
        return torch.arange(start_pos + T, device=device)[None, :] <= (start_pos + torch.arange(T, device=device))[:, None]

    def topk_select(I, K, start_pos):
        B, T, S = I.shape
        c = causal(T, start_pos)
        masked = torch.where(c[None], I, torch.tensor(-float("inf"), device=device))
        order = torch.sort(-masked, dim=-1, stable=True).indices[..., :min(K, S)]   # ties: lower index first
        sel = torch.zeros(B, T, S, dtype=torch.bool, device=device).scatter_(-1, order, True)
        return sel & c[None]

    def act_dequant(q, s):
        return (q.float().reshape(*q.shape[:-1], -1, 128) * s[..., None]).reshape(q.shape)

    def latent_fp8_roundtrip(c_kv):
        return bf16_round(act_dequant(*act_quant(c_kv)))

    def causal_mask(B, T, start_pos):
        return causal(T, start_pos)[None].expand(B, T, start_pos + T)

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

    def moe(x, p, args, official):
        w, idx = gate(x, p["gate"].w, p.get("gate_bias"), args)
        y = torch.zeros(x.shape, dtype=torch.float32, device=device)
        for e in torch.unique(idx).tolist():                                   # expert-id order, fp32 sum
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            y[tok] += mlp(x[tok], p["experts"][e], official) * w[tok, slot, None]
        y += mlp(x, p["shared_experts"], official)
        return bf16_round(y) if official else y

    def weight(W):  # a checkpoint Weight -> device tensors, in the kernels' storage (e4m3fnuz on gfx942)
        w, s = to_torch(W.w, device), None if W.scale is None else to_torch(W.scale, device)
        if s is not None and hasattr(kern, "prepare_weight"):
            w, s = kern.prepare_weight(w, s)
        return quant.Weight(w, s)

    def zeros(shape, fp8):
        return torch.zeros(shape, dtype=F8 if fp8 else torch.float32, device=device)

    return SimpleNamespace(
        name="torch", device=device, kernels=kern,
        bf16_round=bf16_round, no_round=no_round, act_quant=act_quant, linear=linear, dequant=dequant,
        rms_norm=rms_norm, layer_norm=layer_norm, rope_interleaved=rope_interleaved, rope_half_split=rope_half_split,
        rotate_activation=rotate_activation, head_weights=head_weights, index_scores=index_scores,
        topk_select=topk_select, latent_fp8_roundtrip=latent_fp8_roundtrip, causal_mask=causal_mask,
        mha=mha, mqa_absorbed=mqa_absorbed, mlp=mlp, moe=moe, gate=gate,
        cat=lambda xs, axis: torch.cat(xs, axis), zeros=zeros,
        tokens=lambda t: torch.as_tensor(np.asarray(t), device=device),
        angles=lambda cos, sin: (torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)),
        embed=lambda table, tokens: table[tokens].float(),
        head=lambda h, w: h @ w.T, head_weight=lambda w: w.float(),
        param=lambda a: to_torch(a, device), weight=weight, act_dequant=act_dequant,
        plain_weight=lambda W: quant.Weight(to_torch(W.w, device), None if W.scale is None else to_torch(W.scale, device)),
    )
