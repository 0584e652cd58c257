"""The operations runbook, by section: what the sidecar's ``/runbooks/<name>`` serves.

Each alert of ``deploy/prometheus/alerts.yml`` links to
``http://<a sidecar's HTTP address>/runbooks/<name>``, where ``<name>`` is the
anchor of a section of ``docs/operations.md`` (the heading as GitHub writes its
anchor: ``### Peer lost`` is ``peer-lost``). So a link opens wherever the
sidecars' HTTP ports can be reached, with the runbook of the version that runs.
The document ships in the wheel as ``pd_transfer/_docs/operations.md`` (the
packaging copies it from ``docs/``); from a checkout it is read in place.

A request names a section: it is looked up among the document's own headings,
never turned into a path, so nothing but the runbook can be read through it.
A section runs from its heading to the next heading of the same or a higher
level; lines inside fenced code blocks are never headings.

Pure: reads one file, imports nothing of the sidecar.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

_PACKAGE_DOC = Path(__file__).resolve().parents[1] / "_docs" / "operations.md"
_REPO_DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
NAME = re.compile(r"[a-z0-9_-]{1,100}")  # what a runbook name can look like at all


@dataclass(frozen=True)
class Section:
    name: str  # the heading's anchor
    title: str  # the heading's text
    level: int  # 1 for "#", 2 for "##" ...
    text: str  # the section's markdown, its heading first


def doc_path() -> Path | None:
    """Where the runbook is read from: the installed copy, else the checkout's."""
    for path in (_PACKAGE_DOC, _REPO_DOC):
        if path.is_file():
            return path
    return None


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens
    (``Limits and backpressure`` -> ``limits-and-backpressure``)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(markdown: str) -> dict[str, Section]:
    """Every section of ``markdown`` by anchor; a repeated anchor gets ``-1``, ``-2`` ...
    appended, as on GitHub."""
    lines = markdown.splitlines()
    headings: list[tuple[int, int, str]] = []  # (line index, level, title)
    fenced = False
    for index, line in enumerate(lines):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match:
            headings.append((index, len(match.group(1)), match.group(2)))
    found: dict[str, Section] = {}
    for position, (start, level, title) in enumerate(headings):
        end = next((i for i, lv, _ in headings[position + 1 :] if lv <= level), len(lines))
        name = base = anchor(title)
        repeats = 0
        while name in found:
            repeats += 1
            name = f"{base}-{repeats}"
        found[name] = Section(name, title, level, "\n".join(lines[start:end]).rstrip() + "\n")
    return found


@functools.cache
def runbook() -> dict[str, Section]:
    """The sections of the shipped ``operations.md`` (empty where it is not installed)."""
    path = doc_path()
    return sections(path.read_text(encoding="utf-8")) if path is not None else {}


def lookup(name: str) -> Section | None:
    """The section called ``name``; None for any name that is not one of its anchors."""
    if not NAME.fullmatch(name):
        return None
    return runbook().get(name)
