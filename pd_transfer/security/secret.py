"""The shared secret: where it comes from, how it is read, and how it is never shown.

A secret comes from a file (``secret_file`` in the config, or the variable
``PD_TRANSFER_SECRET_FILE``) or from the variable ``PD_TRANSFER_SECRET``;
never from a command-line flag, since every user of the host can read
command lines (``ps``). Its text is hex when it looks like hex (``openssl
rand -hex 32`` gives 32 bytes), otherwise its raw bytes; either way at least
16 bytes. Both sides apply the same rule, so they derive the same key.

:class:`SharedSecret` keeps the bytes out of ``repr``, ``str`` and
tracebacks, so the secret cannot end up in a log line or ``--print-config``.

Pure: reads a file and a mapping of variables, nothing else.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import string
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from pd_transfer.errors import ConfigError

log = logging.getLogger(__name__)

SECRET_ENV = "PD_TRANSFER_SECRET"
SECRET_FILE_ENV = "PD_TRANSFER_SECRET_FILE"
MIN_SECRET_NBYTES = 16
MAX_SECRET_NBYTES = 4096

_HEX = frozenset(string.hexdigits.encode())


class SharedSecret:
    """The secret's bytes, hidden from every printed form."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes) -> None:
        self._value = bytes(value)

    @property
    def value(self) -> bytes:
        return self._value

    def __repr__(self) -> str:
        return f"SharedSecret(<{len(self._value)} bytes, redacted>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SharedSecret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def parse_secret(text: bytes, source: str) -> SharedSecret:
    """The secret in ``text`` (hex if it is hex, else raw), at least 16 bytes.

    Surrounding whitespace (a trailing newline in a file) is not part of it.
    """
    text = text.strip()
    if text and len(text) % 2 == 0 and all(c in _HEX for c in text):
        value = bytes.fromhex(text.decode())
    else:
        value = text
    if len(value) < MIN_SECRET_NBYTES:
        raise ConfigError(
            f"{source}: the secret is {len(value)} bytes, at least {MIN_SECRET_NBYTES} are needed",
            hint="generate one with `pd-transfer keygen --out DIR` or `openssl rand -hex 32`",
        )
    if len(value) > MAX_SECRET_NBYTES:
        raise ConfigError(
            f"{source}: the secret is {len(value)} bytes, at most {MAX_SECRET_NBYTES} are accepted"
        )
    return SharedSecret(value)


def read_secret_file(path: str) -> SharedSecret:
    """The secret in the file ``path``; warns when others may read the file."""
    try:
        data = Path(path).read_bytes()
        mode = os.stat(path).st_mode
    except OSError as err:
        raise ConfigError(
            f"secret file {path}: cannot read it: {err.strerror}",
            hint="check the path and that the sidecar's user may read it",
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "secret file %s is readable by group or others (mode %o); chmod 600 it", path, stat.S_IMODE(mode)
        )
    return parse_secret(data, f"secret file {path}")


def new_secret_file(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Write a fresh random 32-byte secret (hex) to ``path``, mode 0600.

    Refuses (FileExistsError) to replace an existing file unless ``force``:
    replacing a secret in use locks every peer out. ``pd-transfer demo`` and
    the test harness make an ephemeral one per run with this.
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    flags |= os.O_TRUNC if force else os.O_EXCL
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w") as file:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that existed
        file.write(secrets.token_hex(32) + "\n")
    return path


def use_ephemeral_secret(
    directory: str | os.PathLike, environ: MutableMapping[str, str] | None = None
) -> Path | None:
    """Unless ``environ`` (default ``os.environ``) already names a secret, write a
    fresh one to ``directory/secret`` and export it as ``PD_TRANSFER_SECRET_FILE``:
    the sidecars a benchmark or a harness starts, and its clients, then share it.
    Returns the new file, or None when a secret was configured already.
    """
    environ = os.environ if environ is None else environ
    if environ.get(SECRET_FILE_ENV) or environ.get(SECRET_ENV):
        return None
    path = new_secret_file(Path(directory) / "secret")
    environ[SECRET_FILE_ENV] = str(path)
    return path


def load_secret(secret_file: str = "", environ: Mapping[str, str] | None = None) -> SharedSecret | None:
    """The secret from ``secret_file``, else ``PD_TRANSFER_SECRET_FILE``, else
    ``PD_TRANSFER_SECRET``; None when none is set (authentication off).

    A file and the raw variable together are ambiguous and refused.
    """
    environ = os.environ if environ is None else environ
    path = secret_file or environ.get(SECRET_FILE_ENV, "")
    raw = environ.get(SECRET_ENV, "")
    if path and raw:
        raise ConfigError(
            f"both a secret file ({path}) and {SECRET_ENV} are set; set one",
            hint=f"unset {SECRET_ENV} or drop secret_file / {SECRET_FILE_ENV}",
        )
    if path:
        return read_secret_file(path)
    if raw:
        return parse_secret(raw.encode(), SECRET_ENV)
    return None
