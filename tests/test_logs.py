"""Structured logs carry room and peer as fields; a flood of repeats is cut short."""

import json
import logging

from pd_transfer.observability.logs import JsonFormatter, KeyValueFormatter, RepeatLimiter


def _record(msg, *args, **extra):
    record = logging.LogRecord("pd_transfer.agent", logging.WARNING, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def test_key_value_lines_carry_room_and_peer():
    line = KeyValueFormatter().format(_record("room %d failed", 7, room=7, peer="decode[pp0,tp1]"))
    assert "level=warning" in line and "room=7" in line and "peer=decode[pp0,tp1]" in line
    assert 'msg="room 7 failed"' in line


def test_json_lines_are_one_object_with_the_fields():
    entry = json.loads(JsonFormatter().format(_record("lost %s", "p0", peer="prefill[pp0,tp0]")))
    assert entry["msg"] == "lost p0" and entry["peer"] == "prefill[pp0,tp0]"


def test_repeats_beyond_the_burst_are_suppressed_and_then_counted():
    limiter = RepeatLimiter(burst=3, interval_s=0.05)
    passed = [limiter.filter(_record("bad frame from %s", i)) for i in range(10)]
    assert passed == [True] * 3 + [False] * 7
    import time

    time.sleep(0.06)
    record = _record("bad frame from %s", 99)
    assert limiter.filter(record) and "(and 7 similar messages suppressed)" in record.getMessage()


def test_a_flood_of_one_reason_does_not_hide_the_first_of_another():
    limiter = RepeatLimiter(burst=3, interval_s=60)
    flood = [
        limiter.filter(_record("refused [%s]", "frame_too_large", reason="frame_too_large")) for _ in range(8)
    ]
    assert flood == [True] * 3 + [False] * 5
    assert limiter.filter(_record("refused [%s]", "bad_frame", reason="bad_frame"))
    assert not limiter.filter(_record("refused [%s]", "frame_too_large", reason="frame_too_large"))
