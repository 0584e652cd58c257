import pytest


@pytest.fixture(autouse=True)
def _fake_pair_runs_no_handshake(no_secret):
    """The fake pair (fake_pair.py) answers worker calls only: the simulated workers hold
    no secret here (``pd-transfer demo`` runs them against real, authenticated sidecars)."""
