"""agent/retry.py: waits double per failure in a row, jittered within the upper half, to a
cap, counted from the start of the failed try; a success starts over; the text says when
the next try is."""

import random

import pytest

from pd_transfer.agent.retry import Backoff


def test_waits_double_within_their_jitter_band_up_to_the_cap():
    backoff = Backoff(base_s=0.5, cap_s=30.0, rng=random.Random(7))
    started, ceilings = 100.0, []
    for _ in range(10):
        next_try = backoff.failed(started)
        ceiling = min(30.0, 0.5 * 2 ** (backoff.failures - 1))
        assert ceiling / 2 <= next_try - started <= ceiling
        assert backoff.next_try_s == next_try
        assert not backoff.due(next_try - 1e-6) and backoff.due(next_try)
        ceilings.append(ceiling)
        started = next_try
    assert ceilings == [0.5, 1, 2, 4, 8, 16, 30, 30, 30, 30]


def test_the_wait_runs_from_the_start_of_the_failed_try():
    backoff = Backoff(base_s=4.0, rng=random.Random(2))
    next_try = backoff.failed(10.0)  # refused at once: it waits it all
    assert backoff.wait_s(10.0) == pytest.approx(next_try - 10.0) and next_try > 10.0
    backoff.failed(20.0)  # a try of 30 s that timed out
    assert backoff.wait_s(50.0) == 0.0 and backoff.due(50.0)


def test_jitter_spreads_sidecars_that_failed_together():
    next_tries = {Backoff(rng=random.Random(seed)).failed(0.0) for seed in range(20)}
    assert len(next_tries) == 20


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
    next_try = backoff.failed(10.0)
    assert backoff.describe(10.0) == f"next try in {next_try - 10.0:.1f} s (1 failed try)"
    backoff.failed(10.0)
    assert backoff.describe(10.0).endswith("(2 failed tries)")
    assert backoff.describe(1e9).startswith("next try in 0.0 s")
