"""A test run that is stopped, however, leaves no sidecar behind (tests/conftest.py).

A pytest run of a sidecar test module is started in a subprocess; once its
sidecars are up it gets SIGTERM (it stops as on SIGINT, and its fixtures stop
their sidecars) or SIGKILL (it runs nothing: the kernel's parent-death signal
stops each sidecar). A few seconds later no sidecar of that run may be alive.
The run's sidecars are found by their agent ids, which carry its pid
(tests/agent/cluster.py), so that they are found even once re-parented.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pd_transfer.memory.segments import SEGMENT_DIR, SEGMENT_PREFIX

ROOT = Path(__file__).resolve().parents[1]
RUN = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/faults/test_killed_sidecars.py"]
STARTED_WITHIN_S = 120.0  # generous bounds on a busy machine
GONE_WITHIN_S = 60.0


def _sidecars_of(run_pid: int) -> dict[int, list[str]]:
    """Live ``pd-transfer serve`` processes started by the test run ``run_pid``: their argv."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError, UnicodeDecodeError):
            continue
        if state == "Z" or "serve" not in argv or "--agent-id" not in argv:
            continue
        if f"-{run_pid}-" in argv[argv.index("--agent-id") + 1]:
            found[int(entry.name)] = argv
    return found


def _wait(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_test_run_leaves_no_sidecar_behind(signum, tmp_path):
    log = tmp_path / "run.log"
    run = subprocess.Popen(RUN, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    sidecars: dict[int, list[str]] = {}
    try:
        sidecars = _wait(lambda: _sidecars_of(run.pid), STARTED_WITHIN_S)
        assert sidecars, f"the test run started no sidecar within {STARTED_WITHIN_S} s"
        assert run.poll() is None, "the test run ended before it could be stopped"
        run.send_signal(signum)
        left = _wait(lambda: not _sidecars_of(run.pid), GONE_WITHIN_S) or _sidecars_of(run.pid)
        assert left is True, (
            f"sidecars still running {GONE_WITHIN_S} s after {signal.Signals(signum).name}: "
            f"{left}; the run's output:\n{log.read_text()[-3000:]}"
        )
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for pid in _sidecars_of(run.pid):
            os.kill(pid, signal.SIGKILL)
        # what a killed run could not clean: its pools and its work directory
        for pattern in (f"t{run.pid}-*", f"*-{run.pid}-*-doorbells-*"):
            for path in Path(SEGMENT_DIR).glob(SEGMENT_PREFIX + pattern):
                path.unlink(missing_ok=True)
        for argv in sidecars.values():
            shutil.rmtree(Path(argv[argv.index("--ready-file") + 1]).parent, ignore_errors=True)
