"""What a decode rank publishes so that an engine on the prefill side can write into it.

An engine transport (Mooncake, NIXL) writes to absolute addresses in a peer
process, so the peer has to publish, besides where its engine listens, the
address and size of every region it registered with that engine. It travels
as the ``data_address`` of the decode rank's ``Register`` (where the tcp
transport publishes ``tcp://host:port``)::

    mooncake://127.0.0.1:15795/<payload>     engine session: host:rpc_port
    nixl://pdt-decode-0-41c2/<payload>       engine session: NIXL agent name

``payload`` is URL-safe base64 of zlib-compressed msgpack:
``{"r": [[region_id, address, nbytes], ...], "m": <engine metadata bytes>}``
(``m``: NIXL's agent metadata; empty for Mooncake, whose P2P handshake
fetches it itself). 64 regions and NIXL's metadata come to about 2 KB.
A decode rank that offers staged writes (:mod:`~pd_transfer.transport.engines.staging.receiver`) adds
``"s": [address, nbytes, slot_nbytes]`` (its staging area, registered with
the engine) and ``"c": "tcp://host:port"`` (its staging control channel);
a reader without them sees a peer that takes direct writes only.

The text comes from a peer: :meth:`EngineAddress.parse` checks every field
explicitly and raises :class:`TransportError` (``bad_field``) naming it.
"""

from __future__ import annotations

import base64
import binascii
import re
import zlib
from dataclasses import dataclass, field

from pd_transfer.errors import ProtocolError, Reason, TransportError
from pd_transfer.wire.envelope import pack, unpack
from pd_transfer.wire.limits import (
    ENGINE_ADDRESS_LIMITS,
    MAX_ENGINE_ADDRESS_LEN,
    MAX_ENGINE_ADDRESS_PAYLOAD_NBYTES,
    MAX_STAGING_CONTROL_LEN,
)

MAX_ADDRESS_CHARS = MAX_ENGINE_ADDRESS_LEN  # what Register.data_address may carry
_MAX_REGION_NBYTES = 1 << 48
_SESSION = re.compile(r"^[A-Za-z0-9_.:\-\[\]]{1,255}$")


@dataclass(frozen=True)
class EngineAddress:
    kind: str  # "mooncake" or "nixl"
    session: str  # host:port, or the NIXL agent name
    regions: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (address, nbytes)
    metadata: bytes = b""
    control: str = ""  # staging control channel, tcp://host:port
    staging: tuple[int, int, int] | None = None  # staging area: (address, nbytes, slot_nbytes)

    def encode(self) -> str:
        body = {"r": [[r, a, n] for r, (a, n) in self.regions.items()], "m": self.metadata}
        if self.control and self.staging is not None:
            body.update(c=self.control, s=list(self.staging))
        packed = pack(body)
        payload = base64.urlsafe_b64encode(zlib.compress(packed, 6)).decode()
        text = f"{self.kind}://{self.session}/{payload}"
        if len(text) > MAX_ADDRESS_CHARS:
            raise TransportError(
                f"{self.kind} address of {len(self.regions)} regions is "
                f"{len(text)} characters; a registration carries at most "
                f"{MAX_ADDRESS_CHARS}",
                code=Reason.LIMIT_EXCEEDED,
                hint="register fewer, larger regions",
            )
        return text

    @classmethod
    def parse(cls, text: str, kind: str) -> EngineAddress:
        """Decode a peer's ``data_address`` for engine ``kind``; raises on anything malformed."""
        prefix = f"{kind}://"
        if not isinstance(text, str) or not text.startswith(prefix):
            shown = text if isinstance(text, str) and len(text) < 80 else f"{str(text)[:60]}..."
            raise TransportError(
                f"peer published no {kind} address (data_address {shown!r})",
                code=Reason.TRANSPORT_UNSUPPORTED,
                hint=f"run the decode sidecar with transport = {kind!r} too",
            )
        if len(text) > MAX_ADDRESS_CHARS:
            raise _bad(f"is {len(text)} characters, more than {MAX_ADDRESS_CHARS}")
        session, _, payload = text[len(prefix) :].partition("/")
        if not _SESSION.match(session):
            raise _bad(f"session {session[:80]!r} is not a host:port or agent name")
        try:
            raw = base64.urlsafe_b64decode(payload.encode("ascii"))
            inflater = zlib.decompressobj()
            packed = inflater.decompress(raw, MAX_ENGINE_ADDRESS_PAYLOAD_NBYTES)
            if inflater.unconsumed_tail:
                raise _bad(f"payload inflates past {MAX_ENGINE_ADDRESS_PAYLOAD_NBYTES} bytes")
            value = unpack(packed, ENGINE_ADDRESS_LIMITS, "engine address payload")
        except TransportError:
            raise
        except ProtocolError as err:
            raise _bad(f"payload does not decode: {err.message}") from None
        except (binascii.Error, UnicodeEncodeError, zlib.error, ValueError) as err:
            raise _bad(f"payload does not decode ({type(err).__name__})") from None
        return cls(kind, session, _regions(value), _metadata(value), *_staging(value))


def _regions(value: object) -> dict[str, tuple[int, int]]:
    if not isinstance(value, dict) or not isinstance(value.get("r"), list):
        raise _bad("payload is not a map with a region list at 'r'")
    regions: dict[str, tuple[int, int]] = {}
    for i, entry in enumerate(value["r"]):
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and entry[0]
            and all(type(x) is int for x in entry[1:])
        ):
            raise _bad(f"at $.r[{i}]: expected [region_id, address, nbytes]")
        region_id, address, nbytes = entry
        if (
            not 0 < address < (1 << 64)
            or not 0 <= nbytes <= _MAX_REGION_NBYTES
            or address + nbytes >= (1 << 64)
        ):
            raise _bad(f"at $.r[{i}]: region {region_id!r} address {address} nbytes {nbytes} out of range")
        if region_id in regions:
            raise _bad(f"at $.r[{i}]: region {region_id!r} is listed twice")
        regions[region_id] = (address, nbytes)
    return regions


def _metadata(value: dict) -> bytes:
    metadata = value.get("m", b"")
    if not isinstance(metadata, bytes):
        raise _bad("at $.m: engine metadata must be bytes")
    return metadata


def _staging(value: dict) -> tuple[str, tuple[int, int, int] | None]:
    control, area = value.get("c", ""), value.get("s")
    if area is None and not control:
        return "", None
    if not (
        isinstance(control, str) and control.startswith("tcp://") and len(control) <= MAX_STAGING_CONTROL_LEN
    ):
        raise _bad("at $.c: staging control address must be tcp://host:port")
    if not (isinstance(area, list) and len(area) == 3 and all(type(x) is int for x in area)):
        raise _bad("at $.s: expected [address, nbytes, slot_nbytes]")
    address, nbytes, slot_nbytes = area
    if (
        not 0 < address < (1 << 64)
        or not 0 < slot_nbytes <= nbytes <= _MAX_REGION_NBYTES
        or address + nbytes >= (1 << 64)
    ):
        raise _bad(f"at $.s: staging area {area} out of range")
    return control, (address, nbytes, slot_nbytes)


def _bad(detail: str) -> TransportError:
    return TransportError(f"peer engine address {detail}", code=Reason.BAD_FIELD)
