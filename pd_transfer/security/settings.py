"""What a sidecar's security amounts to, resolved once at startup from its config.

:meth:`SecuritySettings.from_config` reads the shared secret and the CURVE
keys the config points to, and turns every problem into a
:class:`~pd_transfer.errors.ConfigError` (exit code 2): an unreadable or
short secret, a malformed key, or no secret at all. Authentication is off
only when the config says so (``allow_insecure = true``, ``--insecure``);
the sidecar then warns at every start and shows it in ``/status``,
``/readyz`` and the ``pd_transfer_insecure`` gauge. An engine transport whose
own listeners authenticate nobody starts only when the config accepts that
(:mod:`pd_transfer.security.engine_trust`).

Pure: reads files and the environment mapping it is given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pd_transfer.errors import ConfigError
from pd_transfer.security.curve import CurveKeypair, check_key, read_secret_key
from pd_transfer.security.engine_trust import unauthenticated_engine
from pd_transfer.security.identity import Identity, read_allow_list
from pd_transfer.security.secret import SECRET_FILE_ENV, SharedSecret, load_secret

#: the one line a sidecar without a secret stops with
NO_SECRET = (
    f"no shared secret: make one with `pd-transfer keygen --out DIR` and set "
    f'secret_file = "DIR/secret" (or {SECRET_FILE_ENV}), or opt out of '
    f"authentication with allow_insecure = true (--insecure)"
)


@dataclass(frozen=True)
class SecuritySettings:
    secret: SharedSecret | None = None  # None: authentication off (allow_insecure)
    curve_keypair: CurveKeypair | None = None  # encrypts the sockets this sidecar binds
    curve_server_key: str = ""  # expected of the sockets it connects to
    unauthenticated_engine: str = ""  # an engine transport with unauthenticated listeners, accepted
    identity_keypair: CurveKeypair | None = None  # presented when it connects (security/identity.py)
    identities: Mapping[str, Identity] | None = None  # public key -> identity; None: names unchecked

    @property
    def auth_enabled(self) -> bool:
        return self.secret is not None

    @classmethod
    def from_config(cls, config: Any, environ: Mapping[str, str] | None = None) -> SecuritySettings:
        """``config`` is a :class:`~pd_transfer.config.sidecar.SidecarConfig` (its auth fields)."""
        environ = os.environ if environ is None else environ
        secret = load_secret(config.secret_file, environ)
        if secret is None and not config.allow_insecure:
            raise ConfigError(NO_SECRET)
        engine = unauthenticated_engine(config)
        keypair = read_secret_key(config.curve_secret_key_file) if config.curve_secret_key_file else None
        server_key = (
            check_key(config.curve_server_key, "sidecar.curve_server_key") if config.curve_server_key else ""
        )
        if not server_key and keypair is not None:
            server_key = keypair.public  # one keypair for the whole deployment
        identity = (
            read_secret_key(config.identity_key_file, "identity_key_file")
            if config.identity_key_file
            else None
        )
        if identity is not None and not server_key:
            raise ConfigError(
                "identity_key_file is presented through CURVE, which is off: set curve_server_key "
                "or curve_secret_key_file"
            )
        identities = read_allow_list(config.identity_allow_file) if config.identity_allow_file else None
        if identities is not None and (keypair is None or secret is None):
            raise ConfigError(
                "identity_allow_file checks the CURVE keys of authenticated peers: it needs "
                "curve_secret_key_file and a shared secret (secret_file)"
            )
        return cls(
            secret=secret,
            curve_keypair=keypair,
            curve_server_key=server_key,
            unauthenticated_engine=engine,
            identity_keypair=identity,
            identities=identities,
        )

    def describe(self) -> str:
        """One line for the startup log: what is on, never any key material."""
        auth = "shared-secret authentication on" if self.auth_enabled else "authentication OFF"
        curve = []
        if self.curve_keypair is not None:
            curve.append(f"CURVE server key {self.curve_keypair.public[:8]}...")
        if self.curve_server_key:
            curve.append(f"expects CURVE server key {self.curve_server_key[:8]}...")
        if self.identity_keypair is not None:
            curve.append(f"identity key {self.identity_keypair.public[:8]}...")
        if self.identities is not None:
            curve.append(f"identities checked ({len(self.identities)} listed)")
        return ", ".join([auth] + curve) if curve else f"{auth}, CURVE off"
