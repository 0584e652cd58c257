"""ZeroMQ CURVE keys: reading, checking and generating them (``pd-transfer keygen``).

CURVE encrypts a ZeroMQ connection and proves the listening side's identity:
the listener holds a secret key, whoever connects must know its public key
in advance. It does not say who connects (any client key is accepted); the
shared-secret handshake does that. Keys are Z85 text, 40 characters.

A deployment keeps it simple with one keypair for all its sidecars: every
sidecar gets ``curve_secret_key_file``, and connects to servers expecting
the public half of that same key unless ``curve_server_key`` names another.

``zmq`` is imported inside the functions that need libzmq's key functions,
so this package stays importable without it (the layering test checks that).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from pd_transfer.errors import ConfigError

Z85_ALPHABET = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
Z85_KEY_LEN = 40

SECRET_KEY_FILE = "curve.key"
PUBLIC_KEY_FILE = "curve.pub"
SHARED_SECRET_FILE = "secret"


@dataclass(frozen=True)
class CurveKeypair:
    public: str
    secret: str

    def __repr__(self) -> str:
        return f"CurveKeypair(public={self.public!r}, secret=<redacted>)"


def check_key(text: str, source: str) -> str:
    """``text`` as a Z85 key (surrounding whitespace dropped); ConfigError if it is not one."""
    key = text.strip()
    if len(key) != Z85_KEY_LEN or not set(key) <= Z85_ALPHABET:
        raise ConfigError(
            f"{source}: expected a Z85 CURVE key of {Z85_KEY_LEN} characters, got "
            f"{len(key)} characters{'' if set(key) <= Z85_ALPHABET else ' outside Z85'}",
            hint="generate a keypair with `pd-transfer keygen --out DIR`",
        )
    return key


def read_secret_key(path: str, setting: str = "curve_secret_key_file") -> CurveKeypair:
    """The keypair whose secret half is in the file ``path`` (the public half is derived);
    ``setting`` names the config key in errors."""
    import zmq

    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"{setting} {path}: cannot read it: {getattr(err, 'strerror', None) or err}"
        ) from None
    secret = check_key(text, f"{setting} {path}")
    return CurveKeypair(public=zmq.curve_public(secret.encode()).decode(), secret=secret)


def generate_keypair() -> CurveKeypair:
    import zmq

    public, secret = zmq.curve_keypair()
    return CurveKeypair(public=public.decode(), secret=secret.decode())


def write_keys(out_dir: str, *, force: bool = False) -> list[Path]:
    """Write a CURVE keypair and a shared secret into ``out_dir``, each file mode 0600.

    Refuses to overwrite an existing file unless ``force``: replacing a key
    in use would lock every peer out.
    """
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    keypair = generate_keypair()
    contents = {
        SECRET_KEY_FILE: keypair.secret,
        PUBLIC_KEY_FILE: keypair.public,
        SHARED_SECRET_FILE: secrets.token_hex(32),
    }
    return write_private_files(
        directory,
        contents,
        force=force,
        what="keygen",
        hint="pass --force to replace them (peers using the old keys are locked out)",
    )


def write_private_files(
    directory: Path, contents: dict[str, str], *, force: bool, what: str, hint: str
) -> list[Path]:
    """Write each ``name: text`` of ``contents`` into ``directory`` with mode 0600; a
    ConfigError naming ``what`` and the files if any exists and not ``force``."""
    paths = [directory / name for name in contents]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise ConfigError(f"{what}: {', '.join(existing)} already exist(s)", hint=hint)
    for path in paths:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "w") as file:
            os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that existed
            file.write(contents[path.name] + "\n")
    return paths
