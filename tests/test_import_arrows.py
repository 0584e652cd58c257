"""The layering in DESIGN.md, read from the source: every import, function-local ones too.

``test_layering.py`` imports a layer and looks at ``sys.modules``; this test
reads each module's ``import`` statements, so an import inside a function (which
runs only on some path) counts as well. A module belongs to the longest package
named in ``FORBIDDEN``; what that package may not import is listed there, by
module prefix.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "pd_transfer"

IO = ["asyncio", "zmq", "socket", "selectors", "threading", "uvloop", "prometheus_client"]
ABOVE_TRANSPORT = [
    "pd_transfer.agent",
    "pd_transfer.client",
    "pd_transfer.integrations",
    "pd_transfer.commands",
]
ENTRY = ["pd_transfer.cli", "pd_transfer.commands"]

FORBIDDEN: dict[str, list[str]] = {
    # pure: tensor views, planning; numpy only
    "pd_transfer.layout": [
        *IO,
        "torch",
        "msgpack",
        "pd_transfer.protocol",
        "pd_transfer.transport",
        "pd_transfer.wire",
    ],
    # sans-I/O framing below the protocol
    "pd_transfer.wire": [*IO, "torch", "pd_transfer.protocol", "pd_transfer.transport", *ABOVE_TRANSPORT],
    # sans-I/O messages and the session state machine
    "pd_transfer.protocol": [*IO, "torch", "pd_transfer.transport", "pd_transfer.security", *ABOVE_TRANSPORT],
    # byte movers: never the protocol or anything above them
    "pd_transfer.transport": ["pd_transfer.protocol", "pd_transfer.security", *ABOVE_TRANSPORT, *ENTRY],
    # the copy engine moves bytes between mapped regions: no network transport
    "pd_transfer.transport.copy": [
        "zmq",
        "socket",
        "asyncio",
        "pd_transfer.transport.tcp",
        "pd_transfer.transport.zmq",
        "pd_transfer.transport.engines",
        "pd_transfer.transport.shm",
        "pd_transfer.transport.mock",
        "pd_transfer.protocol",
        *ABOVE_TRANSPORT,
    ],
    "pd_transfer.transport.tcp": [
        "zmq",
        "pd_transfer.transport.zmq",
        "pd_transfer.transport.engines",
        "pd_transfer.protocol",
        *ABOVE_TRANSPORT,
    ],
    "pd_transfer.transport.zmq": ["pd_transfer.transport.engines", "pd_transfer.protocol", *ABOVE_TRANSPORT],
    "pd_transfer.transport.engines": [
        "zmq",
        "pd_transfer.transport.zmq",
        "pd_transfer.protocol",
        *ABOVE_TRANSPORT,
    ],
    # the sidecar never imports what a worker or an engine imports
    "pd_transfer.agent": ["pd_transfer.client", "pd_transfer.integrations", *ENTRY],
    # what a GPU worker imports: the wire to its sidecar, never the sidecar itself
    "pd_transfer.client": ["pd_transfer.agent", "pd_transfer.transport", "pd_transfer.integrations", *ENTRY],
    # engine adapters sit on the client
    "pd_transfer.integrations": ["pd_transfer.agent", "pd_transfer.transport", *ENTRY],
    # the simulated worker is a worker: the client, never the sidecar or its transports
    "pd_transfer.sim": ["pd_transfer.agent", "pd_transfer.transport", "pd_transfer.integrations", *ENTRY],
    # sans-I/O authentication, below the transports and the sidecar
    "pd_transfer.security": ["pd_transfer.transport", *ABOVE_TRANSPORT, *ENTRY],
    # shared-memory segments, the SIGBUS guard, CUDA IPC handles, doorbells: below the transports
    "pd_transfer.memory": [
        *IO,
        "pd_transfer.layout",
        "pd_transfer.protocol",
        "pd_transfer.security",
        "pd_transfer.transport",
        "pd_transfer.config",
        "pd_transfer.observability",
        *ABOVE_TRANSPORT,
        *ENTRY,
    ],
    # the sidecar's record and where its values came from: read, checked, never acted on
    "pd_transfer.config": [
        "asyncio",
        "zmq",
        "uvloop",
        "prometheus_client",
        "torch",
        "pd_transfer.transport",
        "pd_transfer.memory",
        "pd_transfer.observability",
        *ABOVE_TRANSPORT,
        *ENTRY,
    ],
    # metrics, logs, runbooks, listening sockets: what the sidecar reports, not what it does
    "pd_transfer.observability": [
        "asyncio",
        "zmq",
        "uvloop",
        "torch",
        "pd_transfer.transport",
        "pd_transfer.memory",
        "pd_transfer.config",
        *ABOVE_TRANSPORT,
        *ENTRY,
    ],
    # docs generated from the tables of the layers below the sidecar, never from running it
    "pd_transfer.docgen": [
        "asyncio",
        "zmq",
        "socket",
        "uvloop",
        "torch",
        "pd_transfer.transport",
        "pd_transfer.memory",
        *ABOVE_TRANSPORT,
        *ENTRY,
    ],
    # process helpers: the standard library only
    "pd_transfer.processes": [
        "pd_transfer.errors",
        "pd_transfer.wire",
        "pd_transfer.layout",
        "pd_transfer.protocol",
        "pd_transfer.security",
        "pd_transfer.transport",
        "pd_transfer.config",
        "pd_transfer.memory",
        "pd_transfer.observability",
        *ABOVE_TRANSPORT,
        *ENTRY,
    ],
    # what the subcommands run: never a worker's library or an engine adapter
    "pd_transfer.commands": ["pd_transfer.client", "pd_transfer.integrations", "pd_transfer.cli"],
    # the oracle checks the planner's work without the layers that carry it
    "pd_transfer.testing": [
        "zmq",
        "pd_transfer.protocol",
        "pd_transfer.transport",
        *ABOVE_TRANSPORT,
        *ENTRY,
    ],
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)]
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _layer_of(module: str) -> str | None:
    owners = [layer for layer in FORBIDDEN if module == layer or module.startswith(layer + ".")]
    return max(owners, key=len, default=None)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        layer = _layer_of(module)
        if layer is None:
            continue
        for lineno, name in _imports(path):
            for prefix in FORBIDDEN[layer]:
                if _under(name, prefix) and not _under(module, prefix):
                    found.append(f"{path.relative_to(ROOT.parent)}:{lineno}: {layer} imports {name}")
    return sorted(set(found))


def test_no_module_imports_across_its_layers_arrows():
    assert _violations() == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_every_layer_named_in_the_table_exists(layer):
    path = ROOT.parent.joinpath(*layer.split("."))
    assert path.is_dir() or path.with_suffix(".py").exists(), layer


def test_the_check_sees_a_function_local_import(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    import zmq\n    from pd_transfer.agent import sidecar\n")
    assert [name for _, name in _imports(source)] == ["zmq", "pd_transfer.agent", "pd_transfer.agent.sidecar"]
