"""The whole model in exact numerics against Hugging Face transformers' DeepseekV32ForCausalLM (an
independent implementation; a test-only dependency), on random tiny configs written as FP8
checkpoints in the real layout. transformers runs in float32 on the dequantized weights."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import checkpoint
from helpers import rel_err
from model import Transformer

CONFIGS = {   # at least 16 indexer heads everywhere: exact zero-score ties are then negligible (DESIGN.md)
    "base": dict(index_topk=8),
    "wide-groups": dict(index_topk=12, n_routed_experts=16, n_group=8, topk_group=3, num_experts_per_tok=4,
                        num_attention_heads=2, first_k_dense_replace=2, num_hidden_layers=4),
    "narrow-rope": dict(index_topk=6, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=48, q_lora_rank=96,
                        kv_lora_rank=256, index_n_heads=32, hidden_size=384, n_shared_experts=2, n_group=2,
                        topk_group=1, routed_scaling_factor=1.5),
}


def hf_model(path, cfg):
    """transformers' model with the checkpoint's dequantized weights (experts fused as it expects)."""
    ck = checkpoint.Checkpoint(path)
    conf = transformers.DeepseekV32Config(**cfg)
    conf._attn_implementation = "eager"
    torch.manual_seed(0)
    m = transformers.DeepseekV32ForCausalLM(conf).float().eval()

    def deq(prefix):
        return torch.from_numpy(np.ascontiguousarray(ck.weight(prefix).dequant()))

    sd = {}
    for k in m.state_dict():
        layer = k.split(".")[2] if k.startswith("model.layers.") else None
        experts = range(cfg["n_routed_experts"])
        if k.endswith("mlp.experts.gate_up_proj"):       # [E, 2I, d]: gate rows, then up rows
            sd[k] = torch.stack([torch.cat([deq(f"model.layers.{layer}.mlp.experts.{e}.gate_proj"),
                                            deq(f"model.layers.{layer}.mlp.experts.{e}.up_proj")]) for e in experts])
        elif k.endswith("mlp.experts.down_proj"):
            sd[k] = torch.stack([deq(f"model.layers.{layer}.mlp.experts.{e}.down_proj") for e in experts])
        elif k.endswith(".weight") and k in ck:
            sd[k] = deq(k[:-len(".weight")])
        else:
            sd[k] = torch.from_numpy(np.asarray(ck.get(k), np.float32).copy())
    m.load_state_dict(sd, strict=True)
    return m


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    cfg = checkpoint.tiny_config(**CONFIGS[request.param])
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    checkpoint.write_checkpoint(path, cfg, checkpoint.random_weights(cfg, seed=len(request.param)))
    return Transformer.from_pretrained(path, numerics="exact"), hf_model(path, cfg), cfg


@pytest.mark.slow
def test_logits_at_every_position(pair):
    ours, hf, cfg = pair
    tokens = np.random.default_rng(1).integers(0, cfg["vocab_size"], (2, 3 * cfg["index_topk"] + 5))  # sparse
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens)).logits.numpy()
    got = ours.forward(tokens, all_positions=True)
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= 1e-4


@pytest.mark.slow
def test_greedy_decode_with_cache(pair):
    ours, hf, cfg = pair
    prompt = np.random.default_rng(2).integers(0, cfg["vocab_size"], (1, cfg["index_topk"] + 4))
    with torch.no_grad():
        ref = hf.generate(torch.from_numpy(prompt), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                          pad_token_id=None, eos_token_id=None)[0, prompt.shape[1]:].numpy()
    seq = prompt
    out = []
    logits = ours.forward(seq)
    for step in range(32):
        nxt = int(logits[0].argmax())
        out.append(nxt)
        logits = ours.forward([[nxt]], start_pos=prompt.shape[1] + step)
    np.testing.assert_array_equal(out, ref)
