"""Shared-memory segments nobody uses any more: what a killed worker leaves in /dev/shm.

A worker unlinks its pools' segments when it exits; one killed (SIGKILL, an
OOM kill, a crash) cannot, and its segments keep their memory until someone
unlinks them. A segment is *orphaned* when no process on this host has it
open or mapped: the worker that made it is gone, and every sidecar that
mapped it let go. :func:`orphaned_segments` finds them by reading
``/proc/*/fd`` and ``/proc/*/maps``; :func:`remove` unlinks them
(``pd-transfer shm-clean``, :func:`add_command`).

A process this user may not inspect (another user's without root, or a
sandbox's own init) cannot be ruled out: it is named, and nothing is called
orphaned unless the caller says such processes hold no segment. A segment
made after the scan began is never taken: only names seen before the scan
are candidates. Processes in another PID namespace (another container) are
invisible: run it where the workers' processes are visible (on the host, or
in a pod that shares its process namespace).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_transfer.memory.segments import SEGMENT_DIR, SEGMENT_PREFIX

# shm-clean's exit codes: done; orphans listed, left; a process that may hold them unseen
EXIT_OK, EXIT_LISTED, EXIT_UNSURE = 0, 1, 2


@dataclass(frozen=True)
class Scan:
    orphaned: tuple[str, ...]  # names no inspected process holds or maps
    in_use: tuple[str, ...]  # names some process holds or maps
    uninspected: tuple[str, ...]  # "PID (command)" of processes that could not be inspected


def _held_by_processes(directory: str) -> tuple[set[str], list[str]]:
    """Names under ``directory`` some process has open or mapped, and the processes that
    could not be inspected."""
    held: set[str] = set()
    uninspected: list[str] = []
    prefix = directory.rstrip("/") + "/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                target = os.readlink(fd.path)
                if target.startswith(prefix):
                    held.add(target[len(prefix) :].removesuffix(" (deleted)"))
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = line.rstrip("\n").partition(prefix)[2]
                    if path:
                        held.add(path.removesuffix(" (deleted)"))
        except FileNotFoundError:
            continue  # the process exited during the scan: it holds nothing now
        except PermissionError:
            uninspected.append(f"{pid} ({_command(pid)})")
        except OSError:
            continue  # an fd closed between listing and reading it
    return held, uninspected


def orphaned_segments(prefix: str = SEGMENT_PREFIX, directory: str = SEGMENT_DIR) -> Scan:
    candidates = sorted(p.name for p in Path(directory).glob(f"{prefix}*") if p.is_file())
    held, uninspected = _held_by_processes(directory)
    return Scan(
        orphaned=tuple(name for name in candidates if name not in held),
        in_use=tuple(name for name in candidates if name in held),
        uninspected=tuple(uninspected),
    )


def _command(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().split(b"\0")[0].decode(errors="replace") or "?"
    except OSError:
        return "?"


def remove(names: tuple[str, ...], directory: str = SEGMENT_DIR) -> int:
    """Unlink ``names`` (from :func:`orphaned_segments`); the bytes freed."""
    freed = 0
    for name in names:
        path = Path(directory) / name
        try:
            freed += path.stat().st_blocks * 512
            path.unlink()
        except FileNotFoundError:
            continue
    return freed


def add_command(sub: Any) -> None:
    """``pd-transfer shm-clean``, on the CLI's subcommands."""
    clean = sub.add_parser(
        "shm-clean",
        help="list (or remove) shared-memory segments a killed worker left behind",
        description="List the pd-transfer segments in /dev/shm that no process on this host has "
        "open or mapped: what a worker killed before it could unlink its pools leaves. "
        "With --remove, unlink them. A segment any process holds is never touched.",
        epilog="exit codes: 0 done (nothing orphaned, or removed), 1 orphans listed and left, "
        "2 a process that could not be inspected may hold them (see --skip-uninspectable)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    clean.add_argument("--remove", action="store_true", help="unlink the orphaned segments")
    clean.add_argument("--prefix", default="pdt-", help="only segments whose names start with this")
    clean.add_argument(
        "--skip-uninspectable",
        action="store_true",
        help="take processes this user cannot inspect as holding no segment (they are not workers "
        "or sidecars, e.g. a sandbox's init)",
    )
    clean.set_defaults(handler=_shm_clean)


def _shm_clean(args: argparse.Namespace) -> int:
    scan = orphaned_segments(args.prefix)
    if scan.uninspected and scan.orphaned and not args.skip_uninspectable:
        print(
            f"{len(scan.orphaned)} segments look unused, but these processes could not be "
            f"inspected and may hold them: {', '.join(scan.uninspected)}. Run as root, or as the "
            "user that runs the workers and sidecars; if none of them is a worker or a sidecar, "
            "add --skip-uninspectable",
            file=sys.stderr,
        )
        return EXIT_UNSURE
    for name in scan.orphaned:
        print(name)
    print(f"{len(scan.orphaned)} orphaned, {len(scan.in_use)} in use", file=sys.stderr)
    if not scan.orphaned:
        return EXIT_OK
    if not args.remove:
        print("run with --remove to unlink the orphaned segments", file=sys.stderr)
        return EXIT_LISTED
    freed = remove(scan.orphaned)
    print(f"removed {len(scan.orphaned)} segments, {freed / 2**20:.1f} MiB", file=sys.stderr)
    return EXIT_OK
