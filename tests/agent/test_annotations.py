"""Every parameter and return in the agent is annotated, so its seams read as types.

Walks ``pd_transfer/agent/**/*.py`` with ast: a function (or method, or lambda-free
nested function) with a parameter other than ``self``/``cls`` that has no
annotation, or without a return annotation (``__init__`` excepted), is named.
"""

import ast
from pathlib import Path

import pd_transfer.agent

AGENT = Path(pd_transfer.agent.__file__).resolve().parent


def unannotated(source: str, where: str) -> list[str]:
    """``where:line name(what is missing)`` for each function of ``source`` lacking annotations."""
    tree = ast.parse(source, where)
    methods = {
        id(item)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    missing = []
    for node in sorted(ast.walk(tree), key=lambda node: getattr(node, "lineno", 0)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        params = [*args.posonlyargs, *args.args, args.vararg, *args.kwonlyargs, args.kwarg]
        params = [arg for arg in params if arg is not None]
        if id(node) in methods and params and params[0].arg in ("self", "cls"):
            params = params[1:]
        bare = [arg.arg for arg in params if arg.annotation is None]
        if node.returns is None and node.name != "__init__":
            bare.append("return")
        if bare:
            missing.append(f"{where}:{node.lineno} {node.name}({', '.join(bare)})")
    return missing


def test_every_parameter_and_return_in_the_agent_is_annotated():
    paths = sorted(AGENT.rglob("*.py"))
    assert len(paths) > 30, "the agent's modules were not found"
    missing = [
        line for path in paths for line in unannotated(path.read_text(), str(path.relative_to(AGENT.parent)))
    ]
    assert missing == [], "unannotated in the agent:\n" + "\n".join(missing)


def test_the_check_names_what_is_missing():
    source = (
        "class C:\n"
        "    def __init__(self, a): ...\n"
        "    def m(self, b: int, *rest, key=1) -> None: ...\n"
        "async def f(x: int): ...\n"
        "def g(cls, y: int) -> int: ...\n"
    )
    assert unannotated(source, "m.py") == [
        "m.py:2 __init__(a)",
        "m.py:3 m(rest, key)",
        "m.py:4 f(return)",
        "m.py:5 g(cls)",
    ]
