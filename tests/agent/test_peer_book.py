"""The observer's peer book stays bounded: peers that come and go leave a bounded trail."""

from types import SimpleNamespace

from prometheus_client import generate_latest

from pd_transfer.agent.observe import MAX_PAST_PEERS, Observer
from pd_transfer.layout.geometry import Role


def _observer() -> Observer:
    return Observer(
        SimpleNamespace(
            config=SimpleNamespace(role=Role.PREFILL, peer_series_grace_s=300.0),
            security=SimpleNamespace(enabled=True, settings=SimpleNamespace(unauthenticated_engine="")),
        )
    )


def _channel(label: str, peer_rank: str = "") -> SimpleNamespace:
    return SimpleNamespace(label=label, peer_rank=peer_rank, last_heard_s=0.0)


def test_the_newest_past_peers_are_kept_and_live_ones_never_dropped():
    observer = _observer()
    observer.peer("decode-live", "accepted", key="live")
    for i in range(3 * MAX_PAST_PEERS):
        observer.peer(f"decode-{i}", "rejected" if i % 2 else "connecting", "why", key=f"k{i}")
        if i % 2 == 0:
            observer.lost(f"decode-{i}", "silent", _channel(f"k{i}"))
    past = [k for k, r in observer.peers.items() if r.state in ("rejected", "lost")]
    assert len(past) == MAX_PAST_PEERS
    assert past == [f"k{i}" for i in range(2 * MAX_PAST_PEERS, 3 * MAX_PAST_PEERS)]
    assert observer.peers["live"].state == "accepted"


def test_a_session_lost_before_registering_is_only_counted():
    observer = _observer()
    for i in range(5):
        observer.lost(f"peer {i:08x}", "no heartbeat", _channel(f"peer {i:08x}"))
    assert observer.peers == {}
    text = generate_latest(observer.registry).decode()
    assert 'pd_transfer_heartbeat_misses_total{role="prefill"} 5.0' in text
    assert "pd_transfer_peer_heartbeat_misses_total{" not in text
