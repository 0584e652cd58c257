"""Cancellation is never swallowed: the package bounds its waits with ``asyncio.timeout``.

On Python 3.11, ``asyncio.wait_for`` returns the inner result instead of raising
``CancelledError`` when the task is cancelled just as the inner awaitable finishes
(CPython gh-86296, fixed in 3.12). A sidecar's heartbeat loop sent each heartbeat
through it, so a shutdown could lose its cancel and wait out the 5 s stop bound.
"""

import ast
import asyncio
import sys
from pathlib import Path

import pd_transfer

PACKAGE = Path(pd_transfer.__file__).resolve().parent


def _wait_for_calls() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "wait_for"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "asyncio"
            ):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_no_asyncio_wait_for_in_the_package():
    assert _wait_for_calls() == [], "use `async with asyncio.timeout(...)` instead"


async def _heartbeats(bounded) -> None:
    while True:  # the shape of the sidecar's timers: a short bounded send, again and again
        await bounded(asyncio.sleep(0), 1.0)


async def _with_timeout(step, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        await step


async def _cancels_lost(bounded, tries: int = 50) -> int:
    lost = 0
    for _ in range(tries):
        task = asyncio.create_task(_heartbeats(bounded))
        await asyncio.sleep(0.0005)
        task.cancel()
        await asyncio.sleep(0.01)
        while not task.done():  # a lost cancel: the loop goes on until cancelled again
            lost += 1
            task.cancel()
            await asyncio.sleep(0.001)
    return lost


def test_a_loop_of_timeout_bounded_waits_stops_at_the_first_cancel():
    assert asyncio.run(_cancels_lost(_with_timeout)) == 0
    if sys.version_info < (3, 12):  # why the rule above exists, shown on this interpreter
        assert asyncio.run(_cancels_lost(asyncio.wait_for)) > 0
