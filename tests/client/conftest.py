from __future__ import annotations

import pytest
from fake_sidecar import FakeSidecar


@pytest.fixture
def sidecar():
    fake = FakeSidecar()
    yield fake
    fake.close()
