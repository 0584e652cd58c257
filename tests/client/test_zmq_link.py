"""The blocking ZeroMQ link notices when the sidecar's end of its connection closes."""

import time

import zmq

from pd_transfer.client.links import ZmqLink


def _until(predicate, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_alive_until_the_sidecar_side_closes_then_a_reset_starts_afresh(tmp_path):
    context = zmq.Context()
    endpoint = f"ipc://{tmp_path}/sidecar.sock"
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint)
    link = ZmqLink(endpoint, context, random_id=False)
    try:
        assert link.alive()  # not connected yet is not dropped
        assert link.send(b"hello", time.monotonic() + 3)
        assert router.poll(3000) and router.recv_multipart()[-1] == b"hello"
        assert link.alive()
        router.close(linger=0)  # the sidecar's process ends
        assert _until(lambda: not link.alive()), "the dropped connection went unnoticed"
        assert not link.alive()  # stays dropped, even if a new sidecar binds
        link.reset()
        assert link.alive()
    finally:
        link.close()
        link.close()  # twice: harmless
        context.term()
