"""checkpoint.py: the hand-written safetensors reader and writer against the safetensors library,
the name table, and clear errors (nothing half-written) on broken checkpoints."""
import json
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file

import checkpoint
import quant
from checkpoint import CheckpointError
from conftest import ROOT
from helpers import bad_devices
from model import Transformer


def test_reads_what_safetensors_writes(tmp_path):
    src = {"a.weight": torch.randn(5, 7).to(torch.float8_e4m3fn), "b": torch.randn(3, 130).to(torch.bfloat16),
           "c": torch.randn(2, 2, 2), "d": torch.arange(6, dtype=torch.int64)}
    save_file(src, tmp_path / "x.safetensors")
    hdr = checkpoint.read_header(tmp_path / "x.safetensors")
    data = np.memmap(tmp_path / "x.safetensors", np.uint8, mode="r")
    for name, t in src.items():
        dtype, shape, b, e = hdr[name]
        got = data[b:e].view(dtype).reshape(shape)
        want = t.view(torch.uint8).numpy() if t.dtype == torch.float8_e4m3fn else None
        if want is not None:
            np.testing.assert_array_equal(got.view(np.uint8), want)
        elif t.dtype == torch.bfloat16:
            np.testing.assert_array_equal(got.astype(np.float32), t.float().numpy())
        else:
            np.testing.assert_array_equal(got, t.numpy())


def test_safetensors_reads_what_we_write(tmp_path):
    t = {"w": np.random.default_rng(1).standard_normal((4, 9)).astype(ml_dtypes.float8_e4m3fn),
         "s": np.array([[0.5, 2.0]], np.float32), "e": np.ones((3, 3), ml_dtypes.bfloat16)}
    checkpoint.save_safetensors(tmp_path / "y.safetensors", t)
    back = load_file(tmp_path / "y.safetensors")
    np.testing.assert_array_equal(back["w"].view(torch.uint8).numpy(), t["w"].view(np.uint8))
    np.testing.assert_array_equal(back["s"].numpy(), t["s"])
    np.testing.assert_array_equal(back["e"].float().numpy(), 1.0)


def test_short_names_follow_convert_py():
    cases = {"model.layers.5.self_attn.indexer.wq_b.weight_scale_inv": "layers.5.attn.indexer.wq_b.scale",
             "model.layers.5.mlp.experts.17.gate_proj.weight": "layers.5.ffn.experts.17.w1.weight",
             "model.layers.5.mlp.gate.e_score_correction_bias": "layers.5.ffn.gate.bias",
             "lm_head.weight": "head.weight", "model.embed_tokens.weight": "embed.weight",
             "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": "layers.0.attn.wkv_a.weight"}
    for hf, short in cases.items():
        assert checkpoint.short_name(hf) == short


@pytest.fixture()
def small(tmp_path):
    cfg = checkpoint.tiny_config(num_hidden_layers=2, n_routed_experts=4, n_group=2, topk_group=1)
    return checkpoint.write_checkpoint(tmp_path / "ck", cfg, checkpoint.random_weights(cfg, 0))


def shard_of(path, name):
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_written_layout_is_the_real_one(small):
    ck = checkpoint.Checkpoint(small)
    w = ck.weight("model.layers.0.self_attn.kv_a_proj_with_mqa")
    assert w.w.dtype == ml_dtypes.float8_e4m3fn and w.scale.shape == (2, 2)     # 192 rows -> 2 scale rows
    assert np.all(np.exp2(np.round(np.log2(w.scale))) == w.scale)               # ue8m0 powers of two
    assert ck.get("model.embed_tokens.weight").dtype == ml_dtypes.bfloat16
    assert ck.get("model.layers.1.mlp.gate.e_score_correction_bias").dtype == np.float32
    cfg = json.loads((small / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]


def test_truncated_shard(small):
    f = shard_of(small, "model.embed_tokens.weight")
    data = f.read_bytes()
    f.write_bytes(data[:len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        Transformer.from_pretrained(small)
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.read_header(f)


def rewrite_header(f, edit):
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (n - len(blob)) if len(blob) <= n else b""
    f.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])


def test_header_that_lies(small):
    f = shard_of(small, "model.norm.weight")

    def bad_shape(h):
        h["model.norm.weight"]["shape"] = [7]
    rewrite_header(f, bad_shape)
    with pytest.raises(CheckpointError, match="do not hold F32"):
        checkpoint.read_header(f)


def test_header_with_unknown_dtype_or_garbage(small):
    f = shard_of(small, "model.norm.weight")
    rewrite_header(f, lambda h: h["model.norm.weight"].update(dtype="Q9"))
    with pytest.raises(CheckpointError, match="unknown dtype"):
        checkpoint.read_header(f)
    f.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        checkpoint.read_header(f)
    f.write_bytes(struct.pack("<Q", 10 ** 9) + b"{}")
    with pytest.raises(CheckpointError, match="runs past the end"):
        checkpoint.read_header(f)


def test_missing_pieces(small, tmp_path):
    idx = small / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    del index["weight_map"]["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    idx.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="has no weight_scale_inv"):
        Transformer.from_pretrained(small)
    del index["weight_map"]["model.layers.1.self_attn.o_proj.weight"]
    idx.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.layers.1.self_attn.o_proj.weight' is not in the checkpoint's index"):
        Transformer.from_pretrained(small)
    (small / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        Transformer.from_pretrained(small)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.Checkpoint(tmp_path / "nope")


def test_index_names_only_shards_inside_the_folder(small):
    idx = small / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    shard = index["weight_map"]["model.norm.weight"]
    for bad in ("../" + shard, str(small / shard), "sub/" + shard):
        index["weight_map"]["model.norm.weight"] = bad
        idx.write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="shards are files inside the checkpoint folder"):
            checkpoint.Checkpoint(small).get("model.norm.weight")


def test_config_missing_field_is_named(small):
    cfg = json.loads((small / "config.json").read_text())
    del cfg["kv_lora_rank"]
    (small / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json: missing required field.*kv_lora_rank"):
        Transformer.from_pretrained(small)


def test_nothing_half_written(tmp_path):
    bad = {"ok": np.zeros(3, np.float32), "bad": np.zeros(3, np.complex64)}   # no safetensors dtype
    with pytest.raises(KeyError):
        checkpoint.write_checkpoint(tmp_path / "out", {"x": 1}, bad)
    assert list(tmp_path.iterdir()) == []                                      # no folder, no temp left


def test_tiny_build_is_deterministic(tmp_path):
    cfg = checkpoint.tiny_config(num_hidden_layers=1)
    a = checkpoint.write_checkpoint(tmp_path / "a", cfg, checkpoint.random_weights(cfg, 3))
    b = checkpoint.write_checkpoint(tmp_path / "b", cfg, checkpoint.random_weights(cfg, 3))
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes()


def test_config_that_does_not_fit_the_weights(small):
    cfg = json.loads((small / "config.json").read_text())
    cfg["q_lora_rank"] = 256
    (small / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"layer 0 attn.wq_a has shape \(128, 256\), but config.json implies \(256, 256\)"):
        Transformer.from_pretrained(small)


def test_torch_weight_quant_equals_numpy():
    w = np.random.default_rng(2).standard_normal((300, 200)).astype(np.float32) * 0.01
    q, s = checkpoint.torch_weight_quant(torch.from_numpy(w))
    qr, sr = quant.weight_quant(w)
    np.testing.assert_array_equal(s.numpy(), sr)
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), qr.view(np.uint8))


# -----------------------------------------------------------------------------
# The builder never replaces what it did not write; the write stays atomic

def tree(folder):  # -> {every file's path under folder: sha256 of its bytes}, folders as None: the bytes kept
    import hashlib
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def built(path, seed=0):  # a folder the builder wrote (one layer: quick)
    cfg = checkpoint.tiny_config(num_hidden_layers=1)
    return checkpoint.write_checkpoint(path, cfg, checkpoint.random_weights(cfg, seed))


def trained(path):  # a folder train.py wrote, through its own export (one layer, untrained weights: quick)
    import train
    cfg = checkpoint.tiny_config(num_hidden_layers=1, vocab_size=256, max_position_embeddings=64)
    return train.TrainModel(cfg, seed=0).export(path, cfg, extra_files={"tokenizer.json": "{}"})


def refused(path, message, monkeypatch, **kw):  # build_tiny refuses path with message, before any drawing, unchanged
    before = tree(path)
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "random_weights", lambda *a, **k: pytest.fail("drew weights before refusing"))
        with pytest.raises(FileExistsError) as e:
            checkpoint.build_tiny(path, tokenizer=False, **kw)
    assert str(e.value) == message and tree(path) == before
    assert sorted(p.name for p in path.parent.iterdir() if ".tmp" in p.name) == []


def test_builder_refuses_a_folder_it_did_not_write(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "precious.txt").write_text("keep me")
    refused(mine, f"{mine} is a non-empty folder that checkpoint.py did not write (no {checkpoint.MARKER} in it); "
                  "refusing to replace it: choose a new or empty folder (--force replaces it anyway)", monkeypatch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is not a folder"):
        checkpoint.write_checkpoint(tmp_path / "file", {}, {}, force=True)       # not a folder: not even forced
    empty = tmp_path / "empty"
    empty.mkdir()
    built(empty)                                                                  # an empty folder is fine
    assert (empty / checkpoint.MARKER).read_text().startswith("built by checkpoint.py")


def test_builder_replaces_only_its_own_build(tmp_path, monkeypatch):
    # its own build, nothing else in it: replaced whole (the same bytes as a fresh build)
    out = built(tmp_path / "ck")
    (out / "tokenizer.json").write_text("{}")                      # a name the builder writes (without --no-tokenizer)
    built(out, seed=1)
    assert tree(out) == tree(built(tmp_path / "fresh", seed=1)) != tree(built(tmp_path / "seed0"))
    # the same build with a file (or a folder) the builder does not write: refused, unchanged
    (out / "notes.txt").write_text("mine")
    refused(out, f"{out} holds files the builder does not write (notes.txt); refusing to replace it (--force "
                 "replaces it anyway)", monkeypatch)
    for name in ("a.txt", "b.txt", "c.txt", "sub"):
        (out / name).mkdir() if name == "sub" else (out / name).write_text(name)
    refused(out, f"{out} holds files the builder does not write (a.txt, b.txt, c.txt and 2 more); refusing to "
                 "replace it (--force replaces it anyway)", monkeypatch)
    # a marker of no kind this writes: refused
    (tmp_path / "seed0" / checkpoint.MARKER).write_text("someone else's\n")
    refused(tmp_path / "seed0", f"{tmp_path / 'seed0'}/{checkpoint.MARKER} says neither 'built by checkpoint.py' nor "
                                "'trained by train.py'; refusing to replace the folder (--force replaces it anyway)",
            monkeypatch)


def test_builder_refuses_a_checkpoint_train_py_wrote(tmp_path, monkeypatch):
    # train.py's marker alone refuses it: its files are all names the builder writes too
    out = trained(tmp_path / "t")
    assert (out / checkpoint.MARKER).read_text().startswith("trained by train.py")
    assert all(checkpoint.BUILT_FILES.fullmatch(p.name) for p in out.iterdir() if p.name != checkpoint.MARKER)
    refused(out, f"{out} holds a checkpoint train.py trained; refusing to replace it (--force replaces it anyway)",
            monkeypatch)
    refused(out, f"{out} holds a checkpoint train.py trained; refusing to replace it (--force replaces it anyway)",
            monkeypatch, real_layers=1)                          # before minutes of drawing at real width too


def test_builder_legacy_marker_counts_as_built_only_alone(tmp_path, monkeypatch):
    # the marker of before its kinds (older builds, and train.py's folders then): replaced only while the
    # folder holds nothing but the builder's own files
    out = built(tmp_path / "old")
    (out / checkpoint.MARKER).write_text(checkpoint.LEGACY + "\n")
    (out / "train_log.json").write_text("{}")
    refused(out, f"{out} holds files the builder does not write (train_log.json); refusing to replace it (--force "
                 "replaces it anyway)", monkeypatch)
    (out / "train_log.json").unlink()
    built(out)
    assert (out / checkpoint.MARKER).read_text().startswith("built by checkpoint.py")


def shipped_copy(tmp_path, marker=None):  # a copy of the shipped trained small-v32 (optionally another marker)
    import shutil
    out = shutil.copytree(ROOT / "small-v32", tmp_path / "small-v32")
    if marker is not None:
        (out / checkpoint.MARKER).write_text(marker)
    return out


def run_builder(cwd, *args):
    return subprocess.run([sys.executable, str(ROOT / "checkpoint.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("marker, said", [
    (None, "small-v32 holds a checkpoint train.py trained; refusing to replace it (--force replaces it anyway)"),
    (checkpoint.LEGACY + "\n", "small-v32 holds files the builder does not write (train_log.json); refusing to "
                               "replace it (--force replaces it anyway)")])
def test_builder_cli_keeps_the_shipped_trained_model(tmp_path, marker, said):
    # `python checkpoint.py small-v32` once replaced the trained model with random weights and exited 0;
    # with the shipped marker (train.py's) and with the one it had before (the legacy text)
    out = shipped_copy(tmp_path, marker)
    before = tree(out)
    r = run_builder(tmp_path, "small-v32", "--no-tokenizer")
    assert (r.returncode, r.stderr.splitlines(), r.stdout) == (2, [f"error: {said}"], "")
    assert tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["small-v32"]


@pytest.mark.slow
def test_builder_cli_force_replaces_it(tmp_path):
    # the builder's tiny-v32 in its place, whole (its shards' bytes: test_bundled_checkpoint_bytes_are_the_same_everywhere)
    import hashlib
    out = shipped_copy(tmp_path)
    r = run_builder(tmp_path, "small-v32", "--no-tokenizer", "--force")
    assert r.returncode == 0, r.stderr
    assert sorted(tree(out)) == [checkpoint.MARKER, "config.json", "model-00001-of-00002.safetensors",
                                 "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert [hashlib.sha256(f.read_bytes()).hexdigest()[:24] for f in sorted(out.glob("*.safetensors"))] == [
        "9e0d2a38023c530568b23ea9", "4a78d93080839e73189b62d0"]
    assert checkpoint.made_by(out) == "built" and [p.name for p in tmp_path.iterdir()] == ["small-v32"]


def test_the_shipped_model_carries_train_pys_marker():
    assert checkpoint.made_by(ROOT / "small-v32") == "trained"


def test_builder_replaces_a_build_from_before_the_marker(tmp_path):
    # tiny-v32 folders built before the marker existed hold only the builder's own file names
    def old_build(name):
        out = built(tmp_path / name)
        (out / checkpoint.MARKER).unlink()
        return out
    old = old_build("old")
    (old / "config.json").unlink()                      # what makes setup.sh rebuild it
    built(old)
    assert (old / checkpoint.MARKER).is_file()
    for extra, text in (("README.md", "mine"), ("config.json", '{"model_type": "llama"}')):
        other = old_build(extra)                        # + a file the builder never writes, or another model
        (other / extra).write_text(text)
        with pytest.raises(FileExistsError, match="did not write"):
            checkpoint.write_checkpoint(other, {}, {})
        assert (other / extra).read_text() == text


@pytest.mark.slow
def test_builder_cli_refuses_in_one_line(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    r = run_builder(tmp_path, ".", "--no-tokenizer")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {tmp_path} is a non-empty folder that checkpoint.py did not "
                                             f"write (no {checkpoint.MARKER} in it); refusing to replace it: choose "
                                             "a new or empty folder (--force replaces it anyway)"]
    assert [p.name for p in tmp_path.iterdir()] == ["precious.txt"]
    for v4 in ([], ["--v4"]):                                         # no layers: refused before any drawing
        r = run_builder(tmp_path, "new", "--real-layers", "0", *v4)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            "error: --real-layers 0: a real-width checkpoint needs at least 1 layer"]
        assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("when", ["writing", "between the renames"])
def test_interrupted_rebuild_keeps_the_old_folder(tmp_path, monkeypatch, when):
    cfg = checkpoint.tiny_config(num_hidden_layers=1)
    out = checkpoint.write_checkpoint(tmp_path / "ck", cfg, checkpoint.random_weights(cfg, 1))
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    if when == "writing":
        monkeypatch.setattr(checkpoint, "save_safetensors", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    else:
        real, calls = checkpoint.os.replace, []

        def replace(a, b):                              # the old folder moved aside, then Ctrl-C
            calls.append(a)
            if len(calls) == 2:
                raise KeyboardInterrupt
            real(a, b)
        monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.write_checkpoint(out, cfg, checkpoint.random_weights(cfg, 2))
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]                        # no temporary folder left
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before


# -----------------------------------------------------------------------------
# dtypes checked against the format at load, as shapes are

@pytest.mark.parametrize("tensor, dtype, expected", [
    ("model.norm.weight", "I32", "F32 or BF16"),
    ("model.layers.0.self_attn.q_a_proj.weight", "U8", "F8_E4M3 or BF16"),
    ("model.layers.1.mlp.experts.3.down_proj.weight", "I8", "F8_E4M3 or BF16"),
    ("model.layers.0.self_attn.q_a_proj.weight_scale_inv", "I32", "F32"),
    ("model.embed_tokens.weight", "F16", "BF16"),
    ("model.layers.1.mlp.gate.weight", "F16", "BF16"),
    ("model.layers.0.self_attn.indexer.weights_proj.weight", "F16", "BF16"),
    ("model.layers.1.mlp.gate.e_score_correction_bias", "I32", "F32 or BF16"),
    ("model.layers.0.self_attn.indexer.k_norm.bias", "I32", "F32 or BF16"),
])
def test_dtype_that_is_not_the_formats(small, tensor, dtype, expected):
    f = shard_of(small, tensor)
    rewrite_header(f, lambda h: h[tensor].update(dtype=dtype))                  # same bytes, another type
    with pytest.raises(CheckpointError) as e:
        Transformer.from_pretrained(small)
    assert str(e.value) == f"{f}: tensor {tensor!r} is {dtype}, expected {expected}"


# -----------------------------------------------------------------------------
# Hostile headers: CheckpointError naming the file, whatever the JSON

def entry(**kw):
    return {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]} | kw


@pytest.mark.parametrize("header, message", [
    (b"[" * 100_000 + b"]" * 100_000, "header is JSON nested too deeply to read"),      # past Python's stack
    (b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 8]}}',            # 5000 digits
     r"header is JSON that cannot be read \(Exceeds the limit"),
    (json.dumps({"a": entry(dtype=["F32"])}).encode(), "unknown dtype"),
    (json.dumps({"a": entry(dtype={"F32": 1})}).encode(), "unknown dtype"),
    (json.dumps({"a": entry(shape=[True, True], data_offsets=[0, 4])}).encode(), "bad shape"),
    (json.dumps({"a": entry(shape=[0, 2 ** 64], data_offsets=[0, 0])}).encode(), "bad shape"),
    (json.dumps({"a": entry(shape=[2 ** 40] * 2, data_offsets=[0, 0])}).encode(), "bad shape"),
    (json.dumps({"a": entry(shape=[1] * 40, data_offsets=[0, 4])}).encode(), "bad shape"),
    (json.dumps({"a": entry(data_offsets=[False, 8])}).encode(), "bad data_offsets"),
    (json.dumps({"a": entry(data_offsets=[0, 8.0])}).encode(), "bad data_offsets"),
    (json.dumps({"a": "F32"}).encode(), "entry needs dtype"),
    (b"[1, 2]", "not a JSON object"),
    (b"\xff\xfe", "not valid JSON"),
    (json.dumps({"a": entry(), "b": entry(shape=[1], data_offsets=[4, 8])}).encode(),   # b inside a's bytes
     "tensors 'a' and 'b' overlap in the data"),
])
def test_hostile_header(tmp_path, header, message):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match=message) as e:
        checkpoint.read_header(f)
    assert str(e.value).startswith(f"{f}: ") and len(str(e.value)) < 300


def test_header_length_is_capped(tmp_path):
    f = tmp_path / "big.safetensors"
    with open(f, "wb") as out:                          # a sparse file: the length fits, the cap does not
        out.write(struct.pack("<Q", checkpoint.MAX_HEADER + 1))
        out.truncate(checkpoint.MAX_HEADER + 100)
    with pytest.raises(CheckpointError, match=f"{f}: header length 100000001 exceeds the 100000000-byte limit"):
        checkpoint.read_header(f)


@pytest.mark.parametrize("name, text, message", [
    ("config.json", "[]", "config.json: expected a JSON object, got an array"),
    ("config.json", "3", "config.json: expected a JSON object, got an integer"),
    ("config.json", '"x"', "config.json: expected a JSON object, got a string"),
    ("config.json", "[" * 100_000, "config.json: JSON nested too deeply to read"),
    ("config.json", "\xff", "config.json: not valid JSON"),
    ("model.safetensors.index.json", '{"weight_map": {"a": 3}}', "index.json: needs a JSON object with a weight_map"),
    ("model.safetensors.index.json", "[]", "index.json: needs a JSON object with a weight_map"),
])
def test_config_and_index_that_are_not_objects(small, name, text, message):
    (small / name).write_text(text, encoding="latin-1")
    with pytest.raises(CheckpointError, match=message):
        checkpoint.Checkpoint(small)


@pytest.mark.slow
def test_bundled_checkpoint_bytes_are_the_same_everywhere(tmp_path):
    # tiny-v32's bytes are defined by float64 draws and exactly rounded steps only (quant.round_once for
    # bf16), so any CPU and any NumPy / ml_dtypes in the allowed range writes these very bytes; the
    # goldens in goldens.json are keyed by them. (ml_dtypes 0.5's float64 -> bf16 cast, rounding twice
    # through float32, wrote other bytes.)
    import hashlib
    out = checkpoint.build_tiny(tmp_path / "tiny", tokenizer=False)
    digest = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:24] for f in sorted(out.glob("*.safetensors"))}
    assert digest == {"model-00001-of-00002.safetensors": "9e0d2a38023c530568b23ea9",
                      "model-00002-of-00002.safetensors": "4a78d93080839e73189b62d0"}


@pytest.mark.slow
def test_bundled_v4_checkpoint_bytes_are_the_same_everywhere(tmp_path):
    # tiny-v4 likewise: float64 draws, then power-of-two scalings and single roundings (bf16 by
    # quant.round_once, FP8 and FP4 by ml_dtypes' casts, float32 by IEEE); its goldens are keyed by these bytes
    import hashlib
    out = checkpoint.build_tiny(tmp_path / "tiny", tokenizer=False, v4=True)
    digest = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:24] for f in sorted(out.glob("*.safetensors"))}
    assert digest == {"model-00001-of-00002.safetensors": "3b302b0eb92b94754dcc91f0",
                      "model-00002-of-00002.safetensors": "0f662289853fd285a5cf0ace"}


def test_random_weights_report_progress_per_layer():
    # real-size builds take minutes: build_tiny prints a line per layer drawn (progress), the same draws
    cfg = checkpoint.tiny_config(num_hidden_layers=2, num_nextn_predict_layers=1)
    seen = []
    a = checkpoint.random_weights(cfg, 4, progress=lambda i, n: seen.append((i, n)))
    assert seen == [(0, 3), (1, 3), (2, 3)]
    b = checkpoint.random_weights(cfg, 4)
    assert a.keys() == b.keys() and all(np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)) for k in a)


@pytest.mark.slow
def test_real_width_v4_layers_follow_v4_flash(tmp_path, monkeypatch, capsys):
    # checkpoint.py --v4 --real-layers N: V4-Flash's schedule (SWA, SWA, then CSA and HCA alternating, hash
    # routing in the first 3) at its dimensions; here the dimensions are shrunk so that CI draws them (the
    # torch draws on the CPU, as --device cuda draws them on a GPU) and the model loads and runs
    real = checkpoint.REAL_DIMS_V4                                   # spec/v4_flash.md §1's table
    assert real == dict(hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024,
                        o_groups=8, o_lora_rank=1024, sliding_window=128, index_n_heads=64, index_head_dim=128,
                        index_topk=512, rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings":
                                                     65536, "beta_fast": 32, "beta_slow": 1},
                        max_position_embeddings=1048576, n_routed_experts=256, num_experts_per_tok=6,
                        moe_intermediate_size=2048, num_hash_layers=3)
    cfg = checkpoint.tiny_config_v4(**real)                           # and what it keeps of the tiny config
    assert (cfg["vocab_size"], cfg["hc_mult"], cfg["n_shared_experts"], cfg["compress_rope_theta"],
            cfg["routed_scaling_factor"], cfg["scoring_func"], cfg["expert_dtype"]) == (129280, 4, 1, 160000.0, 1.5,
                                                                                       "sqrtsoftplus", "fp4")
    assert checkpoint.real_ratios_v4(43)[:6] == [0, 0, 4, 128, 4, 128] and checkpoint.real_ratios_v4(43)[42:] == [4, 0]
    monkeypatch.setattr(checkpoint, "REAL_DIMS_V4", real | dict(
        hidden_size=256, num_attention_heads=4, head_dim=128, q_lora_rank=128, o_groups=2, o_lora_rank=128,
        index_n_heads=4, index_head_dim=64, index_topk=4, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, sliding_window=16))
    out = checkpoint.build_tiny(tmp_path / "v4r", tokenizer=False, real_layers=5, device="cpu", v4=True)
    assert "drawing layers [####################] 5/5" in capsys.readouterr().err        # the progress bar's end
    m = Transformer.from_pretrained(out)
    assert m.args.layer_types == ["sliding_attention"] * 2 + ["compressed_sparse_attention",
                                                              "heavily_compressed_attention"] * 1 + ["compressed_sparse_attention"]
    assert m.args.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 2 and m.args.ratio(3) == 128
    assert np.isfinite(m.forward(np.arange(6).reshape(1, 6) * 7, all_positions=True)).all()


def test_the_bundled_template_is_the_chat_modules():
    # the builder reads chat_template.jinja itself (the loader does not import chat); the same text
    import chat
    assert json.loads(checkpoint.tokenizer_files()["tokenizer_config.json"])["chat_template"] == chat.chat_template()


def test_device_without_torch_says_what_to_install(tmp_path):
    # --device draws with torch: without it, one line naming the set-up that installs it, nothing written
    from helpers import without
    r = subprocess.run([sys.executable, str(ROOT / "checkpoint.py"), str(tmp_path / "out"), "--device", "cpu"],
                       env=without(tmp_path, "torch"), capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr.splitlines()[-1:]) == (
        2, ["error: --device needs torch, which is not installed here: ./setup.sh --torch installs it"]), r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("device, said", bad_devices())
def test_device_is_checked_before_any_work(tmp_path, device, said):
    # they were tracebacks from torch (RuntimeError: Cannot get CUDA generator..., Expected one of cpu, cuda...)
    for v4 in ([], ["--v4"]):
        r = run_builder(tmp_path, "real2", "--real-layers", "2", "--device", device, *v4)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: " + said), r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("missing", ["numpy", "ml_dtypes"])
def test_a_python_without_the_packages_names_setup_sh(tmp_path, missing):
    # `python3 checkpoint.py ...` outside .venv was a ModuleNotFoundError traceback
    from helpers import missing_line, run_without
    r = run_without(tmp_path, [missing], "checkpoint.py", "out")
    assert (r.returncode, r.stderr.splitlines()) == (2, [missing_line("error: ", missing, "./setup.sh",
                                                                      "checkpoint.py")])
    assert not (tmp_path / "out").exists()
