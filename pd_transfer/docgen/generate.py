"""Docs generated from the code, so the tables in ``docs/`` cannot drift from it.

Each table is rendered from the data the code itself runs on: the message
schema (:data:`pd_transfer.protocol.schema.RECORDS`), the session transition
table, the room status table, the freshness rules, the reason codes, the
Prometheus metrics, the sidecar config record and the worker API. Meanings
come from the code's own comments and help texts, never from a copy here.

A doc marks where a table goes::

    <!-- BEGIN GENERATED: transitions -->
    (anything here is replaced)
    <!-- END GENERATED: transitions -->

    python -m pd_transfer.docgen.generate          rewrite every generated block
    python -m pd_transfer.docgen.generate --check  print the diff and exit 1 if a doc is stale

A top-level tool: it may import every layer, and runs no I/O but reading and
writing the docs.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

from pd_transfer.docgen.fields import describe_kind, field_table, nested_records
from pd_transfer.docgen.markdown import github_anchor, markdown_table, readable_number, source_comments
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol.generations import FRESHNESS_RULES, Freshness, Handling
from pd_transfer.protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION
from pd_transfer.protocol.rank_table import BOOTSTRAP_MESSAGE_TYPES
from pd_transfer.protocol.room_status import ROOM_TRANSITIONS, TERMINAL_STATUSES, RoomStatus
from pd_transfer.protocol.schema import RECORDS
from pd_transfer.protocol.transitions import TERMINAL_STATES, TRANSITIONS, SessionState, Trigger
from pd_transfer.wire import limits as wire_limits
from pd_transfer.wire.limits import Limits

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(r"<!-- BEGIN GENERATED: ([\w-]+) -->\n.*?<!-- END GENERATED: \1 -->", re.DOTALL)

#: who sends each bootstrap message (they are outside the session table)
BOOTSTRAP_SENDERS = {
    "announce": "each prefill rank's sidecar -> prefill rank 0's bootstrap",
    "table_request": "decode sidecars (and prefill ranks, after announcing) -> the bootstrap",
    "rank_table": "the bootstrap -> whoever asked (reply to announce or table_request)",
}


# -- protocol tables --------------------------------------------------------------------


def _senders(tag: str) -> str:
    # a message fires the trigger of its tag; Verdict fires verdict_accepted or verdict_rejected
    triggers = {t for t in Trigger if t.value == tag} or {t for t in Trigger if t.value.startswith(tag + "_")}
    roles = {role for (_, role, trigger) in TRANSITIONS if trigger in triggers}
    return "either" if len(roles) == 2 else ", ".join(r.value for r in Role if r in roles)


def render_messages() -> str:
    rows = [
        (f"`{tag}`", f"[{t.cls.__name__}](#{github_anchor(t.cls.__name__)})", _senders(tag), t.description)
        for tag, t in MESSAGE_TYPES.items()
    ]
    return markdown_table(("Tag `t`", "Message", "Sent by", "Meaning"), rows)


def render_bootstrap_messages() -> str:
    missing = set(BOOTSTRAP_MESSAGE_TYPES) - set(BOOTSTRAP_SENDERS)
    if missing:
        raise KeyError(f"docgen.BOOTSTRAP_SENDERS lacks {sorted(missing)}")
    rows = [
        (
            f"`{tag}`",
            f"[{t.cls.__name__}](#{github_anchor(t.cls.__name__)})",
            BOOTSTRAP_SENDERS[tag],
            t.description,
        )
        for tag, t in BOOTSTRAP_MESSAGE_TYPES.items()
    ]
    return markdown_table(("Tag `t`", "Message", "From -> to", "Meaning"), rows)


def render_message_fields() -> str:
    """A field table per message, then one per record those messages contain."""
    parts, records, seen = [], [], set()
    for cls, record in RECORDS.items():
        parts.append(f'#### {cls.__name__}\n\n`t = "{cls.TAG}"`\n\n{field_table(record)}')
        records += [r for f in record.fields for r in nested_records(f.kind)]
    while records:
        record = records.pop(0)
        if record.cls in seen:
            continue
        seen.add(record.cls)
        parts.append(f"#### {record.cls.__name__}\n\n{field_table(record)}")
        records += [r for f in record.fields for r in nested_records(f.kind)]
    return "\n\n".join(parts)


def render_session_states() -> str:
    comments = source_comments(SessionState)
    rows = [
        (f"`{s.value}`", comments.get(s.name, ""), "yes" if s in TERMINAL_STATES else "")
        for s in SessionState
    ]
    return markdown_table(("State", "Meaning", "Terminal"), rows)


def render_transitions() -> str:
    """One row per (state, trigger, next state); ``either`` when both roles may send it."""
    merged: dict[tuple[SessionState, Trigger, SessionState], set[Role]] = {}
    for (state, role, trigger), next_state in TRANSITIONS.items():
        merged.setdefault((state, trigger, next_state), set()).add(role)
    states, triggers = list(SessionState), list(Trigger)
    rows = []
    for (state, trigger, next_state), roles in sorted(
        merged.items(), key=lambda item: (states.index(item[0][0]), triggers.index(item[0][1]))
    ):
        sender = "either" if len(roles) == 2 else next(iter(roles)).value
        rows.append((f"`{state.value}`", sender, f"`{trigger.value}`", f"`{next_state.value}`"))
    return markdown_table(("State", "Sender", "Trigger", "Next state"), rows)


def render_room_status() -> str:
    comments = source_comments(RoomStatus)
    rows = [
        (
            f"`{s.value}`",
            comments.get(s.name, ""),
            ", ".join(f"`{n.value}`" for n in RoomStatus if n in ROOM_TRANSITIONS[s])
            or ("terminal" if s in TERMINAL_STATUSES else ""),
        )
        for s in RoomStatus
    ]
    return markdown_table(("Status", "Meaning", "May move to"), rows)


def render_freshness() -> str:
    meaning, handling = source_comments(Freshness), source_comments(Handling)
    rows = []
    for freshness in Freshness:
        how, reason = FRESHNESS_RULES[freshness]
        rows.append(
            (
                f"`{freshness.value}`",
                meaning.get(freshness.name, ""),
                f"`{how.value}`: {handling.get(how.name, '')}",
                f"`{reason.value}`" if reason else "-",
            )
        )
    return markdown_table(("Freshness", "The room message is", "Receiving session does", "Reason"), rows)


def render_limits() -> str:
    rows = [
        (
            f"`{f.name}`",
            readable_number(cast(float, f.default))  # every limit has a number as its default
            + ("" if readable_number(cast(float, f.default)) == str(f.default) else f" ({f.default})"),
        )
        for f in dataclasses.fields(Limits)
    ]
    rows.append(("protocol version", ".".join(map(str, PROTOCOL_VERSION))))
    return markdown_table(("Limit", "Default"), rows)


def _commented_constants(module) -> Iterator[tuple[str, str]]:
    """``(name, why)`` of each module-level constant, ``why`` from the ``#:`` lines above it
    (one comment serves the assignments that follow it without a blank line)."""
    why, collecting = "", False
    for line in inspect.getsource(module).splitlines():
        if line.startswith("#:"):
            why = f"{why} {line[2:].strip()}" if collecting else line[2:].strip()
            collecting = True
            continue
        collecting = False
        match = re.match(r"^([A-Z][A-Z0-9_]+)(?::[^=]*)? = ", line)
        if match:
            yield match.group(1), why
        elif not line.startswith((" ", ")")):  # a blank line or another statement ends its reach
            why = ""


def render_wire_limits() -> str:
    """Every named cap of :mod:`pd_transfer.wire.limits`, with why it is that value."""
    rows, seen_why = [], ""
    for name, why in _commented_constants(wire_limits):
        value = getattr(wire_limits, name)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        rows.append((f"`{name}`", readable_number(value), "" if why == seen_why else why))
        seen_why = why
    framings = [
        (
            f"`{name}`",
            readable_number(lim.max_frame_nbytes),
            readable_number(lim.max_str_len),
            readable_number(lim.max_list_len),
            readable_number(lim.max_map_len),
            str(lim.max_depth),
        )
        for name, lim in wire_limits.FRAMINGS.items()
    ]
    return (
        markdown_table(("Cap", "Value", "Why"), rows)
        + "\n\n"
        + markdown_table(("Framing", "Frame bytes", "String", "List", "Map", "Depth"), framings)
    )


def render_worker_ops() -> str:
    from pd_transfer.protocol import worker_api

    rows = []
    for op in worker_api.WorkerOp:
        required = ", ".join(f"`{f.name}` ({describe_kind(f.kind)})" for f in worker_api._REQUIRED[op])
        rows.append((f"`{op.value}`", required or "-"))
    return markdown_table(("Op", "Required fields besides `op` and `id`"), rows)


# -- errors, metrics, configuration --------------------------------------------------------


def render_reason_codes() -> str:
    notes = source_comments(Reason)
    rows = [(f"[`{r.value}`](#{github_anchor(r.value)})", notes.get(r.name, "")) for r in Reason]
    return markdown_table(("Code", "Note in `errors.py`"), rows)


def render_metrics() -> str:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from pd_transfer.observability.metrics import SidecarMetrics

    metrics = SidecarMetrics(CollectorRegistry(), "prefill")
    rows = []
    for wrapper in vars(metrics).values():
        if not isinstance(wrapper, MetricWrapperBase):
            continue
        family = next(iter(wrapper.describe()))
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = ", ".join(f"`{label}`" for label in wrapper._labelnames) or "-"
        rows.append((f"`{name}`", family.type, labels, family.documentation))
    return markdown_table(("Metric", "Type", "Labels", "Help"), rows)


def render_sidecar_config() -> str:
    from pd_transfer.config import sidecar as config
    from pd_transfer.config.serve_flags import SERVE_FLAGS

    env_prefix = getattr(config, "ENV_PREFIX", "")
    flags = {entry.field: entry for entry in SERVE_FLAGS}
    comments = source_comments(config.SidecarConfig)
    rows = []
    for f in dataclasses.fields(config.SidecarConfig):
        flag = flags.get(f.name)
        if f.default is not dataclasses.MISSING:
            default = f"`{json.dumps(f.default)}`"
        elif f.default_factory is not dataclasses.MISSING:
            factory: Callable[[], object] = f.default_factory
            default = f"`{factory.__name__}()`"
        else:
            default = "required"
        meaning = (
            (flag.help + (f" (default: {flag.default_note})" if flag.default_note else "") if flag else "")
            or comments.get(f.name)
            or "-"
        )
        row: tuple[str, ...] = (f"`{f.name}`", default, f"`{flag.name}`" if flag else "-")
        if env_prefix:
            row += (f"`{env_prefix}{f.name.upper()}`",)
        rows.append(row + (meaning,))
    header = ("Key in `[sidecar]`", "Default", "Flag") + (("Variable",) if env_prefix else ())
    return markdown_table(header + ("Meaning",), rows)


# -- the docs ------------------------------------------------------------------------------

Renderer = Callable[[], str]

BLOCKS: dict[str, dict[str, Renderer]] = {
    "protocol.md": {
        "messages": render_messages,
        "bootstrap-messages": render_bootstrap_messages,
        "message-fields": render_message_fields,
        "session-states": render_session_states,
        "transitions": render_transitions,
        "room-status": render_room_status,
        "freshness": render_freshness,
        "limits": render_limits,
        "wire-limits": render_wire_limits,
        "worker-ops": render_worker_ops,
    },
    "errors.md": {"reason-codes": render_reason_codes},
    "operations.md": {"metrics": render_metrics, "sidecar-config": render_sidecar_config},
}


def fill(text: str, renderers: dict[str, Renderer], where: str) -> str:
    """``text`` with every generated block re-rendered; every renderer must have its block."""
    found = _BLOCK.findall(text)
    unknown = sorted(set(found) - set(renderers))
    missing = sorted(set(renderers) - set(found))
    if unknown or missing:
        raise ValueError(f"{where}: unknown generated block(s) {unknown}, missing {missing}")

    def replace(match: re.Match) -> str:
        name = match.group(1)
        return (
            f"<!-- BEGIN GENERATED: {name} -->\n<!-- by `python -m pd_transfer.docgen.generate`; "
            f"edit the code, not this block -->\n\n{renderers[name]().strip()}\n\n"
            f"<!-- END GENERATED: {name} -->"
        )

    return _BLOCK.sub(replace, text)


def generate(docs_dir: Path = DOCS_DIR) -> dict[Path, tuple[str, str]]:
    """``path -> (current text, generated text)`` for every doc with generated blocks."""
    result = {}
    for name, renderers in BLOCKS.items():
        path = docs_dir / name
        current = path.read_text(encoding="utf-8")
        result[path] = (current, fill(current, renderers, str(path)))
    return result


def check(docs_dir: Path = DOCS_DIR) -> str:
    """The unified diff between the docs and what the code generates ('' when in sync)."""
    diff: list[str] = []
    for path, (current, generated) in generate(docs_dir).items():
        diff += difflib.unified_diff(
            current.splitlines(keepends=True),
            generated.splitlines(keepends=True),
            f"{path} (on disk)",
            f"{path} (from the code)",
        )
    return "".join(diff)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pd_transfer.docgen.generate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a doc differs from the code")
    parser.add_argument("--docs", type=Path, default=DOCS_DIR, help=f"docs directory ({DOCS_DIR})")
    args = parser.parse_args(argv)
    if args.check:
        diff = check(args.docs)
        if diff:
            sys.stdout.write(diff)
            print("docs are stale: run `python -m pd_transfer.docgen.generate`", file=sys.stderr)
            return 1
        return 0
    for path, (current, generated) in generate(args.docs).items():
        if generated != current:
            path.write_text(generated, encoding="utf-8")
            print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
