import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_CKPT = FIXTURES / "official_v32_tiny"
FIXTURE_TRACE = FIXTURES / "official_v32_tiny_trace.npz"

# Few examples per property so the whole suite stays within minutes on 2 cores; shapes and values
# are drawn, not just seeds.
settings.register_profile("ci", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")


@pytest.fixture(scope="session")
def trace():
    import numpy as np
    return dict(np.load(FIXTURE_TRACE))
