"""backend="torch" against the NumPy reference: the same model through the other op table, on the
CPU here and on a GPU where there is one (official numerics are held to the official trace op by op
in test_official_trace.py, for every backend)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")

import backend_torch
import checkpoint
import quant_torch
from conftest import HAS_CUDA, gpu
from helpers import rel_err
from model import Transformer

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = checkpoint.tiny_config(index_topk=8)
    path = tmp_path_factory.mktemp("torch") / "ckpt"
    return checkpoint.write_checkpoint(path, cfg, checkpoint.random_weights(cfg, 11))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_exact_logits_and_greedy_tokens_equal_numpy(ckpt, device):
    ref = Transformer.from_pretrained(ckpt, numerics="exact")
    fast = Transformer.from_pretrained(ckpt, numerics="exact", backend="torch", device=device)
    tokens = np.random.default_rng(0).integers(0, 2048, (2, 30))           # sparse: 30 keys > index_topk 8
    a = ref.forward(tokens, all_positions=True)
    b = fast.forward(torch.as_tensor(tokens), all_positions=True)
    assert isinstance(b, torch.Tensor) and b.dtype == torch.float32
    assert rel_err(b.cpu().numpy(), a) <= 1e-5
    # 32 greedy steps with the caches, token for token
    out_a, out_b = [], []
    la, lb = ref.forward(tokens[:1, :20]), fast.forward(tokens[:1, :20])
    for step in range(32):
        ta, tb = int(la[0].argmax()), int(lb[0].argmax())
        out_a.append(ta)
        out_b.append(tb)
        la = ref.forward([[ta]], start_pos=20 + step)
        lb = fast.forward([[tb]], start_pos=20 + step)
    assert out_a == out_b


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_equals_one_prefill(ckpt, device):
    # exact numerics: chunks equal one prefill. (In official numerics they agree only as far as the
    # float32 GEMMs of the router, head and attention give the same bits for another number of rows,
    # which BLAS does not promise; the random model then amplifies any flipped bf16 rounding.)
    tokens = np.random.default_rng(1).integers(0, 2048, (1, 24))
    m = Transformer.from_pretrained(ckpt, numerics="exact", backend="torch", device=device)
    full = m.forward(tokens, all_positions=True).cpu().numpy()
    a = m.forward(tokens[:, :10], all_positions=True).cpu().numpy()
    b = m.forward(tokens[:, 10:], start_pos=10, all_positions=True).cpu().numpy()
    assert rel_err(np.concatenate([a, b], 1), full) <= 1e-5
    official = Transformer.from_pretrained(ckpt, backend="torch", device=device)
    official.forward(tokens[:, :10])
    assert np.isfinite(official.forward(tokens[:, 10:], start_pos=10).cpu().numpy()).all()


def test_fp8_weights_stay_fp8(ckpt):
    m = Transformer.from_pretrained(ckpt, backend="torch")
    w = m.w["layers"][1]["ffn"]["w13"]                                      # all experts stacked [E, 2I, d]
    assert w.w.dtype == torch.float8_e4m3fn and w.scale.dtype == torch.float32 and w.w.shape == (8, 256, 256)


def test_bad_device_and_backend():
    with pytest.raises(ValueError, match="needs backend='torch'"):
        Transformer.from_pretrained("tests/fixtures/official_v32_tiny", device="cuda")
    with pytest.raises(ValueError, match="backend must be"):
        Transformer.from_pretrained("tests/fixtures/official_v32_tiny", backend="jax")


def permute_w2_rows(t):  # the gfx90a report's bug: 16-row blocks of each 128-row tile in the order 0,2,4,6,1,3,5,7
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    n = t.shape[0]
    idx = torch.cat([torch.arange(tile + 16 * b, tile + 16 * b + 16) for tile in range(0, n, 128) for b in order])
    return t[idx]


def test_expert_probe_stops_a_permuted_w2(ckpt, monkeypatch):
    import model
    Transformer.from_pretrained(ckpt, backend="torch")                      # a correct load passes the probe
    real = model.to_backend

    def faulty(w, ops):                                                     # a loader that permutes one W2
        out = real(w, ops)
        if isinstance(out, dict) and "w2" in out and out["w2"].w.dim() == 3:
            out["w2"].w[3] = permute_w2_rows(out["w2"].w[3])                # expert 3 of every MoE layer
        return out

    monkeypatch.setattr(model, "to_backend", faulty)
    with pytest.raises(model.LoadError, match=r"layer 1 expert 3 w2: the device weights give \d+% relative error"):
        Transformer.from_pretrained(ckpt, backend="torch")


@pytest.mark.parametrize("device", DEVICES)
def test_static_decode_equals_decode(ckpt, device):
    # the capturable decode step (fixed shapes over the whole cache, device-side position) against
    # the ordinary decode step, in exact numerics
    tokens = np.random.default_rng(4).integers(0, 2048, (2, 20))
    a = Transformer.from_pretrained(ckpt, numerics="exact", backend="torch", device=device)
    b = Transformer.from_pretrained(ckpt, numerics="exact", backend="torch", device=device)
    a.forward(tokens)
    b.reserve(2, 40)
    b.forward(tokens)
    nxt = tokens[:, -1:]
    for step in range(12):
        la = a.forward(nxt, start_pos=20 + step)
        lb = b.decode_static(torch.as_tensor(nxt, device=device), torch.tensor(20 + step, device=device))
        assert rel_err(lb.cpu().numpy(), la.cpu().numpy()) <= 1e-5, step
        nxt = la.argmax(-1, keepdim=True).cpu().numpy()


@gpu
def test_cuda_graph_replays_the_static_step(ckpt):
    # official numerics (the grouped expert GEMM: no host synchronisation, so capturable)
    import backend_torch
    tokens = np.random.default_rng(5).integers(0, 2048, (2, 20))
    a = Transformer.from_pretrained(ckpt, backend="torch", device="cuda")
    b = Transformer.from_pretrained(ckpt, backend="torch", device="cuda")
    for m in (a, b):
        m.reserve(2, 40)
        m.forward(tokens)
    graph = backend_torch.GraphDecoder(b, 2, 20)
    nxt = torch.as_tensor(tokens[:, -1:], device="cuda")
    for step in range(12):
        la = a.decode_static(nxt, torch.tensor(20 + step, device="cuda"))
        lb = graph(nxt, 20 + step)
        assert rel_err(lb.cpu().numpy(), la.cpu().numpy()) <= 1e-6, step
        nxt = la.argmax(-1, keepdim=True)


@gpu
@pytest.mark.parametrize("v4", [False, True])
def test_programmatic_dependent_launch_changes_no_bits(ckpt, tmp_path, monkeypatch, v4):
    # every kernel waits for the one before it (kernels_fp8._await_inputs), so launching the kernels early
    # (kernels_fp8.pdl) changes when they start, not what they read: prefill and the graph's decode steps
    # with and without it, bit for bit
    import kernels_fp8
    if not kernels_fp8.pdl():
        pytest.skip("programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0 or later")
    path = checkpoint.build_tiny(tmp_path / "tiny-v4", tokenizer=False, v4=True) if v4 else ckpt
    tokens = np.random.default_rng(8).integers(0, 512, (2, 24))
    runs = []
    for on in (True, False):
        monkeypatch.setattr(kernels_fp8, "USE_PDL", on)
        m = Transformer.from_pretrained(path, backend="torch", device="cuda")
        m.reserve(2, 48)
        logits = [m.forward(tokens).cpu().numpy()]
        graph = backend_torch.GraphDecoder(m, 2, 24)
        nxt = torch.as_tensor(tokens[:, -1:], device="cuda")
        for pos in range(24, 40):
            out = graph(nxt, pos)
            logits.append(out.cpu().numpy())
            nxt = out.argmax(-1, keepdim=True)
        runs.append(logits)
    for step, (a, b) in enumerate(zip(*runs)):
        assert np.array_equal(a, b), step


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=2, max_size=3), st.integers(1, 96), st.integers(0, 2 ** 31), st.data())
def test_fused_linears_equal_one_gemm_per_weight(device, blocks, ragged, seed, data):
    """fuse_rows lays several FP8 weights of one input out as row blocks of one; linears then runs one
    GEMM over them: the same bits as one GEMM per weight (every output column depends on its own
    weight row only), in the caller's order whichever block is ragged; what cannot share a GEMM stays apart."""
    import parallel
    import quant
    ops = backend_torch.torch_ops(device)
    rng = np.random.default_rng(seed)
    K, M = 256, data.draw(st.integers(1, 5))
    rows = [128 * b for b in blocks]
    rows[data.draw(st.integers(0, len(rows) - 1))] += ragged - 128      # one block need not fill its last 128 rows
    Ws = [ops.weight(quant.Weight(*quant.weight_quant(rng.standard_normal((n, K)).astype(np.float32)))) for n in rows]
    x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32)).to(device)
    apart = [ops.linear(x, W, True) for W in Ws]
    fused = ops.fuse_rows(Ws)
    base = fused[0].w._base
    assert base is not None and base.shape == (sum(rows), K) and all(F.w._base is base for F in fused)
    last = max(range(len(rows)), key=lambda i: fused[i].w.data_ptr())
    assert all(n % 128 == 0 for i, n in enumerate(rows) if i != last)   # a ragged block goes last
    for F, W in zip(fused, Ws):                                        # the same weights, now views
        assert torch.equal(F.w.view(torch.uint8), W.w.view(torch.uint8)) and torch.equal(F.scale, W.scale)
    assert all(a is b for a, b in zip(ops.fuse_rows(fused), fused))     # laid out so already: unchanged
    together = ops.linears(x, fused, True)
    for got, want in zip(together, apart):
        assert got.shape == want.shape and torch.equal(got, want)
    # not fused: two ragged blocks, different K, a RowShard (its product is a partial sum), unscaled weights
    two_ragged = [ops.weight(quant.Weight(*quant.weight_quant(rng.standard_normal((n, K)).astype(np.float32))))
                  for n in (64, 64)]
    other_k = ops.weight(quant.Weight(*quant.weight_quant(rng.standard_normal((128, 2 * K)).astype(np.float32))))
    shard = parallel.RowShard(*Ws[0])
    plain = quant.Weight(Ws[0].w.float(), None)
    for group in (two_ragged, [Ws[0], other_k], [shard, Ws[1]], [plain, Ws[1]]):
        assert all(a is b for a, b in zip(ops.fuse_rows(group), group))
    mixed = ops.linears(x, [fused[0], Ws[1]], True)                    # blocks of different weights: one GEMM each
    assert torch.equal(mixed[0], apart[0]) and torch.equal(mixed[1], apart[1])


def test_model_projections_share_gemms(ckpt):
    """The model lays out wq_a | wkv_a | the indexer's wk and wq_b | the indexer's wq_b as one weight each
    (sparse attention; dense leaves the indexer's out), and each SwiGLU's w1 | w3, in official numerics only."""
    def one(*Ws):  # row blocks of one weight
        return Ws[0].w._base is not None and all(W.w._base is Ws[0].w._base for W in Ws)
    p = Transformer.from_pretrained(ckpt, backend="torch").w["layers"][0]["attn"]
    assert one(p["wq_a"], p["wkv_a"], p["indexer"]["wk"]) and one(p["wq_b"], p["indexer"]["wq_b"])
    p = Transformer.from_pretrained(ckpt, backend="torch", attention="dense").w["layers"][0]["attn"]
    assert one(p["wq_a"], p["wkv_a"]) and not one(p["wq_a"], p["indexer"]["wk"]) and not one(p["wq_b"], p["indexer"]["wq_b"])
    p = Transformer.from_pretrained(ckpt, backend="torch", numerics="exact").w["layers"][0]["attn"]
    assert not one(p["wq_a"], p["wkv_a"])
    # and the SwiGLU's w1 | w3: a dense-FFN layer's and the shared experts' (ops.mlp: one GEMM, one act_quant)
    layers = Transformer.from_pretrained(ckpt, backend="torch").w["layers"]
    dense, moe_ = layers[0]["ffn"], layers[-1]["ffn"]["shared_experts"]
    assert "gate" not in layers[0]["ffn"] and "gate" in layers[-1]["ffn"]
    assert one(dense["w1"], dense["w3"]) and one(moe_["w1"], moe_["w3"])
    assert not one(*(Transformer.from_pretrained(ckpt, backend="torch", numerics="exact").w["layers"][-1]["ffn"]
                     ["shared_experts"][k] for k in ("w1", "w3")))


def test_cpu_fp8_decode_and_gemm_bit_for_bit():
    """The CPU's table decode of FP8 (quant.fp8_decode's rule) gives every one of the 256 codes the
    value ml_dtypes and torch's own cast give, NaN at 0x7F / 0xFF and subnormals included; the batched
    fp8_gemm_torch and the broadcast dequant equal quant.fp8_gemm / quant.weight_dequant bit for bit,
    ragged K and N included."""
    import quant
    codes = np.arange(256, dtype=np.uint8)
    t = torch.from_numpy(codes).view(quant_torch.F8)
    for dt in (torch.float32, torch.float64):
        got = quant_torch.fp8_values(t.reshape(16, 16), dt).reshape(-1).numpy()
        want = codes.view(quant.E4M3).astype(got.dtype)
        assert np.isnan(got[[0x7F, 0xFF]]).all() and np.array_equal(got, want, equal_nan=True)
        assert np.array_equal(got, t.to(dt).numpy(), equal_nan=True)
        assert np.array_equal(got, quant.fp8_decode(codes.view(quant.E4M3), got.dtype), equal_nan=True)
    rng = np.random.default_rng(3)
    threads = torch.get_num_threads()
    for M, N, K in ((1, 256, 256), (5, 192, 384), (3, 130, 200), (2, 64, 100)):
        x = (rng.standard_normal((M, K)) * rng.choice([1e-3, 1, 30], (M, K))).astype(np.float32)
        w, ws = quant.weight_quant(rng.standard_normal((N, K)).astype(np.float32) * 0.1)
        K128 = -(-K // 128) * 128                                        # act_quant wants whole blocks
        q, s = quant.act_quant(np.pad(x, ((0, 0), (0, K128 - K))))
        q = q[:, :K]
        want = quant.fp8_gemm(q, s, w, ws)
        tq, tw = quant_torch.to_torch(q, "cpu"), quant_torch.to_torch(w, "cpu")
        got = quant_torch.fp8_gemm(tq, torch.from_numpy(s), tw, torch.from_numpy(ws)).numpy()
        assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
        deq = quant_torch.dequant(quant.Weight(tw, torch.from_numpy(ws))).numpy()
        assert np.array_equal(deq.view(np.uint32), quant.weight_dequant(w, ws).view(np.uint32))
    assert torch.get_num_threads() == threads                          # cpu_threads_for gave the count back


@pytest.mark.parametrize("budget", [1, 8 * 3 * 260 * 7, 1 << 26])
def test_cpu_fp8_gemm_in_row_chunks_is_bit_for_bit(monkeypatch, budget):
    # the float64 partials are made a bounded number of bytes at a time (one row, 7 rows, all 300):
    # the same bits as quant.fp8_gemm, with a ragged K (384 = 3 blocks) and N (260)
    import quant
    rng = np.random.default_rng(1)
    a, sa = quant.act_quant(rng.standard_normal((300, 384)).astype(np.float32))
    w, sw = quant.weight_quant(rng.standard_normal((260, 384)).astype(np.float32))
    T = lambda x: torch.from_numpy(np.ascontiguousarray(x.view(np.uint8))).view(torch.float8_e4m3fn)   # noqa: E731
    monkeypatch.setattr(quant_torch, "PARTIAL_BYTES", budget)
    got = quant_torch.fp8_gemm(T(a), torch.from_numpy(sa), T(w), torch.from_numpy(sw)).numpy()
    np.testing.assert_array_equal(got, quant.fp8_gemm(a, sa, w, sw))
