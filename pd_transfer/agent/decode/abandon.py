"""Decode: telling a prefill instance that a room will never be claimed.

A prefill room learns its decode only from that decode's TransferRequest. A
room decode gives up before its claim (the request ended while it still
queued on decode, or its parameters cannot be loaded) would otherwise hold
prefill's pages in Bootstrapping until ``bootstrap_timeout_s``. The worker's
``abandon`` op names the room and its bootstrap address; this rank sends
every rank of that prefill instance whose Hello offers
:data:`~pd_transfer.protocol.ROOM_ABANDON` a
:class:`~pd_transfer.protocol.RoomRefused` with ``aborted`` and the worker's
reason, and the prefill rank fails the room at once
(``PrefillSide._on_refusal``, which leaves alone a room another decode
instance asked for). A pair that was rejected is told through
:mod:`.rejections`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.protocol import ROOM_ABANDON, RoomRefused
from pd_transfer.wire.fields import clip_text
from pd_transfer.wire.limits import MAX_FAIL_TEXT_LEN

if TYPE_CHECKING:
    from pd_transfer.agent.decode.prefill_instances import PrefillInstances

log = logging.getLogger(__name__)


async def tell_prefill(instances: PrefillInstances, bootstrap: str, room: int, text: str) -> None:
    """Every rank of ``bootstrap``'s instance that understands it hears that ``room`` fails with ``text``."""
    try:
        instance = await instances.usable(bootstrap)
    except PdTransferError as err:
        if err.code is Reason.PEER_REJECTED:
            instances.rejected.refuse_room(bootstrap, room, text)
        else:  # no instance to tell: its room ends with it, or at its own timeout
            log.info("decode: cannot tell %s that room %d is abandoned: %s", bootstrap, room, err.message)
        return
    except Exception as err:  # e.g. a bad address
        log.info("decode: cannot tell %s that room %d is abandoned: %r", bootstrap, room, err)
        return
    refused = RoomRefused(room=room, reason=Reason.ABORTED, reason_text=clip_text(text, MAX_FAIL_TEXT_LEN))
    for peer in instance.peers.values():
        hello = peer.channel.session.their_hello
        if peer.channel.closed or hello is None or ROOM_ABANDON not in hello.capabilities.features:
            continue
        try:
            await peer.channel.send(refused)
        except Exception as err:  # its session ended: its rooms end with it
            log.info("decode: cannot tell %s that room %d is abandoned: %r", peer.rank_id, room, err)
