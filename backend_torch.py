"""The PyTorch backend: the op contract of ops.py (ops.Ops) written in torch, on the CPU or a GPU.

Each function below is the torch twin of the reference named on its def line, with the same
arguments, under the same banners as the reference files. Activations are float32 tensors holding
bf16 values where the official model holds bf16 (the reference's convention); FP8 weights stay FP8
on the device (one byte per weight plus the 128x128 block scales). The numbers themselves (act_quant,
the exact FP8 GEMM, dequantisation) are quant_torch.py's.

`kern` is the GPU's kernel module (kernels_cuda.py or kernels_rocm.py; None on the CPU, or for plain
torch on a GPU): the hot ops go to its Triton kernels (act_quant, the block-scaled FP8 GEMM, the grouped
expert GEMM, RoPE, bf16 rounding). `dsa` is the module whose DSA kernels run the selection and the
attention (fused): the indexer's per-token steps in one kernel (index_prep), the selection as [B, T, K]
indices, one packed row per token of latent cache, and the absorbed attention over the selected rows
for every chunk length (latent_attention; dense prefill through PyTorch's scaled_dot_product_attention).
torch_ops(device) binds them and fills the table; on the CPU, plain torch computes what the reference
computes (FP8 products in float64, which holds them exactly).

On every device, FP8 linears that share an input are laid out at load as row blocks of one weight
(fuse_rows) and run as one GEMM (linears), with the same bits. GraphDecoder, at the end, replays
decode steps from a captured CUDA graph.

Letters as in ops.py.
"""
import functools
from functools import partial

import numpy as np
import torch

import compressor
from attention_v4 import BLOCK, V4LayerCache
import indexer
import quant
from ops import Ops
from quant_torch import F8, act_dequant, cpu_threads_for, dequant, fp8_gemm as fp8_gemm_torch, to_torch, unpack_latent
import quant_torch

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


# -----------------------------------------------------------------------------
# Rounding points, number formats and linears (quant.py)

def bf16_round(x, *, kern=None):  # quant.bf16_round (a bf16 tensor: one copy, nothing to round)
    if x.dtype == torch.bfloat16:
        return x.float()
    if kern is not None and x.dtype == torch.float32:                    # one launch instead of two
        return kern.bf16_round(x)
    return x.float().to(torch.bfloat16).float()


def no_round(x):  # quant.no_round
    return x.float()


def act_quant(x, block_size=128, scale_fmt="ue8m0", *, kern=None):  # quant.act_quant
    if kern is not None and block_size == 128 and scale_fmt == "ue8m0":
        return kern.act_quant(x)
    return quant_torch.act_quant(x, block_size, scale_fmt)


def linear(x, W, official, *, kern=None):  # quant.linear_ref: [..., K], Weight [N, K] -> [..., N]
    if official and W.scale is None and W.w.dtype == torch.bfloat16:   # bf16 weights: a bf16 GEMM, bf16 out
        return (x.to(torch.bfloat16) @ W.w.T).float()
    if not official or W.scale is None:
        y = x.float() @ dequant(W).T
        return bf16_round(y, kern=kern) if official else y
    lead = x.shape[:-1]
    q, s = act_quant(x.reshape(-1, x.shape[-1]), kern=kern)
    return fp8_linear(q, s, W, kern=kern).reshape(*lead, -1)


def fp8_linear(q, s, W, *, kern=None):  # act_quant's [M, K] codes and scales times an FP8 weight -> [M, N] bf16 values
    if W.w.dtype == torch.uint8:                                        # V4's FP4 experts (quant.fp4_gemm)
        y = kern.fp4_gemm(q, s, W.w, W.scale, fnuz=q.dtype == torch.float8_e4m3fnuz) if kern is not None \
            else quant_torch.fp4_gemm(q, s, W.w, W.scale)
        return bf16_round(y, kern=kern)
    if kern is not None:                                                # bf16 values, as the official kernel's bf16 out
        return kern.fp8_gemm(q, s, W.w, W.scale, out_dtype=torch.float32, bf16_values=True)
    return bf16_round(fp8_gemm_torch(q, s, W.w, W.scale))


def linears(x, Ws, official, *, kern=None):  # quant.linears_ref: one GEMM when fuse_rows made them one weight's rows
    whole = _whole(Ws) if official and len(Ws) > 1 else None
    if whole is None:
        return [linear(x, W, official, kern=kern) for W in Ws]
    y = linear(x, whole[0], official, kern=kern)        # each output column depends on its own weight row only
    return [y[..., r:r + W.w.shape[0]] for W, r in zip(Ws, whole[1])]


def fuse_rows(Ws):  # FP8 weights of one input -> the same Weights, as row blocks of one (linears: one GEMM)
    """At load. Every block but one must fill whole 128-row scale blocks; that one goes last.
    Anything else (plain or unscaled weights, different K, a marked subclass such as parallel's
    RowShard) comes back as it was."""
    whole = _whole(Ws) if len(Ws) > 1 else None
    if whole is not None and whole[0].w.shape[0] == sum(W.w.shape[0] for W in Ws):
        return list(Ws)                                                                # laid out so already
    ragged = sum(W.w.shape[0] % 128 > 0 for W in Ws)
    if len(Ws) < 2 or ragged > 1 or len({(W.w.shape[1], W.w.dtype) for W in Ws}) > 1 \
            or any(type(W) is not quant.Weight or W.scale is None for W in Ws):
        return list(Ws)
    order = sorted(range(len(Ws)), key=lambda i: Ws[i].w.shape[0] % 128 > 0)          # the ragged block last
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


def weight(W, *, device, kern=None):  # a checkpoint Weight -> device tensors, in the kernels' storage (e4m3fnuz on gfx942)
    w, s = to_torch(W.w, device), None if W.scale is None else to_torch(W.scale, device)
    if s is not None and kern is not None and w.dtype != torch.uint8:      # FP4 (V4's experts): its own bytes
        w, s = kern.prepare_weight(w, s)
    return quant.Weight(w, s)


def plain_weight(W, *, device):  # a checkpoint Weight -> device tensors, the checkpoint's own layout
    return quant.Weight(to_torch(W.w, device), None if W.scale is None else to_torch(W.scale, device))


def zeros(shape, fp8, *, device, kern=None):  # cache storage; FP8 keys in this GPU's flavour (e4m3fnuz on gfx942)
    f8 = kern.fp8_dtype() if kern is not None else F8
    return torch.zeros(shape, dtype=f8 if fp8 else torch.float32, device=device)


# -----------------------------------------------------------------------------
# Norms and RoPE (attention.rms_norm_ref, indexer.layer_norm_ref, rope.py)

def rms_norm(x, w, eps, rnd, *, kern=None):  # attention.rms_norm_ref
    official = _norm_kernel(x, w, rnd, kern)
    if official is not None:
        return kern.rms_norm(x, w, eps, official)                       # one launch instead of seven
    x = x.float()
    return rnd(w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)))


def add_norm(x, residual, w, eps, rnd, *, kern=None):  # model.Transformer._norm's steps: s = x + residual
    official = _norm_kernel(x, w, rnd, kern)
    if official is None or w is None or residual.dtype != torch.float32 or residual.shape != x.shape:
        s = x + residual
        return rms_norm(s, w, eps, rnd, kern=kern), rnd(s)
    return kern.add_rms_norm(x, residual, w, eps, official)                 # one launch instead of three


def _norm_kernel(x, w, rnd, kern):
    """Whether the kernels' rms_norm computes this norm: None (no: torch) or its official flag (rnd is
    bf16_round, or the op table's partial of it: True; no_round: False); float32 rows it holds, w [D]."""
    official = False if rnd is no_round else True if bf16_round in (rnd, getattr(rnd, "func", None)) else None
    if kern is None or x.dtype != torch.float32 or not 0 < (x.shape[-1] if x.dim() else 0) <= kern.RMS_NORM_MAX \
            or (w is not None and w.shape != x.shape[-1:]):
        return None
    return official


def layer_norm(x, w, b, eps=1e-6):  # indexer.layer_norm_ref
    x = x.float()
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def rope_interleaved(x, cos, sin, *, kern=None):  # rope.rope_interleaved: pairs (x0, x1), (x2, x3), ...
    if kern is not None and x.stride(-1) == 1:                           # one launch instead of seven
        return kern.rope(x, cos, sin, interleaved=True)
    x = x.float()
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)


def rope_half_split(x, cos, sin, *, kern=None):  # rope.rope_half_split: halves (x[:R/2], x[R/2:])
    if kern is not None and x.stride(-1) == 1:
        return kern.rope(x, cos, sin, interleaved=False)
    x = x.float()
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([a * c - b * s, a * s + b * c], -1)


# -----------------------------------------------------------------------------
# DSA: the lightning indexer, eq. (1), and the top-k selection, eq. (2) (indexer.py)

@functools.lru_cache(maxsize=None)
def _hadamard(D, device):  # indexer.hadamard_matrix on the device, float64
    return torch.from_numpy(np.array(indexer.hadamard_matrix(D))).to(device)


def rotate_activation(x):  # indexer.rotate_activation_ref: [..., D] -> x H_D D^-1/2, in float64
    D = x.shape[-1]
    return ((x.double() @ _hadamard(D, x.device)) * D ** -0.5).float()


def proj_f32(x, W, *, kern=None):  # x [..., K], W [N, K] (float32, or bf16 as stored) -> x W^T [..., N] float32
    """The official code's fp32 projections (the router, the indexer's head weights, the output head).
    With a kernel module: exact products and float64 sums, rounded once (kernels_fp8.matmul_f32: the
    same bits for any row count), the bf16 weight read as stored; else torch's fp32 matmul."""
    if kern is None:
        return x.float() @ W.float().T
    return kern.matmul_f32(x.reshape(-1, x.shape[-1]), W.T).reshape(*x.shape[:-1], W.shape[0])


def fp32_weight(W, *, kern=None):  # a plain weight for proj_f32, made at load: float32; as stored for the kernel
    return W if kern is not None else W.float()


def head_weights(x, weights_proj, q_scale, J, D, *, kern=None):  # indexer.head_weights_ref
    w = proj_f32(x, weights_proj.w, kern=kern) * np.float32(J ** -0.5)
    return w * q_scale * np.float32(D ** -0.5)


def index_scores(q, w, k, k_scale):  # indexer.index_scores_ref: [B,T,J,D], [B,T,J], [B,S,D], [B,S] -> [B,T,S]
    B, T, J, D = q.shape
    dt = torch.float32 if q.dtype == torch.float32 else torch.float64      # fp8 products: exact in float64
    qk = (q.to(dt).reshape(B, T * J, D) @ k.to(dt).transpose(1, 2)).float().reshape(B, T, J, -1)
    I = torch.einsum("btj,btjs->bts", w.float(), qk.clamp_min(0))
    return I * k_scale.float()[:, None, :]


def causal(T, start_pos, S, device):  # indexer.causal_ref; start_pos: an int, or a 0-d device tensor (captured decode)
    return torch.arange(S, device=device)[None, :] <= (start_pos + torch.arange(T, device=device))[:, None]


def topk_select(I, K, start_pos):  # indexer.topk_select_ref: ties to the lower index
    B, T, S = I.shape
    c = causal(T, start_pos, S, I.device)
    masked = I.masked_fill(~c[None], -float("inf"))
    order = torch.sort(-masked, dim=-1, stable=True).indices[..., :min(K, S)]
    sel = torch.zeros(B, T, S, dtype=torch.bool, device=I.device).scatter_(-1, order, True)
    return sel & c[None]


def select(q, w, k, k_scale, K, start_pos, indices=False, *, dsa=None):  # indexer.select_ref: eqs. (1)-(2)
    """dsa: the DSA kernels score and select (indices=True), long prompts in query chunks of SCORE_BYTES."""
    if dsa is None or not indices:
        sel = topk_select(index_scores(q, w, k, k_scale), K, start_pos)
        return selection_indices(sel, K) if indices else sel
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    rows = max(1, SCORE_BYTES // (4 * B * S))                            # fp32 scores of bounded size at a time
    if T <= rows:
        return dsa.topk_indices(dsa.index_scores(q, w, k, k_scale, start_pos), K, start_pos)
    out = torch.empty(B, T, K, dtype=torch.int32, device=q.device)
    for t0 in range(0, T, rows):                                         # long prompts: query chunks
        t1 = min(T, t0 + rows)
        I = dsa.index_scores(q[:, t0:t1], w[:, t0:t1], k, k_scale, start_pos + t0)
        out[:, t0:t1] = dsa.topk_indices(I, K, start_pos + t0)
    return out


def selection_indices(sel, K):  # indexer.selection_indices_ref: [B, T, S] bool -> [B, T, K] int32, -1 padded
    order = torch.sort(sel.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :K]
    pad = torch.zeros(*order.shape[:2], max(0, K - order.shape[-1]), dtype=order.dtype, device=sel.device)
    order = torch.cat([order, pad], -1)
    return torch.where(torch.arange(K, device=sel.device) < sel.sum(-1, keepdim=True), order, -1).int()


def index_prep(x, q, k, p, cache, start_pos, cos, sin, *, dsa):  # indexer.index_prep_ref, in one kernel
    B, T, J = q.shape[:3]
    xw = proj_f32(x, p["weights_proj"].w, kern=dsa).reshape(B, T, J)    # as head_weights
    return dsa.index_prep(q, k, xw, cos, sin, p["k_norm"], p["k_norm_bias"], cache.k, cache.k_scale, start_pos)


def selection_mask(idx, start_pos, S):  # [B, T, K] indices (-1 padded) -> [B, T, S] bool, for --verify
    at = torch.where(idx >= 0, idx, S).long()
    return torch.zeros(*idx.shape[:2], S + 1, dtype=torch.bool, device=idx.device).scatter_(-1, at, True)[..., :S]


# -----------------------------------------------------------------------------
# MLA (attention.py)

def latent_fp8_roundtrip(c_kv, *, kern=None):  # attention.latent_fp8_roundtrip_ref
    return bf16_round(act_dequant(*act_quant(c_kv, kern=kern)), kern=kern)


def causal_mask(B, T, start_pos, S, *, device):  # attention.causal_mask_ref
    return causal(T, start_pos, S, device)[None].expand(B, T, S)


def store(buf, start_pos, value, B, T):  # attention.store_ref; a device start_pos keeps it capturable
    if isinstance(start_pos, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            value = torch.full((B, T) + tuple(buf.shape[2:]), value, device=buf.device)
        value = value.to(buf.dtype)
        if buf.element_size() == 1:                                      # FP8 keys: copy their bytes
            buf, value = buf.view(torch.uint8), value.view(torch.uint8)
        buf[:B].index_copy_(1, start_pos + torch.arange(T, device=buf.device), value)
    else:
        buf[:B, start_pos:start_pos + T] = value


def softmax(z):  # attention.softmax_ref
    return torch.softmax(z.float(), -1)


def mha(q_nope, q_pe, k_nope, k_pe, v, allowed, scale, rnd):  # attention.mha_ref, step for step
    H = q_nope.shape[2]
    q = torch.cat([q_nope, q_pe], -1).transpose(1, 2)                           # [B, H, T, N+R]
    k = torch.cat([k_nope, k_pe[:, :, None].expand(*k_pe.shape[:2], H, k_pe.shape[-1])], -1)   # [B, S, H, N+R]
    scores = rnd(q @ k.permute(0, 2, 3, 1))                                     # [B, H, T, S]
    scores = rnd(scores * np.float32(scale))
    scores = scores.masked_fill(~allowed[:, None], -float("inf"))
    p = rnd(softmax(scores))
    return rnd(p @ v.float().transpose(1, 2)).transpose(1, 2)                   # [B, T, H, V]


def absorb(wkv_b, H, N, official, *, bf16_operands=False, kern=None):  # attention.absorb_ref, at load
    """bf16_operands: the DSA kernels take bf16 operands in official numerics (latent_attention), so
    the halves are held in bf16 there (the same values), else in float32; each half contiguous, so no
    step copies it."""
    dt = torch.bfloat16 if official and bf16_operands else torch.float32
    Wb = dequant(wkv_b)
    Wb = (bf16_round(Wb, kern=kern) if official else Wb).reshape(H, -1, Wb.shape[-1]).to(dt)   # [H, N + V, C]
    return Wb[:, :N].contiguous(), Wb[:, N:].contiguous()


def mqa_absorbed(q_nope, q_pe, kv, pe, W_UK, W_UV, allowed, scale, rnd):  # attention.mqa_absorbed_ref, step for step
    qa = rnd(torch.einsum("bthn,hnc->bthc", q_nope, W_UK))                # q^C W^UK
    s_c = rnd(torch.einsum("bthc,bsc->bhts", qa, kv))
    s_r = rnd(torch.einsum("bthr,bsr->bhts", q_pe, pe))
    scores = rnd(rnd(s_c + s_r) * np.float32(scale))
    scores = scores.masked_fill(~allowed[:, None], -float("inf"))
    p = rnd(softmax(scores))                                              # [B, H, T, S]
    o = rnd(torch.einsum("bhts,bsc->bthc", p, kv))
    return rnd(torch.einsum("bthc,hvc->bthv", o, W_UV))                   # W^UV after the sum


# The DSA kernels' path: one packed row per token of latent cache (spec/kernels.md §3.4), attention
# over the selected rows in the absorbed form for every chunk length

def latent_cache(B, cap, a, official, *, device):  # -> [B, cap, W] uint8 rows (official) or [B, cap, C + R] float32
    C, R = a.kv_lora_rank, a.qk_rope_head_dim
    if official:                        # FP8 codes, their ue8m0 scales, bf16 rope
        return torch.zeros(B, cap, quant.latent_width(C, R), dtype=torch.uint8, device=device)
    return torch.zeros(B, cap, C + R, dtype=torch.float32, device=device)   # exact numerics: float32


def store_latent(buf, start_pos, c_kv, k_pe, B, T, *, kern=None):  # c^KV [B, T, C], k^R [B, T, R] -> rows at start_pos
    if buf.dtype == torch.uint8 and kern is not None and kern.latent_stores():   # in one launch
        return kern.store_latent(buf[:B], start_pos, c_kv, k_pe)
    if buf.dtype == torch.uint8:        # the official FP8 round trip's codes and scales: lossless
        flat = c_kv.reshape(B * T, -1)  # e4m3fn codes on every GPU (the format; kernels_rocm.latent_quant)
        q, sc = kern.latent_quant(flat) if kern is not None else quant_torch.act_quant(flat)
        rows = torch.cat([q.view(torch.uint8), sc.float().contiguous().view(torch.uint8),
                          k_pe.reshape(B * T, -1).to(torch.bfloat16).view(torch.uint8)], -1)
    else:
        rows = torch.cat([c_kv, k_pe], -1).float()
    store(buf, start_pos, rows.reshape(B, T, -1), B, T)


def latent_attention(q_nope, q_pe, latent, sel, p, start_pos, S, args, rnd, *, dsa, kern=None):
    """attention.mqa_absorbed_ref over the packed latent cache through the kernels: q^C W^UK,
    attention over the selected rows (sel [B, T, K]; None: every causal key), then W^UV. Dense
    prefill chunks go through PyTorch's fused attention in the MHA form instead (dense_prefill)."""
    dt = torch.bfloat16 if latent.dtype == torch.uint8 else torch.float32   # official: bf16 operands
    B, T = q_nope.shape[:2]
    if sel is None and T > 1:
        return dense_prefill(q_nope, q_pe, latent, p, start_pos, S, args, rnd, dt, kern=kern)
    H, official = args.num_attention_heads, dt == torch.bfloat16       # official numerics: rnd is bf16_round
    # a decode step's few rows: the per-head GEMVs (float64 sums rounded once, then rnd's rounding, in one
    # launch each; faster than cuBLAS at one row, slower at four, kept there for these numbers); more
    # rows: cuBLAS, in dt (bf16: rounded as rnd)
    gemv = kern is not None and B * T <= kern.GEMV_ROWS and max(p["W_UK"].shape[1:]) <= 1024
    if gemv:
        qa = kern.heads_matmul_f32(q_nope.reshape(B * T, H, -1), p["W_UK"], out_dtype=dt,
                                   bf16_values=official).reshape(B, T, H, -1)                  # [B, T, H, C]
    else:
        qa = torch.einsum("bthn,hnc->bthc", q_nope.to(dt), p["W_UK"])      # [B, T, H, C] in dt
    many = B * T * -(-H // 64) >= dsa.sm_count(latent.device)          # one wave of programs without splits
    fn = dsa.sparse_mla_prefill if many else dsa.sparse_mla_decode
    # q_pe as it is: float32 holding dt values (official: rounded to bf16), taken to dt inside the kernel, exactly
    o, _ = fn(qa, q_pe, latent, sel, args.softmax_scale, start_pos, S=S, out_dtype=dt)   # weighted latent
    if gemv:
        return kern.heads_matmul_f32(o.reshape(B * T, H, -1), p["W_UV"].transpose(1, 2),
                                     bf16_values=official).reshape(B, T, H, -1)                # [B, T, H, V]
    return rnd(torch.einsum("bthc,hvc->bthv", o, p["W_UV"]))


def dense_prefill(q_nope, q_pe, latent, p, start_pos, S, args, rnd, dt, *, kern=None):
    """Dense attention of a prefill chunk, MHA form: expand the cached latent with W^UKV, then
    PyTorch's scaled_dot_product_attention in query chunks with a lower-right causal mask."""
    from torch.nn.attention.bias import causal_lower_right
    H, N, R, V = args.num_attention_heads, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    B, T = q_nope.shape[:2]
    c_kv, k_pe = unpack_latent(latent[:B, :S], args.kv_lora_rank)
    kvb = linear(c_kv, p["wkv_b"], dt == torch.bfloat16, kern=kern).reshape(B, S, H, N + V)
    q = torch.cat([q_nope, q_pe], -1).to(dt).transpose(1, 2)                        # [B, H, T, N + R]
    k = torch.cat([kvb[..., :N], k_pe[:, :, None].expand(B, S, H, R)], -1).to(dt).transpose(1, 2)
    v = torch.nn.functional.pad(kvb[..., N:], (0, N + R - V)).to(dt).transpose(1, 2)  # padded to q's width
    o = torch.empty(B, H, T, N + R, dtype=dt, device=q.device)
    step = 4096
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        end = int(start_pos) + t1
        o[:, :, t0:t1] = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, t0:t1], k[:, :, :end], v[:, :, :end], attn_mask=causal_lower_right(t1 - t0, end),
            scale=args.softmax_scale)
    return rnd(o[..., :V].transpose(1, 2))


# -----------------------------------------------------------------------------
# Feed-forward (moe.py)

def mlp(x, p, official, *, kern=None):  # moe.mlp_ref: w2( silu(w1 x) * (w3 x) )
    rnd = partial(bf16_round, kern=kern) if official else no_round
    if kern is None and official and p["w1"].scale is not None and p["w3"].scale is not None:
        q, s = act_quant(x.reshape(-1, x.shape[-1]))                     # CPU: w1 and w3 share one act_quant
        a, b = fp8_linear(q, s, p["w1"]), fp8_linear(q, s, p["w3"])
        return linear(rnd(torch.nn.functional.silu(a) * b), p["w2"], official).reshape(*x.shape[:-1], -1)
    a, b = linears(x, [p["w1"], p["w3"]], official, kern=kern)       # one GEMM where derive_weights fused them
    if kern is not None and official and a.dim() == 2 and p["w2"].scale is not None and p["w2"].w.dtype != torch.uint8:
        return fp8_linear(*kern.swiglu_quant(a, b, official), p["w2"], kern=kern)   # the steps below, one launch
    return linear(rnd(torch.nn.functional.silu(a) * b), p["w2"], official, kern=kern)


def gate(x, weight, bias, args, *, kern=None):  # moe.gate_ref: [M, d], [E, d], [E] or None -> w [M, K_r] f32, idx [M, K_r]
    logits = proj_f32(x, weight, kern=kern)
    s = torch.sigmoid(logits) if args.scoring_func == "sigmoid" else torch.softmax(logits, -1)
    if kern is not None:                                                 # the choice and weights in one launch
        return kern.gate_topk(s, bias, args.num_experts_per_tok, args.n_group, args.topk_group, args.norm_topk_prob,
                              args.routed_scaling_factor)
    choice = s if bias is None else s + bias
    M, E = s.shape
    G = args.n_group
    if G > 1:
        grouped = choice.reshape(M, G, E // G)
        group_score = grouped.amax(-1) if bias is None else grouped.topk(min(2, E // G), -1).values.sum(-1)
        keep = torch.sort(-group_score, dim=-1, stable=True).indices[:, :args.topk_group]
        in_kept = torch.zeros(M, G, dtype=torch.bool, device=x.device).scatter_(1, keep, True)
        choice = choice.masked_fill(~in_kept.repeat_interleave(E // G, 1), -float("inf"))
    idx = torch.sort(-choice, dim=-1, stable=True).indices[:, :args.num_experts_per_tok]
    return gate_weights(s, idx, args), idx


def gate_weights(s, idx, args):  # eqs. (13)-(14): [M, E] scores, [M, K] chosen -> [M, K] weights, f32
    """The chosen scores over their sum (norm_topk_prob), times routed_scaling_factor; the K scores summed
    one by one in idx's order (best first), as kernels_moe.gate_topk sums them, so that the two agree
    bit for bit (NumPy's pairwise sum in moe.gate_ref: within fp32 rounding)."""
    w = s.gather(1, idx)
    if args.norm_topk_prob:
        total = w[:, 0]
        for k in range(1, w.shape[1]):
            total = total + w[:, k]
        w = w / total[:, None]
    return w * np.float32(args.routed_scaling_factor)


def experts(mlps, *, device, kern=None):  # the routed experts -> stacked: w13 [E, 2I, d] (gate rows, then up), w2 [E, d, I]
    I = mlps[0]["w1"].w.shape[0]
    assert I % 128 == 0, f"moe_intermediate_size {I} is not a multiple of 128 (one scale block per row block)"
    stack = {}
    for name, parts in (("w13", ("w1", "w3")), ("w2", ("w2",))):
        Ws = [[weight(m[k], device=device, kern=kern) for k in parts] for m in mlps]
        scaled = Ws[0][0].scale is not None                                 # unquantized experts: no scales
        stack[name] = quant.Weight(torch.stack([torch.cat([W.w for W in ws]) for ws in Ws]),
                                   torch.stack([torch.cat([W.scale for W in ws]) for ws in Ws]) if scaled else None)
    return stack


def route(idx, E, bm, *, kern=None):
    """[M, Kt] expert ids -> the grouped GEMM's rows, on the device, no host synchronisation:
    token-expert pairs sorted by expert and padded to bm-row blocks of one expert each.
    -> rows_tok [P] (token of each row, -1 padding), pair_at [P] (pair of each row; padding ->
    the trash index M*Kt), block_expert [P / bm] (-1: unused block). With a kernel module and a decode
    step's few pairs: one launch (kernels_moe.route) instead of about fifteen."""
    if kern is not None and idx.numel() <= kern.ROUTE_MAX:
        return kern.route(idx, E, bm)
    M, Kt = idx.shape
    device = idx.device
    pairs = M * Kt
    P = -(-(pairs + min(pairs, E) * (bm - 1)) // bm) * bm              # enough for any routing
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


def grouped(q, s, W, rows, block_expert, self_rows=False, out_at=None, out_rows=None, *, kern=None):
    """-> [P, N] bf16 values (float32) of row p of q (self_rows: p itself; else rows[p]) times its block's
    expert; padding rows (rows < 0) garbage. out_at [P]: row p goes to row out_at[p] of [out_rows, N]
    instead (rows no pair lands on: garbage)."""
    if kern is not None:
        return kern.moe_gemm(q, s, W.w, W.scale, rows, block_expert, out_dtype=torch.float32, self_rows=self_rows,
                             bf16_values=True, out_at=out_at, out_rows=out_rows)
    P, bm = rows.shape[0], rows.shape[0] // block_expert.shape[0]
    out = torch.zeros(P, W.w.shape[1], device=q.device)
    be = block_expert.repeat_interleave(bm)
    for e in torch.unique(be[(rows >= 0) & (be >= 0)]).tolist():         # CPU: one GEMM per expert present
        sel = torch.nonzero((rows >= 0) & (be == e)).squeeze(1)
        r = sel if self_rows else rows[sel].long()
        out[sel] = bf16_round(fp8_gemm_torch(q[r], s[r], W.w[e], W.scale[e]))
    if out_at is None:
        return out
    live = rows >= 0
    return torch.zeros(out_rows, out.shape[1], device=q.device).index_copy_(0, out_at[live], out[live])


def routed_grouped(x, p, idx, elsewhere=False, *, kern=None):
    """Official numerics, FP8 experts: each token-expert pair's SwiGLU through the grouped GEMM over
    the E stacked experts, no host synchronisation. idx [M, Kt] in 0..E-1, or with elsewhere=True
    also E: a pair routed to another rank (parallel.py), whose blocks are skipped. -> [M, Kt, d]."""
    E = p["w13"].w.shape[0]
    rows_tok, pair_at, block_expert = route(idx, E + elsewhere, 16, kern=kern)
    if elsewhere:
        block_expert = torch.where(block_expert == E, -1, block_expert)
    q, s = act_quant(x, kern=kern)
    g = grouped(q, s, p["w13"], rows_tok, block_expert, kern=kern)        # [P, 2I]: gate | up
    I = g.shape[1] // 2
    if kern is not None:                                                 # the steps below in one launch
        q2, s2 = kern.swiglu_quant(g[:, :I], g[:, I:], True)
    else:
        q2, s2 = act_quant(bf16_round(torch.nn.functional.silu(g[:, :I]) * g[:, I:]))
    M, Kt = idx.shape                                                    # row p of h, written to its pair's place:
    o = grouped(q2, s2, p["w2"], rows_tok, block_expert, self_rows=True, out_at=pair_at, out_rows=M * Kt, kern=kern)
    return o.view(M, Kt, -1)


def routed_loop(x, p, idx, official, e0=0, *, kern=None):
    """Each chosen expert on its tokens' rows, one at a time (exact numerics, bf16 experts, or the CPU:
    no padded routing table to build). Experts e0.. are held here; pairs routed to others stay 0."""
    rnd = partial(bf16_round, kern=kern) if official else no_round
    out = torch.zeros(*idx.shape, x.shape[1], device=x.device)
    W13, W2 = p["w13"], p["w2"]
    held = (idx >= e0) & (idx < e0 + W13.w.shape[0])
    fp8 = official and W13.scale is not None
    q, s = act_quant(x, kern=kern) if fp8 else (None, None)              # per row: the same codes as x[tok]'s
    for e in torch.unique(idx[held]).tolist():
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        k = e - e0
        w13 = quant.Weight(W13.w[k], None if W13.scale is None else W13.scale[k])
        w2 = quant.Weight(W2.w[k], None if W2.scale is None else W2.scale[k])
        g = fp8_linear(q[tok], s[tok], w13, kern=kern) if fp8 else linear(x[tok], w13, official, kern=kern)
        I = g.shape[1] // 2
        h = rnd(torch.nn.functional.silu(g[:, :I]) * g[:, I:])
        out[tok, slot] = fp8_linear(*act_quant(h, kern=kern), w2, kern=kern) if fp8 else linear(h, w2, official, kern=kern)
    return out


def weighted_sum(w, idx, out):  # [M, Kt], [M, Kt], [M, Kt, d] -> [M, d]: in fp32, each token's experts in id order
    M, Kt, D = out.shape
    perm = torch.argsort(idx, dim=1, stable=True)
    ws, outs = w.gather(1, perm), out.gather(1, perm[..., None].expand(M, Kt, D))
    y = torch.zeros(M, D, device=out.device)
    for k in range(Kt):
        y += outs[:, k] * ws[:, k, None]
    return y


def moe(x, p, args, official, *, kern=None):  # moe.moe_ref: routed experts in expert-id order, shared last
    """Routed experts through the grouped GEMM over all experts' stacked weights (on the CPU, in
    exact numerics or with bf16 experts: one expert at a time on its tokens' rows)."""
    grouped_ = kern is not None and official and p["w13"].scale is not None
    w, idx = gate(x, p["gate"].w, p.get("gate_bias"), args, kern=kern if grouped_ else None)
    out = routed_grouped(x, p, idx, kern=kern) if grouped_ else routed_loop(x, p, idx, official, kern=kern)
    shared = mlp(x, p["shared_experts"], official, kern=kern)
    if grouped_:                                                         # the sum, the shared part, the rounding
        return kern.moe_combine(out, w, idx, shared, official)
    y = weighted_sum(w, idx, out) + shared
    return bf16_round(y, kern=kern) if official else y


def expert_linear(x, ffn, e, name, *, kern=None):  # one expert's w1 / w3 / w2 through the fast path's own layout
    if ffn["w13"].w.dtype == torch.uint8 or ffn["w13"].scale is None:   # V4's FP4 (or unquantized) experts: the
        return linear(x, expert_weights(ffn, e)[name], True, kern=kern)    # linear on expert e's view
    M = x.shape[0]
    P = -(-M // 16) * 16
    rows = torch.full((P,), -1, dtype=torch.int32, device=x.device)
    rows[:M] = torch.arange(M, dtype=torch.int32, device=x.device)
    be = torch.full((P // 16,), e, dtype=torch.int32, device=x.device)
    q, s = act_quant(x, kern=kern)
    W = ffn["w2"] if name == "w2" else ffn["w13"]
    y = grouped(q, s, W, rows, be, kern=kern)[:M]
    I = W.w.shape[1] // 2
    return y if name == "w2" else (y[:, :I] if name == "w1" else y[:, I:])


# -----------------------------------------------------------------------------
# DeepSeek-V4 (mhc.py, compressor.py, attention_v4.py, moe.py): the same steps in torch. On the CPU,
# GEMMs, sums and exp / sigmoid / silu are taken in float64 and rounded once to float32: torch's CPU
# kernels pick another BLAS kernel or split a reduction over threads by tensor size, and take another
# exp for a tensor's tail than for its vectorised body, so a decode step would not give its prefill
# row's bits. On a GPU they stay in float32: the kernels there sum in fp32 in their own order anyway
# (decode equals prefill to fp32 rounding, not bit for bit), and float64 would copy every weight it
# touches on every call (the head alone is 2 GB in float64)

def f64(fn, *xs):  # fn of float64 copies, rounded to float32 (on a GPU: fn of float32)
    if xs[0].is_cuda:
        return fn(*(x.float() for x in xs))
    return fn(*(x.double() for x in xs)).float()


def rsqrt(x):  # quant.rsqrt_f32 (on a GPU: fp32's rsqrt)
    return f64(torch.rsqrt, x)


def mean_sq(x):  # quant.mean_sq_f32: fp32 squares, their mean rounded once
    x = x.float()
    return f64(lambda v: v.mean(-1, keepdim=True), x * x)


def matmul_f32(a, b):  # quant.matmul_f32: float64 sums on the CPU (quant_torch.matmul_f32), fp32 on a GPU
    return a.float() @ b.float() if a.is_cuda else quant_torch.matmul_f32(a, b)


def hc_mix_pre(X, fn, base, scale, args, official=False, *, v4k=None):  # mhc.hc_mix_pre_ref
    if v4k is not None:                                 # one launch: mixes, Sinkhorn and the collapse
        return v4k.hc_mix_pre(X, fn, base, scale, args, official)
    pre, post, comb = hc_mixes(X, fn, base, scale, args, official)
    return pre, post, comb, hc_pre(X, pre, bf16_round if official else no_round)


def hc_mixes(X, fn, base, scale, args, official=False):  # mhc.hc_mixes_ref
    M, n, d = X.shape
    x = X.float().reshape(M, n * d)
    r = rsqrt(mean_sq(x) + args.rms_norm_eps)
    mu = matmul_f32(x, fn.T) * r if official else matmul_f32(x * r, fn.T)
    pre = f64(torch.sigmoid, fma(mu[:, :n], scale[0], base[:n])) + args.hc_eps
    post = 2 * f64(torch.sigmoid, fma(mu[:, n:2 * n], scale[1], base[n:2 * n]))
    return pre, post, sinkhorn(fma(mu[:, 2 * n:], scale[2], base[2 * n:]).reshape(M, n, n), args.hc_sinkhorn_iters,
                               args.hc_eps)


def fma(a, b, c):  # mhc.fma: a * b + c rounded once
    return f64(lambda a, b, c: a * b + c, a, b, c)


def sinkhorn(B0, iters, eps):  # mhc.sinkhorn_ref: exp rounded once, fp32 sums in index order, fp32 divisions
    def total(B, dim):
        s = B.select(dim, 0)
        for i in range(1, B.shape[dim]):
            s = s + B.select(dim, i)
        return s.unsqueeze(dim)
    B = f64(torch.exp, B0 - B0.amax(-1, keepdim=True))
    B = B / total(B, -1) + eps
    B = B / (total(B, -2) + eps)
    for _ in range(iters - 1):
        B = B / (total(B, -1) + eps)
        B = B / (total(B, -2) + eps)
    return B


def hc_pre(X, pre, rnd=no_round):  # mhc.hc_pre_ref: fp32 products, their sum rounded once
    return rnd(f64(lambda v: v.sum(1), pre[:, :, None] * X.float()))


def hc_post(X, y, post, comb, official=False, *, v4k=None):  # mhc.hc_post_ref
    if v4k is not None:
        return v4k.hc_post(X, y, post, comb, official)
    rnd = bf16_round if official else no_round
    X = X.float()
    mix = torch.zeros(X.shape, dtype=torch.float64 if not X.is_cuda else torch.float32, device=X.device)
    for i in range(X.shape[1]):                                                  # B^T X: fp32 products, one sum
        mix += comb[:, i, :, None] * X[:, i, None, :]
    return rnd(post[:, :, None] * y[:, None, :] + mix.float())


def hc_head(X, fn, base, scale, args, official=False, *, kern=None):  # mhc.hc_head_ref
    M, n, d = X.shape
    x = X.float().reshape(M, n * d)
    r = rsqrt(mean_sq(x) + args.rms_norm_eps)
    mu = matmul_f32(x, fn.T) * r if official else matmul_f32(x * r, fn.T)
    pre = f64(torch.sigmoid, scale[0] * mu + base) + args.hc_eps
    return hc_pre(X, pre, partial(bf16_round, kern=kern) if official else no_round)


def v4_norm(x, w, eps, rnd=no_round, *, kern=None):  # compressor.rms_norm: x * rsqrt(mean(x²) + eps), weighted
    official = _norm_kernel(x, w, rnd, kern)
    if official is not None:
        return kern.rms_norm(x, w, eps, official, recip=True)
    x = x.float()
    y = x * rsqrt(mean_sq(x) + eps)
    return rnd(y if w is None else w * y)


def rope_angles(freqs, positions):  # rope.rope_angles on the tensors' device: fp32 products, cos / sin rounded once
    """freqs [R/2] (a device tensor: the model's, made at load; or NumPy), positions [T] int tensor ->
    cos, sin [T, R/2] float32, with no host array or copy per call."""
    f = torch.as_tensor(freqs, device=positions.device).float()
    angle = positions.float()[:, None] * f[None, :]
    return torch.cos(angle.double()).float(), torch.sin(angle.double()).float()


def rope_tail(x, cos, sin):  # compressor.rope_tail: the trailing R dims, interleaved pairs
    R = 2 * cos.shape[-1]
    return torch.cat([x[..., :-R].float(), rope_interleaved(x[..., -R:], cos, sin)], -1)


class CompressorRing(compressor.CompressorState):
    """compressor.CompressorState with every shape fixed, so that a decode step can be captured in a CUDA
    graph: the projections [C_j | Z_j + B] of the last `span` positions in a ring (position j in slot
    j mod span; span = 2m where windows overlap (CSA), m otherwise) in place of the open window and the
    last complete one, and the keys in a buffer of the planned length (reserve)."""

    def __init__(self, B, p, zeros):
        super().__init__(B, p, zeros)
        m, overlap = p["ape"].shape[0], p["wkv"].w.shape[0] == 2 * p["norm"].shape[0]
        self.span = 2 * m if overlap else m
        self.win, self.rows = zeros((B, self.span, self.rows.shape[-1])), None

    def nbytes(self):
        return self.win.nbytes + self.keys.nbytes


def compress_rows(h, p, m, positions):  # [C_j | Z_j + B_{j mod m}] [B, T, (2)c + (2)c] of h [B, T, d] at the positions
    C = matmul_f32(h, dequant(p["wkv"]).T)
    return torch.cat([C, matmul_f32(h, dequant(p["wgate"]).T) + p["ape"][positions % m]], -1)


def pool(Cw, Zw, Cp, Zp, overlap):  # compressor.pool_ref: Cw, Zw [B, k, m, (2)c]; Cp, Zp [B, m, 2c] the window before
    if overlap:                                         # slots [C^a of window w-1 | C^b of window w]; Zp -inf: none
        c = Cw.shape[-1] // 2
        kv = torch.cat([torch.cat([Cp[:, None, :, :c], Cw[:, :-1, :, :c]], 1), Cw[..., c:]], 2)   # [B, k, 2m, c]
        z = torch.cat([torch.cat([Zp[:, None, :, :c], Zw[:, :-1, :, :c]], 1), Zw[..., c:]], 2)
    else:
        kv, z = Cw, Zw
    return f64(lambda z, kv: (torch.softmax(z, 2) * kv).sum(2), z, kv)                    # [B, k, c]


def compressed_key(pooled, p, positions, freqs, eps, rnd, stored):  # Ĉ [B, k, c] -> K [B, k, c], RoPE at the positions
    cos, sin = rope_angles(freqs, positions)
    K = rnd(rope_tail(v4_norm(rnd(pooled), p["norm"], eps, rnd)[:, :, None], cos, sin)[:, :, 0])
    return K if stored is None else stored(K)


def window_keys(full, Cp, Zp, p, m, overlap, positions, freqs, eps, rnd, stored, v4k=None):
    """full [B, k m, 2h] the rows of k complete windows, Cp, Zp the window before -> their keys [B, k, c]
    (RoPE at the positions); with the kernels (v4k) the pooling, RMSNorm and RoPE in one launch."""
    if v4k is not None:
        cos, sin = rope_angles(freqs, positions)
        K = v4k.compress_keys(full, Cp, Zp, p["norm"], cos, sin, eps, m, overlap, rnd is not no_round)
        return K if stored is None else stored(K)
    half = full.shape[-1] // 2
    full = full.reshape(full.shape[0], -1, m, 2 * half)
    return compressed_key(pool(full[..., :half], full[..., half:], Cp, Zp, overlap), p, positions, freqs, eps, rnd, stored)


def compress(h, p, m, overlap, start_pos, freqs, eps, state, rnd=no_round, stored=None, *, v4k=None):  # compressor.compress_ref
    """On a CompressorRing: the rows a window needs before start_pos come from the ring (at most 2m - 1)."""
    B, T, _ = h.shape
    dev = h.device
    L, w0, w1 = start_pos + T, start_pos // m, (start_pos + T) // m          # windows w0 .. w1 - 1 complete here
    base = max(w0 * m - (m if overlap else 0), 0)                           # the first position they read
    rows = torch.cat([state.win[:, torch.arange(base, start_pos, device=dev) % state.span],
                      compress_rows(h, p, m, start_pos + torch.arange(T, device=dev))], 1)   # positions base .. L - 1
    keep = torch.arange(max(base, L - state.span), L, device=dev)
    state.win[:, keep % state.span] = rows[:, keep - base]
    k = w1 - w0
    if k == 0:
        return state.keys[:, :0]
    half = rows.shape[-1] // 2
    Cp, Zp = (rows[:, :m, :half], rows[:, :m, half:]) if overlap and w0 > 0 else \
        (rows.new_zeros(B, m, half), rows.new_full((B, m, half), -float("inf")))        # no window before: no slots
    K = window_keys(rows[:, w0 * m - base:w1 * m - base], Cp, Zp, p, m, overlap, m * (w0 + torch.arange(k, device=dev)),
                    freqs, eps, rnd, stored, v4k)
    state.append(K)
    return K


def compress_step(h, p, m, overlap, pos, freqs, eps, state, rnd=no_round, stored=None, *, v4k=None):
    """compress for one token at the device position pos [1] with every shape fixed (decode_static): the
    token's row into the ring, then the key of its window w = pos // m from the ring, written to key slot w
    at every step. A query reads slot w only once the window is complete, (pos + 1) // m > w, and by then
    the key was written from all m of its rows."""
    B = h.shape[0]
    state.win.index_copy_(1, pos % state.span, compress_rows(h, p, m, pos))
    w = pos // m
    at = torch.arange(m, device=h.device)
    cur = state.win[:, (w * m + at) % state.span]                                      # [B, m, width]
    prev = state.win[:, ((w - 1) * m + at) % state.span] if overlap else cur           # [B, m, width]
    half = cur.shape[-1] // 2
    Cp, Zp = torch.where(w > 0, prev[..., :half], 0.0), torch.where(w > 0, prev[..., half:], -float("inf"))  # window 0: none
    K = window_keys(cur, Cp, Zp, p, m, overlap, m * w, freqs, eps, rnd, stored, v4k)
    state.buf.index_copy_(1, w, K.reshape(B, 1, -1))


def kv_fp8(kv, R, *, kern=None):  # attention_v4.kv_fp8_ref: FP8 per 64 on the nope dims, in bf16
    q, s = quant_torch.act_quant(kv[..., :-R], 64)
    nope = bf16_round((q.float().reshape(*q.shape[:-1], -1, 64) * s[..., None]).reshape(q.shape), kern=kern)
    return torch.cat([nope, kv[..., -R:]], -1)


def index_fp4(x):  # compressor.index_fp4_ref: Hadamard, then FP4 per 32, in bf16
    return bf16_round(quant_torch.fp4_roundtrip(bf16_round(rotate_activation(x))))


def index_query(x, qr, p, cos, sin, args, official, kern=None):  # -> q^I [B, T, J, D], w^I [B, T, J] (scales folded in)
    lin = partial(linear, kern=kern)
    B, T, _ = x.shape
    J, D = args.index_n_heads, args.index_head_dim
    q = rope_tail(lin(qr, p["wq_b"], official).reshape(B, T, J, D), cos, sin)
    if not official:
        return q, lin(x, p["weights_proj"], False) * np.float32(J ** -0.5) * np.float32(D ** -0.5)
    w = bf16_round(bf16_round(matmul_f32(x, dequant(p["weights_proj"]).T)) * np.float32(J ** -0.5 * D ** -0.5))
    return index_fp4(bf16_round(q)), w


def indexer_select_v4(x, qr, p, K_idx, start_pos, cos, sin, args, official=False, *, v4k=None, kern=None):
    """compressor.indexer_select_ref -> [B, T, k] the picks' indices into K_idx, best first (ties: the
    lower index), -1 where a query has fewer complete windows than k. The kernels (v4k) list them
    ascending; only official numerics, whose attention rounds by blocks of the list, puts them in order."""
    B, T, _ = x.shape
    q, w = index_query(x, qr, p, cos, sin, args, official, kern)
    n = K_idx.shape[1]
    k = min(args.index_topk, n)
    if v4k is not None:                                 # eq. (16) with the causal rule, then eq. (17)
        I = v4k.index_scores_v4(q, w, K_idx, start_pos, 4, official)                # -inf past the complete windows
        if k == 0:
            return torch.full((B, T, 0), -1, dtype=torch.int32, device=x.device)
        idx = v4k.topk_indices(I, k, n)                 # every key "causal" to the V3.2 kernel: the -inf decide
        vis = ((start_pos + torch.arange(T, device=x.device) + 1) // 4)[None, :, None]
        idx = torch.where(idx < vis, idx, -1)
        return best_first(I, idx) if official else idx
    if not official:
        I = index_scores(q, w, K_idx, torch.ones(K_idx.shape[:2], device=x.device))
    else:
        qk = bf16_round(f64(lambda a, b: torch.einsum("btjd,bsd->btjs", a, b), q, K_idx))
        I = bf16_round(f64(lambda v: v.sum(2), bf16_round(qk.clamp_min(0) * w[..., None])))
    visible = torch.arange(n, device=x.device)[None, :] < ((start_pos + torch.arange(T, device=x.device) + 1) // 4)[:, None]
    order = torch.sort(-I.masked_fill(~visible[None], -float("inf")), dim=-1, stable=True).indices[..., :k]
    return torch.where(visible[None].expand(B, T, n).gather(-1, order), order, -1)


def best_first(I, picks):  # I [B, T, n], picks [B, T, k] ascending (-1 last) -> the same picks by score, ties: lower index
    s = I.gather(-1, picks.clamp_min(0).long()).masked_fill(picks < 0, -float("inf"))
    return picks.gather(-1, torch.sort(-s, dim=-1, stable=True).indices)


def window_positions(t, W, cols):  # t [T, 1] query positions -> [T, cols]: each window's positions oldest first, -1 after
    pos = (t - W + 1).clamp_min(0) + torch.arange(cols, device=t.device)
    return torch.where(pos <= t, pos, -1)


def window_indices(T, start_pos, P, W, dev):  # attention_v4.window_indices_ref: rows of KW = [P ring keys | T chunk keys]
    pos = window_positions(start_pos + torch.arange(T, device=dev)[:, None], W, min(T, W) if start_pos == 0 else W)
    return torch.where(pos >= 0, pos - (start_pos - P), -1)


def ring_slots(pos, W):  # the same list for one query at the device position pos [1], as ring slots -> [1, W]
    s = window_positions(pos[:, None], W, W)
    return torch.where(s >= 0, s % W, -1)


def blocked_attention(q, keys, idx, sink, scale):  # attention_v4.blocked_attention_ref, step for step
    B, T, H, c = q.shape
    m = q.new_full((B, T, H), -float("inf"), dtype=torch.float32)
    l = q.new_zeros((B, T, H), dtype=torch.float32)
    acc = q.new_zeros((B, T, H, c), dtype=torch.float32)
    b = torch.arange(B, device=q.device)[:, None, None]
    for j in range(0, idx.shape[-1], BLOCK):
        cols = idx[..., j:j + BLOCK].long()                                         # [B, T, k]
        kb = keys[b, cols.clamp_min(0)]                                             # [B, T, k, c]
        z = f64(lambda a, k: torch.einsum("bthc,btkc->bthk", a, k), q, kb) * np.float32(scale)
        z = z.masked_fill(cols[:, :, None] < 0, -float("inf"))                      # [B, T, H, k]
        m_new = torch.maximum(m, z.amax(-1))
        ref = torch.where(torch.isfinite(m_new), m_new, 0)
        a, e = f64(torch.exp, m - ref), f64(torch.exp, z - ref[..., None])
        l = f64(lambda l, a, s: l * a + s, l, a, f64(lambda e: e.sum(-1), e))        # one fma
        acc = f64(lambda acc, e, k: acc + torch.einsum("bthk,btkc->bthc", e, k), acc * a[..., None], bf16_round(e), kb)
        m = m_new
    l = l + f64(torch.exp, sink.float() - torch.where(torch.isfinite(m), m, 0))
    return bf16_round(acc / l[..., None])


def sparse_attention(q, KW, KC, idx, n_dense, sink, scale, official):  # attention_v4.sparse_attention_ref
    B, T = q.shape[:2]
    P, n = KW.shape[1], KC.shape[1]
    keys = torch.cat([KW, KC], 1)
    dense = torch.arange(n, device=q.device)[None] < n_dense[:, None]                 # [T, n]
    if official:
        cols = torch.where(dense, P + torch.arange(n, device=q.device), -1)[None].expand(B, T, n)
        return blocked_attention(q, keys, torch.cat([idx, cols], -1), sink, scale)
    allowed = torch.zeros(B, T, P + n + 1, dtype=torch.bool, device=q.device)
    allowed = allowed.scatter_(-1, torch.where(idx >= 0, idx, P + n).long(), True)[..., :-1]
    allowed[..., P:] |= dense[None]
    z = f64(lambda a, b: torch.einsum("bthc,bsc->bhts", a, b), q, keys) * np.float32(scale)
    z = z.masked_fill(~allowed[:, None], -float("inf"))
    sink = sink[:, None, None]                                                      # attention.softmax_ref(sink=)
    mx = torch.maximum(z.amax(-1, keepdim=True), sink)
    e = f64(torch.exp, z - mx)
    return torch.einsum("bhts,bsc->bthc", e / (e.sum(-1, keepdim=True) + f64(torch.exp, sink - mx)), keys)


def query_key(x, p, cos, sin, args, official, kern=None):  # -> c^Q [B, T, d_c], q [B, T, H, c], the shared key [B, T, c]
    lin = partial(linear, kern=kern)
    B, T, _ = x.shape
    H, c, R, eps = args.num_attention_heads, args.head_dim, args.qk_rope_head_dim, args.rms_norm_eps
    rnd = bf16_round if official else no_round
    qr = v4_norm(lin(x, p["wq_a"], official), p["q_norm"], eps, rnd, kern=kern)
    q = lin(qr, p["wq_b"], official).reshape(B, T, H, c)
    if official:                                        # attention_v4.rms_norm_bf16: every step in bf16
        ms = bf16_round(f64(lambda v: v.mean(-1, keepdim=True), bf16_round(q * q)))
        q = bf16_round(q * bf16_round(rsqrt(bf16_round(ms + eps))))
    else:
        q = v4_norm(q, None, eps, kern=kern)
    q = rnd(rope_tail(q, cos, sin))
    kv = v4_norm(lin(x, p["wkv"], official), p["kv_norm"], eps, rnd, kern=kern)
    kv = rnd(rope_tail(kv[:, :, None], cos, sin)[:, :, 0])
    return qr, q, kv_fp8(kv, R) if official else kv


def attention_v4(x, p, kind, m, start_pos, freqs, args, cache, sparse=True, official=False, *, v4k=None, kern=None):
    """attention_v4.attention_v4_forward, step for step in torch; with the kernels (v4k) the CSA indexer's
    scores and picks, the compressors' pooling and the attention itself run as kernels_v4's."""
    B, T, _ = x.shape
    W, R, eps = args.sliding_window, args.qk_rope_head_dim, args.rms_norm_eps
    dev = x.device
    rnd = bf16_round if official else no_round
    cos, sin = rope_angles(freqs, start_pos + torch.arange(T, device=dev))
    qr, q, kv = query_key(x, p, cos, sin, args, official, kern)
    P = min(start_pos, W - 1)
    pos = start_pos - P + torch.arange(P + T, device=dev)
    KW = torch.cat([cache.ring[:, pos[:P] % W], kv], 1)                               # [B, P + T, c]
    last = pos[-min(T, W):]
    cache.ring[:, last % W] = kv[:, -len(last):]
    idx = window_indices(T, start_pos, P, W, dev)[None].expand(B, T, -1)
    KC, n_dense, n_max = KW[:, :0], torch.zeros(T, dtype=torch.long, device=dev), 0
    if kind != "sliding_attention":
        compress(x, p["compressor"], m, m == 4, start_pos, freqs, eps, cache.comp, rnd,
                 (lambda K: kv_fp8(K, R)) if official else None, v4k=v4k)
        KC = cache.comp.keys
        if kind == "heavily_compressed_attention" or not sparse:
            n_dense, n_max = (start_pos + torch.arange(T, device=dev) + 1) // m, (start_pos + T) // m
        else:
            compress(x, p["indexer"]["compressor"], m, True, start_pos, freqs, eps, cache.idx, rnd,
                     index_fp4 if official else None, v4k=v4k)
            picks = indexer_select_v4(x, qr, p["indexer"], cache.idx.keys, start_pos, cos, sin, args, official, v4k=v4k,
                                      kern=kern)
            cache.selected = selection_mask(picks, start_pos, KC.shape[1])             # for --verify
            idx = torch.cat([idx, torch.where(picks >= 0, picks + P + T, -1)], -1)
    if v4k is not None:                                 # n_max: n_dense's last entry, known without a device sync
        o = v4k.sparse_attention(q, KW, KC, idx, n_dense, p["attn_sink"], args.softmax_scale, official, n_max=n_max)
    else:
        o = sparse_attention(q, KW, KC, idx, n_dense, p["attn_sink"], args.softmax_scale, official)
    return v4_output(o, p, args, cos, sin, official, kern)


def attention_v4_step(x, p, kind, m, pos, freqs, args, cache, sparse=True, official=False, *, v4k, kern=None):
    """attention_v4 for one token at the device position pos [1] with every shape fixed and nothing read
    back (TransformerV4.decode_static; a CUDA graph captures it), through the kernels: the key into ring
    slot pos mod n_win, the window's keys named by slot in position order, the compressors' steps
    (compress_step), the CSA indexer's scores over the whole key buffer and its top-k over the complete
    windows (their count a device value: the causal bound of V3.2's top-k), and the attention over the
    buffer's complete prefix (HCA) or the picks. x [B, 1, d] -> [B, 1, d]."""
    B = x.shape[0]
    W, R, eps = args.sliding_window, args.qk_rope_head_dim, args.rms_norm_eps
    dev = x.device
    rnd = bf16_round if official else no_round
    cos, sin = rope_angles(freqs, pos)
    qr, q, kv = query_key(x, p, cos, sin, args, official, kern)
    cache.ring.index_copy_(1, pos % W, kv)
    idx = ring_slots(pos, W)[None].expand(B, 1, W)                                 # the window's slots, oldest first
    KC, n_dense, n_max = cache.ring[:, :0], torch.zeros(1, dtype=torch.long, device=dev), 0
    if kind != "sliding_attention":
        compress_step(x, p["compressor"], m, m == 4, pos, freqs, eps, cache.comp, rnd,
                      (lambda K: kv_fp8(K, R)) if official else None, v4k=v4k)
        KC = cache.comp.buf                                                        # [B, capacity, c]
        n = KC.shape[1]
        if kind == "heavily_compressed_attention" or not sparse:
            n_dense, n_max = (pos + 1) // m, n
        else:
            compress_step(x, p["indexer"]["compressor"], m, True, pos, freqs, eps, cache.idx, rnd,
                          index_fp4 if official else None, v4k=v4k)
            qI, wI = index_query(x, qr, p["indexer"], cos, sin, args, official, kern)
            I = v4k.index_scores_v4(qI, wI, cache.idx.buf, 4 * n, 4, official)         # every slot scored
            last = (pos + 1) // 4 - 1                    # the last complete window: V3.2's causal bound, on the device
            picks = v4k.topk_indices(I, min(args.index_topk, n), last)                 # (-1 past the complete ones)
            picks = best_first(I, picks) if official else picks                        # the official list's order
            idx = torch.cat([idx, torch.where(picks >= 0, picks + W, -1)], -1)
    o = v4k.sparse_attention(q, cache.ring, KC, idx, n_dense, p["attn_sink"], args.softmax_scale, official, n_max=n_max)
    return v4_output(o, p, args, cos, sin, official, kern)


def v4_output(o, p, args, cos, sin, official, kern=None):  # o [B, T, H, c] -> RoPE_{-t}, then the grouped projection [B, T, d]
    lin = partial(linear, kern=kern)
    B, T = o.shape[:2]
    rnd = bf16_round if official else no_round
    o = rnd(rope_tail(o, cos, -sin))
    g = args.o_groups
    og = o.reshape(B, T, g, -1)
    Wa = dequant(p["wo_a"]).reshape(g, -1, og.shape[-1])
    zg = f64(lambda a, b: torch.einsum("btgk,gok->btgo", a, b), og, Wa).reshape(B, T, -1)
    return lin(bf16_round(zg) if official else zg, p["wo_b"], official)


def moe_v4(x, p, args, official, tokens, weight_inside=False, *, kern=None, v4k=None):
    """moe.moe_ref, V4's: sqrtsoftplus or hash routing, the clamped SwiGLU, official numerics' routing
    weight before w2. The routed experts as a list (one at a time, as the reference), or stacked (p["w13"],
    p["w2"]: ops.v4_experts at load) for routed_v4's grouped GEMMs, whose bookkeeping (the choice, the
    route table, the sum) then runs in kernels_moe's kernels too."""
    grouped_ = official and v4k is not None and "w13" in p and p["w13"].scale is not None   # routed_v4's GEMMs
    logits = matmul_f32(x.float(), p["gate"].w.float().T)
    if args.scoring_func == "sqrtsoftplus":             # softplus rounded once, then sqrt (moe.gate_ref)
        s = torch.sqrt(f64(torch.nn.functional.softplus, logits))
    else:
        s = f64(torch.sigmoid, logits)
    if "tid2eid" in p:
        idx = p["tid2eid"][tokens]
    elif grouped_:                                                       # the choice and weights in one launch
        w, idx = v4k.gate_topk(s, p["gate_bias"], args.num_experts_per_tok, 1, 1, args.norm_topk_prob,
                               args.routed_scaling_factor)
    else:
        idx = torch.sort(-(s + p["gate_bias"]), dim=-1, stable=True).indices[:, :args.num_experts_per_tok]
    if "tid2eid" in p or not grouped_:
        w = gate_weights(s, idx, args)
    rnd = bf16_round if official else no_round
    e0 = p.get("expert_range", (0,))[0]                 # parallel.py: this rank's experts start at e0
    if "w13" in p:
        out = routed_v4(x, p, idx, w if weight_inside else None, args, official, e0, kern=kern, v4k=v4k)
        if grouped_:                                                     # the sum, the shared part, the rounding
            shared = swiglu_v4(x, p["shared_experts"], args, official, kern=kern)
            return v4k.moe_combine(out, torch.ones_like(w) if weight_inside else w, idx, shared, official)
        y = weighted_sum(torch.ones_like(w) if weight_inside else w, idx, out)   # fp32, each token's in id order
    else:
        y = torch.zeros(x.shape, device=x.device)
        for e in torch.unique(idx).tolist():            # ascending expert id, fp32 sum
            if not e0 <= e < e0 + len(p["experts"]):
                continue
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if weight_inside:
                y[tok] += swiglu_v4(x[tok], p["experts"][e - e0], args, official, w[tok, slot], kern=kern)
            else:
                y[tok] += swiglu_v4(x[tok], p["experts"][e - e0], args, official, kern=kern) * w[tok, slot, None]
    y += swiglu_v4(x, p["shared_experts"], args, official, kern=kern)
    return rnd(y)


def swiglu_v4(h, q, args, official, weight=None, *, kern=None):  # moe.mlp_ref with the clamp (and the weight inside)
    lim = args.swiglu_limit
    a = linear(h, q["w1"], official, kern=kern).clamp(max=lim)
    b = linear(h, q["w3"], official, kern=kern).clamp(-lim, lim)
    y = f64(torch.nn.functional.silu, a) * b
    y = y if weight is None else y * weight[:, None]
    return linear(bf16_round(y) if official else y, q["w2"], official, kern=kern)


def expert_weights(p, e):  # expert e's w1, w3, w2 as views of the stacked layout (w13: gate rows, then up rows)
    W13, W2 = p["w13"], p["w2"]
    I = W13.w.shape[1] // 2
    r = I if W13.scale is None or W13.w.dtype == torch.uint8 else I // 128    # FP4: a scale row per row
    sc = (lambda S, sl: None if S is None else S[e, sl])
    return {"w1": quant.Weight(W13.w[e, :I], sc(W13.scale, slice(0, r))),
            "w3": quant.Weight(W13.w[e, I:], sc(W13.scale, slice(r, None))), "w2": quant.Weight(W2.w[e], sc(W2.scale, slice(None)))}


def routed_v4(x, p, idx, w, args, official, e0=0, *, kern=None, v4k=None):
    """Each (token, expert) pair's clamped SwiGLU on the stacked experts -> [M, Kt, d] (pairs whose expert is
    on another rank: 0). w: the routing weights to apply before w2 (official numerics), or None. Official
    numerics with the V4 kernels: the grouped GEMMs over all the layer's experts (kernels_fp8.moe_gemm for
    FP8, kernels_v4.fp4_moe_gemm for FP4), rows gathered by route(), no host synchronisation; otherwise
    one expert at a time."""
    W13, W2 = p["w13"], p["w2"]
    E = W13.w.shape[0]
    M, Kt = idx.shape
    local = idx - e0
    held = (local >= 0) & (local < E)
    if not (official and v4k is not None and W13.scale is not None):
        out = torch.zeros(M, Kt, x.shape[1], device=x.device)
        for e in torch.unique(local[held]).tolist():
            tok, slot = torch.nonzero(local == e, as_tuple=True)
            out[tok, slot] = swiglu_v4(x[tok], expert_weights(p, e), args, official, None if w is None else w[tok, slot],
                                       kern=kern)
        return out
    fp4 = W13.w.dtype == torch.uint8
    rows, pair_at, block_expert = route(torch.where(held, local, E), E + 1, 16, kern=v4k)   # E: elsewhere: skipped
    block_expert = torch.where(block_expert == E, -1, block_expert)

    def gemm(q, s, W, r):  # [P, N] bf16 values
        if fp4:
            return bf16_round(v4k.fp4_moe_gemm(q, s, W.w, W.scale, r, block_expert, fnuz=q.dtype == torch.float8_e4m3fnuz))
        return grouped(q, s, W, r, block_expert, kern=v4k)
    g = gemm(*act_quant(x, kern=kern), W13, rows)                                  # [P, 2I]: gate | up
    I, lim = g.shape[1] // 2, args.swiglu_limit
    y = f64(torch.nn.functional.silu, g[:, :I].clamp(max=lim)) * g[:, I:].clamp(-lim, lim)
    if w is not None:                                                               # each row's pair's weight
        y = y * torch.cat([w.reshape(-1), w.new_zeros(1)])[pair_at][:, None]
    rows_self = torch.where(rows >= 0, torch.arange(rows.shape[0], device=x.device, dtype=torch.int32), -1)
    o = gemm(*act_quant(bf16_round(y), kern=kern), W2, rows_self)                   # [P, d]
    out = torch.zeros(M * Kt + 1, x.shape[1], device=x.device).index_copy_(0, pair_at, o)   # padding -> the trash row
    return torch.where(held[..., None], out[:M * Kt].view(M, Kt, -1), 0.0)         # another rank's pairs: 0


# -----------------------------------------------------------------------------
# The table

def torch_ops(device, kernels=True, dsa=None, v4=None):
    """The op table (ops.Ops) for one device; kernels=False: plain torch. dsa, v4: the modules whose DSA
    and V4 kernels to use (default: the GPU's kernel module); tests pass kernels_cuda on the CPU to run
    the models' kernel paths in the Triton interpreter."""
    device = torch.device(device)
    kern = kernels_for(device) if kernels else None
    dsa, v4 = dsa or kern, v4 or kern
    V = dict(v4k=v4)
    K = dict(kern=kern)
    prep = dsa is not None and dsa.fp8_stores()                          # gfx90a: no FP8 stores in Triton
    return Ops(
        name="torch", device=device, kernels=kern,
        bf16_round=partial(bf16_round, **K), no_round=no_round,
        act_quant=partial(act_quant, **K), act_dequant=act_dequant, dequant=dequant,
        linear=partial(linear, **K), linears=partial(linears, **K),
        rms_norm=partial(rms_norm, **K), add_norm=partial(add_norm, **K) if kern else None, layer_norm=layer_norm,
        rope_interleaved=partial(rope_interleaved, **K), rope_half_split=partial(rope_half_split, **K),
        rotate_activation=rotate_activation, head_weights=partial(head_weights, **K), index_scores=index_scores,
        topk_select=topk_select, select=partial(select, dsa=dsa),
        latent_fp8_roundtrip=partial(latent_fp8_roundtrip, **K), causal_mask=partial(causal_mask, device=device), store=store,
        mha=mha, absorb=partial(absorb, bf16_operands=dsa is not None, **K),
        mqa_absorbed=mqa_absorbed,
        mlp=partial(mlp, **K), gate=gate, moe=partial(moe, **K), expert_linear=partial(expert_linear, **K),
        cat=lambda xs, axis: torch.cat(xs, axis), zeros=partial(zeros, device=device, **K),
        tokens=lambda t: torch.as_tensor(np.asarray(t), device=device),
        angles=lambda cos, sin: (torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)),
        embed=lambda table, tokens: table[tokens].float(),
        head=partial(proj_f32, **K), to_f32=lambda a: a.float(), fp32_weight=partial(fp32_weight, **K),
        param=partial(to_torch, device=device), weight=partial(weight, device=device, **K),
        plain_weight=partial(plain_weight, device=device),
        fuse_rows=fuse_rows, experts=partial(experts, device=device, **K),
        index_prep=partial(index_prep, dsa=dsa) if prep else None,
        latent_cache=partial(latent_cache, device=device) if dsa else None,
        store_latent=partial(store_latent, **K) if dsa else None,
        latent_attention=partial(latent_attention, dsa=dsa, **K) if dsa else None,
        selection_mask=selection_mask if dsa else None,
        hc_mix_pre=partial(hc_mix_pre, **V), hc_post=partial(hc_post, **V), hc_head=partial(hc_head, **K),
        v4_norm=partial(v4_norm, **K), v4_attention=partial(attention_v4, **V, **K),
        v4_attention_step=partial(attention_v4_step, **V, **K) if v4 else None, v4_moe=partial(moe_v4, **V, **K),
        v4_experts=partial(experts, device=device, **K) if v4 else None,
        matmul_f32=matmul_f32,
        v4_cache=partial(V4LayerCache, zeros=lambda shape: torch.zeros(shape, device=device), state=CompressorRing),
    )


# -----------------------------------------------------------------------------
# Decode replayed from a captured CUDA graph

class GraphDecoder:
    """Decode steps of a loaded torch model replayed from one CUDA graph of its decode_static
    (model.Transformer's, model_v4.TransformerV4's): the caches are preallocated (model.reserve), the
    token and the position sit in device buffers, and a step is two small copies, a replay and nothing
    read back but what the caller reads. Built after the prefill, at the first position to decode (its
    warm-up runs write only what that position's step writes, which the first real step overwrites).
    Official numerics only: the exact path's expert loop reads back which experts were chosen, which a
    graph cannot hold."""

    def __init__(self, model, batch, first_pos):
        dev = (model.opts.ops if hasattr(model, "opts") else model.ops).device
        if getattr(model, "planned_len", first_pos + 1) <= first_pos:
            raise ValueError(f"GraphDecoder at position {first_pos}: reserve the caches past it first (model.reserve)")
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
        if pos >= getattr(self.model, "planned_len", pos + 1):      # V4: its key buffers end there (a device assert)
            raise ValueError(f"GraphDecoder: position {pos} is past the reserved {self.model.planned_len} tokens")
        self.tok.copy_(torch.as_tensor(tokens).reshape(self.tok.shape), non_blocking=True)
        self.pos.fill_(pos)
        self.graph.replay()
        self.model.cached_len = pos + 1
        return self.logits
