"""Fuzz a live prefill sidecar on all three sockets; it stays up and still moves bytes exactly.

Hypothesis draws random bytes, byte-level mutations and field-level mutations
of valid frames (every protocol message, every worker request, the bootstrap
frames) and a raw DEALER sends them to the prefill sidecar of a running
prefill TP 1 / decode TP 1 deployment. For each socket the test checks that
the sidecar process stays alive, that every frame it must refuse is counted
in ``pd_transfer_bad_frames_total`` (scraped over HTTP) or answered, that
every reply is well-formed, and, at the end, that a room between the same
sidecars is byte-exact (oracle). The frames sent are printed in the terminal
summary ("sidecar fuzz: ...") and recorded as the ``frames_sent`` property.
"""

import json
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq
from cluster import Sidecar
from fault_tools import kv_requests, metric_by_label, metric_total, tiny_ranks, wait_for
from fuzz_frames import (
    BYTE_OPS,
    FRAMES_SENT,
    FRAMES_SKIPPED,
    HELLO,
    FreshSessions,
    Target,
    bootstrap_kind,
    bootstrap_seeds,
    byte_mutation,
    control_seeds,
    field_mutation,
    worker_kind,
    worker_seeds,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_samples import every_frame_type, rank_entry

from pd_transfer.client import Refused, RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Close, RankTable, TableRequest, decode, encode

EXAMPLES = 500  # per socket
INSECURE = {"allow_insecure": True}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=24),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def frames(seeds: list[bytes]):
    return st.one_of(
        st.binary(max_size=128),
        st.builds(
            byte_mutation,
            st.sampled_from(seeds),
            st.lists(
                st.tuples(st.sampled_from(BYTE_OPS), st.integers(0, 1 << 20), st.integers(0, 255)),
                min_size=1,
                max_size=4,
            ),
        ),
        st.builds(field_mutation, st.sampled_from(seeds), st.integers(0, 1 << 20), msgpack_values),
    )


@pytest.fixture(scope="module")
def cluster(module_deployment):
    # rooms the fuzz opens (a send, a transfer request) expire after 2 s, so none is
    # left to drain when the sidecars stop
    # insecure on purpose: the fuzz aims at the frame parsers behind authentication
    # (tests/security checks what a sidecar with a secret refuses before the handshake)
    return module_deployment(
        tiny_ranks(Role.PREFILL, 1),
        tiny_ranks(Role.DECODE, 1),
        config={"bootstrap_timeout_s": 2.0, **INSECURE},
    )


def _prefill(cluster):
    return cluster.prefill[0].rank_id


def _bad_frames(cluster) -> float:
    status, text = cluster.http(_prefill(cluster), "/metrics")
    assert status == 200
    return metric_total(text, "pd_transfer_bad_frames_total")


def _alive(cluster) -> None:
    for name, sidecar in cluster.sidecars.items():
        assert sidecar.proc.poll() is None, f"{name} died: {sidecar.log.read_text()[-3000:]}"
    assert cluster.http(_prefill(cluster), "/healthz")[0] == 200


def _report(target, record_property) -> None:
    FRAMES_SENT[target.name] += target.sent
    record_property(f"frames_sent_{target.name}", target.sent)
    print(f"\n{target.name}: {target.sent} frames {dict(target.kinds)}, {len(target.replies)} replies")


def test_control_socket_counts_every_frame_its_session_refuses(cluster, record_property):
    target = FreshSessions("control", cluster.ready[_prefill(cluster)]["control_address"])
    seeds = control_seeds(every_frame_type())
    before = _bad_frames(cluster)

    @FUZZ
    @given(frames(seeds), st.booleans())
    def fuzz(frame, after_hello):
        target.send(frame, after_hello)

    try:
        fuzz()
        # every frame the session refuses is counted (and answered with a Close or a
        # room-level reply); valid ones are handled, and nothing else is counted
        wait_for(
            lambda: _bad_frames(cluster) - before >= target.kinds["counted"],
            15,
            f"{target.kinds['counted']} refused control frames counted",
        )
        time.sleep(0.2)
        assert _bad_frames(cluster) - before == target.kinds["counted"]
        _alive(cluster)
    finally:
        _report(target, record_property)


def test_worker_endpoint_answers_every_fuzzed_request(cluster, record_property):
    prefill = cluster.prefill[0]
    target = Target("worker", cluster.sidecars[prefill.rank_id].endpoint)
    seeds = worker_seeds(prefill, cluster.pools[prefill.rank_id].handles)
    before = _bad_frames(cluster)

    @FUZZ
    @given(frames(seeds))
    def fuzz(frame):
        target.send(frame, worker_kind(frame))

    try:
        fuzz()
        wanted = target.sent - target.kinds["slow_wait"]
        assert target.drain_until(wanted, 15) >= wanted
        replies = [msgpack.unpackb(r, raw=False) for r in target.replies]
        refused = [r for r in replies if not r["ok"]]
        assert all(isinstance(r["code"], str) and r["reason"] for r in refused)
        internal = [r["reason"] for r in refused if r["reason"].startswith("internal error")]
        assert internal == [], f"requests that reached a bug instead of a check: {internal[:5]}"
        # each malformed request is counted once (by the time its reply left); refusals
        # of well-formed ones (unknown room, already registered) are not bad frames
        assert _bad_frames(cluster) - before == target.kinds["bad"]
        _alive(cluster)
    finally:
        target.close()
        _report(target, record_property)


def test_bootstrap_socket_answers_table_requests_and_refuses_the_rest(cluster, record_property):
    target = Target("bootstrap", cluster.bootstrap)
    seeds = bootstrap_seeds(rank_entry())
    real = cluster.ready[_prefill(cluster)]["control_address"]

    @FUZZ
    @given(frames(seeds))
    def fuzz(frame):
        kind = bootstrap_kind(frame)
        if kind == "announce":
            # a well-formed announce replaces a rank's entry: an authentication matter
            # (issue 5 item 1), not malformed input; counted here, not sent
            FRAMES_SKIPPED["well-formed announces"] += 1
            return
        target.send(frame, kind)

    try:
        fuzz()
        # a table request gets the table; a bad frame nothing, or a Close with its reason
        target.drain_until(target.kinds["table_request"], 15)
        target.drain(0.2)
        replies = [decode(reply) for reply in target.replies]
        tables = [r for r in replies if isinstance(r, RankTable)]
        assert len(tables) == target.kinds["table_request"]
        assert all(isinstance(r, Close) and r.reason for r in replies if not isinstance(r, RankTable))
        for table in tables:
            assert table.complete and [e.control_address for e in table.entries] == [real]
        _alive(cluster)
    finally:
        target.close()
        _report(target, record_property)


# -- frames the fuzz found neither answered nor counted ---------------------------------


def _raw(address: str, *messages, parts=1, wait_s: float = 0.5) -> list[bytes]:
    """Send ``messages`` (each as ``parts`` frames) on a new DEALER; the replies."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        for message in messages:
            socket.send_multipart([message] * parts)
        replies = []
        while socket.poll(int(wait_s * 1000)):
            replies.append(socket.recv())
        return replies
    finally:
        socket.close()


def test_a_bootstrap_frame_on_the_control_socket_is_counted_and_answered(cluster):
    before = _bad_frames(cluster)
    replies = _raw(
        cluster.ready[_prefill(cluster)]["control_address"],
        encode(TableRequest(agent_id="lost-0")),
        wait_s=0.3,
    )
    assert _bad_frames(cluster) - before == 1
    assert [type(decode(r)).__name__ for r in replies] == ["Close"]


def test_a_multipart_message_on_the_control_socket_is_counted(cluster):
    before = _bad_frames(cluster)
    _raw(cluster.ready[_prefill(cluster)]["control_address"], HELLO, parts=2, wait_s=0.1)
    wait_for(lambda: _bad_frames(cluster) - before == 1, 0.3, "the 2-part message counted")


def test_bad_frames_on_the_bootstrap_socket_are_counted_in_metrics(cluster):
    before = _bad_frames(cluster)
    _raw(cluster.bootstrap, b"\x81\xa1t\xa3bad", parts=1, wait_s=0.1)
    wait_for(lambda: _bad_frames(cluster) - before == 1, 0.3, "the bootstrap bad frame counted")


def test_a_multipart_worker_request_is_counted(cluster):
    # multipart messages exist on a ZeroMQ ipc:// endpoint only (a unix:// stream has none)
    workdir = Path(tempfile.mkdtemp(prefix="pdt-"))
    sidecar = Sidecar(workdir, "prefill", "p-ipc", {"http_port": 0, **INSECURE}, worker_scheme="ipc")
    try:
        ready = sidecar.wait_ready()

        def bad_frames() -> float:
            with urllib.request.urlopen(ready["http_address"] + "/metrics", timeout=5) as response:
                return metric_total(response.read().decode(), "pd_transfer_bad_frames_total")

        request = worker_seeds(cluster.prefill[0], cluster.pools[_prefill(cluster)].handles)[5]
        _raw(sidecar.endpoint, request, parts=2, wait_s=0.1)
        wait_for(lambda: bad_frames() == 1, 0.3, "the 2-part request counted")
    finally:
        sidecar.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_page_index_beyond_int64_is_refused_naming_the_field(cluster):
    client = cluster.clients[_prefill(cluster)]
    with pytest.raises(Refused) as err:
        client._call({"op": "send", "room": 5, "pages": [2**63], "last": True})
    assert err.value.code_text == "bad_field" and "$.pages" in err.value.reason


def test_a_negative_room_id_is_refused_at_expect(cluster):
    client = cluster.clients[cluster.decode[0].rank_id]
    with pytest.raises(Refused) as err:
        client._call({"op": "expect", "room": -5, "bootstrap": cluster.bootstrap, "pages": [0]})
    assert err.value.code_text == "bad_field" and "$.room" in err.value.reason


def test_sessions_refused_or_gone_silent_leave_nothing_behind(cluster):
    """Each session the sidecar closes over a bad frame, and each that said Hello and went
    silent, is forgotten: fuzz_sidecar.py once grew the prefill sidecar by 1 GB a minute
    (every refused session kept, with its peer entry and the errors' tracebacks)."""
    prefill = _prefill(cluster)

    def held() -> tuple[int, int]:
        status = json.loads(cluster.http(prefill, "/status")[1])
        return status["control_sessions"], len(status["peers"])

    wait_for(lambda: held()[0] <= 1, 5, "the earlier tests' sessions gone")  # the decode peer's
    before = held()
    sessions = FreshSessions("control", cluster.ready[prefill]["control_address"])
    for i in range(150):  # Hello, then a frame the session refuses with a Close
        bad = encode(TableRequest(agent_id=f"lost-{i}")) if i % 2 else b"\xc1" * (i % 7 + 1)
        assert sessions.send(bad, after_hello=True) == "counted"
    for _ in range(20):  # Hello, then silence: lost after 5 heartbeats of 0.2 s
        assert sessions.send(HELLO, after_hello=False) == "accepted"
    wait_for(
        lambda: held() == before, 60, f"sessions and peers back to {before}"
    )  # a silent session whose connection stays up is slow until slow_peer_limit_s
    _alive(cluster)


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -1.0, 1e300])
def test_a_wait_timeout_that_is_no_duration_is_refused_naming_the_field(cluster, timeout_s):
    """NaN once reached the room's timer as an internal error (found by fuzz_sidecar.py)."""
    client = cluster.clients[_prefill(cluster)]
    with pytest.raises(Refused) as err:
        client._call({"op": "wait", "room": 6, "timeout_s": timeout_s})
    assert err.value.code_text == "bad_field" and "$.timeout_s" in err.value.reason
    _alive(cluster)


def test_after_the_fuzz_a_room_between_the_same_sidecars_is_byte_exact(cluster):
    _alive(cluster)
    requests = kv_requests([0, 5, 9, 15], [3, 2, 1, 0])
    room = 2**40 + 17  # far from every room id the fuzz frames carry
    cluster.expect(room, requests)
    cluster.send(room, requests)
    assert cluster.wait_decode(room)[cluster.decode[0].rank_id].status is RoomStatus.SUCCESS
    assert cluster.verify(requests) == []
    status, text = cluster.http(_prefill(cluster), "/metrics")
    counted = metric_by_label(text, "pd_transfer_bad_frames_total", "reason")
    print(f"\nprefill bad_frames by reason: {dict(sorted(counted.items()))}")
