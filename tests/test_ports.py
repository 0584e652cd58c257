"""Ports handed to processes that bind them later stay clear of the kernel's ephemeral range."""

from __future__ import annotations

import socket

import pytest

from pd_transfer.processes import ports


@pytest.fixture
def port_range(tmp_path, monkeypatch):
    def use(text: str) -> None:
        path = tmp_path / "ip_local_port_range"
        path.write_text(text)
        monkeypatch.setattr(ports, "_RANGE_FILE", str(path))

    monkeypatch.setattr(ports, "_given", set())
    return use


def test_ports_are_outside_the_ephemeral_range_free_and_never_repeated():
    low, high = ports.ephemeral_range()
    seen = [ports.spare_port() for _ in range(50)]
    assert len(set(seen)) == 50
    for port in seen:
        assert not low <= port <= high and port >= 10000
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when handed out


@pytest.mark.parametrize("text", ["", "abc def", "61000 32768", "0 100", "32768 70000", "1 2 3"])
def test_an_unreadable_range_means_linux_default(port_range, text):
    port_range(text)
    assert ports.ephemeral_range() == (32768, 60999)


def test_the_range_is_read_from_the_kernel_file(port_range):
    port_range("20000 50000\n")
    assert ports.ephemeral_range() == (20000, 50000)
    assert not 20000 <= ports.spare_port() <= 50000


def test_a_held_port_is_skipped_and_the_kernel_chooses_when_none_is_left(port_range):
    port_range("10001 65535")  # one port outside the range: 10000
    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", 10000))
        except OSError:
            pytest.skip("port 10000 is taken on this host")
        holder.listen(1)
        fallback = ports.spare_port()
        assert fallback != 10000 and fallback >= 10001
    assert ports.spare_port() == 10000  # released: now it is handed out, once
    assert ports.spare_port() != 10000
