"""Framed socket I/O: more buffers than IOV_MAX, partial transfers, and prefixes that are not ours."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.tcp import native_io
from pd_transfer.transport.tcp.iovecs import Part
from pd_transfer.transport.tcp.sockets import (
    IOV_MAX,
    MAGIC,
    PREFIX,
    Kind,
    PeerClosed,
    parse_address,
    prefix,
    read_prefix,
    recv_all_into,
    recv_part,
    send_all,
    send_part,
)


def _pair():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)  # force partial sends
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    return a, b


def test_send_and_receive_more_buffers_than_iov_max_byte_exact():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 3000, 3 * IOV_MAX + 17)
    src = rng.integers(0, 256, int(sizes.sum()), np.uint8)
    dst = np.zeros_like(src)
    edges = np.concatenate(([0], np.cumsum(sizes))).tolist()
    src_views = [memoryview(src[a:b]) for a, b in zip(edges[:-1], edges[1:])]
    # the receiver cuts the same bytes differently: whole buffers split at other points
    cuts = np.unique(np.concatenate(([0, src.size], rng.integers(1, src.size, 2 * IOV_MAX))))
    dst_views = [memoryview(dst[a:b]) for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())]
    a, b = _pair()
    sender = threading.Thread(target=send_all, args=(a, src_views))
    sender.start()
    recv_all_into(b, dst_views)
    sender.join()
    assert np.array_equal(src, dst)
    a.close(), b.close()


def test_receive_raises_when_the_peer_closes_mid_payload():
    a, b = _pair()
    a.sendall(b"x" * 100)
    a.close()
    with pytest.raises(PeerClosed):
        recv_all_into(b, [memoryview(bytearray(200))])
    b.close()


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"HTTP/1.1 200 OK\r\n\r\n", Reason.BAD_FRAME),
        (PREFIX.pack(MAGIC, 9, 2, 0, 0, 0), Reason.VERSION_UNSUPPORTED),
        (PREFIX.pack(MAGIC, 1, 7, 0, 0, 0), Reason.BAD_FRAME),
        (PREFIX.pack(MAGIC, 1, 2, 0, 1 << 30, 0), Reason.FRAME_TOO_LARGE),
        (PREFIX.pack(MAGIC, 1, 2, 0, 10, 1 << 40), Reason.FRAME_TOO_LARGE),
    ],
)
def test_a_prefix_that_is_not_ours_is_refused_with_a_reason(raw, code):
    a, b = _pair()
    a.sendall(raw.ljust(PREFIX.size, b"\0"))
    with pytest.raises(TransportError) as info:
        read_prefix(b, max_header_nbytes=1 << 20, max_payload_nbytes=1 << 30)
    assert info.value.code is code
    a.close(), b.close()


def test_a_clean_end_between_frames_is_not_an_error():
    a, b = _pair()
    a.sendall(prefix(Kind.REPLY, 0))
    a.close()
    assert read_prefix(b, max_header_nbytes=16, max_payload_nbytes=0).kind is Kind.REPLY
    assert read_prefix(b, max_header_nbytes=16, max_payload_nbytes=0) is None
    b.close()


@pytest.mark.parametrize(
    "address", ["127.0.0.1:5", "tcp://host", "tcp://:80", "tcp://h:0", "tcp://h:99999", "ipc:///tmp/x"]
)
def test_bad_data_addresses_are_refused(address):
    with pytest.raises(TransportError):
        parse_address(address)


def test_data_addresses_parse():
    assert parse_address("tcp://10.0.0.1:5601") == ("10.0.0.1", 5601)
    assert parse_address("tcp://[::1]:80") == ("::1", 80)


@pytest.mark.parametrize("native", [True, False], ids=["native", "memoryviews"])
def test_parts_send_and_receive_byte_exact_with_partial_transfers(monkeypatch, native):
    if native and not native_io.AVAILABLE:
        pytest.skip("no native sendmsg/recvmsg on this platform")
    monkeypatch.setattr(native_io, "AVAILABLE", native)
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 1 << 20, np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    # 3 x IOV_MAX runs of 100 bytes at scattered places, landing elsewhere
    n = 3 * IOV_MAX
    src_at = rng.permutation(src.size // 100)[:n] * 100
    dst_at = rng.permutation(dst.size // 100)[:n] * 100
    sending, receiving = Part(), Part()
    sending.add(src, src_at, np.full(n, 100))
    receiving.add(dst, dst_at, np.full(n, 100))
    a, b = _pair()
    sender = threading.Thread(target=send_part, args=(a, sending))
    sender.start()
    recv_part(b, receiving)
    sender.join()
    assert all(np.array_equal(dst[d : d + 100], src[s : s + 100]) for s, d in zip(src_at, dst_at))
    outside = np.ones(dst.size, bool)
    outside[(dst_at[:, None] + np.arange(100)).ravel()] = False
    assert not dst[outside].any()  # nothing landed anywhere else
    a.close()
    with pytest.raises(PeerClosed):
        recv_part(b, receiving)
    b.close()
