"""A worker request reaches the sidecar as its operation's record (protocol/worker_requests.py).

Each operation decodes to its own frozen record, with the defaults the worker API
documents; every field is still checked as before (a poll carrying a bad ``pp_size``
is refused naming it); and nothing in the agent indexes a request by name.
"""

import ast
import dataclasses
from pathlib import Path

import pytest

import pd_transfer
from pd_transfer.errors import Reason
from pd_transfer.protocol.worker_api import WorkerApiError, encode
from pd_transfer.protocol.worker_requests import (
    AbandonRequest,
    AbortRequest,
    ExpectRequest,
    LayerReadyRequest,
    PollRequest,
    RegisterRequest,
    SendRequest,
    WaitRequest,
    read_request,
)

AGENT = Path(pd_transfer.__file__).resolve().parent / "agent"


def _read(**fields):
    return read_request(encode({"id": 9, **fields}))


def test_each_operation_reads_into_its_own_record():
    pages = list(range(300))
    send = _read(op="send", room=5, last=False, pages=pages, aux_row=7, stream=True, decode="d1")
    assert send == SendRequest(9, 5, pages, [], [], 7, last=False, stream=True, decode="d1")
    expect = _read(op="expect", room=6, bootstrap="tcp://127.0.0.1:1", state_slots=[2], held_pages=0)
    assert expect == ExpectRequest(9, 6, [], [], [2], None, bootstrap="tcp://127.0.0.1:1", held_pages=0)
    register = _read(op="register", geometry={"a": 1}, handles={"r": "s"}, worker_id="w")
    assert register == RegisterRequest(9, {"a": 1}, {"r": "s"}, "w", pp_size=1)
    assert _read(op="layer_ready", room=1, layer_id=3) == LayerReadyRequest(9, 1, 3)
    assert _read(op="poll", room=2) == PollRequest(9, 2)
    wait = _read(op="wait", room=2, timeout_s=1)
    assert wait == WaitRequest(9, 2, 1.0) and isinstance(wait.timeout_s, float)
    assert _read(op="abort", room=3) == AbortRequest(9, 3)
    assert _read(op="abandon", room=4, bootstrap="tcp://h:1") == AbandonRequest(9, 4, "tcp://h:1", "")
    with pytest.raises(dataclasses.FrozenInstanceError):
        send.room = 6  # type: ignore[misc]


def test_a_field_an_operation_does_not_use_is_still_checked():
    with pytest.raises(WorkerApiError) as caught:
        _read(op="poll", room=2, pp_size=0)
    assert "$.pp_size" in str(caught.value) and caught.value.request_id == 9
    with pytest.raises(WorkerApiError) as caught:
        _read(op="send", room="x", last=True)
    assert "at $.room" in str(caught.value) and caught.value.code is Reason.BAD_FIELD


def test_nothing_in_the_agent_indexes_a_request_by_name():
    """The records are the one place a worker request is read: no ``request["room"]``."""
    found = [
        f"{path.relative_to(AGENT.parent)}:{node.lineno}"
        for path in sorted(AGENT.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "request"
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    ]
    assert found == []
