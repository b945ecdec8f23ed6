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
cache. So far: the NumPy reference in exact numerics (float32 on dequantized weights: what
transformers' DeepseekV4ForCausalLM computes); the official numerics and the torch path come next.

Letters: B batch, T tokens, M = B T, n streams (hc_mult), d hidden size, V vocabulary.
"""
from pathlib import Path

import numpy as np

import checkpoint
import moe
import quant
from attention_v4 import V4LayerCache, attention_v4_forward
from compressor import rms_norm
from config import V4Args
from mhc import hc_head_ref, hc_mixes_ref, hc_post_ref, hc_pre_ref

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


class TransformerV4:
    """embed -> n streams -> Block x L -> hc head -> norm -> head."""

    def __init__(self, args, weights, ck_path=None, numerics="exact"):
        if numerics != "exact":
            raise ValueError(f"numerics {numerics!r}: DeepSeek-V4 runs in exact numerics so far (numerics='exact'); "
                             "the official code's rounding points are not implemented yet")
        self.args, self.w, self.path, self.numerics = args, weights, ck_path, numerics
        self.freqs = {False: args.freqs(False), True: args.freqs(True)}    # plain, and YaRN for compressed layers
        self.caches, self.cached_len = [], 0

    @classmethod
    def from_pretrained(cls, path, backend="numpy", numerics="exact", max_seq_len=None, device=None, **unused):
        if backend != "numpy":
            raise ValueError(f"backend {backend!r}: DeepSeek-V4 runs on the NumPy reference so far (backend='numpy')")
        ck = checkpoint.Checkpoint(path)
        args = V4Args.from_config(ck.config, where=str(Path(path) / "config.json"),
                                  **({"max_seq_len": max_seq_len} if max_seq_len is not None else {}))
        w = {"embed": ck.get("embed.weight", PLAIN), "head": ck.get("head.weight", PLAIN),
             "norm": np.asarray(ck.get("norm.weight", NORM), np.float32),
             "hc_head": {k: np.asarray(ck.get(f"hc_head_{k}", ("F32",)), np.float32) for k in ("fn", "base", "scale")},
             "layers": [load_layer(ck, i, args) for i in range(args.num_hidden_layers)]}
        return cls(args, w, path, numerics)

    def forward(self, tokens, start_pos=0, all_positions=False):
        """tokens [B, T] -> logits [B, V] of the last position (or [B, T, V]). start_pos 0 starts over;
        start_pos = the cached length continues the caches (one token: decode; several: a chunk)."""
        tokens = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)
        if tokens.ndim != 2 or 0 in tokens.shape or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a [batch, seq] integer array, got {tokens.dtype} {tokens.shape}")
        bad = (tokens < 0) | (tokens >= self.args.vocab_size)
        if bad.any():
            raise ValueError(f"token id {tokens[bad][0]} is outside the vocabulary [0, {self.args.vocab_size})")
        a, w = self.args, self.w
        B, T = tokens.shape
        if start_pos == 0:
            self.caches = [V4LayerCache(B, a, a.layer_types[i], lw["attn"]) for i, lw in enumerate(w["layers"])]
            self.cached_len = 0
        elif start_pos != self.cached_len or B != self.caches[0].ring.shape[0]:
            raise ValueError(f"start_pos {start_pos} (batch {B}): V4 continues its caches only at the cached length "
                             f"{self.cached_len} (batch {self.caches[0].ring.shape[0] if self.caches else 0}), or starts over at 0")
        if start_pos + T > a.max_seq_len:
            raise ValueError(f"start_pos {start_pos} + {T} tokens exceeds max_seq_len {a.max_seq_len}")
        n, d = a.hc_mult, a.hidden_size
        e = np.asarray(w["embed"][tokens], np.float32).reshape(B * T, d)
        X = np.repeat(e[:, None], n, 1)                                              # X^0 [M, n, d]
        for i, (lw, cache) in enumerate(zip(w["layers"], self.caches)):
            kind, m = a.layer_types[i], a.ratio(i)
            pre, post, comb = hc_mixes_ref(X, lw["hc_attn_fn"], lw["hc_attn_base"], lw["hc_attn_scale"], a)
            h = rms_norm(hc_pre_ref(X, pre), lw["attn_norm"], a.rms_norm_eps).reshape(B, T, d)
            y = attention_v4_forward(h, lw["attn"], kind, m, start_pos, self.freqs[m > 0], a, cache)
            X = hc_post_ref(X, y.reshape(B * T, d), post, comb)
            pre, post, comb = hc_mixes_ref(X, lw["hc_ffn_fn"], lw["hc_ffn_base"], lw["hc_ffn_scale"], a)
            h = rms_norm(hc_pre_ref(X, pre), lw["ffn_norm"], a.rms_norm_eps)
            y = moe.moe_ref(h, lw["ffn"], a, False, tokens.reshape(-1))
            X = hc_post_ref(X, y, post, comb)
        self.cached_len = start_pos + T
        hc = w["hc_head"]
        h = rms_norm(hc_head_ref(X, hc["fn"], hc["base"], hc["scale"], a), w["norm"], a.rms_norm_eps)
        logits = (h @ np.asarray(w["head"], np.float32).T).reshape(B, T, -1)         # [B, T, V]
        return logits if all_positions else logits[:, -1]
