"""Structured logging for the sidecar: key=value or JSON lines, repeats rate-limited.

Transfer lines carry ``room`` and ``peer`` as fields (``log.warning(..., extra=
{"room": 7, "peer": "decode[pp0,tp1]"})``); both formats print them. A message
logged again and again (a peer sending bad frames, say) is let through a few
times per interval; the rest are counted and reported as one line when the
interval ends, so a misbehaving peer cannot flood the log.
"""

from __future__ import annotations

import json
import logging
import sys
import time

FIELDS = ("room", "peer")


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        parts = [
            f"ts={self.formatTime(record, '%Y-%m-%dT%H:%M:%S')}.{int(record.msecs):03d}",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"pid={record.process}",
        ]
        parts += [f"{name}={getattr(record, name)}" for name in FIELDS if hasattr(record, name)]
        parts.append(f"msg={json.dumps(record.getMessage())}")
        if record.exc_info:
            parts.append(f"exc={json.dumps(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        entry.update({name: getattr(record, name) for name in FIELDS if hasattr(record, name)})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class RepeatLimiter(logging.Filter):
    """At most ``burst`` records per (logger, format string, reason) per ``interval_s``.

    ``reason`` is a record's ``extra={"reason": code}``: a flood of one refusal
    (32 oversized headers) does not hide the first of another kind (a stream
    that is not ours at all) logged through the same call.
    """

    def __init__(self, burst: int = 5, interval_s: float = 10.0) -> None:
        super().__init__()
        self.burst, self.interval_s = burst, interval_s
        self._windows: dict[tuple[str, str, str], list] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg), str(getattr(record, "reason", "")))
        now = time.monotonic()
        window = self._windows.get(key)
        if window is None or now - window[0] > self.interval_s:
            suppressed = window[2] if window else 0
            self._windows[key] = [now, 1, 0]
            if suppressed:
                record.msg = f"{record.msg} (and {suppressed} similar messages suppressed)"
            return True
        window[1] += 1
        if window[1] <= self.burst:
            return True
        window[2] += 1
        return False


def configure_logging(level: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else KeyValueFormatter())
    handler.addFilter(RepeatLimiter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
