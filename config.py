"""The model's configuration: a checkpoint's config.json, keys unchanged, in one dataclass (ModelArgs),
every value's JSON type and range checked, and what the run derives from it (the softmax scale with
YaRN's mscale, whether YaRN is active at this run's context).
"""
import math
import typing
from dataclasses import dataclass, field, fields
from types import NoneType

import checkpoint
import quant
import rope


@dataclass
class ModelArgs:
    """The checkpoint's config.json, keys unchanged. Comments: paper symbol (official demo name)."""
    vocab_size: int = 129280              # |V| (vocab_size)
    hidden_size: int = 7168               # d (dim)
    intermediate_size: int = 18432        # dense FFN width (inter_dim)
    moe_intermediate_size: int = 2048     # routed expert width (moe_inter_dim)
    num_hidden_layers: int = 61           # L (n_layers); layer L is the MTP module, not built
    first_k_dense_replace: int = 3        # leading dense-FFN layers (n_dense_layers)
    num_attention_heads: int = 128        # n_h (n_heads)
    n_routed_experts: int = 256           # N_r (n_routed_experts)
    n_shared_experts: int = 1             # N_s (n_shared_experts)
    num_experts_per_tok: int = 8          # K_r (n_activated_experts)
    n_group: int = 8                      # expert groups (n_expert_groups)
    topk_group: int = 4                   # groups kept per token (n_limited_groups)
    routed_scaling_factor: float = 2.5    # route scale (route_scale)
    scoring_func: str = "sigmoid"         # s_{i,t} = sigmoid(u . e) (score_func)
    topk_method: str = "noaux_tc"         # noaux_tc: bias-corrected choice b_i (Gate.bias)
    norm_topk_prob: bool = True           # normalise the K gate weights to sum 1
    swiglu_limit: float | None = None     # V4's SwiGLU clamp; V3.2 has none (moe.mlp_ref)
    q_lora_rank: int = 1536               # d'_c (q_lora_rank)
    kv_lora_rank: int = 512               # d_c (kv_lora_rank)
    qk_nope_head_dim: int = 128           # d_h (qk_nope_head_dim)
    qk_rope_head_dim: int = 64            # d^R_h (qk_rope_head_dim)
    v_head_dim: int = 128                 # d_h for values (v_head_dim)
    index_n_heads: int = 64               # H^I (index_n_heads)
    index_head_dim: int = 128             # d^I (index_head_dim)
    index_topk: int = 2048                # k in Top-k(I_{t,:}) (index_topk)
    rms_norm_eps: float = 1e-6            # RMSNorm epsilon (hard-coded in the demo)
    rope_theta: float = 10000.0           # RoPE base (rope_theta)
    rope_scaling: dict | None = field(default_factory=dict)   # YaRN: factor, original_max_position_embeddings, beta_*, mscale
    max_position_embeddings: int = 163840  # longest context the checkpoint claims
    quantization_config: dict | None = None   # fp8 e4m3, ue8m0 scales, 128x128 blocks
    bos_token_id: int = 0                 # <｜begin▁of▁sentence｜>
    eos_token_id: int = 1                 # <｜end▁of▁sentence｜>, ends generation
    num_nextn_predict_layers: int = 0     # MTP modules stored after the main layers (skipped)
    hidden_act: str = "silu"              # SwiGLU's gate activation (checked: silu only)
    attention_bias: bool = False          # MLA projections carry no bias (checked)
    tie_word_embeddings: bool = False     # separate embedding and head (checked)
    moe_layer_freq: int = 1               # every layer after the dense ones is MoE (checked)
    num_key_value_heads: int = 128        # unused by MLA (its latent is shared by all heads)
    ep_size: int = 1                      # training-time expert parallelism; unused here
    attention_dropout: float = 0.0        # training only; unused
    initializer_range: float = 0.02       # training only; unused
    architectures: list = field(default_factory=list)   # bookkeeping of the HF checkpoint; unused
    model_type: str = "deepseek_v32"
    torch_dtype: str = "bfloat16"
    transformers_version: str = ""
    use_cache: bool = True
    # derived in __post_init__
    max_seq_len: int | None = None        # this run's context (default max_position_embeddings)
    softmax_scale: float = 0.0            # d_qk^-0.5 * mscale^2 (with YaRN)

    REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                "index_head_dim", "index_topk", "intermediate_size")

    @classmethod
    def from_config(cls, cfg, where="config.json", **run):
        """Build from a config.json dict; unknown keys are ignored, missing required keys named, every
        known key's JSON type and range checked: whatever the JSON, only ValueError escapes."""
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: expected a JSON object, got {checkpoint.json_type(cfg)}")
        missing = [k for k in cls.REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"{where}: missing required field(s) {', '.join(missing)}")
        if "max_seq_len" in run:                          # this run's option, not config.json's
            _need("max_seq_len", run["max_seq_len"], (int,), low=1)
        known = {f.name for f in fields(cls)} - {"max_seq_len", "softmax_scale"}
        kw = {k: v for k, v in cfg.items() if k in known}
        try:
            return cls(**kw, **run)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def __post_init__(self):
        for f in fields(self):                                # JSON types, from the annotations above
            _need(f.name, getattr(self, f.name), typing.get_args(f.type) or (f.type,))
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                    "index_head_dim", "index_topk", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                    "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "max_position_embeddings")
        for k in positive:
            _need(k, getattr(self, k), (int,), low=1)
        for k in ("first_k_dense_replace", "bos_token_id", "eos_token_id", "num_nextn_predict_layers"):
            _need(k, getattr(self, k), (int,), low=0)
        for k in ("routed_scaling_factor", "rms_norm_eps"):
            _need(k, getattr(self, k), (float,), low=0, strict=True)
        _need("rope_theta", self.rope_theta, (float,), low=1, strict=True)    # log(theta) divides in YaRN
        self.rope_scaling = {} if self.rope_scaling is None else self.rope_scaling   # HF writes null for none
        for k, t, low in (("factor", float, 0), ("original_max_position_embeddings", int, 1), ("beta_fast", float, 0),
                          ("beta_slow", float, 0), ("mscale", float, None), ("mscale_all_dim", float, None),
                          ("type", str, None), ("rope_type", str, None)):
            if k in self.rope_scaling:
                _need(f"rope_scaling.{k}", self.rope_scaling[k], (t,), low, strict=t is float)
        for k, t in (("quant_method", str), ("fmt", str), ("scale_fmt", str), ("activation_scheme", str),
                     ("weight_block_size", list)):
            if k in (self.quantization_config or {}):
                _need(f"quantization_config.{k}", self.quantization_config[k], (t,))
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and fit in index_head_dim")
        if self.index_head_dim & (self.index_head_dim - 1) or self.index_head_dim % quant.BLOCK:
            raise ValueError(f"index_head_dim {self.index_head_dim} must be a power of two and a multiple of 128 "
                             "(Hadamard rotation, one FP8 scale per head)")
        if self.kv_lora_rank % quant.BLOCK:
            raise ValueError(f"kv_lora_rank {self.kv_lora_rank} must be a multiple of 128 (FP8 latent groups)")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide n_routed_experts {self.n_routed_experts} "
                             f"and be >= topk_group {self.topk_group}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok exceeds n_routed_experts")
        unsupported = {"hidden_act": (self.hidden_act, "silu"), "attention_bias": (self.attention_bias, False),
                       "tie_word_embeddings": (self.tie_word_embeddings, False), "moe_layer_freq": (self.moe_layer_freq, 1)}
        for k, (got, want) in unsupported.items():
            if got != want:
                raise ValueError(f"{k}={got!r} is not a DeepSeek-V3.2 architecture this code implements (expects {want!r})")
        if self.topk_method not in ("noaux_tc", "greedy"):
            raise ValueError(f"topk_method {self.topk_method!r} is not noaux_tc (bias-corrected) or greedy")
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"scoring_func {self.scoring_func!r} is not sigmoid or softmax")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace {self.first_k_dense_replace} is outside 0..num_hidden_layers")
        if self.max_seq_len is None:                      # not 0: an explicit 0 is an error, not the default
            self.max_seq_len = self.max_position_embeddings
        _need("max_seq_len", self.max_seq_len, (int,), low=1)
        self.softmax_scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.yarn_active:
            m = rope.yarn_mscale(self.rope_factor, self.rope_scaling.get("mscale", 1.0))
            self.softmax_scale *= m * m                                   # mscale enters squared
            if not (math.isfinite(self.softmax_scale) and self.softmax_scale > 0):
                raise ValueError(f"rope_scaling.mscale {self.rope_scaling.get('mscale', 1.0)!r} with factor "
                                 f"{self.rope_factor} gives softmax scale {self.softmax_scale}, not a positive number")

    @property
    def original_seq_len(self):
        return self.rope_scaling.get("original_max_position_embeddings", self.max_position_embeddings)

    @property
    def rope_factor(self):
        return float(self.rope_scaling.get("factor", 1.0))

    @property
    def yarn_active(self):  # the official condition: the run's context exceeds the trained one
        return self.rope_scaling.get("type", self.rope_scaling.get("rope_type")) == "yarn" \
            and self.max_seq_len > self.original_seq_len

    @property
    def fp8(self):
        q = self.quantization_config or {}
        return q.get("quant_method") == "fp8"


MAX_INT = 2 ** 63 - 1       # an int64: every integer the model computes with fits NumPy's int64 and a float


def _need(name, v, types, low=None, strict=False):  # one config value: JSON type(s), finite, optional bound
    def fits(t):
        if t is NoneType:
            return v is None
        if t in (int, float) and isinstance(v, int) and not isinstance(v, bool):   # JSON true is a Python int
            return -MAX_INT <= v <= MAX_INT
        return t is float and isinstance(v, float) and math.isfinite(v) or t not in (int, float) and isinstance(v, t)
    if any(fits(t) for t in types) and (low is None or v is None or (v > low if strict else v >= low)):
        return
    words = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string",
             dict: "an object", list: "an array", NoneType: "null"}
    want = " or ".join(words[t] for t in types)
    if low is not None:
        want = {(int, 1): "a positive integer", (int, 0): "a non-negative integer"}.get(
            (types[0], low), f"{want} {'>' if strict else '>='} {low}")
    raise ValueError(f"{name} must be {want}, got {checkpoint.json_type(v)} {repr(v)[:60]}")


# -----------------------------------------------------------------------------
# DeepSeek-V4-Flash (spec/v4_flash.md §1): the same kind of dataclass, its own keys

V4_LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


@dataclass
class V4Args:
    """A DeepSeek-V4 config.json, keys unchanged (the official file's legacy keys compress_ratios and
    num_hash_layers, or transformers' layer_types, compress_rates and mlp_layer_types).
    Comments: paper symbol (official code name)."""
    vocab_size: int = 129280              # |V| (vocab_size)
    hidden_size: int = 4096               # d (dim)
    num_hidden_layers: int = 43           # L (n_layers); the MTP layer stored after them is not built
    num_attention_heads: int = 64         # n_h (n_heads): queries; one key-value head shared by all
    num_key_value_heads: int = 1          # shared-KV MQA (checked)
    head_dim: int = 512                   # c (head_dim): [nope | rope] per head; keys = values
    qk_rope_head_dim: int = 64            # d^R (rope_head_dim): the trailing dims that rotate
    q_lora_rank: int = 1024               # d_c (q_lora_rank)
    o_groups: int = 8                     # g (o_groups): heads per output group n_h / g
    o_lora_rank: int = 1024               # d_g (o_lora_rank)
    sliding_window: int = 128             # n_win (window_size), the current token included
    layer_types: list | None = None       # per layer: sliding / compressed_sparse / heavily_compressed _attention
    compress_ratios: list | None = None   # legacy per layer 0 / 4 / 128 (the MTP layer's entry last)
    compress_rates: dict | None = None    # m (CSA, 4) and m' (HCA, 128) by layer type
    index_n_heads: int = 64               # n_h^I (index_n_heads)
    index_head_dim: int = 128             # c^I (index_head_dim)
    index_topk: int = 512                 # k of the CSA indexer's top-k (index_topk)
    rope_theta: float = 10000.0           # RoPE base of the sliding-window-only layers
    compress_rope_theta: float = 160000.0  # RoPE base of the CSA / HCA layers, with YaRN
    rope_scaling: dict | None = None      # YaRN of the compressed layers: factor, original_max_position_embeddings, beta_*
    rope_parameters: dict | None = None   # transformers' form: {"main": ..., "compress": {... YaRN ...}}
    max_position_embeddings: int = 1048576
    hc_mult: int = 4                      # n (hc_mult): residual streams of mHC
    hc_sinkhorn_iters: int = 20           # t_max (hc_sinkhorn_iters)
    hc_eps: float = 1e-6                  # epsilon of the mHC mixes (hc_eps)
    rms_norm_eps: float = 1e-6            # RMSNorm epsilon (norm_eps)
    n_routed_experts: int = 256           # N_r (n_routed_experts)
    n_shared_experts: int = 1             # N_s (n_shared_experts)
    num_experts_per_tok: int = 6          # K_r (n_activated_experts)
    moe_intermediate_size: int = 2048     # expert width, routed and shared (moe_inter_dim)
    scoring_func: str = "sqrtsoftplus"    # s = sqrt(softplus(u . e)) (score_func)
    topk_method: str = "noaux_tc"         # bias-corrected choice, no group limit
    norm_topk_prob: bool = True           # normalise the K gate weights to sum 1
    routed_scaling_factor: float = 1.5    # route scale (route_scale)
    mlp_layer_types: list | None = None   # per layer: hash_moe (routed by tid2eid) or moe
    num_hash_layers: int | None = None    # legacy: the first n layers are hash_moe (default 3)
    swiglu_limit: float = 10.0            # SwiGLU clamp: gate <= limit, up in [-limit, limit]
    quantization_config: dict | None = None   # fp8 e4m3, ue8m0 scales, 128x128 blocks
    expert_dtype: str | None = None       # "fp4": routed experts MXFP4 (e2m1, ue8m0 per 32)
    bos_token_id: int = 0
    eos_token_id: int = 1
    num_nextn_predict_layers: int = 0     # MTP layers stored after the main ones (skipped)
    hidden_act: str = "silu"              # checked
    tie_word_embeddings: bool = False     # checked
    model_type: str = "deepseek_v4"
    max_seq_len: int | None = None        # this run's context (default max_position_embeddings)

    REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                "o_groups", "o_lora_rank", "sliding_window")
    n_group = 1                           # no group-limited routing in V4 (moe.gate_ref reads these)
    topk_group = 1

    @classmethod
    def from_config(cls, cfg, where="config.json", **run):
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: expected a JSON object, got {checkpoint.json_type(cfg)}")
        missing = [k for k in cls.REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"{where}: missing required field(s) {', '.join(missing)}")
        known = {f.name for f in fields(cls)} - {"max_seq_len"}
        try:
            return cls(**{k: v for k, v in cfg.items() if k in known}, **run)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def __post_init__(self):
        for f in fields(self):
            _need(f.name, getattr(self, f.name), typing.get_args(f.type) or (f.type,))
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                  "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                  "hc_mult", "hc_sinkhorn_iters", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "max_position_embeddings"):
            _need(k, getattr(self, k), (int,), low=1)
        for k in ("rms_norm_eps", "hc_eps", "routed_scaling_factor", "swiglu_limit"):
            _need(k, getattr(self, k), (float,), low=0, strict=True)
        L = self.num_hidden_layers
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128} | (self.compress_rates or {})
        if self.layer_types is None and self.compress_ratios is not None:   # the official file's per-layer ratios
            bad = [r for r in self.compress_ratios if not (isinstance(r, int) and r >= 0)]
            hca = {r for r in self.compress_ratios[:L] if r not in (0, 4)}
            if bad or len(hca) > 1:
                raise ValueError(f"compress_ratios must be 0 (window only), 4 (CSA) or one HCA rate per layer, "
                                 f"got {self.compress_ratios!r}")
            rates["heavily_compressed_attention"] = hca.pop() if hca else rates["heavily_compressed_attention"]
            self.layer_types = [V4_LAYER_TYPES.get(r, "heavily_compressed_attention") for r in self.compress_ratios]
        if self.layer_types is None:
            raise ValueError("neither layer_types nor compress_ratios is given (the attention of each layer)")
        self.layer_types = list(self.layer_types[:L])
        self.compress_rates = rates
        if self.mlp_layer_types is None:
            n_hash = 3 if self.num_hash_layers is None else self.num_hash_layers
            self.mlp_layer_types = ["hash_moe"] * min(L, n_hash) + ["moe"] * max(0, L - n_hash)
        self.mlp_layer_types = list(self.mlp_layer_types[:L])
        for name, got, allowed in (("layer_types", self.layer_types, V4_LAYER_TYPES.values()),
                                   ("mlp_layer_types", self.mlp_layer_types, ("hash_moe", "moe"))):
            if len(got) != L or any(t not in allowed for t in got):
                raise ValueError(f"{name} must list one of {', '.join(allowed)} for each of the {L} layers, got {got!r}")
        if rates["compressed_sparse_attention"] != 4:
            raise ValueError("the CSA compression rate must be 4 (its windows overlap by one window, as the official code)")
        if self.rope_scaling is None and isinstance((self.rope_parameters or {}).get("compress"), dict):
            self.rope_scaling = self.rope_parameters["compress"]          # transformers' nested form
        self.rope_scaling = self.rope_scaling or {}
        unsupported = {"num_key_value_heads": (self.num_key_value_heads, 1), "hidden_act": (self.hidden_act, "silu"),
                       "tie_word_embeddings": (self.tie_word_embeddings, False)}
        for k, (got, want) in unsupported.items():
            if got != want:
                raise ValueError(f"{k}={got!r} is not a DeepSeek-V4 architecture this code implements (expects {want!r})")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"scoring_func {self.scoring_func!r} is not sqrtsoftplus, sigmoid or softmax")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups {self.o_groups} must divide num_attention_heads {self.num_attention_heads}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and fit head_dim and index_head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok exceeds n_routed_experts")
        if self.max_seq_len is None:
            self.max_seq_len = self.max_position_embeddings
        _need("max_seq_len", self.max_seq_len, (int,), low=1)

    @property
    def yarn_active(self):  # on the compressed layers' RoPE, whatever the run's context (the official V4 code and
        s = self.rope_scaling   # transformers both; V3.2's condition differs); the window-only layers never scale
        return s.get("type", s.get("rope_type")) == "yarn"

    @property
    def softmax_scale(self):  # 1 / sqrt(c): no YaRN mscale in V4
        return self.head_dim ** -0.5

    @property
    def original_seq_len(self):
        return self.rope_scaling.get("original_max_position_embeddings", self.max_position_embeddings)

    def ratio(self, i):  # layer i's compression rate m: 0 (sliding window only), 4 (CSA) or m' (HCA)
        t = self.layer_types[i]
        return 0 if t == "sliding_attention" else self.compress_rates[t]

    def freqs(self, compressed):  # the layer's RoPE frequencies [R/2]: YaRN at compress_rope_theta, or plain
        R = self.qk_rope_head_dim
        if not compressed:
            return rope.yarn_freqs(R, self.rope_theta, 1, 1, 1.0, 32, 1)
        s, L = self.rope_scaling, self.original_seq_len
        return rope.yarn_freqs(R, self.compress_rope_theta, L + 1 if self.yarn_active else L,   # > L: the ramp on
                               L, float(s.get("factor", 1.0)), s.get("beta_fast", 32), s.get("beta_slow", 1))

    @property
    def fp8(self):
        return (self.quantization_config or {}).get("quant_method") == "fp8"
