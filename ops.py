"""The op contract: every numerical op the model's wiring calls (model.py, attention.mla_forward,
indexer.indexer_forward), its shapes in and out, and the reference that defines it.

A backend fills one Ops. NUMPY_OPS, below, holds the references themselves: the definition of the
model. backend_torch.torch_ops(device) fills the same fields with torch functions, on a GPU with the
Triton kernels (kernels_cuda.py, kernels_rocm.py); parallel.Parallel.wrap replaces a few with their
collectives. A field that may be None is a fast path: None means "not fast here", and the wiring
then takes the reference's steps. The wiring reads these fields and nothing else; it never probes.

Official numerics pass `rnd` = bf16_round (a bf16 rounding point) and official=True; exact numerics
pass no_round and official=False. Arrays are NumPy arrays or torch tensors, as the backend holds them;
"f32" below means float32 values (bf16 values where the official code holds bf16).

Letters: B batch, T new tokens, S keys (start_pos + T, or a captured decode's capacity), d hidden size,
H heads, N / R / V the nope, rope and value head dims, C = r_kv latent width, J indexer heads, D indexer
head dim, K = index_topk (in act_quant and linears: the input features), M = B * T tokens, E experts.
"""
from dataclasses import dataclass
from typing import Callable

import numpy as np

import attention
import attention_v4
import compressor
import indexer
import mhc
import moe
import quant
import rope


@dataclass(frozen=True)
class Ops:
    name: str                      # "numpy" or "torch"
    device: object                 # where the tensors live (torch.device), or None (NumPy)
    kernels: object                # the GPU's kernel module (kernels_cuda / kernels_rocm), or None

    # rounding points
    bf16_round: Callable           # x -> f32 holding the nearest bf16 values                 quant.bf16_round
    no_round: Callable             # x -> x as f32, untouched                                 quant.no_round

    # number formats and linears
    act_quant: Callable            # x [..., K] -> codes [..., K] e4m3, scales [..., K/128]   quant.act_quant
    act_dequant: Callable          # codes, scales -> [..., K] f32                            quant.act_dequant
    dequant: Callable              # Weight [N, K] -> [N, K] f32                               quant.Weight.dequant
    linear: Callable               # x [..., K], Weight [N, K], official -> [..., N] f32      quant.linear_ref
    linears: Callable              # x, [Weight, ...], official -> [linear(x, W), ...]        quant.linears_ref

    # norms, RoPE
    rms_norm: Callable             # x [..., n], w [n], eps, rnd -> [..., n]                  attention.rms_norm_ref
    layer_norm: Callable           # x [..., D], w [D], b [D] -> [..., D]                     indexer.layer_norm_ref
    rope_interleaved: Callable     # x [B, T, H, R], cos, sin [T, R/2] -> [B, T, H, R]        rope.rope_interleaved
    rope_half_split: Callable      # the same, halves instead of pairs                        rope.rope_half_split

    # DSA: the lightning indexer, eq. (1), and the top-k selection, eq. (2)
    rotate_activation: Callable    # x [..., D] -> x H_D D^-1/2                               indexer.rotate_activation_ref
    head_weights: Callable         # x [B, T, d], Weight [J, d], q_scale [B, T, J], J, D -> w [B, T, J]
    #                                                                                         indexer.head_weights_ref
    index_scores: Callable         # q [B, T, J, D], w [B, T, J], k [B, S, D], k_scale [B, S] -> I [B, T, S]
    #                                                                                         indexer.index_scores_ref
    topk_select: Callable          # I [B, T, S], K, start_pos -> [B, T, S] bool              indexer.topk_select_ref
    select: Callable               # q, w, k, k_scale, K, start_pos, indices -> [B, T, S] bool, or with
    #                                indices=True [B, T, K] int32 positions, -1 padded        indexer.select_ref

    # MLA (attention.py)
    latent_fp8_roundtrip: Callable  # c^KV [..., C] -> the same on the FP8 grid               attention.latent_fp8_roundtrip_ref
    causal_mask: Callable          # B, T, start_pos, S -> [B, T, S] bool                     attention.causal_mask_ref
    store: Callable                # buf, start_pos, value [B, T, ...], B, T: a cache write   attention.store_ref
    mha: Callable                  # q^C, q^R, k^C, k^R, v, allowed, scale, rnd -> [B, T, H, V]
    #                                                                                         attention.mha_ref
    absorb: Callable               # Weight wkv_b [H (N + V), C], H, N, official -> W^UK [H, N, C], W^UV [H, V, C]
    #                                (made at load)                                           attention.absorb_ref
    mqa_absorbed: Callable         # q^C, q^R, c^KV [B, S, C], k^R [B, S, R], W^UK, W^UV, allowed, scale, rnd
    #                                -> [B, T, H, V]                                          attention.mqa_absorbed_ref

    # feed-forward (moe.py)
    mlp: Callable                  # x [M, d], weights, official -> [M, d]                    moe.mlp_ref
    gate: Callable                 # x [M, d], router [E, d], bias [E], args -> w [M, K_r] f32, idx [M, K_r]
    #                                                                                         moe.gate_ref
    moe: Callable                  # x [M, d], weights, args, official -> [M, d]              moe.moe_ref
    expert_linear: Callable        # x [M, K], ffn, e, "w1" | "w2" | "w3" -> expert e's linear, as the
    #                                backend runs it (model.probe_experts)                    quant.linear_ref

    # tensors of this backend (glue)
    cat: Callable                  # [x, ...], axis -> one array
    zeros: Callable                # shape, fp8 -> cache storage (FP8 codes or f32)
    tokens: Callable               # [B, T] int array -> the backend's
    angles: Callable               # cos, sin [T, R/2] NumPy -> the backend's
    embed: Callable                # table [V, d], tokens [B, T] -> [B, T, d] f32
    head: Callable                 # h [..., d], W [V, d] (fp32_weight's) -> logits [..., V] f32
    to_f32: Callable               # a plain array -> f32 on this backend (made at load: V4's fp32 projections)
    fp32_weight: Callable          # a plain weight for head / head_weights / gate, made at load: f32, or the
    #                                bf16 array as stored where those widen it in a kernel (torch on a GPU)
    param: Callable                # a checkpoint array -> the backend's
    weight: Callable               # a checkpoint Weight -> the backend's (FP8 stays FP8)
    plain_weight: Callable         # a checkpoint Weight -> the backend's, in the checkpoint's own layout

    # fast paths: None = not fast here
    fuse_rows: Callable | None = None      # [Weight, ...] of one input -> the same as row blocks of one
    #                                        weight, for linears' one GEMM (at load)
    experts: Callable | None = None        # the routed experts' weights -> the backend's stacked layout
    #                                        (None: a list of per-expert Weights, as moe.moe_ref reads)
    add_norm: Callable | None = None       # x, residual [..., n], w [n], eps, rnd -> (rms_norm(s), rnd(s)) with
    #                                        s = x + residual: a block's entry      model.Transformer._norm
    index_prep: Callable | None = None     # x, q [B, T, J, D], k [B, T, D], weights, cache, start_pos, cos,
    #                                        sin -> q codes, w [B, T, J]; keys to the cache   indexer.index_prep_ref
    # the DSA kernels' path: selections as [B, T, K] positions, the latent cache as packed rows; all
    # four or none (`fused`)
    latent_cache: Callable | None = None   # B, cap, args, official -> [B, cap, W] packed rows (spec/kernels.md §3.4)
    store_latent: Callable | None = None   # rows, start_pos, c^KV [B, T, C], k^R [B, T, R], B, T: a cache write
    latent_attention: Callable | None = None  # q^C, q^R, rows, sel [B, T, K] or None, weights, start_pos, S,
    #                                        args, rnd -> [B, T, H, V]                        attention.mqa_absorbed_ref
    selection_mask: Callable | None = None  # sel [B, T, K], start_pos, S -> [B, T, S] bool (--verify)

    # DeepSeek-V4 (model_v4.py); None where the backend does not run V4
    hc_mix_pre: Callable | None = None     # X [M, n, d], Φ, b, α, args, official -> pre, post [M, n], comb [M, n, n],
    #                                        u [M, d] (the collapsed input)               mhc.hc_mix_pre_ref
    hc_post: Callable | None = None        # X, y [M, d], post, comb, official -> X' [M, n, d]   mhc.hc_post_ref
    hc_head: Callable | None = None        # X, Φ, b, α, args, official -> [M, d]              mhc.hc_head_ref
    v4_norm: Callable | None = None        # x, w or None, eps, rnd -> x * rsqrt(mean(x²) + eps) w   compressor.rms_norm
    v4_attention: Callable | None = None   # x [B, T, d], weights, kind, m, start_pos, freqs [R/2] (the backend's), args, cache, sparse,
    #                                        official -> [B, T, d]                   attention_v4.attention_v4_forward
    v4_attention_step: Callable | None = None   # v4_attention for one token at a device position pos [1], every shape
    #                                        fixed (TransformerV4.decode_static); torch with the V4 kernels only
    v4_moe: Callable | None = None         # x [M, d], weights, args, official, tokens [M], weight_inside -> [M, d]
    #                                                                                         moe.moe_ref
    matmul_f32: Callable | None = None     # a, b -> a @ b summed in float64, rounded to f32    quant.matmul_f32
    v4_experts: Callable | None = None     # a layer's routed experts [{w1, w2, w3}, ...] -> stacked {w13, w2} for the
    #                                        V4 kernels' grouped GEMMs (at load; None: the list stays)
    v4_cache: Callable | None = None       # B, args, kind, a layer's attention weights -> its caches      attention_v4.V4LayerCache

    @property
    def fused(self):  # the GPU's DSA kernels run the selection and the attention
        return self.latent_attention is not None


def _zeros(shape, fp8):  # cache storage: FP8 codes (ml_dtypes) or float32
    return np.zeros(shape, quant.E4M3 if fp8 else np.float32)


def _f32(a):  # a plain array -> float32 (NumPy: the head, the fp32 projections' weights, V4's)
    return np.asarray(a, np.float32)


NUMPY_OPS = Ops(
    name="numpy", device=None, kernels=None,                  # weights stay memory-mapped NumPy arrays
    bf16_round=quant.bf16_round, no_round=quant.no_round,
    act_quant=quant.act_quant, act_dequant=quant.act_dequant, dequant=quant.Weight.dequant,
    linear=quant.linear_ref, linears=quant.linears_ref,
    rms_norm=attention.rms_norm_ref, layer_norm=indexer.layer_norm_ref,
    rope_interleaved=rope.rope_interleaved, rope_half_split=rope.rope_half_split,
    rotate_activation=indexer.rotate_activation_ref, head_weights=indexer.head_weights_ref,
    index_scores=indexer.index_scores_ref, topk_select=indexer.topk_select_ref, select=indexer.select_ref,
    latent_fp8_roundtrip=attention.latent_fp8_roundtrip_ref, causal_mask=attention.causal_mask_ref,
    store=attention.store_ref, mha=attention.mha_ref, absorb=attention.absorb_ref,
    mqa_absorbed=attention.mqa_absorbed_ref,
    mlp=moe.mlp_ref, gate=moe.gate_ref, moe=moe.moe_ref,
    expert_linear=lambda x, ffn, e, name: quant.linear_ref(x, ffn["experts"][e][name], True),
    cat=lambda xs, axis: np.concatenate(xs, axis), zeros=_zeros,
    tokens=np.asarray, angles=lambda cos, sin: (cos, sin),
    embed=lambda table, tokens: np.asarray(table[tokens], np.float32),
    head=lambda h, w: h @ w.T, to_f32=_f32, fp32_weight=_f32,
    param=lambda a: a, weight=lambda W: W, plain_weight=lambda W: W,
    hc_mix_pre=mhc.hc_mix_pre_ref, hc_post=mhc.hc_post_ref, hc_head=mhc.hc_head_ref,
    v4_norm=compressor.rms_norm, v4_attention=attention_v4.attention_v4_forward, v4_moe=moe.moe_ref,
    matmul_f32=quant.matmul_f32, v4_cache=attention_v4.V4LayerCache,
)
