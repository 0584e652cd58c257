"""Fixtures every test directory may use.

Every sidecar a test starts authenticates: the test run writes one ephemeral
shared secret and exports it as ``PD_TRANSFER_SECRET_FILE``, which sidecar
processes (``pd-transfer serve``), in-process sidecars and the client library
all read. A test of insecure behaviour passes ``--insecure`` (or
``allow_insecure = true``) explicitly; a test of a missing secret removes the
variable (``no_secret``).

Tests do not depend on the order they run in. ``pytest --shuffle SEED`` checks
that: modules run in an order drawn from SEED, the tests of each in reverse.

Every process a test starts ends with the test run, however the run ends:

- each child started through :class:`subprocess.Popen` from the main thread
  gets SIGTERM from the kernel once this process is gone
  (:mod:`pd_transfer.processes.parent_death`), which covers a runner killed outright;
- SIGTERM to the runner stops it as SIGINT does (KeyboardInterrupt): the
  fixtures' teardown stops their sidecars;
- at the end of the run, descendants still running (a child a test left
  behind) get SIGTERM, and SIGKILL a few seconds later.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from pd_transfer.processes.parent_death import tied_to_parent
from pd_transfer.security.secret import SECRET_ENV, SECRET_FILE_ENV, new_secret_file

DESCENDANTS_STOP_S = 10.0  # at the end of the run: SIGTERM, then SIGKILL after this long


class _TiedPopen(subprocess.Popen):
    """A child that ends with the test run (the module docstring)."""

    def __init__(self, *args, preexec_fn=None, **kwargs):
        # a child started from another thread would get the signal when that thread ends
        if preexec_fn is None and threading.current_thread() is threading.main_thread():
            preexec_fn = tied_to_parent()
        super().__init__(*args, preexec_fn=preexec_fn, **kwargs)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def pytest_configure(config):
    subprocess.Popen = _TiedPopen
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupted)


def pytest_unconfigure(config):
    _stop_descendants(os.getpid())


def _descendants(root: int) -> list[int]:
    """The live (not zombie) processes below ``root``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _stop_descendants(root: int) -> None:
    """SIGTERM to what is left below ``root``, SIGKILL to what outlives it."""
    if not Path("/proc").is_dir():
        return
    for signum in (signal.SIGTERM, signal.SIGKILL):
        pids = _descendants(root)
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + DESCENDANTS_STOP_S
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = _descendants(root)


def pytest_addoption(parser):
    parser.addoption(
        "--shuffle",
        type=int,
        default=None,
        metavar="SEED",
        help="run test modules in an order drawn from SEED, each module's tests in reverse",
    )


def pytest_collection_modifyitems(config, items):
    seed = config.getoption("--shuffle")
    if seed is None:
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = list(modules)
    random.Random(seed).shuffle(order)
    items[:] = [item for name in order for item in reversed(modules[name])]


@pytest.fixture(scope="session", autouse=True)
def session_secret():
    """The path of the test run's shared secret (mode 0600), exported to every sidecar."""
    directory = Path(tempfile.mkdtemp(prefix="pdt-secret-"))
    path = new_secret_file(directory / "secret")
    saved = {name: os.environ.pop(name, None) for name in (SECRET_ENV, SECRET_FILE_ENV)}
    os.environ[SECRET_FILE_ENV] = str(path)
    yield path
    os.environ.pop(SECRET_FILE_ENV, None)
    os.environ.update({k: v for k, v in saved.items() if v is not None})
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def no_secret(monkeypatch):
    """No shared secret anywhere in this test's environment (nor its children's)."""
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(SECRET_ENV, raising=False)


@pytest.fixture
def owned_doorbells():
    """``make(name, slots)``: a doorbell segment this test owns, unlinked and closed after it."""
    from pd_transfer.memory.doorbell import Doorbells

    made = []

    def make(name: str, slots: int) -> Doorbells:
        made.append(Doorbells.create(name, slots=slots))
        return made[-1]

    yield make
    for owned in made:
        owned.segment.unlink()
        owned.close()
