"""Comparison helpers shared by the tests, and ways to run the project's scripts as a user does."""
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np


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
