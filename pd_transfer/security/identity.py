"""Per-sidecar identity: a CURVE key of its own, and the allow-list that names it.

The shared secret proves membership of a deployment, not a name: any holder
can say it is ``decode-0``. With identity on, each sidecar also holds a CURVE
keypair of its own (``identity_key_file``), presented as its client key
whenever it connects; the listening sidecars hold an allow-list
(``identity_allow_file``) mapping each public key to the one identity it may
claim, one line each::

    # public key (Z85, 40 characters)        role     agent id   decode instance
    rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7  decode   decode-0   dec-A
    Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID  prefill  prefill-0

ZeroMQ proves the key in its CURVE handshake (the client must hold the secret
half); the listener's ZAP handler (:mod:`pd_transfer.agent.zap`) refuses a
key not on the list and tags the connection with it; the gate
(:mod:`pd_transfer.security.gate`) then refuses an ``AuthHello`` that claims
another agent id than the key's, and the prefill refuses a Register naming
another agent or decode instance (``identity_mismatch``). The key never
leaves its sidecar, so a member cannot act as another even holding the
shared secret.

Pure: reads files; ``zmq`` is imported inside functions for libzmq's key
functions only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pd_transfer.errors import ConfigError
from pd_transfer.security.curve import (
    Z85_KEY_LEN,
    CurveKeypair,
    check_key,
    generate_keypair,
    write_private_files,
)

IDENTITY_KEY_FILE = "identity.key"
IDENTITY_LINE_FILE = "identity.allow"
ROLES = ("prefill", "decode")
#: the ZAP domain of the sockets that check identities (control, bootstrap)
IDENTITY_DOMAIN = "pd-transfer-identity"


@dataclass(frozen=True)
class Identity:
    """Who the holder of one key is allowed to be."""

    role: str
    agent_id: str
    instance_id: str = ""  # decode: the decode instance it registers under ('' = none)

    def line(self, public_key: str) -> str:
        return " ".join(filter(None, (public_key, self.role, self.agent_id, self.instance_id)))


def _is_comment(line: str) -> bool:
    """A line starting with '#' that is not a key's line ('#' is a Z85 character too)."""
    fields = line.split()
    return line.startswith("#") and not (
        len(fields) in (3, 4) and len(fields[0]) == Z85_KEY_LEN and fields[1] in ROLES
    )


def parse_allow_list(text: str, source: str) -> dict[str, Identity]:
    """``public key -> Identity`` from the allow-list's text; ConfigError naming the line."""
    identities: dict[str, Identity] = {}
    agents: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or _is_comment(line):
            continue
        where = f"{source} line {number}"
        fields = line.split()
        if len(fields) not in (3, 4):
            raise ConfigError(
                f"{where}: expected 'PUBLIC_KEY ROLE AGENT_ID [INSTANCE_ID]', got {len(fields)} fields",
                hint="`pd-transfer identity` prints a sidecar's line",
            )
        key = check_key(fields[0], where)
        if fields[1] not in ROLES:
            raise ConfigError(f"{where}: role {fields[1]!r} is not one of {', '.join(ROLES)}")
        if key in identities:
            raise ConfigError(
                f"{where}: the key is listed twice (also line {agents[identities[key].agent_id]})"
            )
        if fields[2] in agents:
            raise ConfigError(
                f"{where}: agent id {fields[2]!r} is listed twice (also line {agents[fields[2]]})"
            )
        identities[key] = Identity(fields[1], fields[2], fields[3] if len(fields) == 4 else "")
        agents[fields[2]] = number
    return identities


def read_allow_list(path: str) -> dict[str, Identity]:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"identity_allow_file {path}: cannot read it: {getattr(err, 'strerror', None) or err}"
        ) from None
    identities = parse_allow_list(text, f"identity_allow_file {path}")
    if not identities:
        raise ConfigError(f"identity_allow_file {path}: lists no identity")
    return identities


def write_identity(
    out_dir: str, identity: Identity, *, force: bool = False
) -> tuple[CurveKeypair, list[Path]]:
    """A fresh identity keypair in ``out_dir``: ``identity.key`` (the secret half, mode
    0600: the sidecar's ``identity_key_file``) and ``identity.allow`` (its allow-list line,
    for the listeners' ``identity_allow_file``). Refuses to overwrite unless ``force``."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    keypair = generate_keypair()
    contents = {IDENTITY_KEY_FILE: keypair.secret, IDENTITY_LINE_FILE: identity.line(keypair.public)}
    paths = write_private_files(
        directory,
        contents,
        force=force,
        what="identity",
        hint="pass --force to replace them (then replace the key's line on every listener)",
    )
    return keypair, paths


def identity_of(identities: Mapping[str, Identity] | None, user_id: str) -> Identity | None:
    """The identity ZeroMQ's ZAP handler bound to a connection (its key), if any."""
    return identities.get(user_id) if identities is not None and user_id else None
