"""When decode may close the sessions of a lost prefill instance (agent/decode/retire.py)."""

from types import SimpleNamespace

from pd_transfer.agent.decode.retire import rooms_state
from pd_transfer.agent.decode.room import DecodeRoom
from pd_transfer.errors import Reason


def _room(instance, terminal, sources=("p0", "p1"), acks=(), done=()):
    room = DecodeRoom(1, 0, instance=instance, sources=list(sources), acks=set(acks), done_from=set(done))
    if terminal:
        room.fail(Reason.PEER_LOST, "a source was lost")
    return room


def test_a_lost_instance_stays_open_while_a_room_uses_it_or_a_survivor_may_still_answer():
    lost = SimpleNamespace(lost_ranks={"p1"})
    other = SimpleNamespace(lost_ranks=set())
    assert rooms_state([_room(other, False)], lost) == "quiet"  # not its rooms
    assert rooms_state([_room(lost, False)], lost) == "live"
    assert rooms_state([_room(lost, True)], lost) == "pending"  # p0 has not answered
    assert rooms_state([_room(lost, True, acks={"p0"})], lost) == "quiet"  # p1 never will
    assert rooms_state([_room(lost, True, done={"p0"}), _room(lost, True, acks={"p0"})], lost) == "quiet"
