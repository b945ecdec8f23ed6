"""DeepSeek-V4-Flash's official numerics, op by op, against the trace of the official inference code
(tests/fixtures/README.md, official_v4_tiny): for each of the 4 layers, in the prefill of 206 tokens and
in each of the 4 decode steps after it, each op gets the trace's own input and must give the trace's
output bit for bit: the arrays the official code holds in bf16, its FP8 codes and scales, and the fp32
ones too (the mHC mixes, the routing weights, the logits), since the code is deterministic and the
trace fixes the hardware's open choices (correctly rounded exp, sigmoid and rsqrt; the Sinkhorn
kernel's fma and its sums in index order; other sums exact, rounded once); selections as sets per row
and in the official order. Both CPU backends are held to it: the NumPy reference and torch (the twins in
backend_torch.py); on a GPU the fp32 sums and rsqrt are the hardware's (its kernels against the trace:
tests/test_kernels_v4.py), so its parameter skips. Then the whole model on the same tokens: every
layer's streams and all 5 steps' logits, bit for bit."""
from types import SimpleNamespace

import numpy as np
import pytest

import attention_v4
import checkpoint
import compressor
import indexer
import moe
import quant
import rope
from conftest import backends
from helpers import bf16_ulp
from model import Transformer

PHASES = [("", 0)] + [(f"dec{k}.", 206 + k) for k in range(4)]     # (key prefix, first position)
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"

def host(x):  # a backend array -> NumPy (FP8 as its raw bytes)
    if hasattr(x, "cpu"):
        import torch
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            return x.view(torch.uint8).cpu().numpy()
        return x.cpu().numpy()
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 and x.dtype.kind not in "biu" else x


def same(got, want, key):
    """got equals the trace's array bit for bit (-inf where it is -inf)."""
    __tracebackhide__ = True
    got, want = np.asarray(host(got), np.float64).reshape(np.shape(want)), np.asarray(want, np.float64)
    bad = (got != want) & ~(np.isnan(got) & np.isnan(want))
    if bad.any():
        d = np.abs(got - want)[bad]
        steps = float(np.nanmax(d / bf16_ulp(np.maximum(np.abs(got), np.abs(want))[bad])))
        rows = sorted(set(np.nonzero(bad)[0].tolist()))
        raise AssertionError(f"{key}: {int(bad.sum())} of {want.size} values differ, by up to {steps:.3g} bf16 "
                             f"ulps, in rows {rows[:8]}")


def layer(trace, ph, i):  # phase ph's arrays of layer i, without the prefix
    pre = f"{ph}l{i}."
    return {k[len(pre):]: v for k, v in trace.items() if k.startswith(pre)}


def phase_tokens(trace, ph):
    return trace["tokens"] if ph == "" else trace["decode_tokens"][int(ph[3]):int(ph[3]) + 1]


def twins(ops, a):
    """The V4 attention's steps that ops.Ops does not list, as each backend names them: the NumPy
    reference's functions, or their torch twins in backend_torch.py."""
    eps, R, rb = a.rms_norm_eps, a.qk_rope_head_dim, quant.bf16_round
    if ops.name == "numpy":
        def query(x, qr, p, cos, sin):  # attention_v4_forward's q from c^Q: wq_b, the per-head bf16 norm, RoPE
            q = quant.linear_ref(qr, p["wq_b"], True).reshape(*qr.shape[:2], a.num_attention_heads, a.head_dim)
            return rb(compressor.rope_tail(attention_v4.rms_norm_bf16(q, eps), cos, sin))

        def index_query(x, qr, p, cos, sin):  # compressor.indexer_select_ref's q^I and head weights
            J, D = a.index_n_heads, a.index_head_dim
            q = compressor.rope_tail(quant.linear_ref(qr, p["wq_b"], True).reshape(*qr.shape[:2], J, D), cos, sin)
            xw = rb(quant.matmul_f32(x, p["weights_proj"].dequant().T))
            return compressor.index_fp4_ref(rb(q)), rb(xw * np.float32(J ** -0.5 * D ** -0.5))

        return SimpleNamespace(
            angles=rope.rope_angles, rope_tail=compressor.rope_tail, query=query, kv_fp8=attention_v4.kv_fp8_ref,
            compress=compressor.compress_ref, index_fp4=compressor.index_fp4_ref, index_query=index_query,
            select=compressor.indexer_select_ref, sparse_attention=attention_v4.sparse_attention_ref,
            output=lambda o, p, cos, sin: attention_v4.grouped_output_ref(rb(compressor.rope_tail(o, cos, -sin)),
                                                                          p["wo_a"], p["wo_b"], a.o_groups, True),
            zeros=lambda T: np.zeros(T, np.int64))
    import torch
    import backend_torch as bt
    return SimpleNamespace(
        angles=lambda f, pos: bt.rope_angles(f, torch.as_tensor(pos, device=ops.device)), rope_tail=bt.rope_tail,
        query=lambda x, qr, p, cos, sin: bt.query_key(x, p, cos, sin, a, True)[1],   # (its c^Q: held to `qr` above)
        kv_fp8=bt.kv_fp8, compress=bt.compress, index_fp4=bt.index_fp4,
        index_query=lambda x, qr, p, cos, sin: bt.index_query(x, qr, p, cos, sin, a, True),
        select=bt.indexer_select_v4, sparse_attention=lambda *args: bt.sparse_attention(*args),
        output=lambda o, p, cos, sin: bt.v4_output(o, p, a, cos, sin, True),
        zeros=lambda T: torch.zeros(T, dtype=torch.long, device=ops.device))


@pytest.fixture(scope="module", params=backends())
def fx(request, official_v4_ckpt):
    if request.param[1] not in (None, "cpu"):
        pytest.skip("the GPU paths' bounds against the V4 trace are not measured yet")
    m = Transformer.from_pretrained(official_v4_ckpt, backend=request.param[0], device=request.param[1])
    return m, m.ops, m.args, twins(m.ops, m.args)


def picked(sel, offset=0):  # a selection (a [T, n] mask, or [T, k] indices -1 padded) -> a set per row
    sel = host(sel)
    if sel.dtype == bool:
        return [set(np.nonzero(r)[0].tolist()) for r in sel]
    return [{int(s) - offset for s in r if s >= 0} for r in sel]


def test_fixture_is_the_official_layout(official_v4_ckpt, trace_v4):
    ck = checkpoint.Checkpoint(official_v4_ckpt)
    assert "embed.weight" in ck.weight_map and "layers.0.hc_attn_fn" in ck.weight_map
    assert not any(k.startswith("model.") for k in ck.weight_map)          # the official names, no prefix
    assert any(k.startswith("mtp.0.") for k in ck.weight_map)              # an MTP layer is stored...
    m = Transformer.from_pretrained(official_v4_ckpt)
    assert len(m.w["layers"]) == 4                                         # ...and not built
    assert m.args.layer_types == ["sliding_attention", CSA, HCA, CSA]
    assert m.args.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    # the trace's recorded shapes, for the layout below
    assert trace_v4["tokens"].shape == (206,) and trace_v4["logits"].shape == (5, 2048)
    assert (trace_v4["hc_rows"] == np.r_[np.arange(0, 206, 4), 205]).all()


@pytest.mark.slow
@pytest.mark.parametrize("i", range(4))
def test_mhc_ops(fx, trace_v4, i):
    # the mixes, Sinkhorn, the collapse, the sub-layer's RMSNorm and the post-mix, on both sides of the
    # block, from the trace's streams (the prefill's mHC arrays hold the rows hc_rows)
    m, ops, a, _ = fx
    P, rb, lw = ops.param, ops.bf16_round, m.w["layers"][i]
    for ph, start in PHASES:
        t = layer(trace_v4, ph, i)
        rows = trace_v4["hc_rows"] if ph == "" else [0]
        if i == 0:                                                        # X^0: the bf16 embedding, 4 copies
            e = host(rb(ops.embed(m.w["embed"], ops.tokens(phase_tokens(trace_v4, ph)[rows]))))
            np.testing.assert_array_equal(t["hc_attn_in"], np.repeat(e[:, None], a.hc_mult, 1))
        X = t["hc_attn_in"] if i == 0 else trace_v4[f"{ph}l{i - 1}.hc_ffn_out"]
        for side, norm_in, out in (("attn", "attn_in", "attn_out"), ("ffn", "ffn_in", "ffn_out")):
            key = f"{ph}l{i}.hc_{side}_"
            pre, post, comb, u = ops.hc_mix_pre(P(X), lw[f"hc_{side}_fn"], lw[f"hc_{side}_base"], lw[f"hc_{side}_scale"],
                                                a, True)
            for name, got in (("pre", pre), ("post", post), ("comb", comb)):           # fp32, bit for bit
                same(got, t[f"hc_{side}_{name}"], key + name)
            same(u, t[f"hc_{side}_u"], key + "u")
            same(ops.v4_norm(P(t[f"hc_{side}_u"]), lw[f"{side}_norm"], a.rms_norm_eps, rb), t[norm_in][rows],
                 f"{ph}l{i}.{norm_in}")
            Xo = ops.hc_post(P(X), P(t[out][rows]), P(t[f"hc_{side}_post"]), P(t[f"hc_{side}_comb"]), True)
            same(Xo, t[f"hc_{side}_out"], f"{ph}l{i}.hc_{side}_out")
            X = t["hc_attn_out"]


def decode_keys(kv_rows, pos, W):  # the decode cache's window: position p in ring slot p mod W
    allkv = np.concatenate(kv_rows)                                       # positions 0 .. pos
    ring = np.zeros((W, allkv.shape[1]), np.float32)
    for p in range(max(0, pos - W + 1), pos + 1):
        ring[p % W] = allkv[p]
    return ring


@pytest.mark.slow
@pytest.mark.parametrize("i", range(4))
def test_attention_ops(fx, trace_v4, i):
    m, ops, a, tw = fx
    P, rb = ops.param, ops.bf16_round
    p, kind, mm = m.w["layers"][i]["attn"], a.layer_types[i], a.ratio(i)
    eps, R, W = a.rms_norm_eps, a.qk_rope_head_dim, a.sliding_window
    freqs = m.freqs[mm > 0]
    cache = ops.v4_cache(1, a, kind, p)                                   # the compressors' states, this backend's
    layer_cache = ops.v4_cache(1, a, kind, p)                             # the whole layer's (at the end)
    kv_rows, comp_kv, idx_kv = [], [], []
    for ph, start in PHASES:
        t, key = layer(trace_v4, ph, i), f"{ph}l{i}."
        T = t["attn_in"].shape[0]
        x = P(t["attn_in"])
        if i == 0:                                                        # the first FP8 linear in detail
            q8, s8 = ops.act_quant(x)
            np.testing.assert_array_equal(host(q8), t["wq_a_act_fp8_bits"])
            np.testing.assert_array_equal(host(s8), t["wq_a_act_scale"])
            same(ops.linear(x, p["wq_a"], True), t["wq_a_out"], key + "wq_a_out")
            same(ops.v4_norm(P(t["wq_a_out"]), p["q_norm"], eps, rb), t["qr"], key + "qr")
        same(ops.v4_norm(ops.linear(x, p["wq_a"], True), p["q_norm"], eps, rb), t["qr"], key + "qr")
        same(ops.v4_norm(ops.linear(x, p["wkv"], True), p["kv_norm"], eps, rb), t["kv_normed"], key + "kv_normed")
        q8, s8 = ops.act_quant(P(t["kv_normed"][:, :-R]), 64)             # the key's FP8 step: one block of 64
        np.testing.assert_array_equal(host(q8), t["kv_fp8_bits"])
        np.testing.assert_array_equal(host(s8), t["kv_fp8_scale"])

        # q and the key, RoPE at the tokens' positions (YaRN's frequencies on the compressed layers)
        cos, sin = tw.angles(freqs, start + np.arange(T))
        same(tw.query(x[None], P(t["qr"])[None], p, cos, sin)[0], t["q"], key + "q")
        kv = tw.kv_fp8(rb(tw.rope_tail(P(t["kv_normed"])[None, :, None], cos, sin)[:, :, 0]), R)
        same(kv[0], t["kv"], key + "kv")
        kv_rows.append(t["kv"])

        # the compressors, their state carried from the prefill through the decode steps
        if mm:
            K = tw.compress(x[None], p["compressor"], mm, mm == 4, start, freqs, eps, cache.comp, rb,
                            lambda K: tw.kv_fp8(K, R))
            if "comp_kv" in t:
                same(K[0], t["comp_kv"], key + "comp_kv")
                comp_kv.append(t["comp_kv"])
            else:
                assert K.shape[1] == 0, key                               # no window completes here
        if kind == CSA:
            ip, off = p["indexer"], T if ph == "" else W                   # idx_topk: window + offset
            K = tw.compress(x[None], ip["compressor"], 4, True, start, freqs, eps, cache.idx, rb, tw.index_fp4)
            if "idx_kv" in t:
                same(K[0], t["idx_kv"], key + "idx_kv")
                idx_kv.append(t["idx_kv"])
            else:
                assert K.shape[1] == 0, key
            Kidx = np.concatenate(idx_kv)                                  # the trace's keys from here on
            qI, wI = tw.index_query(x[None], P(t["qr"])[None], ip, cos, sin)
            same(qI[0], t["idx_q"], key + "idx_q")
            same(wI[0], t["idx_weights_proj_out"] * np.float32(1 / 32), key + "idx_weights_proj_out")
            if ops.name == "numpy":                                       # (torch: inside indexer_select_v4)
                I = compressor.index_scores_v4_ref(t["idx_q"][None], rb(t["idx_weights_proj_out"] / 32)[None],
                                                   Kidx[None], True)[0]
                I = np.where(indexer.causal_ref(T, start, Kidx.shape[0], 4), I, -np.inf)
                same(I, t["idx_scores"], key + "idx_scores")
                sel = indexer.topk_select_ref(t["idx_scores"][None], a.index_topk, start, 4)[0]
                assert picked(sel) == picked(t["idx_topk"], off), key + "top-k of the trace's scores"
            # the official list is best first, ties to the lower window, then -1 (torch.topk's order)
            S = t["idx_scores"]
            order = np.argsort(-S, -1, kind="stable")[:, :a.index_topk]
            want = np.where(np.isfinite(np.take_along_axis(S, order, -1)), order, -1)
            np.testing.assert_array_equal(np.where(t["idx_topk"] >= 0, t["idx_topk"] - off, -1), want)
            # the whole indexer from the trace's input, c^Q and keys: the same picks
            picks = host(tw.select(x[None], P(t["qr"])[None], ip, P(Kidx)[None], start, cos, sin, a, True))[0]
            assert picked(picks) == picked(t["idx_topk"], off), key + "idx_topk"
            np.testing.assert_array_equal(picks, want, err_msg=key + "idx_topk order")       # in the official order

        # the attention kernel on the trace's q, keys and index list: the rows [kv | comp_kv] in prefill,
        # the layer's cache (W ring slots, then the compressed keys) in decode
        KW = t["kv"] if ph == "" else decode_keys(kv_rows, start, W)
        KC = np.concatenate(comp_kv) if comp_kv else np.zeros((0, a.head_dim), np.float32)
        o = tw.sparse_attention(P(t["q"])[None], P(KW)[None], P(KC)[None], P(t["attn_topk_idxs"])[None], tw.zeros(T),
                                p["attn_sink"], a.softmax_scale, True)
        same(o[0], t["attn_kernel_out"], key + "attn_kernel_out")
        # the inverse RoPE and the grouped output projection (W^OA in bf16, W^OB FP8)
        same(tw.output(P(t["attn_kernel_out"])[None], p, cos, sin)[0], t["attn_out"], key + "attn_out")

        # the whole layer from its input alone (ops.v4_attention, its caches carried across the phases)
        y = ops.v4_attention(x[None], p, kind, mm, start, freqs, a, layer_cache, True, True)
        same(y[0], t["attn_out"], key + "attn_layer_out")


@pytest.mark.slow
@pytest.mark.parametrize("i", range(4))
def test_ffn_ops(fx, trace_v4, i):
    m, ops, a, _ = fx
    P = ops.param
    f = m.w["layers"][i]["ffn"]
    for ph, start in PHASES:
        t, key = layer(trace_v4, ph, i), f"{ph}l{i}."
        toks = phase_tokens(trace_v4, ph)
        if ops.name == "numpy":         # (torch's moe_v4 routes inside; its choice is held by ffn_out below)
            hashed = f["tid2eid"][toks] if "tid2eid" in f else None
            w, idx = moe.gate_ref(t["ffn_in"], f["gate"].dequant(), f.get("gate_bias"), a, hashed)
            if hashed is not None:
                np.testing.assert_array_equal(t["gate_indices"], hashed)           # layer 0: tid2eid[token]
            np.testing.assert_array_equal(idx, t["gate_indices"], err_msg=key)     # the top 2, best first
            same(w, t["gate_weights"], key + "gate_weights")                         # fp32, bit for bit
        y = ops.v4_moe(P(t["ffn_in"]), f, a, True, ops.tokens(toks), weight_inside=True)
        same(y, t["ffn_out"], key + "ffn_out")


def test_head_ops(fx, trace_v4):
    m, ops, a, _ = fx
    P, rb, hc = ops.param, ops.bf16_round, m.w["hc_head"]
    for k, (ph, start) in enumerate(PHASES):
        rows = trace_v4["hc_rows"] if ph == "" else [0]
        u = ops.hc_head(P(trace_v4[f"{ph}l3.hc_ffn_out"]), hc["fn"], hc["base"], hc["scale"], a, True)
        same(u, trace_v4[f"{ph}head_u"], ph + "head_u")
        same(ops.v4_norm(P(trace_v4[f"{ph}head_u"]), m.w["norm"], a.rms_norm_eps, rb), trace_v4[f"{ph}final_norm"][rows],
             ph + "final_norm")
        logits = ops.matmul_f32(P(trace_v4[f"{ph}final_norm"][-1:]), m.w["head_f32"].T)   # the fp32 head, last row
        same(logits[0], trace_v4["logits"][k], f"logits[{k}]")


@pytest.mark.slow
def test_whole_model(fx, trace_v4):
    # the model in official numerics on the trace's prefill and its 4 decode tokens, each the greedy pick
    # before it: every layer's streams (the prefill's hc_rows) and the 5 steps' logits bit for bit. This
    # random model is chaotic (the fixture's README: one rounding point done otherwise moves the logits by
    # tens of percent), so this holds only when every op above does
    m, ops, a, _ = fx
    record = {}
    logits = [host(m.forward(trace_v4["tokens"][None], record=record))[0]]
    for k, tok in enumerate(trace_v4["decode_tokens"]):
        logits.append(host(m.forward(np.array([[tok]]), start_pos=206 + k))[0])
    for i in range(4):
        streams = host(record["hidden"][i])[0].reshape(206, a.hc_mult, a.hidden_size)[trace_v4["hc_rows"]]
        same(streams, trace_v4[f"l{i}.hc_ffn_out"], f"model.l{i}.hc_ffn_out")
    same(np.stack(logits), trace_v4["logits"], "model.logits")
    np.testing.assert_array_equal(np.argmax(logits, -1)[:4], trace_v4["decode_tokens"])   # the trace's greedy steps
