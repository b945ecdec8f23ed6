"""model.py: decode step by step and prefill in chunks equal one prefill; ModelArgs from real and
broken configs; clear errors on bad input."""
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import checkpoint
from config import ModelArgs
from helpers import rel_err
from model import Transformer

REAL_CONFIG = {   # spec/dsv32.md §1, the DeepSeek-V3.2(-Exp) config.json
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.44.2",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_real_config_loads_unchanged():
    a = ModelArgs.from_config(REAL_CONFIG, max_seq_len=16384)
    for k, v in REAL_CONFIG.items():                                     # every field, kept as is
        assert getattr(a, k) == v, k
    assert (a.hidden_size, a.index_topk, a.n_group, a.kv_lora_rank) == (7168, 2048, 8, 512)
    assert a.yarn_active and a.fp8 and abs(a.softmax_scale - 0.1352337789) < 1e-9
    assert not ModelArgs.from_config(REAL_CONFIG, max_seq_len=4096).yarn_active      # the official condition


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": None}, "missing required field"),
    ({"num_attention_heads": -2}, "num_attention_heads must be a positive integer"),
    ({"n_group": 7}, "n_group 7 must divide"),
    ({"index_head_dim": 96}, "index_head_dim 96"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"topk_method": "aux"}, "topk_method"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be an object or null, got a string 'yarn'"),
    ({"rope_theta": "10000"}, "rope_theta must be a finite number, got a string '10000'"),
    ({"rope_theta": 1}, "rope_theta must be a finite number > 1, got an integer 1"),
    ({"hidden_size": True}, "hidden_size must be an integer, got true"),
    ({"hidden_size": 7168.0}, "hidden_size must be an integer, got a number 7168.0"),
    ({"vocab_size": 2 ** 70}, "vocab_size must be an integer, got an integer"),
    ({"n_shared_experts": 0}, "n_shared_experts must be a positive integer, got an integer 0"),
    ({"eos_token_id": [1, 2]}, "eos_token_id must be an integer, got an array"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number, got a number nan"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a finite number > 0"),
    ({"routed_scaling_factor": {}}, "routed_scaling_factor must be a finite number, got an object {}"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false, got a string"),
    ({"scoring_func": 1}, "scoring_func must be a string, got an integer 1"),
    ({"quantization_config": []}, "quantization_config must be an object or null, got an array"),
    ({"quantization_config": {"weight_block_size": 128}}, "quantization_config.weight_block_size must be an array"),
    ({"architectures": "x"}, "architectures must be an array, got a string"),
    ({"rope_scaling": {"factor": "40", "type": "yarn"}}, "rope_scaling.factor must be a finite number > 0, got a string"),
    ({"rope_scaling": {"beta_fast": 0, "type": "yarn"}}, "rope_scaling.beta_fast must be a finite number > 0"),
    ({"rope_scaling": {"original_max_position_embeddings": 4096.5}}, "rope_scaling.original_max_position_embeddings must be a positive integer"),
    ({"rope_scaling": {"type": ["yarn"]}}, "rope_scaling.type must be a string, got an array"),
    ({"rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1e308, "original_max_position_embeddings": 4096}},
     "rope_scaling.mscale 1e+308 with factor 40.0 "
     "gives softmax scale inf, not a positive"),
])
def test_bad_configs_are_named(change, message):
    cfg = dict(REAL_CONFIG)
    for k, v in change.items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    with pytest.raises(ValueError, match="^config.json: " + re.escape(message)):
        ModelArgs.from_config(cfg)


@pytest.mark.parametrize("cfg, got", [([], "an array"), (3, "an integer"), ("x", "a string"), (None, "null")])
def test_config_that_is_not_an_object(cfg, got):
    with pytest.raises(ValueError, match=f"^c.json: expected a JSON object, got {got}$"):
        ModelArgs.from_config(cfg, where="c.json")


def test_max_seq_len_zero_is_an_error():
    for bad, got in ((0, "an integer 0"), (-5, "an integer -5"), (8.0, "a number 8.0"), ("8", "a string '8'")):
        with pytest.raises(ValueError, match=f"^max_seq_len must be a positive integer, got {got}$"):
            ModelArgs.from_config(REAL_CONFIG, max_seq_len=bad)
    assert ModelArgs.from_config(REAL_CONFIG).max_seq_len == 163840                 # absent: the config's
    assert ModelArgs.from_config({**REAL_CONFIG, "rope_scaling": None}).rope_scaling == {}   # HF's null


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.integers(-2 ** 80, 2 ** 80) | st.floats()
                    | st.text(max_size=4),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                    max_leaves=8)


@given(st.dictionaries(st.sampled_from(sorted(REAL_CONFIG) + ["max_seq_len"]), JSON, max_size=3),
       st.dictionaries(st.sampled_from(["factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                        "mscale", "type"]), JSON, max_size=2), JSON)
def test_any_json_config_gives_only_value_error(change, rope_change, whole):
    # the fuzzer's contract: whatever config.json holds, from_config builds or raises ValueError
    cfg = {**REAL_CONFIG, **change}
    if isinstance(cfg["rope_scaling"], dict):
        cfg["rope_scaling"] = {**cfg["rope_scaling"], **rope_change}
    for c in (cfg, whole):
        try:
            a = ModelArgs.from_config(c)
        except ValueError:
            continue
        assert np.isfinite(a.softmax_scale) and a.softmax_scale > 0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = checkpoint.tiny_config(index_topk=8, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("model") / "ckpt"
    return checkpoint.write_checkpoint(path, cfg, checkpoint.random_weights(cfg, 7))


@pytest.fixture(scope="module")
def exact(ckpt):
    return Transformer.from_pretrained(ckpt, numerics="exact")


def test_weights_derived_at_load(ckpt, exact):
    # what a step reads in fp32 is made once at load, with the checkpoint's values (bf16 -> fp32 is exact)
    from checkpoint import Checkpoint
    ck = Checkpoint(ckpt)
    for i, layer in enumerate(exact.w["layers"]):
        if "gate" not in layer["ffn"]:
            continue                                                           # a dense-FFN layer
        gate = layer["ffn"]["gate"].w
        stored = ck.get(f"model.layers.{i}.mlp.gate.weight")
        assert gate.dtype == np.float32 and np.array_equal(gate, np.asarray(stored, np.float32))
        assert layer["attn"]["indexer"]["weights_proj"].w.dtype == np.float32
    assert exact.w["head_f32"].dtype == np.float32


@pytest.mark.slow
def test_decode_step_by_step_equals_one_prefill(exact):
    tokens = np.random.default_rng(0).integers(0, 2048, (2, 72))       # sparse (topk 8), cache grows past 64
    full = exact.forward(tokens, all_positions=True)
    step = [exact.forward(tokens[:, :1])]
    for p in range(1, 72):
        step.append(exact.forward(tokens[:, p:p + 1], start_pos=p))
    assert rel_err(np.stack(step, 1), full) <= 1e-5


@pytest.mark.slow
@settings(max_examples=6)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=5))
def test_chunked_prefill_equals_one_prefill(exact, sizes):
    tokens = np.random.default_rng(1).integers(0, 2048, (1, sum(sizes)))
    full = exact.forward(tokens, all_positions=True)
    parts, pos = [], 0
    for n in sizes:
        parts.append(exact.forward(tokens[:, pos:pos + n], start_pos=pos, all_positions=True))
        pos += n
    assert rel_err(np.concatenate(parts, 1), full) <= 1e-5


def test_official_chunked_prefill_equals_one_prefill(ckpt):
    # in official numerics every op is row-wise, so a chunk sees what one prefill computes; only the
    # float32 BLAS products (router, head) may round differently with another number of rows
    m = Transformer.from_pretrained(ckpt)
    tokens = np.random.default_rng(2).integers(0, 2048, (1, 30))
    full = m.forward(tokens, all_positions=True)
    a = m.forward(tokens[:, :13], all_positions=True)
    b = m.forward(tokens[:, 13:], start_pos=13, all_positions=True)
    assert rel_err(np.concatenate([a, b], 1), full) <= 1e-6


@pytest.mark.slow
def test_batch_rows_are_independent(ckpt):
    m = Transformer.from_pretrained(ckpt)
    tokens = np.random.default_rng(3).integers(0, 2048, (3, 20))
    both = m.forward(tokens)
    for i in range(3):
        assert rel_err(m.forward(tokens[i:i + 1])[0], both[i]) <= 1e-6


def test_accepts_lists_and_returns_float32(exact):
    out = exact.forward([[1, 2, 3]])
    assert out.shape == (1, 2048) and out.dtype == np.float32


def test_bad_input_is_named(ckpt, exact):
    with pytest.raises(ValueError, match="token id 2048 is outside the vocabulary"):
        exact.forward([[1, 2048]])
    with pytest.raises(ValueError, match="token id -1"):
        exact.forward([[-1]])
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        exact.forward([1, 2, 3])
    with pytest.raises(ValueError, match="integers"):
        exact.forward([[1.5]])
    exact.forward([[1, 2, 3]])
    with pytest.raises(ValueError, match="start_pos 5 is outside 0..3"):
        exact.forward([[1]], start_pos=5)
    with pytest.raises(ValueError, match="batch 2 differs"):
        exact.forward([[1], [2]], start_pos=3)
    with pytest.raises(ValueError, match="exceeds max_seq_len 256"):
        exact.forward(np.zeros((1, 257), int))
    for pos, got in ((3.0, "float 3.0"), (True, "bool True"), ("3", "str '3'"), (None, "NoneType None")):
        with pytest.raises(ValueError, match=f"start_pos must be an integer, got {got}"):
            exact.forward([[1]], start_pos=pos)
    assert exact.forward([[1]], start_pos=np.int64(3)).shape == (1, 2048)       # NumPy integers are fine
    with pytest.raises(ValueError, match="start_pos -1 is outside 0..4"):
        exact.forward([[1]], start_pos=-1)
    with pytest.raises(ValueError, match="rows of different lengths"):
        exact.forward([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"batch, seq >= 1, got shape \(0, 3\)"):
        exact.forward(np.zeros((0, 3), int))
    with pytest.raises(ValueError, match="integers, got dtype bool"):
        exact.forward([[True]])
    with pytest.raises(ValueError, match="max_seq_len must be a positive integer, got an integer 0"):
        Transformer.from_pretrained(ckpt, max_seq_len=0)
    with pytest.raises(ValueError, match="numerics"):
        Transformer.from_pretrained(ckpt, numerics="fast")
    with pytest.raises(ValueError, match="backend must be"):
        Transformer.from_pretrained(ckpt, backend="tensorflow")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Transformer.from_pretrained(ckpt.parent / "nowhere")


def test_max_seq_len_switches_yarn(ckpt):
    short = Transformer.from_pretrained(ckpt, max_seq_len=64)         # original length is 128: YaRN off
    assert not short.args.yarn_active and short.args.softmax_scale == 128 ** -0.5
    assert Transformer.from_pretrained(ckpt).args.yarn_active
