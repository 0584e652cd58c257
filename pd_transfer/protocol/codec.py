"""Frames <-> messages: the msgpack envelope, limits, and one error class.

A frame is one msgpack map::

    {"t": "abort", "v": [1, 0], "room": 42, "generation": 1,
     "reason": "aborted", "reason_text": "client cancelled request"}

``t`` is the message type tag, ``v`` the protocol version the sender speaks,
and every field travels by name (never by position, unlike SGLang's
``msg[14]``). :func:`decode` checks, in order:

1. the frame size (``frame_too_large``);
2. msgpack validity, with string, binary, list and map lengths capped while
   unpacking (``bad_frame`` / ``limit_exceeded``), then the nesting depth;
3. the envelope: a map with a str ``t`` and a ``v`` of two ints; a different
   MAJOR version is refused (``version_unsupported``), a newer MINOR accepted;
4. the type tag (``unknown_message``);
5. every field's type and range, with the field's path (``bad_field``);
   unknown fields are ignored.

Every failure raises :class:`~pd_transfer.errors.ProtocolError` with a reason
code; no msgpack, Key, Type or Value error escapes.

The envelope and the field kinds are :mod:`pd_transfer.wire`'s, shared with
every other framing.

Pure (sans-IO): bytes in, objects out; nothing with sockets.
"""

from __future__ import annotations

from pd_transfer.errors import LocalProtocolError, Reason
from pd_transfer.protocol.messages import PROTOCOL_VERSION, Message
from pd_transfer.protocol.schema import RECORDS, RECORDS_BY_TAG
from pd_transfer.wire.envelope import Envelope
from pd_transfer.wire.limits import DEFAULT_LIMITS, Limits


def envelope(limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """The protocol's envelope under ``limits``."""
    return Envelope(PROTOCOL_VERSION, limits)


_ENVELOPE = envelope()


def encode(message: Message) -> bytes:
    """The frame of ``message``. Raises LocalProtocolError for a non-message."""
    record = RECORDS.get(type(message))
    if record is None:
        raise LocalProtocolError(
            f"cannot encode {type(message).__name__}: not a protocol message", code=Reason.UNKNOWN_MESSAGE
        )
    return _ENVELOPE.pack(message.TAG, record.encode(message))


def decode(frame: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """The message in ``frame``, fully checked; see the module docstring."""
    opener = _ENVELOPE if limits is DEFAULT_LIMITS else envelope(limits)
    tag, raw = opener.open(frame, RECORDS_BY_TAG)
    _, record = RECORDS_BY_TAG[tag]
    message: Message = record.decode(raw, f"$.{tag}")
    return message
