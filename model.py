"""DeepSeek-V3.2-Exp: the Transformer (embedding -> blocks -> norm -> head) with explicit caches, and
loading it from a checkpoint folder.

A block is RMSNorm -> MLA under DSA (attention.py, indexer.py) -> RMSNorm -> MLP or MoE (moe.py), with
the official fused residual: each norm adds its input to the residual in fp32, normalises that sum
and keeps the sum rounded to bf16 as the new residual (spec/dsv32.md §3.2).

Numerics, set at load time:
- "official" (default): the official inference code's rounding points: bf16 residual stream, FP8
  act_quant before every FP8 linear, the FP8 latent round trip, the FP8 indexer.
- "exact": float32 throughout on dequantized weights, and by default the exact float32 indexer
  (what transformers computes): the mode for oracle work.

Backends: every numerical op goes through one op table (ops.Ops, the contract): ops.NUMPY_OPS (the
_ref functions, the definition of the model) or backend_torch.torch_ops(device); the wiring below is
written once. A table with the GPU's DSA kernels (ops.fused) keeps selections as indices and the
latent cache as packed rows (LayerCache), which attention.mla_forward routes through its one fused
branch. At load (derive_weights), a table with ops.fuse_rows lays the linears that share an input out
as row blocks of one weight (wq_a | wkv_a | the indexer's wk, and wq_b | the indexer's wq_b) for
ops.linears' one GEMM per group, and the copies the math reads are made once: W^UK and W^UV of the
absorbed form, the fp32 head and indexer weights.

The configuration is config.py's ModelArgs; the checkpoint reader is checkpoint.py.

Letters: B batch, T new tokens, S = start_pos + T keys, d hidden_size, V vocab_size.
"""
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import attention
import checkpoint
import quant
import rope
from checkpoint import LoadError
from config import ModelArgs
from ops import NUMPY_OPS


# -----------------------------------------------------------------------------
# Weights: the checkpoint's tensors under the official short names, FP8 kept as codes + scales

# The dtypes the format stores (spec/dsv32.md §2.1), checked as each tensor is opened; lenient only
# where real checkpoints differ: norms (and biases) F32 in the listing but bf16 in one official note,
# the FP8 linears BF16 in the official fp8_cast_bf16.py conversion (no scales then).
NORM = ("F32", "BF16")
LINEAR = ("F8_E4M3", "BF16")             # FP8 with its F32 weight_scale_inv (Checkpoint.weight), or BF16
PLAIN = ("BF16",)                        # never quantized: embedding, head, router gate, indexer weights_proj


def load_layer(ck, i, args):  # -> nested dict of quant.Weight / float32 arrays for layer i
    pre = f"model.layers.{i}."
    a = pre + "self_attn."

    def vec(name):
        return np.asarray(ck.get(name, NORM), np.float32)

    short = checkpoint.SHORT_NAMES                   # HF name -> the official short name: the one table
    attn = {short[hf]: ck.weight(a + hf, LINEAR) for hf in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                             "kv_b_proj", "o_proj")}
    attn |= {short[hf]: vec(a + hf + ".weight") for hf in ("q_a_layernorm", "kv_a_layernorm")}
    attn["indexer"] = {"wq_b": ck.weight(a + "indexer.wq_b", LINEAR), "wk": ck.weight(a + "indexer.wk", LINEAR),
                       "k_norm": vec(a + "indexer.k_norm.weight"), "k_norm_bias": vec(a + "indexer.k_norm.bias"),
                       "weights_proj": ck.weight(a + "indexer.weights_proj", PLAIN)}
    m = pre + "mlp."

    def mlp(prefix):
        return {short[hf]: ck.weight(prefix + hf, LINEAR) for hf in ("gate_proj", "down_proj", "up_proj")}

    if i < args.first_k_dense_replace:
        ffn = mlp(m)
    else:
        ffn = {"gate": ck.weight(m + "gate", PLAIN),
               "experts": [mlp(m + f"experts.{e}.") for e in range(args.n_routed_experts)],
               "shared_experts": mlp(m + "shared_experts.")}
        if args.topk_method == "noaux_tc":                              # bias-corrected choice
            ffn["gate_bias"] = vec(m + "gate.e_score_correction_bias")
    norms = {short[hf]: vec(pre + hf + ".weight") for hf in ("input_layernorm", "post_attention_layernorm")}
    return {**norms, "attn": attn, "ffn": ffn}


def check_shapes(w, args, path):  # every weight against the shape config.json implies
    a = args
    d, H, N, R, V, C = a.hidden_size, a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
    J, Di = a.index_n_heads, a.index_head_dim

    def mlp(inter):
        return {"w1": (inter, d), "w3": (inter, d), "w2": (d, inter)}

    want_attn = {"wq_a": (a.q_lora_rank, d), "wq_b": (H * (N + R), a.q_lora_rank), "wkv_a": (C + R, d),
                 "wkv_b": (H * (N + V), C), "wo": (d, H * V), "q_norm": (a.q_lora_rank,), "kv_norm": (C,)}
    want_idx = {"wq_b": (J * Di, a.q_lora_rank), "wk": (Di, d), "k_norm": (Di,), "k_norm_bias": (Di,), "weights_proj": (J, d)}
    checks = [("model.embed_tokens", w["embed"], (a.vocab_size, d)), ("lm_head", w["head"], (a.vocab_size, d)),
              ("model.norm", w["norm"], (d,))]
    for i, lw in enumerate(w["layers"]):
        checks += [(f"layer {i} attn.{k}", lw["attn"][k], s) for k, s in want_attn.items()]
        checks += [(f"layer {i} indexer.{k}", lw["attn"]["indexer"][k], s) for k, s in want_idx.items()]
        f = lw["ffn"]
        if "experts" in f:
            checks.append((f"layer {i} gate", f["gate"], (a.n_routed_experts, d)))
            checks += [(f"layer {i} expert 0 {k}", f["experts"][0][k], s) for k, s in mlp(a.moe_intermediate_size).items()]
            checks += [(f"layer {i} shared {k}", f["shared_experts"][k], s)
                       for k, s in mlp(a.moe_intermediate_size * a.n_shared_experts).items()]
        else:
            checks += [(f"layer {i} mlp {k}", f[k], s) for k, s in mlp(a.intermediate_size).items()]
    for name, t, shape in checks:
        got = tuple((t.w if isinstance(t, quant.Weight) else t).shape)
        if got != shape:
            raise checkpoint.CheckpointError(f"{path}: {name} has shape {got}, but config.json implies {shape}")


def probe_experts(w, host_layers, ops, rows=2):
    """Known-answer probe at load time: a fixed input through every routed expert's W1, W2, W3 as the
    device holds them (the fast path's own act_quant + FP8 GEMM), against the product of the
    checkpoint's own tensors dequantized in fp32 on the device. The torch backend's layout: all
    experts of a layer stacked, w13 [E, 2I, d] (gate rows, then up rows) and w2 [E, d, I] in FP8 with
    [E, N/128, K/128] block scales. A loader/kernel layout mismatch (the gfx90a report's W2 read in a
    permuted row order) stops the load, naming layer and expert."""
    inputs = {}
    for i, (lw, hw) in enumerate(zip(w["layers"], host_layers)):
        for e, hx in enumerate(hw["ffn"].get("experts", [])):
            for name in ("w1", "w2", "w3"):
                K = hx[name].w.shape[1]
                if K not in inputs:                      # a fixed input, no RNG: bf16 values of a sine
                    inputs[K] = ops.param(quant.bf16_round(np.sin(np.arange(rows * K) * 0.37).reshape(rows, K)))
                x = inputs[K]
                got = ops.expert_linear(x, lw["ffn"], e, name)                       # device layout + kernel
                ref = ops.act_dequant(*ops.act_quant(x)) @ ops.dequant(ops.plain_weight(hx[name])).T
                err = float(abs(got - ref).max()) / (float(abs(ref).max()) + 1e-30)
                if not err <= 2e-2:                                                  # bf16 output: ~2^-8
                    raise LoadError(f"layer {i} expert {e} {name}: the device weights give {err:.0%} relative error "
                                    "against the checkpoint's tensors (a layout mismatch between loader and kernel?)")


# -----------------------------------------------------------------------------
# Weights onto the backend, and the copies made from them at load

def make_ops(backend, device=None):  # the op table of a backend ("numpy", or "torch" on a device)
    if backend == "numpy":
        if device not in (None, "cpu"):
            raise ValueError(f"device {device!r} needs backend='torch'; the NumPy reference runs on the CPU")
        return NUMPY_OPS
    if backend == "torch":
        import backend_torch                                 # torch is needed only here
        return backend_torch.torch_ops(device or "cpu")
    raise ValueError(f"backend must be 'numpy' or 'torch', got {backend!r}")


def to_backend(w, ops):  # a nested weight dict -> the same with every array handed to ops.param
    if isinstance(w, quant.Weight):
        return ops.weight(w)
    if isinstance(w, dict) and "experts" in w and ops.experts is not None:      # the backend's expert layout
        out = {k: to_backend(v, ops) for k, v in w.items() if k != "experts"}
        return out | ops.experts(w["experts"])
    if isinstance(w, dict):
        return {k: to_backend(v, ops) for k, v in w.items()}
    if isinstance(w, list):
        return [to_backend(v, ops) for v in w]
    return ops.param(w)


def derive_weights(w, args, opts):
    """The weights as this model reads them, made once at load and never inside a step: a new dict
    over the same arrays (the caller's stays as it was), with
    - head_f32: the output head for its fp32 GEMM (ops.head; the official head GEMM runs in fp32);
    - per layer, W_UK [H, N, C] and W_UV [H, V, C], wkv_b split per head for the absorbed form
      (bf16 values in official numerics; ops.absorb);
    - the indexer's weights_proj and the router's gate for theirs (fp32 projections in the official
      code; a bf16 gate was widened inside every decode step: a 7 MB copy per MoE layer). These three
      are float32, or, where a kernel reads them (ops.fp32_weight: torch on a GPU), the bf16 values as
      stored, widened in registers: half the bytes a step, and no float32 copy (3.7 GB for the head);
    - with ops.fuse_rows (official numerics): the linears of one input as row blocks of one weight,
      the groups of mla_forward's ops.linears, and the SwiGLU's w1 | w3 of the dense MLPs and the shared
      experts (ops.mlp)."""
    ops, H, N = opts.ops, args.num_attention_heads, args.qk_nope_head_dim

    def fp32(W):  # a plain (bf16) weight of an fp32 projection: its values, never widened inside a step
        return quant.Weight(ops.fp32_weight(W.w if W.scale is None else ops.dequant(W)), None)

    layers = []
    for layer in w["layers"]:
        p = dict(layer["attn"], indexer=dict(layer["attn"]["indexer"]))
        idx = p["indexer"]
        if ops.fuse_rows is not None and opts.official:
            groups = [[(p, "wq_a"), (p, "wkv_a")], [(p, "wq_b")]]
            if opts.sparse:
                groups = [groups[0] + [(idx, "wk")], groups[1] + [(idx, "wq_b")]]
            for g in groups:
                for (d, name), W in zip(g, ops.fuse_rows([d[name] for d, name in g])):
                    d[name] = W
        p["W_UK"], p["W_UV"] = ops.absorb(p["wkv_b"], H, N, opts.official)
        idx["weights_proj"] = fp32(idx["weights_proj"])
        ffn = layer["ffn"]
        if "gate" in ffn:
            ffn = dict(ffn, gate=fp32(ffn["gate"]))
        if ops.fuse_rows is not None and opts.official:              # a SwiGLU's w1 | w3: one weight
            fused = lambda m: dict(m, **dict(zip(("w1", "w3"), ops.fuse_rows([m["w1"], m["w3"]]))))  # noqa: E731
            if "shared_experts" in ffn:
                ffn = dict(ffn, shared_experts=fused(ffn["shared_experts"]))
            elif "w1" in ffn:                                        # a dense-FFN layer
                ffn = fused(ffn)
        layers.append(dict(layer, attn=p, ffn=ffn))
    return dict(w, layers=layers, head_f32=ops.fp32_weight(w["head"]))


# -----------------------------------------------------------------------------
# Caches: per layer, the latent c^KV, the rope key k^R, the indexer keys and their scales

class LayerCache:
    """One layer's caches, grown (doubling) up to max_seq_len instead of allocated whole: the latent
    c^KV [B, cap, C] and rope key k^R [B, cap, R] (kv, pe), or with the GPU's DSA kernels (fused)
    one packed row per token instead (latent [B, cap, W], backend_torch.latent_cache); the indexer's
    keys [B, cap, D] (FP8 codes or float32) and their scales [B, cap] (idx.k, idx.k_scale)."""

    def __init__(self, B, args, fp8_keys, ops, official=True):
        self.B, self.args, self.cap, self.ops, self.fp8_keys = B, args, 0, ops, fp8_keys
        self.fused, self.official = ops.fused, official
        self._set(self._alloc(0))

    def _alloc(self, cap):
        z, a, B = self.ops.zeros, self.args, self.B
        bufs = {"k": z((B, cap, a.index_head_dim), self.fp8_keys), "k_scale": z((B, cap), False)}
        if self.fused:
            bufs["latent"] = self.ops.latent_cache(B, cap, a, self.official)
        else:
            bufs["kv"], bufs["pe"] = z((B, cap, a.kv_lora_rank), False), z((B, cap, a.qk_rope_head_dim), False)
        return bufs

    def _set(self, bufs):
        self.bufs = bufs
        self.kv, self.pe, self.latent = bufs.get("kv"), bufs.get("pe"), bufs.get("latent")
        self.idx = SimpleNamespace(k=bufs["k"], k_scale=bufs["k_scale"])

    def reserve(self, end):
        if end <= self.cap:
            return
        cap = min(max(end, 2 * self.cap, 64), self.args.max_seq_len)
        bufs, n = self._alloc(cap), self.cap
        for name, buf in bufs.items():
            buf[:, :n] = self.bufs[name][:, :n]
        self._set(bufs)
        self.cap = cap


# -----------------------------------------------------------------------------

class Transformer:
    """embed -> Block x L -> norm -> head, with caches owned here and passed down explicitly."""

    can_rewind = True               # forward may restart anywhere up to the cached length (the caches hold every position)

    def __init__(self, args, weights, ck_path=None, numerics="official", attention_mode="sparse",
                 indexer_mode=None, ops=NUMPY_OPS):
        if numerics not in ("official", "exact"):
            raise ValueError(f"numerics must be 'official' or 'exact', got {numerics!r}")
        if attention_mode not in ("sparse", "dense"):
            raise ValueError(f"attention must be 'sparse' or 'dense', got {attention_mode!r}")
        indexer_mode = indexer_mode or ("fp8" if numerics == "official" else "exact")
        if indexer_mode not in ("fp8", "exact"):
            raise ValueError(f"indexer must be 'fp8' or 'exact', got {indexer_mode!r}")
        self.args, self.path = args, ck_path
        self.opts = SimpleNamespace(official=numerics == "official", sparse=attention_mode == "sparse",
                                    indexer_fp8=indexer_mode == "fp8", ops=ops, record=None)
        self.numerics, self.attention, self.indexer = numerics, attention_mode, indexer_mode
        self.w = derive_weights(weights, args, self.opts)
        self.freqs = rope.yarn_freqs(args.qk_rope_head_dim, args.rope_theta, args.max_seq_len, args.original_seq_len,
                                     args.rope_factor, args.rope_scaling.get("beta_fast", 32),
                                     args.rope_scaling.get("beta_slow", 1))
        self.caches, self.cached_len = None, 0
        self.rope_table = None                   # decode_static's cos, sin over the caches' capacity

    @classmethod
    def from_pretrained(cls, path, backend="numpy", numerics=None, attention="sparse", indexer=None,
                        max_seq_len=None, device=None, progress=None, probe=True, n_layers=None, parallel=None,
                        ops=None, experts=None):
        """Open a checkpoint folder in the real layout: DeepSeek-V3.2-Exp here, DeepSeek-V4 (config.json's
        model_type deepseek_v4) as model_v4.TransformerV4 with the options that apply to it.
        numerics: "official" (None: the default) or "exact".
        NumPy: weights stay memory-mapped until used.
        torch: each layer's tensors go to the device as they are read (FP8 stays FP8), then every
        routed expert passes a known-answer probe (probe_experts); progress(i, n) is called after each layer.
        n_layers: build only the first n layers (then the final norm and head), for checks.
        parallel: a parallel.Parallel (tensor/expert parallelism over torch.distributed ranks): this
        rank's slices of the weights and the op table with the collectives, applied from outside.
        ops: an op table to load onto instead of the backend's default (tests: the DSA kernels in the
        Triton interpreter on the CPU).
        experts: DeepSeek-V4's routed experts as stored ("fp4", the default) or re-encoded at load to
        128x128 block FP8 ("fp8": exact, twice the bytes; model_v4.reencode_experts)."""
        ck = checkpoint.Checkpoint(path)
        if ck.config.get("model_type") == "deepseek_v4":             # one entry point for both models
            import model_v4
            return model_v4.TransformerV4.from_pretrained(path, backend, numerics, attention, indexer, max_seq_len,
                                                          device, progress, n_layers, parallel,
                                                          ops or make_ops(backend, device), ck, probe, experts)
        if experts is not None:
            raise ValueError(f"experts={experts!r}: DeepSeek-V3.2-Exp's experts are FP8 as stored (the option is V4's)")
        numerics = numerics or "official"
        ops = ops or make_ops(backend, device)
        if parallel is not None:
            ops = parallel.wrap(ops)
        args = ModelArgs.from_config(ck.config, where=str(Path(path) / "config.json"),
                                     **({"max_seq_len": max_seq_len} if max_seq_len is not None else {}))
        if n_layers is not None and n_layers < args.num_hidden_layers:   # only the first n layers (--verify-layers)
            args = dataclasses.replace(args, num_hidden_layers=n_layers,
                                       first_k_dense_replace=min(args.first_k_dense_replace, n_layers))
        weights = {"embed": ck.get("model.embed_tokens.weight", PLAIN),
                   "norm": np.asarray(ck.get("model.norm.weight", NORM), np.float32), "head": ck.get("lm_head.weight", PLAIN),
                   "layers": [load_layer(ck, i, args) for i in range(args.num_hidden_layers)]}  # MTP layer skipped
        check_shapes(weights, args, path)
        if parallel is not None:                         # this rank's slices of the memory-mapped arrays
            weights, args = parallel.shard(weights, args)
        layers = weights.pop("layers")
        weights = to_backend(weights, ops)
        weights["layers"] = []
        for i, layer in enumerate(layers):
            weights["layers"].append(to_backend(layer, ops))
            if progress:
                progress(i + 1, len(layers))
        if ops is not NUMPY_OPS and probe:             # NumPy computes on the checkpoint's own arrays
            probe_experts(weights, layers, ops)
        return cls(args, weights, path, numerics, attention, indexer, ops)

    def reserve(self, batch, total_len):
        """Allocate the caches for `batch` sequences of up to total_len tokens now (on the device),
        so that generation does not grow them step by step."""
        if not (self.caches and self.caches[0].B == batch):
            self.caches = [self._cache(batch) for _ in range(self.args.num_hidden_layers)]
        for c in self.caches:
            c.reserve(min(total_len, self.args.max_seq_len))

    def _cache(self, B):
        o = self.opts
        return LayerCache(B, self.args, o.indexer_fp8, o.ops, o.official)

    def _check_tokens(self, tokens, start_pos):
        if not isinstance(start_pos, (int, np.integer)) or isinstance(start_pos, (bool, np.bool_)):
            raise ValueError(f"start_pos must be an integer, got {type(start_pos).__name__} {start_pos!r}")
        start_pos = int(start_pos)
        try:
            tokens = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)   # a torch tensor too
        except ValueError:                                                  # ragged nested lists
            raise ValueError("tokens must be a [batch, seq] integer array; rows of different lengths given") from None
        if tokens.ndim != 2 or 0 in tokens.shape:
            raise ValueError(f"tokens must be a [batch, seq] integer array with batch, seq >= 1, got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
        bad = (tokens < 0) | (tokens >= self.args.vocab_size)
        if bad.any():
            raise ValueError(f"token id {tokens[bad][0]} is outside the vocabulary [0, {self.args.vocab_size})")
        B, T = tokens.shape
        if start_pos < 0 or start_pos > self.cached_len:
            raise ValueError(f"start_pos {start_pos} is outside 0..{self.cached_len} (the cached length)")
        if start_pos > 0 and B != self.caches[0].B:
            raise ValueError(f"batch {B} differs from the cached batch {self.caches[0].B}")
        if start_pos + T > self.args.max_seq_len:
            raise ValueError(f"start_pos {start_pos} + {T} tokens exceeds max_seq_len {self.args.max_seq_len}")
        return tokens.astype(np.int64), start_pos

    def forward(self, tokens, start_pos=0, all_positions=False, record=None):
        """tokens [B, T] -> logits [B, V] of the last position (or [B, T, V]); continues the caches
        when start_pos > 0 (one token: decode; several: a prefill chunk). record: a dict that
        receives each layer's output ("hidden") and indexer selection ("selected"), for --verify."""
        tokens, start_pos = self._check_tokens(tokens, start_pos)
        B, T = tokens.shape
        a, o, ops = self.args, self.opts, self.opts.ops
        if start_pos == 0 and not (self.caches and self.caches[0].B == B):
            self.caches = [self._cache(B) for _ in range(a.num_hidden_layers)]
        end = start_pos + T
        for c in self.caches:
            c.reserve(end)
        cos, sin = ops.angles(*rope.rope_angles(self.freqs, np.arange(start_pos, end)))   # [T, R/2] each

        h = ops.embed(self.w["embed"], ops.tokens(tokens))                  # [B, T, d] (bf16 values)
        h = self._blocks(h, start_pos, end, cos, sin, record)
        self.cached_len = end
        return ops.head(h if all_positions else h[:, -1], self.w["head_f32"])   # [B, (T,) V] float32

    def _blocks(self, h, start_pos, S, cos, sin, record=None):  # [B, T, d] -> the final norm's output
        a, o, ops = self.args, self.opts, self.opts.ops
        B, T, _ = h.shape
        residual = None
        o.record = record
        for i, (lw, cache) in enumerate(zip(self.w["layers"], self.caches)):
            x, residual = self._norm(h, residual, lw["attn_norm"])
            x = attention.mla_forward(x, lw["attn"], cache, start_pos, S, cos, sin, a, o)
            x, residual = self._norm(x, residual, lw["ffn_norm"])
            x = x.reshape(B * T, -1)                                        # [M, d], M = B*T tokens
            if i < a.first_k_dense_replace:
                h = ops.mlp(x, lw["ffn"], o.official).reshape(B, T, -1)
            else:
                h = ops.moe(x, lw["ffn"], a, o.official).reshape(B, T, -1)
            if record is not None:
                record.setdefault("hidden", []).append(h + residual)          # the residual stream after layer i
        o.record = None
        h, _ = self._norm(h, residual, self.w["norm"])
        return h

    def decode_static(self, tok, pos):
        """One decode step with every shape fixed and nothing read back: tok [B, 1] and pos (a 0-d
        integer array) live on the device, attention and the indexer run over the caches' whole
        capacity with the causal mask hiding the slots not written yet. This is what a CUDA graph
        captures (backend_torch.GraphDecoder); it equals forward(tok, pos) in exact arithmetic."""
        ops, cap = self.opts.ops, self.caches[0].cap
        if self.rope_table is None or self.rope_table[0].shape[0] != cap:
            self.rope_table = ops.angles(*rope.rope_angles(self.freqs, np.arange(cap)))   # [cap, R/2] each
        at = pos.reshape(1)                                               # indexing by a tensor: no .item()
        cos, sin = self.rope_table[0][at], self.rope_table[1][at]         # [1, R/2]
        h = self._blocks(ops.embed(self.w["embed"], tok), pos, cap, cos, sin)
        return ops.head(h[:, -1], self.w["head_f32"])

    def _norm(self, x, residual, w):  # fused residual add (official): norm of the fp32 sum, residual rounded
        ops = self.opts.ops
        rnd = ops.bf16_round if self.opts.official else ops.no_round
        if residual is not None and ops.add_norm is not None:              # the GPU: the steps below in one launch
            return ops.add_norm(x, residual, w, self.args.rms_norm_eps, rnd)
        s = x if residual is None else x + residual                       # fp32 sum of two bf16 tensors
        return ops.rms_norm(s, w, self.args.rms_norm_eps, rnd), rnd(s)
