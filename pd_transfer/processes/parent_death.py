"""Child processes that end when the process that started them ends (Linux).

The demo and the tests start sidecars and workers as child processes. A parent
that is stopped by SIGTERM or SIGINT stops its children itself; one that is
killed (SIGKILL, a crash) runs no code, and its children would live on,
re-parented to PID 1. The kernel's parent-death signal covers that case:
``prctl(PR_SET_PDEATHSIG, SIGTERM)`` armed in the child between fork and exec
makes the kernel send it SIGTERM once its parent is gone, and a sidecar or a
worker then stops as on any SIGTERM (a sidecar drains, a worker unlinks its
pools).

The signal follows the parent *thread* that forked the child: start children
that must outlive a short-lived thread from the main thread. Elsewhere than
Linux, :func:`tied_to_parent` returns None and children are not tied.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def tied_to_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets ``signum`` when
    this process (the calling thread, strictly) ends; None where that is not available.

    Resolved before the fork, so that the child calls one C function and reads its
    parent's pid, nothing more: a parent that died before the signal was armed is
    seen there (the child was re-parented already), and the child signals itself.
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent_pid = os.getpid()
    signum = int(signum)

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signum)

    return arm
