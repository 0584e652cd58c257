"""The bare-room floor (``benchmarks/room_floor.py``) that the sidecar bench prints its
1-page rooms against: a real relay process moves the room's bytes, and checks them."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from benchmarks import room_floor
from pd_transfer.memory import doorbell

pytestmark = pytest.mark.skipif(not doorbell.AVAILABLE, reason="doorbells need futexes (Linux x86-64)")


def _segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if "floor" in name}


def test_the_bare_room_moves_every_page_and_times_each_mode(tmp_path):
    before = _segments()
    times = room_floor.measure(tmp_path, rooms=6, pieces=4, pages=8, page_nbytes=8192, idle_s=0.002)
    assert len(times) == len(room_floor.MODES)
    assert all(math.isfinite(t) and t > 0 for t in times)
    assert _segments() == before  # the floor's segments are gone
    assert not list(tmp_path.iterdir())  # and its socket files


def test_the_check_refuses_a_page_copied_from_the_wrong_place():
    src = np.arange(2 * 4 * 16, dtype=np.uint8).reshape(2, 4, 16)
    dst = np.zeros_like(src)
    dst[:, 1] = src[:, 3]
    room_floor._check(src, dst, {1: 3})  # as copied: passes
    with pytest.raises(RuntimeError, match="page 1"):
        room_floor._check(src, dst, {1: 2})
    dst[0, 2, 5] = 9  # a byte landed on a page no room wrote
    with pytest.raises(RuntimeError, match="page 2"):
        room_floor._check(src, dst, {1: 3})
