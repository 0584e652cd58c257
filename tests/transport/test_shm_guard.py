"""A segment truncated under its mapping: the copy fails, the process lives (shm_guard).

Each case runs in a child process, since the one under test installs a SIGBUS
handler and, when the guard is wrong, dies of SIGBUS.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pd_transfer.memory import segment_guard as shm_guard

pytestmark = pytest.mark.skipif(
    not shm_guard.available(), reason=f"no SIGBUS guard: {shm_guard.why_unavailable()}"
)

_PRELUDE = """
import mmap, os, threading
import numpy as np
from pd_transfer.memory import segment_guard as shm_guard
from pd_transfer.errors import TransportError
from pd_transfer.memory.segments import create_segment, open_segment
from pd_transfer.transport.copy import native_loop as native_copy
name = f"pdt-guardtest-{os.getpid()}"
owner = create_segment(name, 1 << 20)
seen = open_segment(name, 1 << 20)
"""


def _run(body: str, **env) -> subprocess.CompletedProcess:
    code = _PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


def test_copies_into_a_truncated_segment_fail_and_the_process_lives():
    done = _run("""
        try:
            assert seen.watched and not seen.truncated
            os.truncate(seen.path, 4096)              # the owner keeps one page
            before = shm_guard.faults_total()
            errors = []
            def native():                             # a copy thread, as the engine runs them
                try:
                    native_copy.scatter_runs(seen.array, np.array([0, 8192, 16384]),
                                             np.array([4096, 4096, 4096]),
                                             np.ones(1 << 16, np.uint8))
                except TransportError as err:
                    errors.append(err.code.value)
            thread = threading.Thread(target=native)
            thread.start()
            thread.join()
            seen.array[1 << 19] = 7                   # numpy, past the end, after that
            print(errors, seen.truncated, shm_guard.faults_total() - before)
        finally:
            seen.close()
            owner.close()
            owner.unlink()
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "['segment_truncated'] True 1"


def test_a_sigbus_outside_the_watched_segments_still_kills(tmp_path):
    """The guard takes only faults in watched mappings: any other is not hidden."""
    done = _run(f"""
        path = {str(tmp_path / "plain")!r}
        with open(path, "wb") as f:
            f.truncate(1 << 16)
        fd = os.open(path, os.O_RDWR)
        other = mmap.mmap(fd, 1 << 16)
        os.truncate(path, 0)
        print("touching", flush=True)
        other[8192] = 1
        print("survived", flush=True)
    """)
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout, done.stderr)
    assert "survived" not in done.stdout


def test_without_the_guard_a_shrunk_segment_is_seen_before_the_copy():
    done = _run(
        """
        try:
            print(seen.watched, seen.shrunk())
            os.truncate(seen.path, 0)
            print(seen.shrunk())
        finally:
            seen.close()
            owner.close()
            owner.unlink()
    """,
        PD_TRANSFER_SIGBUS_GUARD="0",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "True"]
