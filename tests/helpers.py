"""Comparison helpers shared by the tests, and ways to run the project's scripts as a user does."""
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from conftest import HAS_CUDA


def bf16_ulp(x):  # spacing of bfloat16 at |x| (8 significant bits); the smallest normal spacing at 0
    x = np.abs(np.asarray(x, np.float64))
    e = np.floor(np.log2(np.where(x > 0, x, 2.0 ** -126)))
    return 2.0 ** (np.maximum(e, -126) - 7)


def assert_bf16_close(got, ref, ulps=1, what=""):
    """Every element within `ulps` bf16 steps of the reference (steps taken at the larger magnitude)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    tol = ulps * bf16_ulp(np.maximum(np.abs(got), np.abs(ref)))
    bad = np.abs(got - ref) > tol
    if bad.any():
        i = np.unravel_index(np.argmax(np.abs(got - ref) / tol), got.shape)
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} beyond {ulps} bf16 ulp; worst at {i}: "
                             f"{got[i]} vs {ref[i]}")


def rel_err(a, b):  # max|a - b| / max|b|, the project's relative error
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def without(tmp_path, *names):  # an environment in which these packages do not import (shadowed on PYTHONPATH)
    for name in names:
        (tmp_path / "shim" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "shim" / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    return dict(os.environ, PYTHONPATH=str(tmp_path / "shim"))


ROOT = Path(__file__).resolve().parent.parent


def missing_line(prefix, name, setup, script):  # what a script says, one line, when a package of its set-up is missing
    return (f"{prefix}{name} is not installed in this Python ({sys.executable}): run {setup}, then "
            f".venv/bin/python {script}")


def run_without(tmp_path, names, script, *args):  # the project's `script` as a user runs it, these packages hidden
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=tmp_path,
                          env=without(tmp_path, *names), capture_output=True, text=True, timeout=120)


def interrupt(args, ready, stream="stderr", cwd=None, timeout=120):
    """Run the command `args` until a line of its `stream` starts with `ready`, then send it SIGINT (Ctrl-C)
    -> (exit status, the lines of stderr that came after). Killed once `timeout` seconds have passed (the wait
    for `ready` then fails)."""
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=cwd, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # (SIGINT as a terminal delivers it, even where the suite runs in the background: a shell starts background
    # jobs with SIGINT ignored, and a child inherits that)
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    try:
        seen = []
        while not (seen and seen[-1].startswith(ready)):
            seen.append(getattr(p, stream).readline())
            assert seen[-1], f"ended (or killed after {timeout} s) before {ready!r}: {seen}"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate()
    finally:
        timer.cancel()
        p.kill()
    return p.returncode, err.splitlines()


def bad_devices():  # pytest params (--device value, the start of the one line refusing it), for check_device's users
    import pytest
    import torch
    return [("bogus", "--device bogus: expected cpu, cuda or cuda:N"),
            ("cuda:99", "--device cuda:99: "),                          # no GPU here, or fewer than 100
            pytest.param("cuda", "--device cuda: no GPU is visible here (use --device cpu)",
                         marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here"))]


# the kernel tests' (test_kernels_*.py) device and FP8 comparisons
DEV = "cuda" if HAS_CUDA else "cpu"
INTERPRETED = not HAS_CUDA      # the Triton kernels in the CPU interpreter (TRITON_INTERPRET=1, conftest.py)


def t8(a, dtype=None):  # ml_dtypes FP8 array -> torch FP8 tensor (float8_e4m3fn unless dtype) on DEV
    import torch
    return torch.from_numpy(np.array(a.view(np.uint8))).view(dtype or torch.float8_e4m3fn).to(DEV)


def assert_fp8_gemm_close(got, ref, a, sa, b, sb):  # a kernel's fp32 [M, N] against quant.fp8_gemm's
    """Each output within a fraction of its sum of absolute products, Σ_k |a_k b_k| times the scales (the
    result itself can be far smaller where the terms cancel): 2^-10 on a GPU, 2^-18 in the interpreter.
    On the H200 the 64- and 128-row tiles run Hopper's fp8 wgmma, which adds a 128-term block keeping
    about 13 bits below its largest term and drops the rest: 2^16 + 127 x 2^0 comes back 2^16, and
    2^8 + 127 x 2^-4 whole (the 16- and 32-row tiles' mma keeps all of both). Truncated, the errors do not
    average out: at most 2^-11.6 of the sum over 300 drawn GEMMs (2026-12-03). In the interpreter the products are
    exact and only the fp32 sums round (128 additions at 2^-24: 2^-17 at worst; measured 2^-24)."""
    import quant
    bound = 2.0 ** -10 if not INTERPRETED else 2.0 ** -18
    rel = np.abs(got - ref) / np.maximum(quant.fp8_gemm(np.abs(a), sa, np.abs(b), sb), np.finfo(np.float32).tiny)
    assert rel.max() <= bound, f"an output {rel.max():.3g} of its sum of absolute products off (bound {bound:.3g})"


def assert_codes(got, want, what, rate=0.1):
    """FP8 codes equal on a GPU. Under the interpreter, whose fp32->fp8 cast is defective (spec/kernels.md
    §4.3; seen here: a lost mantissa carry turns 2^k into 2^(k-1), ties go away from even, subnormals
    truncate), a code may be one e4m3 step off, or half the reference where that is a power of two; at
    most `rate` of them (bf16 values hit e4m3's ties one time in sixteen: more there)."""
    import torch
    if not INTERPRETED:
        np.testing.assert_array_equal(got.view(torch.uint8).cpu().numpy(), want.view(np.uint8), err_msg=what)
        return
    g, w = got.float().cpu().numpy().astype(np.float64), want.astype(np.float64)
    bad = g != w
    g, w = g[bad], w[bad]
    big = np.maximum(np.abs(g), np.abs(w))
    step = np.maximum(np.exp2(np.floor(np.log2(big)) - 3), 2.0 ** -9)       # one e4m3 step (subnormal: 2^-9)
    pow2 = np.exp2(np.round(np.log2(np.abs(w)))) == np.abs(w)
    ok = (np.abs(g - w) <= step) | (pow2 & (g == w / 2))
    assert ok.all(), f"{what}: differences beyond the interpreter's defects: {list(zip(g[~ok], w[~ok]))[:5]}"
    assert bad.mean() <= rate, f"{what}: {bad.mean():.1%} of the codes differ"
