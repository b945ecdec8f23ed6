"""DeepSeek-V4-Flash: the Transformer (embedding -> n residual streams -> blocks -> the hc head -> norm
-> head) and loading it from the checkpoint's real layout (spec/v4_flash.md §2-3).

A block is two sub-layers, each wrapped in mHC (mhc.py): the streams are collapsed, RMSNorm'd and fed to
the sub-layer, and its output is expanded back into the streams beside their doubly stochastic mix.

    X^0_t = [e_t, ..., e_t]                                    n copies of the token's embedding
    X ← hc_post(X, Attn(RMSNorm(hc_pre(X))))                   attention_v4.py (window + CSA / HCA keys)
    X ← hc_post(X, MoE(RMSNorm(hc_pre(X))))                    moe.py: sqrtsoftplus or hash routing, clamp
    logits_t = W_head RMSNorm(hc_head(X_t))

Layer i's attention is sliding-window only, CSA (compressed keys of 4 tokens picked by the indexer)
or HCA (compressed keys of m' tokens, all attended to), per config.V4Args.layer_types; the first
layers route tokens to experts by a fixed table (tid2eid), the rest by the gate's top-k.

The caches stay small: per layer the keys of the last n_win positions (a ring) and each compressor's
open window and emitted keys (one per m tokens), so a decode step does not grow with a full-length KV
cache; forward continues at the cached length and cannot rewind (can_rewind).

Numerics, set at load time, as for V3.2:
- "official" (default): the rounding points of the official V4 inference code (revision 60d8d707:
  bf16 activations and residual streams; FP8 act_quant per 128 before every FP8 linear and the FP4
  expert GEMM (weights widened to FP8, scales per 32); the KV keys' FP8 round trip per 64 on the 448
  nope dims; the indexer's Hadamard + FP4 round trip per 32 and its bf16 scores; fp32 mHC mixes,
  Sinkhorn, compressors, router and head, each fp32 step rounded where the official code rounds it
  (rsqrt, exp and sigmoid once, the Sinkhorn kernel's a * b + c as one fma and its sums in index
  order, each product of the streams' mixes before their sum); the routing weight before w2; the sparse attention as the
  official kernel rounds it: the index list in blocks of 64 columns, bf16 probabilities against the
  running max, the sink last: attention_v4.blocked_attention_ref). Every GEMM is a function of its own
  row (FP8 / FP4 partials exact, fp32 GEMMs summed in float64 and rounded once), so a row's bits do
  not depend on the batch or the chunk it runs in, but the attention's blocks do depend on the list's
  layout: a prefill from position 0 lists min(T, n_win) window columns, every later step n_win, so
  after a prompt shorter than the window the compressed keys fall in other blocks. Decode equals
  prefill in exact numerics to fp32 rounding (its GEMMs are BLAS's); in official numerics bit for bit
  when the first chunk has at least n_win tokens or no query lists more than 64 keys (the official
  code's decode is not its own prefill either, there). On the CPU (NumPy and torch) every op and the whole model give the bits of
  the official code's trace (its GPU kernels emulated exactly, the hardware's open choices fixed as
  tests/fixtures/README.md says; tests/test_official_trace_v4.py); a GPU's fp32 sums are its own.
- "exact": float32 on dequantized weights, what transformers' DeepseekV4ForCausalLM computes.

Backends: the wiring below calls ops.Ops' V4 fields (hc_mix_pre, v4_attention, v4_moe, ...): the NumPy
references, or backend_torch's twins (on a GPU through kernels_v4's kernels). A torch load
probes every routed expert against the checkpoint's own bytes (probe_experts).

Letters: B batch, T tokens, M = B T, n streams (hc_mult), d hidden size, V vocabulary.
"""
from pathlib import Path

import numpy as np

import checkpoint
import quant
from config import V4Args
from ops import NUMPY_OPS

# The dtypes the format stores (spec/v4_flash.md §3)
NORM = ("BF16", "F32")
LINEAR = ("F8_E4M3", "BF16", "F32")       # FP8 with its F8_E8M0 block scale `.scale`; or unquantized
EXPERT = ("I8", "F8_E4M3", "BF16", "F32")  # I8: FP4 e2m1 packed two per byte, `.scale` F8_E8M0 per 32
PLAIN = ("BF16", "F32")                   # never quantized: embedding, head, router, compressors


def load_layer(ck, i, args):  # -> nested dict of quant.Weight / float32 arrays for layer i (REF names)
    pre = f"layers.{i}."

    def vec(name, dtypes=NORM):
        return np.asarray(ck.get(pre + name, dtypes), np.float32)

    def lin(name, dtypes=LINEAR):
        return ck.weight(pre + name, dtypes)

    def comp(prefix):  # a compressor: gated pooling of m tokens into one key
        return {"wkv": lin(prefix + "wkv", PLAIN), "wgate": lin(prefix + "wgate", PLAIN),
                "ape": vec(prefix + "ape", ("F32",)), "norm": vec(prefix + "norm.weight")}

    attn = {k: lin("attn." + k) for k in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")}
    attn |= {"q_norm": vec("attn.q_norm.weight"), "kv_norm": vec("attn.kv_norm.weight"),
             "attn_sink": vec("attn.attn_sink", ("F32",))}
    kind = args.layer_types[i]
    if kind != "sliding_attention":
        attn["compressor"] = comp("attn.compressor.")
    if kind == "compressed_sparse_attention":
        attn["indexer"] = {"wq_b": lin("attn.indexer.wq_b"), "weights_proj": lin("attn.indexer.weights_proj", PLAIN),
                           "compressor": comp("attn.indexer.compressor.")}

    def mlp(prefix):
        return {k: lin(prefix + k, EXPERT) for k in ("w1", "w2", "w3")}

    ffn = {"gate": lin("ffn.gate", PLAIN), "experts": [mlp(f"ffn.experts.{e}.") for e in range(args.n_routed_experts)],
           "shared_experts": mlp("ffn.shared_experts.")}
    if args.mlp_layer_types[i] == "hash_moe":
        ffn["tid2eid"] = np.asarray(ck.get(pre + "ffn.gate.tid2eid", ("I64", "I32")), np.int64)
    else:
        ffn["gate_bias"] = vec("ffn.gate.bias", ("F32",))
    hc = {f"hc_{s}_{k}": vec(f"hc_{s}_{k}", ("F32",)) for s in ("attn", "ffn") for k in ("fn", "base", "scale")}
    return {"attn_norm": vec("attn_norm.weight"), "ffn_norm": vec("ffn_norm.weight"), "attn": attn, "ffn": ffn} | hc


def check_shapes(w, a, path):  # every weight against the shape config.json implies (spec/v4_flash.md §3, §5.2)
    d, H, c, n = a.hidden_size, a.num_attention_heads, a.head_dim, a.hc_mult
    E, I, J, cI, g = a.n_routed_experts, a.moe_intermediate_size, a.index_n_heads, a.index_head_dim, a.o_groups

    def logical(W):  # a Weight's [out, in]: FP4 stores two codes per byte
        return (W.w.shape[0], 2 * W.w.shape[1]) if W.w.dtype == np.uint8 else tuple(W.w.shape)

    def comp(c_out, m, overlap):
        k = 2 * c_out if overlap else c_out
        return {"wkv": (k, d), "wgate": (k, d), "ape": (m, k), "norm": (c_out,)}

    checks = [("embed", w["embed"], (a.vocab_size, d)), ("head", w["head"], (a.vocab_size, d)), ("norm", w["norm"], (d,)),
              ("hc_head_fn", w["hc_head"]["fn"], (n, n * d))]
    for i, lw in enumerate(w["layers"]):
        at, f = lw["attn"], lw["ffn"]
        want = {"wq_a": (a.q_lora_rank, d), "wq_b": (H * c, a.q_lora_rank), "wkv": (c, d), "kv_norm": (c,),
                "wo_a": (g * a.o_lora_rank, H * c // g), "wo_b": (d, g * a.o_lora_rank), "attn_sink": (H,)}
        checks += [(f"layers.{i}.attn.{k}", at[k], s) for k, s in want.items()]
        checks += [(f"layers.{i}.hc_{s}_fn", lw[f"hc_{s}_fn"], ((2 + n) * n, n * d)) for s in ("attn", "ffn")]
        m = a.ratio(i)
        if m:
            checks += [(f"layers.{i}.attn.compressor.{k}", at["compressor"][k], s) for k, s in comp(c, m, m == 4).items()]
        if m == 4:
            checks += [(f"layers.{i}.attn.indexer.{k}", at["indexer"]["compressor"][k], s)
                       for k, s in comp(cI, m, True).items()]
            checks += [(f"layers.{i}.attn.indexer.wq_b", at["indexer"]["wq_b"], (J * cI, a.q_lora_rank)),
                       (f"layers.{i}.attn.indexer.weights_proj", at["indexer"]["weights_proj"], (J, d))]
        checks += [(f"layers.{i}.ffn.gate", f["gate"], (E, d))]
        for name, mlp in [(f"experts.{e}", x) for e, x in enumerate(f["experts"])] + [("shared_experts", f["shared_experts"])]:
            checks += [(f"layers.{i}.ffn.{name}.{k}", mlp[k], s) for k, s in (("w1", (I, d)), ("w3", (I, d)), ("w2", (d, I)))]
        if "tid2eid" in f:
            checks.append((f"layers.{i}.ffn.gate.tid2eid", f["tid2eid"], (a.vocab_size, a.num_experts_per_tok)))
    for name, t, shape in checks:
        got = logical(t) if isinstance(t, quant.Weight) else tuple(np.shape(t))
        if got != shape:
            raise checkpoint.CheckpointError(f"{path}: {name} has shape {got}, but config.json implies {shape}")


FP4_TABLE = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])   # e2m1 codes (§3.1)


def checkpoint_values(W, rows=None):  # a checkpoint Weight -> [N, K] float64 (or its rows), decoded from its bytes
    rows = np.arange(W.w.shape[0]) if rows is None else rows                 # (the probe's oracle)
    if W.scale is None:
        return np.asarray(W.w[rows], np.float64)
    if W.w.dtype == np.uint8:                           # FP4: low nibble = even k, one scale per 32 along k
        w = W.w[rows]
        v = FP4_TABLE[np.stack([w & 0xF, w >> 4], -1).reshape(len(rows), -1)]
        return v * np.repeat(np.asarray(W.scale, np.float64)[rows], 32, 1)
    K = W.w.shape[1]                                    # FP8: one scale per 128 x 128 block
    return quant.decode(W.w[rows], np.float64) * np.repeat(np.asarray(W.scale, np.float64)[rows // 128], 128, 1)[:, :K]


def probe_experts(w, host_layers, ops, rows=2, stride=61):
    """Known-answer probe at load (spec/v4_flash.md §5.2, check 2; the gfx90a report's W2): a fixed
    input through every routed expert's w1, w2 and w3 as the backend holds and runs them (official
    numerics: act_quant, the FP4 GEMM), against the product with the checkpoint's own bytes decoded by
    the format's table in float64. Every row of each layer's first expert and of any matrix of at most
    2^20 values (a loader's or kernel's layout is the same for every expert: a permutation of rows at
    any grain shows there), and every stride-th row and the last of the other experts (their order and
    offsets; all 256 experts whole in float64 took minutes a layer at real width). A layout mismatch
    stops the load, naming layer, expert and matrix.
    Stacked experts (ops.v4_experts) run through ops.expert_linear, the backend's view of expert e."""
    inputs = {}
    for i, (lw, hw) in enumerate(zip(w["layers"], host_layers)):
        stored = hw["ffn"].get("fp4_experts", hw["ffn"]["experts"])       # the checkpoint's bytes (reencode_experts)
        for e, host in enumerate(stored):
            for name in ("w1", "w2", "w3"):
                N, K = host[name].w.shape[0], host[name].w.shape[1] * (2 if host[name].w.dtype == np.uint8 else 1)
                whole = e == 0 or N * K <= 1 << 20                                          # (FP4: 2 codes a byte)
                sel = np.arange(N) if whole else np.unique(np.r_[np.arange(0, N, stride), N - 1])
                ref_w = checkpoint_values(host[name], sel)                                  # [len(sel), K]
                key = (ref_w.shape[1], host[name].scale is not None)
                if key not in inputs:                   # a fixed input (no RNG), and as the GEMM sees it
                    x = quant.bf16_round(np.sin(np.arange(rows * key[0]) * 0.37).reshape(rows, -1))
                    xq = quant.act_dequant(*quant.act_quant(x)) if key[1] else x                # FP8 / FP4: act_quant
                    inputs[key] = ops.param(x), xq.astype(np.float64)
                x, xq = inputs[key]
                got = ops.expert_linear(x, lw["ffn"], e, name) if "w13" in lw["ffn"] else \
                    ops.linear(x, lw["ffn"]["experts"][e][name], True)
                got = np.asarray(got.float().cpu() if hasattr(got, "cpu") else got, np.float64)[:, sel]
                ref = xq @ ref_w.T
                err = np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30)
                if not err <= 2e-2:                                                          # bf16 output: ~2^-8
                    raise checkpoint.LoadError(
                        f"layer {i} expert {e} {name}: the backend's weights give {err:.0%} relative error against "
                        "the checkpoint's bytes (a layout mismatch between loader and kernel?)")


def reencode_experts(lw, i):
    """Layer i's routed experts re-encoded from MXFP4 to 128x128 block FP8, exactly (quant.fp4_to_fp8_blocks):
    the route that runs V4's experts through V3.2's FP8 GEMMs at twice the bytes. The layer keeps its FP4
    originals under "fp4_experts" for the load-time probe (probe_experts checks the FP8 copies against
    the checkpoint's own FP4 bytes)."""
    def fp8(W, name):
        if W.w.dtype != np.uint8:
            return W
        try:
            return quant.Weight(*quant.fp4_to_fp8_blocks(np.asarray(W.w), np.asarray(W.scale, np.float32)))
        except ValueError as e:
            raise checkpoint.LoadError(f"layer {i} {name}: {e} (load with experts='fp4')") from None
    ex = [{k: fp8(W, f"expert {e} {k}") for k, W in m.items()} for e, m in enumerate(lw["ffn"]["experts"])]
    return dict(lw, ffn=dict(lw["ffn"], experts=ex, fp4_experts=lw["ffn"]["experts"]))


def derive_weights(w, ops):
    """The weights as the model reads them, made once at load on a new dict (the caller's stays as it
    was), never inside a step: the fp32 head, and in float32 (the same values, no longer dequantized or
    widened per call) W^OA (FP8), the compressors' W^KV and W^Z, the indexer's weights_proj and the
    router (bf16)."""
    def f32(W):
        return quant.Weight(ops.to_f32(ops.dequant(W)), None)

    def comp(c):
        return dict(c, wkv=f32(c["wkv"]), wgate=f32(c["wgate"]))

    layers = []
    for lw in w["layers"]:
        at = dict(lw["attn"], wo_a=f32(lw["attn"]["wo_a"]))
        if "compressor" in at:
            at["compressor"] = comp(at["compressor"])
        if "indexer" in at:
            at["indexer"] = dict(at["indexer"], weights_proj=f32(at["indexer"]["weights_proj"]),
                                 compressor=comp(at["indexer"]["compressor"]))
        layers.append(dict(lw, attn=at, ffn=dict(lw["ffn"], gate=f32(lw["ffn"]["gate"]))))
    return dict(w, layers=layers, head_f32=ops.to_f32(w["head"]))


def to_backend(w, ops):  # a nested weight dict -> the backend's arrays; the routed experts stay a list
    if isinstance(w, quant.Weight):
        return ops.weight(w)
    if isinstance(w, dict):
        return {k: to_backend(v, ops) for k, v in w.items()}
    if isinstance(w, list):
        return [to_backend(v, ops) for v in w]
    return ops.param(w)


class TransformerV4:
    """embed -> n streams -> Block x L -> hc head -> norm -> head."""

    can_rewind = False      # the window ring and the compressors' open windows hold no earlier positions

    def __init__(self, args, weights, ck_path=None, numerics="official", attention="sparse", ops=None):
        if numerics not in ("official", "exact"):
            raise ValueError(f"numerics must be 'official' or 'exact', got {numerics!r}")
        self.ops = ops or NUMPY_OPS
        if self.ops.v4_attention is None:
            raise ValueError(f"the {self.ops.name} op table does not run DeepSeek-V4")
        self.official = numerics == "official"
        self.args, self.path, self.numerics = args, ck_path, numerics
        self.w = derive_weights(weights, self.ops)
        self.attention = attention                          # dense: CSA layers attend every complete window
        self.indexer = "fp4" if self.official else "exact"  # Hadamard + FP4 keys and queries, or float32
        self.freqs = {k: self.ops.param(args.freqs(k)) for k in (False, True)}   # plain, and YaRN for compressed layers
        self.caches, self._len, self.planned_len = [], 0, 0

    @property
    def cached_len(self):  # positions the caches hold
        return self._len

    @cached_len.setter
    def cached_len(self, L):  # after decode_static's steps (which write keys by position): the compressors' key counts
        self._len = L
        for state, m in self._compressors():
            state.n = L // m

    def _compressors(self):  # (each compressor's state, its m) over the layers' caches
        for i, cache in enumerate(self.caches):
            for state, m in ((cache.comp, self.args.ratio(i)), (cache.idx, 4)):
                if state is not None:
                    yield state, m

    @classmethod
    def from_pretrained(cls, path, backend="numpy", numerics=None, attention="sparse", indexer=None, max_seq_len=None,
                        device=None, progress=None, n_layers=None, parallel=None, ops=None, ck=None, probe=True,
                        experts=None):
        """The checkpoint folder in the official layout (model.Transformer.from_pretrained comes here for
        a deepseek_v4 config). Options that do not apply to V4 yet are refused in one line."""
        numerics = numerics or "official"
        if experts not in (None, "fp4", "fp8"):
            raise ValueError(f"experts must be 'fp4' (as stored) or 'fp8' (re-encoded at load), got {experts!r}")
        if indexer is not None:
            raise ValueError(f"indexer={indexer!r}: DeepSeek-V4's indexer precision follows numerics (FP4 in official)")
        if ops is None and backend != "numpy":
            raise ValueError(f"backend {backend!r}: load through model.Transformer.from_pretrained (it makes the op table)")
        ops = ops or NUMPY_OPS
        if attention not in ("sparse", "dense"):
            raise ValueError(f"attention must be 'sparse' or 'dense', got {attention!r}")
        ck = ck or checkpoint.Checkpoint(path)
        args = V4Args.from_config(ck.config, where=str(Path(path) / "config.json"),
                                  **({"max_seq_len": max_seq_len} if max_seq_len is not None else {}))
        L = args.num_hidden_layers if n_layers is None else min(n_layers, args.num_hidden_layers)
        layers = []
        for i in range(L):
            layers.append(load_layer(ck, i, args))
            if progress:
                progress(i + 1, L)
        if L < args.num_hidden_layers:                    # only the first L layers (--verify-layers)
            args.num_hidden_layers = L
            args.layer_types, args.mlp_layer_types = args.layer_types[:L], args.mlp_layer_types[:L]
        w = {"embed": ck.get("embed.weight", PLAIN), "head": ck.get("head.weight", PLAIN),
             "norm": np.asarray(ck.get("norm.weight", NORM), np.float32),
             "hc_head": {k: np.asarray(ck.get(f"hc_head_{k}", ("F32",)), np.float32) for k in ("fn", "base", "scale")},
             "layers": layers}                                                  # mtp.* skipped
        check_shapes(w, args, path)
        if parallel is not None:                          # this rank's slices, and the ops with the collectives
            w, args = parallel.shard_v4(w, args)
            ops = parallel.wrap(ops)
        if experts == "fp8":                              # this rank's experts, FP8 beside their FP4 originals
            w = dict(w, layers=[reencode_experts(lw, i) for i, lw in enumerate(w["layers"])])
        stack = ops.v4_experts is not None                # the V4 kernels' grouped GEMMs read the experts stacked
        held = to_backend(dict(w, layers=[dict(lw, ffn={k: v for k, v in lw["ffn"].items()
                                                        if k != "fp4_experts" and not (stack and k == "experts")})
                                          for lw in w["layers"]]), ops)
        if stack:
            for dev, lw in zip(held["layers"], w["layers"]):
                dev["ffn"].update(ops.v4_experts(lw["ffn"]["experts"]))
        if ops is not NUMPY_OPS and probe:               # NumPy computes on the checkpoint's own arrays
            probe_experts(held, w["layers"], ops)
        return cls(args, held, path, numerics, attention, ops)

    def reserve(self, batch, total_len):
        """Room for total_len tokens' compressed keys: at the caches' start, or now for caches kept from a
        chat's last turn (decode_static writes by position and cannot grow a buffer)."""
        if total_len > self.args.max_seq_len:
            raise ValueError(f"{total_len} tokens exceed max_seq_len {self.args.max_seq_len}")
        self.planned_len = total_len
        self._reserve_keys()

    def _reserve_keys(self):  # each compressor's key buffer sized for planned_len, + the open window's (decode_static)
        for state, m in self._compressors():
            state.reserve(self.planned_len // m + 1)

    def forward(self, tokens, start_pos=0, all_positions=False, record=None):
        """tokens [B, T] -> logits [B, V] of the last position (or [B, T, V]). start_pos 0 starts over;
        start_pos = the cached length continues the caches (one token: decode; several: a chunk).
        record: a dict that receives each layer's streams ("hidden" [B, T, n d]) and the CSA layers' picks
        ("selected" [B, T, n]; None for the other layers), for --verify."""
        tokens = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)
        ops = self.ops
        if tokens.ndim != 2 or 0 in tokens.shape or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a [batch, seq] integer array, got {tokens.dtype} {tokens.shape}")
        bad = (tokens < 0) | (tokens >= self.args.vocab_size)
        if bad.any():
            raise ValueError(f"token id {tokens[bad][0]} is outside the vocabulary [0, {self.args.vocab_size})")
        a, w = self.args, self.w
        B, T = tokens.shape
        if start_pos == 0:
            self.caches = [ops.v4_cache(B, a, a.layer_types[i], lw["attn"]) for i, lw in enumerate(w["layers"])]
            self._reserve_keys()                         # keys of the planned length at once, not by doubling
            self.cached_len = 0
        elif start_pos != self.cached_len or B != self.caches[0].ring.shape[0]:
            raise ValueError(f"start_pos {start_pos} (batch {B}): V4 continues its caches only at the cached length "
                             f"{self.cached_len} (batch {self.caches[0].ring.shape[0] if self.caches else 0}), or starts over at 0")
        if start_pos + T > a.max_seq_len:
            raise ValueError(f"start_pos {start_pos} + {T} tokens exceeds max_seq_len {a.max_seq_len}")
        sparse = self.attention == "sparse"

        def attend(i, h, p, cache):  # layer i's attention of h [B, T, d] at start_pos
            m = a.ratio(i)
            return ops.v4_attention(h, p, a.layer_types[i], m, start_pos, self.freqs[m > 0], a, cache, sparse, self.official)
        logits = self._blocks(ops.tokens(tokens), B, T, attend, record)
        self.cached_len = start_pos + T
        return logits if all_positions else logits[:, -1]

    def decode_static(self, tok, pos):
        """One decode step with every shape fixed and nothing read back: tok [B, 1] and pos (a 0-d integer
        tensor) on the device; the attention through ops.v4_attention_step (the window's ring slot by
        position, the compressors' keys written by window, the indexer and attention over the key buffers'
        whole capacity with the windows not complete yet hidden). backend_torch.GraphDecoder captures it;
        it equals forward(tok, pos) to fp32 rounding (the kernels split the longer key lists otherwise).
        The caller sets cached_len to pos + 1 after it."""
        if self.ops.v4_attention_step is None:
            raise ValueError(f"decode_static needs the {self.ops.name} op table with the V4 kernels")
        a, at = self.args, pos.reshape(1)
        sparse = self.attention == "sparse"

        def attend(i, h, p, cache):
            m = a.ratio(i)
            return self.ops.v4_attention_step(h, p, a.layer_types[i], m, at, self.freqs[m > 0], a, cache, sparse,
                                              self.official)
        return self._blocks(tok.reshape(-1), tok.shape[0], 1, attend)[:, -1]

    def _blocks(self, ids, B, T, attend, record=None):  # ids [B T] device tokens -> logits [B, T, V]
        ops, a, w = self.ops, self.args, self.w
        n, d, off = a.hc_mult, a.hidden_size, self.official
        rnd = ops.bf16_round if off else ops.no_round
        e = rnd(ops.embed(w["embed"], ids)).reshape(B * T, d)                        # bf16 rows
        X = ops.cat([e[:, None]] * n, 1)                                              # X^0 [M, n, d]
        for i, (lw, cache) in enumerate(zip(w["layers"], self.caches)):
            kind = a.layer_types[i]
            _, post, comb, u = ops.hc_mix_pre(X, lw["hc_attn_fn"], lw["hc_attn_base"], lw["hc_attn_scale"], a, off)
            h = ops.v4_norm(u, lw["attn_norm"], a.rms_norm_eps, rnd).reshape(B, T, d)
            y = attend(i, h, lw["attn"], cache)
            X = ops.hc_post(X, y.reshape(B * T, d), post, comb, off)
            _, post, comb, u = ops.hc_mix_pre(X, lw["hc_ffn_fn"], lw["hc_ffn_base"], lw["hc_ffn_scale"], a, off)
            h = ops.v4_norm(u, lw["ffn_norm"], a.rms_norm_eps, rnd)
            y = ops.v4_moe(h, lw["ffn"], a, off, ids.reshape(-1), weight_inside=off)
            X = ops.hc_post(X, y, post, comb, off)
            if record is not None:                      # the streams after layer i, the CSA indexer's picks
                record.setdefault("hidden", []).append(X.reshape(B, T, -1))
                record.setdefault("selected", []).append(cache.selected if kind == "compressed_sparse_attention" else None)
        hc = w["hc_head"]
        h = ops.v4_norm(ops.hc_head(X, hc["fn"], hc["base"], hc["scale"], a, off), w["norm"], a.rms_norm_eps, rnd)
        return ops.matmul_f32(h, w["head_f32"].T).reshape(B, T, -1)                # [B, T, V], fp32 head


def cache_bytes_per_token(args, key_bytes, index_key_bytes):
    """Bytes of cache one more token of context adds, over all layers: a compressed key per m tokens on
    the CSA and HCA layers, and on CSA layers an indexer key per 4 (the window is a fixed ring of n_win
    keys per layer, the open windows at most m rows: neither grows with the context).
    key_bytes, index_key_bytes: one stored key of head_dim and of index_head_dim values."""
    return sum((key_bytes + (index_key_bytes if t == "compressed_sparse_attention" else 0)) / args.ratio(i)
               for i, t in enumerate(args.layer_types) if args.ratio(i))
