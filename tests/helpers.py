"""Comparison helpers shared by the tests."""
import os

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
        (tmp_path / "shim" / name).mkdir(parents=True)
        (tmp_path / "shim" / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    return dict(os.environ, PYTHONPATH=str(tmp_path / "shim"))
