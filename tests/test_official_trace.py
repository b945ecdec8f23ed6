"""Official numerics, op by op, against the golden trace of the official inference code
(tests/fixtures/README.md): each op gets the trace's input and must give the trace's output:
FP8 codes and scales bit for bit, bf16 values within one bf16 ulp, fp32 values within 1e-6
relative, selections as sets. Every backend's op table is held to the trace: the NumPy reference,
torch on the CPU, and torch on a GPU (with its Triton kernels) where one is present.
Then the whole model on the same fixture."""
import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest

import checkpoint
import rope
from config import ModelArgs
from conftest import FIXTURE_CKPT, backends
from helpers import assert_bf16_close, rel_err
from model import LayerCache, Transformer, load_layer, make_ops, to_backend


@pytest.fixture(scope="module", params=backends())
def fx(request):
    ops = make_ops(*request.param)
    ck = checkpoint.Checkpoint(FIXTURE_CKPT)
    args = ModelArgs.from_config(json.loads((FIXTURE_CKPT / "config.json").read_text()))
    return ops, args, [to_backend(load_layer(ck, i, args), ops) for i in (0, 1)]


def host(x):  # a backend array -> NumPy (fp8 as its raw bytes)
    if hasattr(x, "cpu"):
        import torch
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            return x.view(torch.uint8).cpu().numpy()
        return x.cpu().numpy()
    return x.view(np.uint8) if x.dtype.itemsize == 1 and x.dtype != np.uint8 else x


def layer_trace(trace, i, ops):  # this layer's trace arrays, handed to the backend
    return {k.split(".", 1)[1]: v for k, v in trace.items() if k.startswith(f"l{i}.")}


@pytest.mark.slow
@pytest.mark.parametrize("i", [0, 1])
def test_attention_ops(fx, trace, i):
    ops, a, layers = fx
    t = layer_trace(trace, i, ops)
    P = ops.param
    p = layers[i]["attn"]
    eps, rb = a.rms_norm_eps, ops.bf16_round
    C = a.kv_lora_rank

    # RMSNorm, fused with the residual add from layer 1 on
    if i == 0:
        s = P(t["attn_norm_in"])
    else:
        s = P(t["attn_norm_in"]) + P(t["attn_norm_residual_in"])
        assert_bf16_close(host(rb(s)), t["attn_norm_residual_out"], what="residual")
    assert_bf16_close(host(ops.rms_norm(s, layers[i]["attn_norm"], eps, rb)), t["attn_norm_out"], what="attn_norm")
    x = P(t["attn_norm_out"])

    # query and latent projections
    assert_bf16_close(host(ops.linear(x, p["wq_a"], True)), t["wq_a_out"], what="wq_a")
    assert_bf16_close(host(ops.rms_norm(P(t["wq_a_out"]), p["q_norm"], eps, rb)), t["qr"], what="q_norm")
    assert_bf16_close(host(ops.linear(P(t["qr"]), p["wq_b"], True)), t["wq_b_out"], what="wq_b")
    assert_bf16_close(host(ops.linear(x, p["wkv_a"], True)), t["wkv_a_out"], what="wkv_a")
    assert_bf16_close(host(ops.rms_norm(P(t["wkv_a_out"][..., :C]), p["kv_norm"], eps, rb)), t["kv_normed"], what="kv_norm")

    # the FP8 latent round trip, bit for bit
    q8, s8 = ops.act_quant(P(t["kv_normed"]))
    np.testing.assert_array_equal(host(q8), t["kv_fp8_bits"])
    np.testing.assert_array_equal(host(s8), t["kv_fp8_scale"])
    np.testing.assert_array_equal(host(ops.latent_fp8_roundtrip(P(t["kv_normed"]))), t["kv_latent"])
    assert_bf16_close(host(ops.linear(P(t["kv_latent"]), p["wkv_b"], True)), t["wkv_b_out"], what="wkv_b")

    # the indexer, op by op
    ip = p["indexer"]
    assert_bf16_close(host(ops.linear(P(t["qr"]), ip["wq_b"], True)), t["idx_wq_b_out"], what="idx wq_b")
    assert_bf16_close(host(ops.linear(x, ip["wk"], True)), t["idx_wk_out"], what="idx wk")
    assert_bf16_close(host(rb(ops.layer_norm(P(t["idx_wk_out"]), ip["k_norm"], ip["k_norm_bias"]))), t["idx_k_normed"],
                      what="k_norm")
    assert_bf16_close(host(rb(ops.rotate_activation(P(t["idx_q_before_hadamard"])))), t["idx_q_rotated"], what="hadamard q")
    assert_bf16_close(host(rb(ops.rotate_activation(P(t["idx_k_before_hadamard"])))), t["idx_k_rotated"], what="hadamard k")
    qi, qs = ops.act_quant(P(t["idx_q_rotated"]))
    ki, ks = ops.act_quant(P(t["idx_k_rotated"]))
    np.testing.assert_array_equal(host(qi), t["idx_q_fp8_bits"])
    np.testing.assert_array_equal(host(ki), t["idx_k_fp8_bits"])
    np.testing.assert_array_equal(host(ks), t["idx_k_scale"])
    w = ops.head_weights(x, ip["weights_proj"], qs[..., 0], a.index_n_heads, a.index_head_dim)
    assert rel_err(host(w), t["idx_weights_folded"][..., 0]) <= 1e-6
    I = ops.index_scores(qi, P(t["idx_weights_folded"][..., 0]), ki, P(t["idx_k_scale"][..., 0]))
    assert rel_err(host(I), t["idx_scores"]) <= 1e-6
    sel = host(ops.topk_select(P(t["idx_scores"]), a.index_topk, 0))[0]        # [T, S]
    T = sel.shape[0]
    for r in range(T):
        want = {int(s) for s in t["idx_topk"][0, r] if s <= r}             # causal part of the official set
        assert set(np.nonzero(sel[r])[0].tolist()) == want, f"row {r}"

    # MHA-mode attention core on the trace's q, k, v and selection
    H, N, R, V = a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    kvb = t["wkv_b_out"].reshape(1, T, H, N + V)
    allowed = np.zeros((1, T, T), bool)
    np.put_along_axis(allowed[0], t["idx_topk"][0], True, -1)
    allowed &= np.tri(T, dtype=bool)
    o = ops.mha(P(t["wq_b_out"].reshape(1, T, H, N + R)[..., :N]), P(t["q_pe_roped"]), P(kvb[..., :N]),
                P(t["k_pe_roped"][:, :, 0]), P(kvb[..., N:]), P(allowed), a.softmax_scale, rb)
    assert_bf16_close(host(o).reshape(1, T, -1), t["attn_core_out"], what="attention core")
    assert_bf16_close(host(ops.linear(P(t["attn_core_out"]), p["wo"], True)), t["attn_out"], what="wo")

    # the whole attention layer from its input reproduces the trace's output, through the unfused
    # layout whose caches the trace holds (the GPU's DSA kernels' path: tests/test_dsa_path.py)
    ops = dataclasses.replace(ops, latent_cache=None, store_latent=None, latent_attention=None, selection_mask=None)
    cache = LayerCache(1, a, True, ops)
    cache.reserve(T)
    f = rope.yarn_freqs(a.qk_rope_head_dim, a.rope_theta, a.max_seq_len, a.original_seq_len, a.rope_factor,
                        a.rope_scaling["beta_fast"], a.rope_scaling["beta_slow"])
    cos, sin = ops.angles(*rope.rope_angles(f, np.arange(T)))
    import attention
    out = attention.mla_forward(x, p, cache, 0, T, cos, sin, a, SimpleNamespace(official=True, sparse=True,
                                                                            indexer_fp8=True, ops=ops, record=None))
    assert_bf16_close(host(out), t["attn_out"], what="mla_forward")
    np.testing.assert_array_equal(host(cache.idx.k[:, :T]), t["idx_k_fp8_bits"])
    np.testing.assert_array_equal(host(cache.kv[:, :T]), t["kv_latent"])


def test_ffn_ops(fx, trace):
    ops, a, layers = fx
    P, rb = ops.param, ops.bf16_round
    for i in (0, 1):
        t = layer_trace(trace, i, ops)
        s = P(t["ffn_norm_in"]) + P(t["ffn_norm_residual_in"])
        assert_bf16_close(host(ops.rms_norm(s, layers[i]["ffn_norm"], a.rms_norm_eps, rb)), t["ffn_norm_out"], what="ffn_norm")
        assert_bf16_close(host(rb(s)), t["ffn_norm_residual_out"], what="ffn residual")
        xn = t["ffn_norm_out"].reshape(-1, a.hidden_size)
        x = P(xn)
        f = layers[i]["ffn"]
        if i == 0:
            M = xn.shape[0]
            assert_bf16_close(host(ops.linear(x, f["w1"], True)), t["mlp_w1_out"].reshape(M, -1), what="w1")
            assert_bf16_close(host(ops.linear(x, f["w3"], True)), t["mlp_w3_out"].reshape(M, -1), what="w3")
            assert_bf16_close(host(ops.linear(P(t["mlp_w2_in"]), f["w2"], True)), t["ffn_out"], what="w2")
            assert_bf16_close(host(ops.mlp(x, f, True)), t["ffn_out"].reshape(xn.shape), what="mlp")
        else:
            w, idx = ops.gate(x, f["gate"].w, f["gate_bias"], a)
            w, idx = host(w), host(idx)
            for r in range(xn.shape[0]):
                assert set(idx[r].tolist()) == set(t["gate_indices"][r].tolist()), f"token {r}"
                order, ref_order = np.argsort(idx[r]), np.argsort(t["gate_indices"][r])
                assert rel_err(w[r][order], t["gate_weights"][r][ref_order]) <= 1e-6
            assert_bf16_close(host(ops.mlp(x, f["shared_experts"], True)), t["shared_out"], what="shared expert")
            assert_bf16_close(host(ops.moe(x, f, a, True)), t["ffn_out"].reshape(xn.shape), what="moe")


def test_silu_times_up_rounding(trace):
    import moe
    import quant
    t = layer_trace(trace, 0, None)
    assert_bf16_close(quant.bf16_round(moe.silu(t["mlp_w1_out"]) * t["mlp_w3_out"]), t["mlp_w2_in"], what="silu * up")


def test_fixture_loads_and_skips_mtp():
    ck = checkpoint.Checkpoint(FIXTURE_CKPT)
    assert any(k.startswith("model.layers.3.") for k in ck.weight_map)      # the MTP layer is stored...
    m = Transformer.from_pretrained(FIXTURE_CKPT)
    assert len(m.w["layers"]) == 3                                          # ...and not built


@pytest.mark.slow
@pytest.mark.parametrize("backend", backends())
def test_whole_model_reproduces_official_logits(trace, backend):
    # bit-faithful backends only: NumPy and torch on the CPU compute every rounding point as the
    # official code does; a GPU's FP8 tensor cores accumulate with fewer bits (spec §4.3), and this
    # random model is chaotic, so the GPU is held to the trace op by op above, not end to end here
    if backend[1] not in (None, "cpu"):
        pytest.skip("end to end only where the path is bit-faithful (CPU)")
    m = Transformer.from_pretrained(FIXTURE_CKPT, backend=backend[0], device=backend[1])
    tok = trace["tokens"]
    assert rel_err(host(m.forward(tok)), trace["logits_last"]) <= 1e-5
    for t in (0, 1, 15, 16, 17, 30, 52):                                    # prefixes: dense, then sparse
        assert rel_err(host(m.forward(tok[:, :t + 1])), trace["logits_prefix"][t]) <= 1e-3, t
    m.forward(tok[:, :26])                                                  # absorbed decode, one token at a time
    errs = [rel_err(host(m.forward(tok[:, p:p + 1], start_pos=p))[0], trace["logits_decode"][p - 26]) for p in range(26, 53)]
    assert max(errs) <= 1e-3, errs
