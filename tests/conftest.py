import importlib
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_CKPT = FIXTURES / "official_v32_tiny"
FIXTURE_TRACE = FIXTURES / "official_v32_tiny_trace.npz"
FIXTURE_V4_CKPT = FIXTURES / "official_v4_tiny"
FIXTURE_V4_TRACE = FIXTURES / "official_v4_tiny_trace.npz"

try:
    import torch
    HAS_CUDA = torch.cuda.is_available()
except ImportError:                                     # the NumPy reference needs no torch
    torch, HAS_CUDA = None, False
if torch is not None and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")       # Triton kernels run on the CPU, in the interpreter


def backends():  # (backend, device) pairs every op table test runs on: the GPU too where there is one
    out = [("numpy", None)]
    if torch is not None:
        out.append(("torch", "cpu"))
    if HAS_CUDA:
        out.append(("torch", "cuda"))
    return out


gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA or ROCm GPU")

# What the suite imports (requirements-test.txt). Without one of them the modules that need it skip, so
# that the NumPy reference's tests run without torch; but in the environment setup.sh builds (.venv) and
# under TESTS_NEED_ALL=1 (.ci/gpu) a package that does not import stops the run: a broken install must
# not pass for a green suite with whole files skipped.
NEEDED = ("numpy", "ml_dtypes", "tokenizers", "safetensors", "hypothesis", "torch", "triton", "transformers",
          "jinja2", "matplotlib")


def pytest_sessionstart(session):
    in_venv = Path(sys.prefix).resolve() == (ROOT / ".venv").resolve()
    if not (in_venv or os.environ.get("TESTS_NEED_ALL") == "1"):
        return
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception as e:                           # an import error of any kind: a missing dependency too
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        raise pytest.UsageError("tests: cannot import " + "; ".join(missing)
                                + " (./setup.sh --tests installs them all)")

# Few examples per property so the whole suite stays within minutes on 2 cores; shapes and values
# are drawn, not just seeds. "ci", the default (CI and the fast loop), reports the first failing example
# as drawn, without shrinking it: shrinking replays a failing property hundreds of times, minutes through
# the interpreted kernels, for a smaller example. "dev" shrinks: HYPOTHESIS_PROFILE=dev or
# --hypothesis-profile=dev. A test's own @settings(...) overrides only the fields it names (none names
# phases), so the profile decides everywhere.
_PROFILE = dict(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target], **_PROFILE)
settings.register_profile("dev", phases=list(Phase), **_PROFILE)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def trace():
    import numpy as np
    return dict(np.load(FIXTURE_TRACE))


@pytest.fixture(scope="session")
def official_v4_ckpt():  # the tiny V4-Flash checkpoint in the official layout (tests/fixtures/README.md)
    return FIXTURE_V4_CKPT


@pytest.fixture(scope="session")
def trace_v4():  # the official V4-Flash code's trace on it: {key: array}
    import numpy as np
    return dict(np.load(FIXTURE_V4_TRACE))
