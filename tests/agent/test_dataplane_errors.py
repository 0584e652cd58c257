"""The data plane hands a transport's failure to its caller as the TransportError it is.

A prefill sidecar's :class:`~pd_transfer.agent.dataplane.DataPlane` connects to a
decode rank's real tcp receiver on 127.0.0.1; a plan that runs past the peer's
region fails with ``RUN_OUT_OF_REGION`` and a peer without a data address with
``TRANSPORT_UNSUPPORTED``: the caller sees a :class:`TransportError` with the
transport's own code, never a bare :class:`PdTransferError` under another code.
"""

from __future__ import annotations

import numpy as np
import pytest
import zmq.asyncio

from pd_transfer.agent.dataplane import DataPlane
from pd_transfer.config.sidecar import SidecarConfig
from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout
from pd_transfer.protocol import Register
from pd_transfer.transport import TcpReceiver

pytestmark = pytest.mark.asyncio


def _geometry(role: Role) -> RankGeometry:
    return build_instance(
        load_preset("llama-3.1-8b"), role, 1, page_size=16, kv_layout=Layout.NHD, num_pages=2
    )[0]


def _one_run(src: RankGeometry, dst: RankGeometry, dst_offset: int, nbytes: int) -> TransferPlan:
    batch = RunBatch(
        src.regions[0].id,
        dst.regions[0].id,
        np.array([0], np.int64),
        np.array([dst_offset], np.int64),
        np.array([nbytes], np.int64),
        np.ones(1, np.int64),
        0,
        0,
    )
    return TransferPlan(src.rank_id, dst.rank_id, (batch,))


async def test_a_write_past_the_peer_region_fails_with_the_transport_error_and_its_code():
    prefill, decode = _geometry(Role.PREFILL), _geometry(Role.DECODE)
    regions = {r.id: np.zeros(r.nbytes, np.uint8) for r in decode.regions}
    context = zmq.asyncio.Context()
    plane = DataPlane(SidecarConfig(role=Role.PREFILL, transport="tcp"), context)
    plane.local_regions = {r.id: np.ones(r.nbytes, np.uint8) for r in prefill.regions}
    try:
        async with TcpReceiver("127.0.0.1", regions) as receiver:
            register = Register(
                agent_id="d", host_id="elsewhere", geometry=decode, data_address=receiver.address
            )
            link = await plane.connect(register)
            nbytes = decode.regions[0].nbytes
            assert await plane.write(link, _one_run(prefill, decode, nbytes - 64, 64), 1, 0) == 64
            with pytest.raises(TransportError) as refused:
                await plane.write(link, _one_run(prefill, decode, nbytes - 32, 64), 2, 0)
            assert refused.value.code is Reason.RUN_OUT_OF_REGION, refused.value
            assert regions[decode.regions[0].id][nbytes - 64 :].tolist() == [1] * 64  # the good write only
    finally:
        await plane.close()
        context.term()


async def test_a_peer_without_a_data_address_is_refused_with_the_transport_error_and_its_code():
    context = zmq.asyncio.Context()
    plane = DataPlane(SidecarConfig(role=Role.PREFILL, transport="tcp"), context)
    try:
        register = Register(agent_id="d", host_id="elsewhere", geometry=_geometry(Role.DECODE))
        with pytest.raises(TransportError) as refused:
            await plane.connect(register)
        assert refused.value.code is Reason.TRANSPORT_UNSUPPORTED, refused.value
        assert "cannot reach decode" in refused.value.message and "publishes no data address" in str(
            refused.value
        )
    finally:
        await plane.close()
        context.term()
