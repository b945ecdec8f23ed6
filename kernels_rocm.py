"""The fast path's kernels for AMD GPUs (ROCm): act_quant, fp8_gemm, moe_gemm, rope, bf16_round, rms_norm, the
routed experts' bookkeeping (gate_topk, route, moe_combine: kernels_moe.py, integers and fp32) and the
DSA kernels (index_prep, index_scores, topk_indices, sparse_mla_decode, sparse_mla_prefill) under the
same names as in kernels_cuda.py (act_quant, fp8_gemm, moe_gemm and bf16_round re-exported there from
kernels_fp8.py), from the same Triton sources, with what differs by architecture kept as data below.
V4's kernels (hc_mix_pre, hc_post, compress_keys, index_scores_v4, sparse_attention: kernels_v4.py) decode
every format from its bytes, so they are re-exported unchanged; the FP4 expert GEMMs (fp4_gemm,
fp4_moe_gemm) take the architecture's route: fp16 (both operands decoded to fp16 for the MMA) or, on
gfx90a, the gfx90a report's int8 (FP4 codes x 2 and the activations' integer limbs in INT8 MMAs: exact),
with fp16 its fallback (route="fp16").

    gfx942 (MI300/MI325)  e4m3fnuz, maximum 240: checkpoint e4m3fn bytes are reinterpreted as e4m3fnuz
                          with the scale doubled (0x80, -0 in e4m3fn, is NaN in e4m3fnuz: mapped to 0);
                          the indexer's FP8 q and key cache are e4m3fnuz (native MMA); the packed latent
                          cache keeps the e4m3fn format of spec/kernels.md §3.4, decoded from its bytes
    gfx950 (MI350/MI355)  e4m3fn (OCP), maximum 448, as on NVIDIA
    gfx90a (MI200/MI250)  no FP8 hardware: the GEMMs and the indexer decode FP8 bytes to fp16 inside the
                          kernel, the sparse MLA decodes the latent bytes; act_quant runs in torch (no
                          FP8 store in Triton there); V4's FP4 experts through INT8 MMAs

On gfx942 the activation grid (e4m3fnuz, maximum 240) differs from the official e4m3fn one, so its
numerics are close to, not identical with, the official model's.

No AMD GPU was available to this project: these paths are checked in the Triton CPU interpreter
(tests/test_kernels_rocm.py) and by reading, not on hardware.
"""
import torch

import kernels_cuda as _k
import kernels_v4 as _v4
import quant_torch
from kernels_v4 import compress_keys, hc_mix_pre, hc_post, index_scores_v4, sparse_attention  # noqa: F401  V4's, unchanged

ARCHS = {  # gfx name -> FP8 storage dtype, its maximum, decode in-kernel (no FP8 hardware), decode the
           # packed latent's e4m3fn bytes by integer arithmetic (no native OCP FP8 conversion), FP4 GEMM route
    "gfx942": dict(fp8=torch.float8_e4m3fnuz, fp8_max=240.0, decode=False, fnuz=True, latent_decode=True, fp4="fp16"),
    "gfx950": dict(fp8=torch.float8_e4m3fn, fp8_max=448.0, decode=False, fnuz=False, latent_decode=False, fp4="fp16"),
    "gfx90a": dict(fp8=torch.float8_e4m3fn, fp8_max=448.0, decode=True, fnuz=False, latent_decode=True, fp4="int8"),
}

ROCM_GEMM_CONFIGS = [  # (max M, BLOCK_M, BLOCK_N, num_warps, num_stages); wave64: fewer, wider warps
    (16, 16, 64, 4, 2),
    (64, 32, 128, 4, 2),
    (256, 64, 128, 4, 2),
    (1 << 62, 128, 128, 8, 2),
]


def current_arch():
    name = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    if name not in ARCHS:
        raise RuntimeError(f"no kernel data for AMD architecture {name}; known: {', '.join(ARCHS)}")
    return name


def prepare_weight(w, scale, arch=None):  # checkpoint e4m3fn codes + scales -> this arch's storage
    a = ARCHS[arch or current_arch()]
    if not a["fnuz"]:
        return w, scale
    bits = w.view(torch.uint8).clone()
    bits[bits == 0x80] = 0                                           # -0 in e4m3fn, NaN in e4m3fnuz
    return bits.view(torch.float8_e4m3fnuz), scale * 2               # same bytes are worth half


def act_quant(x, arch=None):
    a = ARCHS[arch or current_arch()]
    if a["decode"]:
        return quant_torch.act_quant(x)                             # no FP8 stores in Triton here
    return _k.act_quant(x, fp8=a["fp8"], fp8_max=a["fp8_max"])


def swiglu_quant(a, b, official, arch=None):
    cfg = ARCHS[arch or current_arch()]
    if cfg["decode"]:                                               # no FP8 stores in Triton here: torch's steps
        h = torch.nn.functional.silu(a) * b
        return quant_torch.act_quant(_k.bf16_round(h.contiguous()) if official else h)
    return _k.swiglu_quant(a, b, official, fp8=cfg["fp8"], fp8_max=cfg["fp8_max"])


def fp8_gemm(a, sa, b, sb, out_dtype=torch.bfloat16, bf16_values=False, arch=None):
    cfg = ARCHS[arch or current_arch()]
    return _k.fp8_gemm(a, sa, b, sb, out_dtype=out_dtype, configs=ROCM_GEMM_CONFIGS, decode=cfg["decode"],
                       fnuz=cfg["fnuz"], bf16_values=bf16_values)


rope, bf16_round, rms_norm, RMS_NORM_MAX = _k.rope, _k.bf16_round, _k.rms_norm, _k.RMS_NORM_MAX   # fp32: all the same
add_rms_norm = _k.add_rms_norm
matmul_f32, heads_matmul_f32, GEMV_ROWS = _k.matmul_f32, _k.heads_matmul_f32, _k.GEMV_ROWS   # fp32 / bf16 in, float64 sums: the same on every arch
gate_topk, route, moe_combine, ROUTE_MAX = _k.gate_topk, _k.route, _k.moe_combine, _k.ROUTE_MAX      # integers and fp32


def _int8_route(route, arch):  # route "int8", "fp16" or None (the architecture's) -> int8?
    route = route or ARCHS[arch or current_arch()]["fp4"]
    if route not in ("int8", "fp16"):
        raise ValueError(f"FP4 GEMM route {route!r}: int8 or fp16")
    return route == "int8"


def fp4_gemm(a, sa, packed, sb, fnuz=False, arch=None, route=None):
    return _v4.fp4_gemm(a, sa, packed, sb, fnuz=fnuz, int8=_int8_route(route, arch))


def fp4_moe_gemm(a, sa, packed, sb, rows, block_expert, fnuz=False, gemv=None, arch=None, route=None):
    return _v4.fp4_moe_gemm(a, sa, packed, sb, rows, block_expert, fnuz=fnuz, gemv=gemv, int8=_int8_route(route, arch))


def moe_gemm(a, sa, b, sb, rows, block_expert, out_dtype=torch.bfloat16, self_rows=False, bf16_values=False,
             out_at=None, out_rows=None, arch=None):
    cfg = ARCHS[arch or current_arch()]
    return _k.moe_gemm(a, sa, b, sb, rows, block_expert, out_dtype=out_dtype, decode=cfg["decode"], fnuz=cfg["fnuz"],
                       self_rows=self_rows, bf16_values=bf16_values, out_at=out_at, out_rows=out_rows)


# -----------------------------------------------------------------------------
# DSA kernels: the FP8 flavour of the indexer and the packed latent's decoding, per architecture

latent_width = _k.latent_width
topk_indices = _k.topk_indices                  # scores are fp32: nothing differs by architecture
sm_count = _k.sm_count                          # compute units, as torch reports them


def fp8_dtype(arch=None):  # what the indexer's FP8 key cache holds on this architecture
    return ARCHS[arch or current_arch()]["fp8"]


def latent_quant(x, arch=None):  # the packed latent rows hold e4m3fn codes (the format) on every architecture
    a = ARCHS[arch or current_arch()]
    if a["fnuz"] or a["decode"]:
        return quant_torch.act_quant(x)                             # no FP8 stores in Triton here
    return _k.act_quant(x)


def latent_stores(arch=None):  # store_latent runs here: Triton stores e4m3fn (gfx950), not on gfx942 / gfx90a
    a = ARCHS[arch or current_arch()]
    return not (a["fnuz"] or a["decode"])


store_latent = _k.store_latent                  # (where latent_stores() holds: the same e4m3fn codes)


def fp8_stores(arch=None):  # can Triton store FP8 here (gfx90a: no; the model then runs index_prep's steps unfused)
    return not ARCHS[arch or current_arch()]["decode"]


def index_prep(q, k, xw, cos, sin, ln_w, ln_b, k_cache, k_scale_cache, start_pos, arch=None):
    a = ARCHS[arch or current_arch()]
    if a["decode"]:
        raise NotImplementedError("index_prep: gfx90a has no FP8 stores in Triton (fp8_stores() is False)")
    return _k.index_prep(q, k, xw, cos, sin, ln_w, ln_b, k_cache, k_scale_cache, start_pos, fp8_max=a["fp8_max"])


def index_scores(q, w, k, k_scale, start_pos, arch=None, **tiles):
    a = ARCHS[arch or current_arch()]
    return _k.index_scores(q, w, k, k_scale, start_pos, decode=a["decode"] and q.dtype != torch.float32,
                           fnuz=a["fnuz"], **tiles)


def sparse_mla_decode(qa, q_pe, cache, idx, scale, start_pos, arch=None, **kw):
    return _k.sparse_mla_decode(qa, q_pe, cache, idx, scale, start_pos, decode=ARCHS[arch or current_arch()]["latent_decode"], **kw)


def sparse_mla_prefill(qa, q_pe, cache, idx, scale, start_pos, arch=None, **kw):
    return _k.sparse_mla_prefill(qa, q_pe, cache, idx, scale, start_pos, decode=ARCHS[arch or current_arch()]["latent_decode"], **kw)
