"""Which transport a peer pair gets (:func:`pd_transfer.transport.choice.choose_transport`).

A table of what the decode peer offers and what this sidecar can do, each
row with the kind it gets or the refusal: its reason code and its full text.
Then every combination of the inputs: the choice is a kind or a refusal,
never an exception, and the rules hold across all of them.
"""

from __future__ import annotations

import itertools

import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.base import TransportKind
from pd_transfer.transport.choice import LocalPlane, PeerOffer, TransportRefusal, choose_transport

HERE, THERE = "host-a", "host-b"
SHM_ACROSS = (
    "transport shm needs the decode peer on this host with published region handles "
    "(peer host {peer!r}, this host 'host-a')"
)
CUDA_TEXT = (
    "this sidecar's regions are CUDA memory, which only same-host copies move "
    "(peer decode-0: transport {transport}, peer host {peer!r}, this host 'host-a')"
)
SHM_HINT = "use --transport tcp or auto across hosts"
CUDA_HINT = "run the peers on one host with transport shm or auto, or register host pools"


def _offer(host: str = HERE, handles: bool = True, cuda: bool = False) -> PeerOffer:
    return PeerOffer("decode-0", host, handles, cuda)


def _local(transport: str = "auto", on_device: bool = False) -> LocalPlane:
    return LocalPlane(transport, HERE, on_device)


CASES = [
    # (peer offer, local plane, expected kind or (code, text, hint))
    (_offer(), _local(), TransportKind.SHM),
    (_offer(cuda=True), _local(), TransportKind.DEVICE),
    (_offer(THERE), _local(), TransportKind.TCP),
    (_offer(handles=False), _local(), TransportKind.TCP),  # same host, nothing to map
    (_offer(), _local("tcp"), TransportKind.TCP),
    (_offer(), _local("shm"), TransportKind.SHM),
    (_offer(cuda=True), _local("shm"), TransportKind.DEVICE),
    (_offer(), _local("mooncake"), TransportKind.MOONCAKE),
    (_offer(THERE), _local("nixl"), TransportKind.NIXL),
    (_offer(), _local(on_device=True), TransportKind.SHM),  # CUDA here, segments there
    (_offer(cuda=True), _local("shm", on_device=True), TransportKind.DEVICE),
    (_offer(THERE), _local("shm"), (Reason.TRANSPORT_FAILED, SHM_ACROSS.format(peer=THERE), SHM_HINT)),
    (_offer(handles=False), _local("shm"), (Reason.TRANSPORT_FAILED, SHM_ACROSS.format(peer=HERE), SHM_HINT)),
    (
        _offer(THERE),
        _local("auto", on_device=True),
        (Reason.TRANSPORT_UNSUPPORTED, CUDA_TEXT.format(transport="auto", peer=THERE), CUDA_HINT),
    ),
    (
        _offer(),
        _local("tcp", on_device=True),
        (Reason.TRANSPORT_UNSUPPORTED, CUDA_TEXT.format(transport="tcp", peer=HERE), CUDA_HINT),
    ),
    (
        _offer(),
        _local("nixl", on_device=True),
        (Reason.TRANSPORT_UNSUPPORTED, CUDA_TEXT.format(transport="nixl", peer=HERE), CUDA_HINT),
    ),
    (  # shm across hosts is refused for that first, CUDA or not
        _offer(THERE),
        _local("shm", on_device=True),
        (Reason.TRANSPORT_FAILED, SHM_ACROSS.format(peer=THERE), SHM_HINT),
    ),
]


@pytest.mark.parametrize("offer, local, expected", CASES)
def test_choice_table(offer: PeerOffer, local: LocalPlane, expected) -> None:
    chosen = choose_transport(offer, local)
    if isinstance(expected, TransportKind):
        assert chosen is expected
        return
    assert isinstance(chosen, TransportRefusal), chosen
    assert (chosen.code, chosen.text, chosen.hint) == expected
    error = chosen.error()
    assert type(error) is TransportError and error.code is expected[0]
    assert str(error) == f"{expected[1]}\n  hint: {expected[2]}"


def test_every_combination_chooses_by_the_rules() -> None:
    transports = ("auto", "shm", "tcp", "mooncake", "nixl")
    for host, handles, cuda, transport, on_device in itertools.product(
        (HERE, THERE), (True, False), (True, False), transports, (True, False)
    ):
        offer, local = _offer(host, handles, cuda and handles), _local(transport, on_device)
        chosen = choose_transport(offer, local)
        same_host = host == HERE and handles
        if isinstance(chosen, TransportRefusal):
            # refused only: shm asked without a mappable peer, or CUDA regions off the shm path
            assert (transport == "shm" and not same_host) or on_device, (offer, local, chosen)
            continue
        if on_device:  # CUDA memory moves only by same-host copies
            assert chosen in (TransportKind.SHM, TransportKind.DEVICE), (offer, local)
        if transport in ("mooncake", "nixl"):
            assert chosen.value == transport
        elif transport == "tcp" or not same_host:
            assert chosen is TransportKind.TCP, (offer, local)
        else:
            assert chosen is (TransportKind.DEVICE if offer.cuda_handles else TransportKind.SHM)
