"""Fixtures every test directory may use."""

from __future__ import annotations

import pytest


@pytest.fixture
def owned_doorbells():
    """``make(name, slots)``: a doorbell segment this test owns, unlinked and closed after it."""
    from pd_transfer.doorbell import Doorbells
    made = []

    def make(name: str, slots: int) -> Doorbells:
        made.append(Doorbells.create(name, slots=slots))
        return made[-1]

    yield make
    for owned in made:
        owned.segment.unlink()
        owned.close()
