"""The runbook served at /runbooks/ (pd_transfer/observability/runbooks.py): sections by their headings'
GitHub anchors, each up to the next heading of its level or above; headings inside code
blocks are not sections; only those anchors are names."""

import tomllib
from pathlib import Path

from pd_transfer.observability import runbooks

DOC = """# Operations

Intro.

## Top failures

### Peer lost

A peer went silent.

```toml
# not a heading: a comment in a code block
[sidecar]
```

### Bad frames (`bad_frame`)

Garbage.

## Metrics

Counters.

## Metrics
"""


def test_sections_run_to_the_next_heading_of_their_level_or_above():
    found = runbooks.sections(DOC)
    assert list(found) == [
        "operations",
        "top-failures",
        "peer-lost",
        "bad-frames-bad_frame",
        "metrics",
        "metrics-1",
    ]
    assert found["peer-lost"].text.startswith("### Peer lost\n") and "[sidecar]" in found["peer-lost"].text
    assert "Garbage" not in found["peer-lost"].text
    assert found["top-failures"].text.count("###") == 2 and "Counters" not in found["top-failures"].text
    assert found["operations"].text == DOC.rstrip() + "\n"
    assert (found["peer-lost"].level, found["peer-lost"].title) == (3, "Peer lost")


def test_only_the_shipped_documents_anchors_are_names():
    assert runbooks.lookup("peer-lost").title == "Peer lost"
    for name in (
        "",
        "../docs/operations.md",
        "peer-lost/..",
        "PEER-LOST",
        "a" * 101,
        "peer lost",
        "not-a-section",
    ):
        assert runbooks.lookup(name) is None, name


def test_the_runbook_is_read_from_the_installed_copy_or_the_checkout():
    path = runbooks.doc_path()
    assert path is not None and path.name == "operations.md" and path.parent.name in ("_docs", "docs")


def test_the_wheel_ships_the_runbook_where_the_sidecar_reads_it():
    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    shipped = project["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]["docs/operations.md"]
    assert root / shipped == runbooks._PACKAGE_DOC
