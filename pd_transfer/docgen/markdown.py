"""Markdown pieces of the generated docs: tables, heading anchors, readable
bounds, and the comments the code writes beside its own definitions.

Used by :mod:`pd_transfer.docgen.generate`; no imports from the package.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import textwrap
import tokenize


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (``Peer lost`` -> ``peer-lost``)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def source_comments(obj: type) -> dict[str, str]:
    """``name -> comment`` of each ``name ... = value  # comment`` assignment in ``obj``'s
    body, the comment on its first line or, where the formatter wrapped a long line as
    ``name = (\n    value  # comment\n)``, inside the parentheses."""
    source = textwrap.dedent(inspect.getsource(obj))
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    found = {}
    for node in ast.walk(ast.parse(source)):
        target: ast.expr
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and value is not None:
            lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            text = next((comments[n] for n in lines if n in comments), None)
            if text:
                found[target.id] = text
    return found


def _cell(text: object) -> str:
    """``text`` as one Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: tuple[str, ...], rows: list[tuple]) -> str:
    """A Markdown table of ``rows`` under ``header``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def readable_number(n: float) -> str:
    """Bounds as people write them: ``2^64-1``, ``2^48``, ``65535``."""
    if isinstance(n, int) and n >= 1 << 16:
        if (n + 1) & n == 0:
            return f"2^{(n + 1).bit_length() - 1}-1"
        if n & (n - 1) == 0:
            return f"2^{n.bit_length() - 1}"
    return str(n)
