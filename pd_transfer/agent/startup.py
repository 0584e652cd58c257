"""What a sidecar claims on its host at start, and errors that name the setting to change.

- Ports: a bind that fails (another sidecar on the same host with the same
  ``http_port``, say) is a :class:`StartupError` naming the field, the
  address and the fix, not a bare ``address already in use``.
- Directories: the shipped configs put the worker socket and the ready file
  in ``/run/pd-transfer/<gpu>/``, which systemd makes for its unit
  (``RuntimeDirectory=``). Started any other way, the sidecar makes a missing
  directory itself, mode 0700 (the socket is the worker's way in: only this
  user may reach it); where it cannot, the error names the directory and the
  command that makes it.
- The ready file: written once serving, removed on stop, so a file that
  exists describes a sidecar that runs (or one that was killed).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq

from pd_transfer.protocol.stream_frames import unix_path

_IN_USE = (errno.EADDRINUSE, zmq.EADDRINUSE)


class StartupError(OSError):
    """The sidecar cannot start; the text names the setting and the fix (exit code 3)."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


@contextlib.contextmanager
def binding(host_field: str, host: str, port_field: str, port: int) -> Iterator[None]:
    """Turns a failed bind of ``host:port`` into a StartupError naming the field to change."""
    try:
        yield
    except (OSError, zmq.ZMQError) as err:
        code = err.errno or 0
        where = f"{port_field} {port}: cannot bind {host}:{port}"
        if code in _IN_USE:
            text = (
                f"{where}: in use by another process (another sidecar on this host?); give "
                f"each sidecar on a host its own {port_field} (--{port_field.replace('_', '-')} "
                f"or PD_TRANSFER_{port_field.upper()}), e.g. base + GPU index, or 0 for any "
                f"free port"
            )
        else:
            text = (
                f"{where}: {err.strerror or err}; {host_field} must be an address of this "
                f"host (0.0.0.0: every interface)"
            )
        raise StartupError(code, text) from None


def prepare_worker_endpoint(endpoint: str) -> None:
    """Makes the directory of a ``unix://`` or ``ipc://`` worker endpoint."""
    path = unix_path(endpoint)
    if path is None and endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
    if path:
        ensure_directory(Path(path).parent, "worker_endpoint")


def ensure_directory(directory: Path, field: str) -> None:
    """``directory`` exists; the parts that did not are made with mode 0700."""
    missing = []
    for part in (directory, *directory.parents):
        if part.exists():
            break
        missing.append(part)
    for part in reversed(missing):
        try:
            part.mkdir(mode=0o700)
        except FileExistsError:
            continue
        except OSError as err:
            user = pwd.getpwuid(os.getuid()).pw_name
            raise StartupError(
                err.errno or 0,
                (
                    f"{field}: cannot create the directory {directory} ({part}: {err.strerror}); "
                    f"create it for this user (install -d -m 0700 -o {user} {directory}), or point "
                    f"{field} at a directory this user may write"
                ),
            ) from None


class ReadyFile:
    """The JSON file of bound addresses (``ready_file``; nothing when that is empty)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None
        self._written = False

    def write(self, info: dict[str, Any]) -> None:
        if self.path is None:
            return
        ensure_directory(self.path.parent, "ready_file")
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(info))
        temporary.replace(self.path)
        self._written = True

    @property
    def written(self) -> bool:
        return self._written

    def remove(self) -> None:
        if self.path is not None and self._written:
            self.path.unlink(missing_ok=True)
            self._written = False
