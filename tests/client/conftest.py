from __future__ import annotations

import pytest
from fake_sidecar import FakeSidecar


@pytest.fixture(autouse=True)
def _fake_runs_no_handshake(no_secret):
    """The fake answers worker calls only: its clients hold no secret (the handshake's
    client side is tested against real sidecars in tests/security)."""


@pytest.fixture
def sidecar():
    fake = FakeSidecar()
    yield fake
    fake.close()
