"""generate.py --verify (verify.py): the fixed-token check runs on any platform and catches a model that
is slightly wrong, the bit-level goldens are compared only under their bits key, --record-golden FILE
writes FILE alone, and a PASS always means something was compared."""
import hashlib
import io
import json
import subprocess
import sys

import numpy as np
import pytest

import checkpoint
import ops
import verify
from conftest import ROOT, gpu

TINY_V32 = "dbfbc62aac468e20"          # tiny-v32's fingerprint, as goldens.json records it (name "tiny-v32")

# One RMSNorm's weights off by 1e-4 (in every layer): tiny-v32's exact logits move by ~2.5e-4 relative,
# the greedy tokens stay; the fixed-token check (tolerance 1e-5) must see it.
PERTURB = """
import runpy, sys
import numpy as np
sys.path.insert(0, {root!r})
import ops
real = ops.NUMPY_OPS.rms_norm
object.__setattr__(ops.NUMPY_OPS, "rms_norm", lambda x, w, eps, rnd: real(x, w * np.float32(1 + 1e-4), eps, rnd))
sys.argv = ["generate.py", *sys.argv[1:]]
runpy.run_path({generate!r}, run_name="__main__")
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):     # setup.sh's tiny-v32, built again (deterministic bytes: the same fingerprint)
    return checkpoint.build_tiny(tmp_path_factory.mktemp("tiny") / "tiny-v32")


@pytest.fixture
def norm_off_by_1e4():          # the same perturbation, in this process
    real = ops.NUMPY_OPS.rms_norm
    object.__setattr__(ops.NUMPY_OPS, "rms_norm", lambda x, w, eps, rnd: real(x, w * np.float32(1 + 1e-4), eps, rnd))
    yield
    object.__setattr__(ops.NUMPY_OPS, "rms_norm", real)


def cli(*args, script=ROOT / "generate.py"):  # as a user runs it
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def run_verify(ckpt, goldens, backend="numpy", numerics="official", **kw):
    out = io.StringIO()
    verdict = verify.verify(ckpt, backend, None, numerics, out=out, goldens_path=goldens, **kw)
    return verdict, out.getvalue()


def fixed_line(text):  # the result line of comparison 2
    return text.split("2. fixed tokens", 1)[1].splitlines()[1]


@pytest.mark.slow
def test_the_default_numpy_setup_compares_and_passes(tiny):
    # what a new user runs after ./setup.sh (NumPy only), on any machine: a real comparison, exit 0
    r = cli("--ckpt", tiny, "--verify")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"({TINY_V32}, recorded as tiny-v32): backend numpy" in r.stdout
    assert "16/16 recorded greedy tokens hold" in fixed_line(r.stdout) and "VERIFY PASS" in r.stdout
    assert "NOTHING" not in r.stdout
    here = r.stdout.split("bits key here: ", 1)[1].splitlines()[0]
    if here in verify.load_goldens(verify.GOLDENS)[TINY_V32]["bits"]:   # the platforms the goldens come from
        assert "logits hash matches (8a0e9ce39624c493 vs 8a0e9ce39624c493)" in r.stdout
        assert "(2 comparisons)" in r.stdout
    else:                                                              # elsewhere: listed, not a FAIL
        assert "no golden under this bits key (not compared)" in r.stdout and "(1 comparison)" in r.stdout


@pytest.mark.slow
def test_a_slightly_wrong_model_fails_the_fixed_check(tiny, tmp_path):
    launcher = tmp_path / "perturbed.py"
    launcher.write_text(PERTURB.format(root=str(ROOT), generate=str(ROOT / "generate.py")))
    r = cli("--ckpt", tiny, "--verify", script=launcher)
    assert r.returncode == 1 and "VERIFY FAIL" in r.stdout, r.stdout + r.stderr
    line = fixed_line(r.stdout)
    assert "16/16 recorded greedy tokens hold (16 the top one)" in line and "<-- beyond tolerance" in line
    err = float(line.split("max rel. error ")[1].split()[0])
    assert 1e-5 < err < 1e-3                                  # slightly beyond float rounding, caught


def bits_elsewhere(tmp_path):  # goldens.json with tiny-v32's bit-level goldens under a key no platform has
    g = verify.load_goldens(verify.GOLDENS)
    g[TINY_V32]["bits"] = {"numpy 1.0 SSE2, another BLAS Pentium, ml_dtypes 0.1":
                           {c: v for combos in g[TINY_V32]["bits"].values() for c, v in combos.items()}}
    path = tmp_path / "goldens.json"
    verify.save_goldens(path, g)
    return path


@pytest.mark.slow
def test_a_golden_under_another_bits_key_is_listed_and_the_fixed_check_still_runs(tiny, tmp_path, norm_off_by_1e4):
    goldens = bits_elsewhere(tmp_path)
    verdict, text = run_verify(tiny, goldens)                 # perturbed: the fixed check alone must fail it
    assert verdict == verify.FAIL and "(1 comparison)" in text and "<-- beyond tolerance" in fixed_line(text)
    assert "no golden under this bits key (not compared); recorded under 1 other:" in text
    assert "   numpy 1.0 SSE2, another BLAS Pentium, ml_dtypes 0.1\n" in text


def test_a_golden_under_another_bits_key_is_not_a_fail(tiny, tmp_path):
    verdict, text = run_verify(tiny, bits_elsewhere(tmp_path))
    assert verdict == verify.PASS and "(1 comparison)" in text and "logits hash" not in text
    assert "16/16 recorded greedy tokens hold" in fixed_line(text)


@pytest.mark.slow
def test_record_golden_writes_its_file_and_leaves_goldens_json_alone(tiny, tmp_path):
    before = hashlib.sha256(verify.GOLDENS.read_bytes()).hexdigest()
    out = tmp_path / "mine.json"
    r = cli("--ckpt", tiny, "--verify", "--record-golden", out)
    assert r.returncode == 0 and f"recorded in {out}" in r.stdout, r.stdout + r.stderr
    r = cli("--ckpt", tiny, "--verify", "--numerics", "exact", "--record-golden", out)     # updates it
    assert r.returncode == 0, r.stdout + r.stderr
    assert hashlib.sha256(verify.GOLDENS.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json"]                    # no temporary left
    mine = json.loads(out.read_text())
    assert mine["format"] == 2 and set(mine["checkpoints"]) == {TINY_V32}
    entry = mine["checkpoints"][TINY_V32]
    (key, combos), = entry["bits"].items()
    assert key == r.stdout.split("bits key here: ", 1)[1].splitlines()[0]
    assert set(combos) == {"numpy/official/all", "numpy/exact/all"} and set(entry["fixed"]) == {"exact/all"}
    committed = verify.load_goldens(verify.GOLDENS)[TINY_V32]["fixed"]["exact/all"]
    assert entry["fixed"]["exact/all"]["greedy"] == committed["greedy"]      # the greedy tokens hold here


@pytest.mark.slow
def test_record_golden_refuses_the_tracked_goldens_json(tmp_path):
    # `--record-golden goldens.json` (from the repository) wrote into the tracked file: refused in one line before
    # the model loads, by any name of that file; every byte kept
    before = verify.GOLDENS.read_bytes()
    (tmp_path / "link.json").symlink_to(verify.GOLDENS)
    for name in ("goldens.json", verify.GOLDENS, tmp_path / "link.json", tmp_path / ".." / tmp_path.name / "link.json"):
        r = cli("--ckpt", ROOT / "small-v32", "--verify", "--record-golden", name)
        assert (r.returncode, r.stdout, r.stderr.splitlines()) == (2, "", [
            f"error: --record-golden {name}: that is the tracked goldens.json, which --verify only reads; record "
            "into another file (a maintainer merges it)"]), r.stderr
    with pytest.raises(ValueError, match="that is the tracked goldens.json"):         # the Python API too
        verify.verify(ROOT / "small-v32", "numpy", record=verify.GOLDENS)
    assert verify.GOLDENS.read_bytes() == before and not list(ROOT.glob("goldens.json.tmp"))


@pytest.mark.slow
def test_nothing_compared_is_no_pass_and_goldens_are_per_bits_key(tiny, tmp_path):
    goldens, mine = tmp_path / "goldens.json", tmp_path / "mine.json"
    verdict, text = run_verify(tiny, goldens, numerics="exact", layers=1)   # no record: nothing applies
    assert verdict == verify.NOTHING and "VERIFY NOTHING COMPARED" in text and "PASS" not in text
    assert "no exact/1 record for this checkpoint (not compared)" in text
    verdict, text = run_verify(tiny, goldens, numerics="exact", layers=1, record=mine)
    assert verdict == verify.NOTHING and f"recorded in {mine}" in text and not goldens.exists()
    verdict, text = run_verify(tiny, mine, numerics="exact", layers=1)
    assert verdict == verify.PASS and "(2 comparisons)" in text and "greedy tokens match, logits hash matches" in text
    g = json.loads(mine.read_text())
    entry = g["checkpoints"][TINY_V32]
    (where, combos), = entry["bits"].items()
    assert where == verify.platform_id("numpy", None) and set(combos) == {"numpy/exact/1"}
    assert "cores" not in where and "family" not in where and np.__version__ in where    # bits, not the CPU's name

    combos["numpy/exact/1"]["logits_bf16"] = "0" * 16                     # a bits golden this run does not reproduce
    mine.write_text(json.dumps(g))
    verdict, text = run_verify(tiny, mine, numerics="exact", layers=1)
    assert verdict == verify.FAIL and "logits hash DIFFERS" in text and "VERIFY FAIL" in text

    old_form = {TINY_V32: {"another CPU, 64 cores": combos}}             # the earlier file form still reads
    mine.write_text(json.dumps(old_form))
    verdict, text = run_verify(tiny, mine, numerics="exact", layers=1)
    assert verdict == verify.NOTHING and "recorded under 1 other:\n   another CPU, 64 cores\n" in text


def test_a_tampered_fixed_record_fails(tiny, tmp_path):
    g = verify.load_goldens(verify.GOLDENS)
    top = g[TINY_V32]["fixed"]["exact/all"]["top_logits"]
    top[5][2] *= 1 + 3e-5                                     # one recorded logit moved by 3x the tolerance
    path = tmp_path / "goldens.json"
    verify.save_goldens(path, g)
    verdict, text = run_verify(tiny, path)
    assert verdict == verify.FAIL and "<-- beyond tolerance" in fixed_line(text)


@pytest.mark.slow
def test_verify_layers_must_be_within_the_model(tiny, tmp_path):
    r = cli("--ckpt", tiny, "--verify", "--verify-layers", "99")
    assert "--verify-layers 99: " in r.stderr and "has 4 layers, so N must be 1..4" in r.stderr and r.returncode == 2
    assert "Traceback" not in r.stderr
    for flags, what in ((["--verify-layers", "2"], "--verify-layers"),
                        (["--record-golden", tmp_path / "g.json"], "--record-golden")):
        r = cli("--ckpt", tiny, "--prompt", "hi", *flags)
        assert r.returncode == 2 and f"error: {what} needs --verify" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "g.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_torch_passes_against_the_reference_and_the_fixed_tokens(tiny, device):
    pytest.importorskip("torch")
    r = cli("--ckpt", tiny, "--verify", "--backend", "torch", "--device", device)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"1. torch on {device} against the NumPy reference" in r.stdout and r.stdout.count(" | ") >= 8
    assert "16/16 recorded greedy tokens hold" in fixed_line(r.stdout) and "VERIFY PASS" in r.stdout
    here = r.stdout.split("bits key here: ", 1)[1].splitlines()[0]       # as the CLI runs (1 torch thread on the CPU)
    if "torch/official/all" in verify.load_goldens(verify.GOLDENS)[TINY_V32]["bits"].get(here, {}):
        assert "greedy tokens match, logits hash matches" in r.stdout and "(3 comparisons)" in r.stdout
    else:
        assert "no golden under this bits key" in r.stdout and "(2 comparisons)" in r.stdout


@pytest.mark.slow
def test_verify_catches_the_old_indexer_rope(tiny, monkeypatch):
    # REF-old's bug: interleaved RoPE in the indexer. The torch path with that bug must fail --verify.
    pytest.importorskip("torch")
    import dataclasses
    import backend_torch
    real = backend_torch.torch_ops

    def buggy(device):
        ops = real(device)
        return dataclasses.replace(ops, rope_half_split=ops.rope_interleaved)

    monkeypatch.setattr(backend_torch, "torch_ops", buggy)
    out = io.StringIO()
    assert verify.verify(tiny, "torch", "cpu", "exact", out=out) == verify.FAIL
    assert "beyond tolerance" in out.getvalue() and "VERIFY FAIL" in out.getvalue()
