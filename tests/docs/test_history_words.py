"""The tree speaks of the project as it is: no words about the work's own history.

Docs, code and comments describe what pd-transfer does today. What was tried,
when, and in which order belongs in commit messages; a phrase such as "the
seventh session", "earlier today" or a dated diary heading goes stale the day
it is written. These tests read every text file of the repository (``.git``,
virtual environments and caches aside) and name each offending ``file:line``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PERFORMANCE = ROOT / "docs" / "performance.md"
MAX_PERFORMANCE_LINES = 300

SKIPPED_DIRS = {
    ".git",
    ".venv",
    "venv",
    "node_modules",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    "build",
    "dist",
    ".hypothesis",
    "shared",
}
TEXT_SUFFIXES = {
    ".py",
    ".pyi",
    ".md",
    ".rst",
    ".txt",
    ".toml",
    ".cfg",
    ".ini",
    ".yaml",
    ".yml",
    ".json",
    ".sh",
    ".c",
    ".h",
    ".j2",
    ".service",
    "",
}

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
    "twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|"
    "nineteenth|twentieth|\\d+(?:st|nd|rd|th)"
)
HISTORY = [
    (re.compile(rf"\b(?:the )?(?:{_ORDINALS}) session\b", re.I), "a numbered session or attempt"),
    (re.compile(r"\b(?:this|last|previous|earlier|that|next) (?:session|sitting)\b", re.I), "a work session"),
    (re.compile(r"\bsessions? before\b", re.I), "a work session"),
    (
        re.compile(r"\b(?:last time|earlier today|later today|yesterday|the day before)\b", re.I),
        "a moment of the work",
    ),
    (re.compile(r"\bpreviously\b", re.I), "what the code was"),
    (re.compile(r"\bwe tried\b", re.I), "what was tried"),
    (
        re.compile(
            r"\b(?:now fixed|is fixed now|before this change|the commit before|"
            r"the old code|the new code)\b",
            re.I,
        ),
        "what the code was",
    ),
    (
        re.compile(r"\bused to (?:end|go|be|make|declare|wait|crash|hang|fail|lose|send|take)\b", re.I),
        "what the code was",
    ),
    (re.compile(r"^\s*#{1,6} .*\b20\d\d-[01]\d-[0-3]\d\b"), "a dated diary heading"),
    (re.compile(r"\(20\d\d-[01]\d-[0-3]\d[,)]"), "a dated entry"),
]
# Phrases where the words above name a concept of the project, not its history:
# a protocol session between two sidecars, and the error class raised when this
# side attempted an illegal send.
TECHNICAL = re.compile(
    r"\b(?:on|released) this session\b|\bits last session\b|"
    r"\bthat session's\b|\bwe tried to send\b",
    re.I,
)


def _text_files(root: Path):
    for path in sorted(root.iterdir()):
        if path.is_dir():
            if path.name not in SKIPPED_DIRS and not path.name.endswith(".egg-info"):
                yield from _text_files(path)
        elif path.suffix in TEXT_SUFFIXES or path.name == "Dockerfile":
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if "\0" not in text:
                yield path, text


def history_hits(root: Path, *, skip: tuple[Path, ...] = ()) -> list[str]:
    """``file:line: what`` for every line of a text file under ``root`` that
    speaks of the work's history."""
    hits = []
    for path, text in _text_files(root):
        if path in skip:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            line = TECHNICAL.sub("", line)
            for pattern, what in HISTORY:
                if pattern.search(line):
                    hits.append(f"{path.relative_to(root)}:{number}: {what}: {line.strip()[:100]}")
                    break
    return hits


def test_no_file_in_the_tree_speaks_of_the_works_history():
    hits = history_hits(ROOT, skip=(Path(__file__).resolve(),))
    assert hits == [], "work-history words (history goes in commit messages):\n" + "\n".join(hits)


def test_the_history_check_finds_each_kind_of_phrase(tmp_path):
    (tmp_path / "notes.md").write_text(
        "# Performance\n"
        "### 2026-12-01 (seventh session): less Python\n"
        "Measured earlier today, on a quiet machine.\n"
        "The decode side previously polled.\n"
        "A session of the protocol: current generation 3 on this session.\n"
    )
    (tmp_path / "mod.py").write_text(
        "x = 1  # the sidecar used to crash here\ny = 2  # decode released this session\n"
    )
    hits = history_hits(tmp_path)
    assert [h.split(": ")[0] for h in hits] == ["mod.py:1", "notes.md:2", "notes.md:3", "notes.md:4"]


# -- docs/performance.md ------------------------------------------------------------


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_performance_doc_is_a_reference_not_a_notebook():
    lines = PERFORMANCE.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_PERFORMANCE_LINES, (
        f"docs/performance.md has {len(lines)} lines (at most {MAX_PERFORMANCE_LINES}): "
        "one table per benchmark, its command and what limits it; the rest goes in commits"
    )
    assert not [line for line in lines if line.startswith("### ")], "no subsections (diary entries)"


def test_every_performance_table_has_its_command_and_its_limit():
    sections = _sections(PERFORMANCE.read_text(encoding="utf-8"))
    with_tables = {name: body for name, body in sections.items() if re.search(r"^\|.*\d.*\|$", body, re.M)}
    assert len(with_tables) >= 8, sorted(sections)
    command = re.compile(
        r"^```\n(?:(?:PYTHONPATH|UCX_MODULES)=\S+ )*(?:python|\.venv/bin/python|bash) "
        r"(?:benchmarks|tests)/\S+",
        re.M,
    )
    no_command = [name for name, body in with_tables.items() if not command.search(body)]
    assert no_command == [], f"tables without the command that reproduces them: {no_command}"
    no_limit = [name for name, body in with_tables.items() if "**What limits it.**" not in body]
    assert no_limit == [], f"tables without a paragraph on what limits their rows: {no_limit}"


def test_performance_commands_name_benchmarks_that_exist():
    text = PERFORMANCE.read_text(encoding="utf-8")
    scripts = set(re.findall(r"\b((?:benchmarks|tests/gpu)/[\w/]+\.(?:py|sh))\b", text))
    assert scripts, "no benchmark named"
    assert sorted(s for s in scripts if not (ROOT / s).is_file()) == []
