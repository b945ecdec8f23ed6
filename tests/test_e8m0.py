"""V4's quantized weights as checkpoint.py reads them, against the file's raw bytes.

The test draws the codes and exponents of FP8 linears (e4m3fn, 128 x 128 blocks, `.scale` F8_E8M0) and
FP4 experts (I8, two e2m1 codes a byte, the low nibble first, `.scale` F8_E8M0 per 1 x 32), writes them
into a checkpoint folder, reads them back through `checkpoint.Checkpoint.weight` and the V4 loader
(`model_v4.load_layer`), and holds what comes back to an oracle that shares nothing with the reader:
the test parses the safetensors file itself (8-byte little-endian header length, the JSON header, its
data_offsets counted from the end of the header) and decodes every number from its bits in float64,
an E8M0 byte b as 2^(b - 127), an e4m3fn byte as (-1)^s 2^(e - 7) (1 + m/8) (2^-6 m/8 where e = 0),
an e2m1 nibble as (-1)^s 2^(e - 1) (1 + m/2) (m/2 where e = 0): neither ml_dtypes nor the reader.

The other oracle, an independent reader of the same layout end to end, is transformers' own loader,
which decodes the E8M0 scales with torch: test_v4.py's test_exact_logits_match_transformers_reading_e8m0."""
import json
import struct

import numpy as np
import pytest

import checkpoint
import model_v4
from config import V4Args

E8M0 = __import__("ml_dtypes").float8_e8m0fnu          # only to hand the writer its dtype; never to decode


def e4m3fn(b):  # uint8 codes -> float64 values, from the bits
    b = b.astype(np.int64)
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    return np.where(s == 1, -v, v)


def e2m1(n):  # 4-bit codes -> float64 values, from the bits
    n = n.astype(np.int64)
    s, e, m = n >> 3, (n >> 1) & 3, n & 1
    v = np.where(e == 0, m / 2, (1 + m / 2) * 2.0 ** (e - 1))
    return np.where(s == 1, -v, v)


def e8m0(b):  # uint8 exponent bytes -> float64 scales
    return 2.0 ** (b.astype(np.float64) - 127)


def raw_bytes(folder, name):  # (safetensors dtype, shape, bytes) of one tensor, parsed here from the file
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    data = (folder / shard).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    info = json.loads(data[8:8 + n])[name]
    begin, end = info["data_offsets"]
    return info["dtype"], tuple(info["shape"]), data[8 + n + begin:8 + n + end]


def fp8_codes(rng, rows, k):  # every e4m3fn byte but the two NaNs
    return rng.choice(np.setdiff1d(np.arange(256), [0x7F, 0xFF]), (rows, k)).astype(np.uint8)


# FP8 linears: name -> [N, K]; the last is ragged (partial blocks) and carries every extreme exponent
FP8 = {"layers.0.attn.wq_a": (128, 256), "layers.0.attn.wo_b": (256, 256), "layers.0.ffn.shared_experts.w2": (256, 128),
       "extra.ragged": (200, 300)}
FP4 = {"layers.0.ffn.experts.3.w1": (128, 256), "layers.0.ffn.experts.5.w2": (256, 128)}     # [N, K] of values
EXTREMES = np.array([[0, 1, 126], [128, 253, 254]], np.uint8)    # 2^-127 (subnormal in fp32) .. 2^127


@pytest.fixture(scope="module")
def folder(tmp_path_factory):  # -> (checkpoint folder, {tensor name: the uint8 bytes drawn})
    cfg = checkpoint.tiny_config_v4(vocab_size=64, num_hidden_layers=1, compress_ratios=[4, 0], num_hash_layers=0)
    t = checkpoint.random_weights_v4(cfg, seed=0)
    rng = np.random.default_rng(55)
    drawn = {}
    for name, (N, K) in FP8.items():
        codes = fp8_codes(rng, N, K)
        exps = EXTREMES if name == "extra.ragged" else rng.integers(96, 160, (-(-N // 128), -(-K // 128))).astype(np.uint8)
        drawn[name + ".weight"], drawn[name + ".scale"] = codes, exps
        t[name + ".weight"], t[name + ".scale"] = codes.view(checkpoint.DTYPES["F8_E4M3"]), exps.view(E8M0)
    for name, (N, K) in FP4.items():
        packed = np.resize(rng.permutation(256), (N, K // 2)).astype(np.uint8)   # every byte, both nibble orders
        exps = rng.integers(96, 160, (N, K // 32)).astype(np.uint8)
        drawn[name + ".weight"], drawn[name + ".scale"] = packed, exps
        t[name + ".weight"], t[name + ".scale"] = packed.view(np.int8), exps.view(E8M0)
    path = tmp_path_factory.mktemp("e8m0") / "ckpt"
    checkpoint.write_checkpoint(path, cfg, t)
    return path, drawn


def expected(folder, name):  # -> (scales [float64], values [float64]) decoded here from the file's bytes
    wd, wshape, wraw = raw_bytes(folder, name + ".weight")
    sd, sshape, sraw = raw_bytes(folder, name + ".scale")
    assert sd == "F8_E8M0"
    w, s = np.frombuffer(wraw, np.uint8).reshape(wshape), np.frombuffer(sraw, np.uint8).reshape(sshape)
    scale = e8m0(s)
    if wd == "I8":                                                   # FP4: [N, K/2] bytes, a scale per 1 x 32
        nib = np.stack([w & 0xF, w >> 4], -1).reshape(w.shape[0], -1)     # even k: the low nibble
        return scale, e2m1(nib) * np.repeat(scale, 32, 1)
    assert wd == "F8_E4M3"
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
    return scale, e4m3fn(w) * full


def check(W, folder, name, drawn):
    # the file holds the bytes drawn (so the oracle decodes what the test wrote), and the reader's Weight
    # holds the file's scales and values exactly
    for part in (".weight", ".scale"):
        assert np.frombuffer(raw_bytes(folder, name + part)[2], np.uint8).tobytes() == drawn[name + part].tobytes()
    scale, values = expected(folder, name)
    assert W.scale.dtype == np.float32 and W.scale.shape == scale.shape, name
    bad = np.argwhere(W.scale != scale).tolist()
    assert not len(bad), (f"{name}: scale {tuple(bad[0])} read as {W.scale[tuple(bad[0])]!r}, the file's byte "
                          f"says 2^{int(drawn[name + '.scale'][tuple(bad[0])]) - 127}")
    with np.errstate(over="ignore"):                                 # 448 x 2^127 is past float32: inf both ways
        want, got = values.astype(np.float32), W.dequant()
    assert got.dtype == np.float32 and got.shape == want.shape, name
    bad = np.argwhere(got != want).tolist()
    assert not len(bad), f"{name}: dequant {tuple(bad[0])} is {got[tuple(bad[0])]!r}, want {want[tuple(bad[0])]!r}"


@pytest.mark.parametrize("name", list(FP8) + list(FP4))
def test_reader_scales_and_values_against_the_raw_bytes(folder, name):
    path, drawn = folder
    check(checkpoint.Checkpoint(path).weight(name, model_v4.EXPERT), path, name, drawn)


def test_v4_loader_against_the_raw_bytes(folder):
    path, drawn = folder
    ck = checkpoint.Checkpoint(path)
    lw = model_v4.load_layer(ck, 0, V4Args.from_config(ck.config))
    held = {"layers.0.attn.wq_a": lw["attn"]["wq_a"], "layers.0.attn.wo_b": lw["attn"]["wo_b"],
            "layers.0.ffn.shared_experts.w2": lw["ffn"]["shared_experts"]["w2"],
            "layers.0.ffn.experts.3.w1": lw["ffn"]["experts"][3]["w1"], "layers.0.ffn.experts.5.w2": lw["ffn"]["experts"][5]["w2"]}
    for name, W in held.items():
        check(W, path, name, drawn)


def test_the_oracle_decoders():
    # the bit formulas on known values: e4m3fn's largest, smallest normal and subnormal, e2m1's eight
    # magnitudes, E8M0's bias
    assert e4m3fn(np.array([0x7E, 0xFE, 0x08, 0x01, 0x38, 0x00, 0x80], np.uint8)).tolist() == \
        [448.0, -448.0, 2.0 ** -6, 2.0 ** -9, 1.0, 0.0, 0.0]
    assert e2m1(np.arange(16)).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert e8m0(np.array([0, 126, 127, 128, 254], np.uint8)).tolist() == [2.0 ** -127, 0.5, 1.0, 2.0, 2.0 ** 127]
