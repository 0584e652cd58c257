"""agent/retry.py: waits double per failure in a row, jittered within the upper half, to a
cap; a success starts over; the text says when the next try is."""

import random

import pytest

from pd_transfer.agent.retry import Backoff


def test_waits_double_within_their_jitter_band_up_to_the_cap():
    backoff = Backoff(base_s=0.5, cap_s=30.0, rng=random.Random(7))
    now, ceilings = 100.0, []
    for _ in range(10):
        wait = backoff.failed(now)
        ceiling = min(30.0, 0.5 * 2 ** (backoff.failures - 1))
        assert ceiling / 2 <= wait <= ceiling
        assert backoff.next_try_s == pytest.approx(now + wait)
        assert not backoff.due(now + wait - 1e-6) and backoff.due(now + wait)
        ceilings.append(ceiling)
        now += wait
    assert ceilings == [0.5, 1, 2, 4, 8, 16, 30, 30, 30, 30]


def test_jitter_spreads_sidecars_that_failed_together():
    waits = {Backoff(rng=random.Random(seed)).failed(0.0) for seed in range(20)}
    assert len(waits) == 20


def test_a_success_starts_over():
    backoff = Backoff(rng=random.Random(1))
    for _ in range(5):
        backoff.failed(0.0, "rejected")
    backoff.succeeded()
    assert backoff.failures == 0 and backoff.due(0.0)
    assert backoff.failed(0.0) <= 0.5


def test_the_same_error_again_is_marked_so_it_can_be_logged_quietly():
    backoff = Backoff(rng=random.Random(1))
    backoff.failed(0.0, "rejected: dtype")
    assert not backoff.same_error
    backoff.failed(1.0, "rejected: dtype")
    assert backoff.same_error
    backoff.failed(2.0, "no answer")
    assert not backoff.same_error


def test_describe_says_when_the_next_try_is():
    backoff = Backoff(base_s=4.0, rng=random.Random(3))
    wait = backoff.failed(10.0)
    assert backoff.describe(10.0) == f"next try in {wait:.1f} s (1 failed try)"
    backoff.failed(10.0)
    assert backoff.describe(10.0).endswith("(2 failed tries)")
    assert backoff.describe(1e9).startswith("next try in 0.0 s")
