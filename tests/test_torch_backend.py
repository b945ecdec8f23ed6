"""backend="torch" against the NumPy reference: the same model through the other op table, on the
CPU here and on a GPU where there is one (official numerics are held to the official trace op by op
in test_official_trace.py, for every backend)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import checkpoint
from conftest import HAS_CUDA, gpu
from helpers import rel_err
from model import Transformer

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = checkpoint.tiny_config(index_topk=8)
    path = tmp_path_factory.mktemp("torch") / "ckpt"
    return checkpoint.write_checkpoint(path, cfg, checkpoint.random_weights(cfg, 11))


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
