"""Official numerics, op by op, against the golden trace of the official inference code
(tests/fixtures/README.md): each op gets the trace's input and must give the trace's output:
FP8 codes and scales bit for bit, bf16 values within one bf16 ulp, fp32 values within 1e-6
relative, selections as sets. Then the whole model on the same fixture."""
import json

import numpy as np
import pytest

import attention
import checkpoint
import indexer
import moe
import quant
from conftest import FIXTURE_CKPT
from helpers import assert_bf16_close, rel_err
from model import NUMPY_OPS, LayerCache, ModelArgs, Transformer, load_layer


@pytest.fixture(scope="module")
def fx():
    ck = checkpoint.Checkpoint(FIXTURE_CKPT)
    args = ModelArgs.from_config(json.loads((FIXTURE_CKPT / "config.json").read_text()))
    return ck, args, [load_layer(ck, i, args) for i in (0, 1)]


def bits(q):
    return q.view(np.uint8)


@pytest.mark.parametrize("i", [0, 1])
def test_attention_ops(fx, trace, i):
    ck, a, layers = fx
    t = {k.split(".", 1)[1]: v for k, v in trace.items() if k.startswith(f"l{i}.")}
    p = layers[i]["attn"]
    eps, rb = a.rms_norm_eps, quant.bf16_round
    C = a.kv_lora_rank

    # RMSNorm, fused with the residual add from layer 1 on
    if i == 0:
        assert_bf16_close(attention.rms_norm_ref(t["attn_norm_in"], layers[i]["attn_norm"], eps, rb), t["attn_norm_out"], what="attn_norm")
    else:
        s = t["attn_norm_in"] + t["attn_norm_residual_in"]
        assert_bf16_close(attention.rms_norm_ref(s, layers[i]["attn_norm"], eps, rb), t["attn_norm_out"], what="attn_norm")
        assert_bf16_close(rb(s), t["attn_norm_residual_out"], what="residual")
    x = t["attn_norm_out"]

    # query and latent projections
    assert_bf16_close(quant.linear_ref(x, p["wq_a"], True), t["wq_a_out"], what="wq_a")
    assert_bf16_close(attention.rms_norm_ref(t["wq_a_out"], p["q_norm"], eps, rb), t["qr"], what="q_norm")
    assert_bf16_close(quant.linear_ref(t["qr"], p["wq_b"], True), t["wq_b_out"], what="wq_b")
    assert_bf16_close(quant.linear_ref(x, p["wkv_a"], True), t["wkv_a_out"], what="wkv_a")
    assert_bf16_close(attention.rms_norm_ref(t["wkv_a_out"][..., :C], p["kv_norm"], eps, rb), t["kv_normed"], what="kv_norm")

    # the FP8 latent round trip, bit for bit
    q8, s = quant.act_quant(t["kv_normed"])
    np.testing.assert_array_equal(bits(q8), t["kv_fp8_bits"])
    np.testing.assert_array_equal(s, t["kv_fp8_scale"])
    np.testing.assert_array_equal(attention.latent_fp8_roundtrip_ref(t["kv_normed"]), t["kv_latent"])
    assert_bf16_close(quant.linear_ref(t["kv_latent"], p["wkv_b"], True), t["wkv_b_out"], what="wkv_b")

    # the indexer, op by op
    ip = p["indexer"]
    assert_bf16_close(quant.linear_ref(t["qr"], ip["wq_b"], True), t["idx_wq_b_out"], what="idx wq_b")
    assert_bf16_close(quant.linear_ref(x, ip["wk"], True), t["idx_wk_out"], what="idx wk")
    assert_bf16_close(rb(indexer.layer_norm_ref(t["idx_wk_out"], ip["k_norm"], ip["k_norm_bias"])), t["idx_k_normed"], what="k_norm")
    assert_bf16_close(rb(indexer.rotate_activation_ref(t["idx_q_before_hadamard"])), t["idx_q_rotated"], what="hadamard q")
    assert_bf16_close(rb(indexer.rotate_activation_ref(t["idx_k_before_hadamard"])), t["idx_k_rotated"], what="hadamard k")
    qi, qs = quant.act_quant(t["idx_q_rotated"])
    ki, ks = quant.act_quant(t["idx_k_rotated"])
    np.testing.assert_array_equal(bits(qi), t["idx_q_fp8_bits"])
    np.testing.assert_array_equal(bits(ki), t["idx_k_fp8_bits"])
    np.testing.assert_array_equal(ks, t["idx_k_scale"])
    proj = np.asarray(x, np.float32) @ ip["weights_proj"].dequant().T
    assert rel_err(proj, t["idx_weights_proj_out"]) <= 1e-6
    w = indexer.head_weights_ref(x, ip["weights_proj"], qs[..., 0], a.index_n_heads, a.index_head_dim)
    assert rel_err(w, t["idx_weights_folded"][..., 0]) <= 1e-6
    I = indexer.index_scores_ref(t["idx_q_fp8_bits"].view(quant.E4M3), t["idx_weights_folded"][..., 0],
                                 t["idx_k_fp8_bits"].view(quant.E4M3), t["idx_k_scale"][..., 0])
    assert rel_err(I, t["idx_scores"]) <= 1e-6
    sel = indexer.topk_select_ref(t["idx_scores"], a.index_topk, 0)[0]     # [T, S]
    T = sel.shape[0]
    for r in range(T):
        want = {int(s) for s in t["idx_topk"][0, r] if s <= r}             # causal part of the official set
        assert set(np.nonzero(sel[r])[0].tolist()) == want, f"row {r}"

    # MHA-mode attention core on the trace's q, k, v and selection
    H, N, R, V = a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    q_nope = t["wq_b_out"].reshape(1, T, H, N + R)[..., :N]
    kvb = t["wkv_b_out"].reshape(1, T, H, N + V)
    allowed = np.zeros((1, T, T), bool)
    np.put_along_axis(allowed[0], t["idx_topk"][0], True, -1)
    allowed &= np.tri(T, dtype=bool)
    o = attention.mha_ref(q_nope, t["q_pe_roped"], kvb[..., :N], t["k_pe_roped"][:, :, 0], kvb[..., N:], allowed,
                          a.softmax_scale, rb)
    assert_bf16_close(o.reshape(1, T, -1), t["attn_core_out"], what="attention core")
    assert_bf16_close(quant.linear_ref(t["attn_core_out"], p["wo"], True), t["attn_out"], what="wo")

    # the whole attention layer from its input reproduces the trace's output
    cache = LayerCache(1, a, True, NUMPY_OPS)
    cache.reserve(T)
    cos, sin = _angles(a, T)
    from types import SimpleNamespace
    out = attention.mla_forward(x, p, cache, 0, cos, sin, a, SimpleNamespace(official=True, sparse=True, indexer_fp8=True, ops=NUMPY_OPS))
    assert_bf16_close(out, t["attn_out"], what="mla_forward")
    np.testing.assert_array_equal(bits(cache.idx.k[:, :T]), t["idx_k_fp8_bits"])
    np.testing.assert_array_equal(cache.kv[:, :T], t["kv_latent"])


def _angles(a, T):
    import rope
    f = rope.yarn_freqs(a.qk_rope_head_dim, a.rope_theta, a.max_seq_len, a.original_seq_len, a.rope_factor,
                        a.rope_scaling["beta_fast"], a.rope_scaling["beta_slow"])
    return rope.rope_angles(f, np.arange(T))


def test_ffn_ops(fx, trace):
    ck, a, layers = fx
    rb = quant.bf16_round
    for i in (0, 1):
        t = {k.split(".", 1)[1]: v for k, v in trace.items() if k.startswith(f"l{i}.")}
        s = t["ffn_norm_in"] + t["ffn_norm_residual_in"]
        assert_bf16_close(attention.rms_norm_ref(s, layers[i]["ffn_norm"], a.rms_norm_eps, rb), t["ffn_norm_out"], what="ffn_norm")
        assert_bf16_close(rb(s), t["ffn_norm_residual_out"], what="ffn residual")
        x = t["ffn_norm_out"].reshape(-1, a.hidden_size)
        f = layers[i]["ffn"]
        if i == 0:
            assert_bf16_close(quant.linear_ref(x, f["w1"], True), t["mlp_w1_out"].reshape(x.shape[0], -1), what="w1")
            assert_bf16_close(quant.linear_ref(x, f["w3"], True), t["mlp_w3_out"].reshape(x.shape[0], -1), what="w3")
            w2_in = rb(moe.silu(t["mlp_w1_out"]) * t["mlp_w3_out"])
            assert_bf16_close(w2_in, t["mlp_w2_in"], what="silu * up")
            assert_bf16_close(quant.linear_ref(t["mlp_w2_in"], f["w2"], True), t["ffn_out"], what="w2")
            assert_bf16_close(moe.mlp_ref(x, f, True), t["ffn_out"].reshape(x.shape), what="mlp")
        else:
            w, idx = moe.gate_ref(x, f["gate"].dequant(), f["gate_bias"], a)
            for r in range(x.shape[0]):
                assert set(idx[r].tolist()) == set(t["gate_indices"][r].tolist()), f"token {r}"
                order = np.argsort(idx[r])
                ref_order = np.argsort(t["gate_indices"][r])
                assert rel_err(w[r][order], t["gate_weights"][r][ref_order]) <= 1e-6
            assert_bf16_close(moe.mlp_ref(x, f["shared_experts"], True), t["shared_out"], what="shared expert")
            assert_bf16_close(moe.moe_ref(x, f, a, True), t["ffn_out"].reshape(x.shape), what="moe")


def test_fixture_loads_and_skips_mtp():
    ck = checkpoint.Checkpoint(FIXTURE_CKPT)
    assert any(k.startswith("model.layers.3.") for k in ck.weight_map)      # the MTP layer is stored...
    m = Transformer.from_pretrained(FIXTURE_CKPT)
    assert len(m.w["layers"]) == 3                                          # ...and not built


def test_whole_model_reproduces_official_logits(trace):
    m = Transformer.from_pretrained(FIXTURE_CKPT)
    tok = trace["tokens"]
    assert rel_err(m.forward(tok), trace["logits_last"]) <= 1e-5
    h = m.forward(tok, all_positions=True)
    assert h.shape == (1, 53, 2048)
    for t in (0, 1, 15, 16, 17, 30, 52):                                    # prefixes: dense, then sparse
        assert rel_err(m.forward(tok[:, :t + 1]), trace["logits_prefix"][t]) <= 1e-3, t
    # absorbed decode after a 26-token prefill, one token at a time
    m.forward(tok[:, :26])
    errs = [rel_err(m.forward(tok[:, p:p + 1], start_pos=p)[0], trace["logits_decode"][p - 26]) for p in range(26, 53)]
    assert max(errs) <= 1e-3, errs
