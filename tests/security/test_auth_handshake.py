"""The handshake, sans-IO: mutual, replay-proof, and only ProtocolError/AuthError escape."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_transfer.errors import AuthError, ProtocolError, Reason
from pd_transfer.security import ClientHandshake, Decision, Gate, NonceBook, new_routing_id, parse_secret
from pd_transfer.security.messages import AuthProof, AuthResult, decode, encode

KEY = parse_secret(b"k" * 32, "test")
OTHER_KEY = parse_secret(b"x" * 32, "test")


def _handshake(gate, client, identity=None):
    """Run a whole handshake; return the frames the client sent and the gate's answers."""
    identity = identity or new_routing_id()
    hello = client.hello()
    challenge = gate.admit(identity, hello)
    assert challenge.decision is Decision.ANSWER, challenge.error
    proof = client.receive(challenge.reply)
    result = gate.admit(identity, proof)
    return identity, hello, proof, result


def test_a_good_handshake_authenticates_both_sides_and_opens_the_gate():
    gate, client = Gate(KEY, "prefill-0"), ClientHandshake(KEY, "decode-0")
    identity, _, _, result = _handshake(gate, client)
    assert result.decision is Decision.ANSWER
    assert client.receive(result.reply) is None and client.done
    assert client.peer_agent_id == "prefill-0" and gate.peer_of(identity) == "decode-0"
    assert gate.admit(identity, b"any protocol frame").decision is Decision.PASS


def test_client_refuses_a_listener_with_another_key_and_tells_it_why():
    gate, client = Gate(OTHER_KEY, "prefill-0"), ClientHandshake(KEY, "decode-0", peer="prefill X")
    challenge = gate.admit(new_routing_id(), client.hello())
    with pytest.raises(AuthError) as err:
        client.receive(challenge.reply)
    assert err.value.code is Reason.AUTH_FAILED
    assert "prefill X (prefill-0) did not prove it holds the shared secret" in str(err.value)
    told = decode(err.value.reply)
    assert isinstance(told, AuthResult) and told.reason is Reason.AUTH_FAILED


def test_gate_counts_the_refusal_a_client_sends_back():
    gate, client = Gate(OTHER_KEY, "prefill-0"), ClientHandshake(KEY, "decode-0")
    identity = new_routing_id()
    challenge = gate.admit(identity, client.hello())
    with pytest.raises(AuthError) as err:
        client.receive(challenge.reply)
    admission = gate.admit(identity, err.value.reply)
    assert admission.decision is Decision.REFUSE and admission.reply is None
    assert admission.error.code is Reason.AUTH_FAILED


def test_gate_refuses_a_proof_made_with_another_key():
    gate = Gate(KEY, "prefill-0")
    client = ClientHandshake(OTHER_KEY, "decode-0")
    identity = new_routing_id()
    challenge = decode(gate.admit(identity, client.hello()).reply)
    # a client that skips checking the listener's proof still cannot produce its own
    forged = encode(AuthProof(nonce=challenge.nonce, proof=b"\0" * 32))
    admission = gate.admit(identity, forged)
    assert admission.decision is Decision.REFUSE
    assert admission.error.code is Reason.AUTH_FAILED
    assert "the two sides hold different secrets" in admission.error.message
    assert decode(admission.reply).reason is Reason.AUTH_FAILED
    assert gate.admit(identity, b"protocol frame").decision is Decision.UNAUTHENTICATED


def test_gate_refuses_a_tampered_proof():
    gate, client = Gate(KEY, "prefill-0"), ClientHandshake(KEY, "decode-0")
    identity = new_routing_id()
    proof = decode(client.receive(gate.admit(identity, client.hello()).reply))
    flipped = bytes([proof.proof[0] ^ 1]) + proof.proof[1:]
    admission = gate.admit(identity, encode(AuthProof(nonce=proof.nonce, proof=flipped)))
    assert admission.error.code is Reason.AUTH_FAILED


def test_client_refuses_a_tampered_challenge():
    gate, client = Gate(KEY, "prefill-0"), ClientHandshake(KEY, "decode-0")
    raw = msgpack.unpackb(gate.admit(new_routing_id(), client.hello()).reply)
    raw["nonce"] = bytes(32)  # the listener's proof no longer covers this nonce
    with pytest.raises(AuthError, match="did not prove"):
        client.receive(msgpack.packb(raw))


def test_a_replayed_proof_on_a_new_connection_is_refused_as_replayed():
    gate = Gate(KEY, "prefill-0")
    _, hello, proof, result = _handshake(gate, ClientHandshake(KEY, "decode-0"))
    assert result.decision is Decision.ANSWER
    # the attacker captured the proof; a fresh hello gets a fresh challenge the proof does not answer
    attacker = new_routing_id()
    assert gate.admit(attacker, ClientHandshake(KEY, "x").hello()).decision is Decision.ANSWER
    admission = gate.admit(attacker, proof)
    assert admission.decision is Decision.REFUSE and admission.error.code is Reason.AUTH_REPLAYED
    assert gate.admit(attacker, b"protocol frame").decision is Decision.UNAUTHENTICATED


def test_a_replayed_hello_is_refused_at_once():
    gate = Gate(KEY, "prefill-0")
    _, hello, proof, _ = _handshake(gate, ClientHandshake(KEY, "decode-0"))
    attacker = new_routing_id()
    admission = gate.admit(attacker, hello)
    assert admission.decision is Decision.REFUSE and admission.error.code is Reason.AUTH_REPLAYED
    assert gate.admit(attacker, proof).error.code is Reason.AUTH_REPLAYED  # no challenge to answer


def test_a_proof_without_a_hello_is_refused():
    gate = Gate(KEY, "prefill-0")
    frame = encode(AuthProof(nonce=bytes(32), proof=bytes(32)))
    admission = gate.admit(new_routing_id(), frame)
    assert admission.error.code is Reason.AUTH_FAILED and "without a hello" in admission.error.message


def test_each_connection_gets_its_own_single_use_nonce():
    gate = Gate(KEY, "prefill-0")
    first = ClientHandshake(KEY, "decode-0")
    second = ClientHandshake(KEY, "decode-0")
    id1, id2 = new_routing_id(), new_routing_id()
    c1 = decode(gate.admit(id1, first.hello()).reply)
    c2 = decode(gate.admit(id2, second.hello()).reply)
    assert c1.nonce != c2.nonce
    # the proof for connection 1 sent on connection 2: answers a challenge it was not given
    proof1 = first.receive(encode(c1))
    assert gate.admit(id2, proof1).error.code is Reason.AUTH_FAILED


def test_ids_generated_by_zeromq_are_not_authenticated():
    # 5-byte ids are sequential: another connection could claim one and inherit it
    gate, client = Gate(KEY, "prefill-0"), ClientHandshake(KEY, "decode-0")
    admission = gate.admit(b"\0\x01\x02\x03\x04", client.hello())
    assert admission.error.code is Reason.AUTH_FAILED and "routing id" in admission.error.message


def test_protocol_frames_before_the_handshake_are_unauthenticated():
    gate = Gate(KEY, "prefill-0")
    hello = msgpack.packb({"t": "hello", "v": [1, 0], "agent_id": "d", "role": "decode"})
    admission = gate.admit(new_routing_id(), hello)
    assert admission.decision is Decision.UNAUTHENTICATED and admission.reply is None
    assert admission.error.code is Reason.UNAUTHENTICATED


def test_authentication_off_passes_everything():
    assert Gate(None, "prefill-0").admit(b"\0abcd", b"garbage").decision is Decision.PASS


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        b"\x92\x01",
        msgpack.packb([1, 2]),
        b"x" * 5000,
        msgpack.packb({"t": "auth_proof", "v": [1, 0], "nonce": b"1"}),
        msgpack.packb({"t": "auth_hello", "v": [9, 0]}),
        msgpack.packb({"t": "auth_hello"}),
    ],
)
def test_truncated_and_garbage_frames_are_refused_without_other_exceptions(frame):
    with pytest.raises(ProtocolError):
        decode(frame)
    admission = Gate(KEY, "prefill-0").admit(new_routing_id(), frame)
    assert admission.decision in (Decision.UNAUTHENTICATED, Decision.REFUSE)
    client = ClientHandshake(KEY, "decode-0")
    with pytest.raises(AuthError):
        client.receive(frame)


def _valid_frames():
    gate, client = Gate(KEY, "p"), ClientHandshake(KEY, "d")
    identity = new_routing_id()
    hello = client.hello()
    challenge = gate.admit(identity, hello).reply
    proof = client.receive(challenge)
    return [hello, challenge, proof, gate.admit(identity, proof).reply]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(_valid_frames()),
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4),
    st.integers(0, 200),
)
def test_mutated_frames_only_raise_protocol_or_auth_errors(frame, flips, cut):
    data = bytearray(frame)
    for position, value in flips:
        if data:
            data[position % len(data)] = value
    data = bytes(data[: max(cut, 1)] if cut < len(data) else data)
    gate = Gate(KEY, "p", NonceBook())
    assert gate.admit(new_routing_id(), data).decision in set(Decision) - {Decision.PASS}
    try:
        ClientHandshake(KEY, "d").receive(data)
    except (AuthError, ProtocolError):
        pass
