"""Fixtures every test directory may use.

Every sidecar a test starts authenticates: the test run writes one ephemeral
shared secret and exports it as ``PD_TRANSFER_SECRET_FILE``, which sidecar
processes (``pd-transfer serve``), in-process sidecars and the client library
all read. A test of insecure behaviour passes ``--insecure`` (or
``allow_insecure = true``) explicitly; a test of a missing secret removes the
variable (``no_secret``).

Tests do not depend on the order they run in. ``pytest --shuffle SEED`` checks
that: modules run in an order drawn from SEED, the tests of each in reverse.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from pd_transfer.security.secret import SECRET_ENV, SECRET_FILE_ENV, new_secret_file


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
    from pd_transfer.doorbell import Doorbells

    made = []

    def make(name: str, slots: int) -> Doorbells:
        made.append(Doorbells.create(name, slots=slots))
        return made[-1]

    yield make
    for owned in made:
        owned.segment.unlink()
        owned.close()
