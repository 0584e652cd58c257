"""The torch (device) executor moves plans byte-exact; on CPU tensors, and on CUDA tensors where a GPU is present."""

import numpy as np
import pytest
import torch

from pd_transfer.errors import TransportError
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.planner import plan_pair
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.memory.cuda_ipc import cuda_available
from pd_transfer.testing import World
from pd_transfer.transport.copy.device import execute_on_device

ON_GPU = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not cuda_available(), reason="no CUDA device on this machine"),
    ],
)


@pytest.mark.parametrize("per_run_max", [0, 1 << 20], ids=["rows", "per-run"])
@pytest.mark.parametrize("device", ["cpu", ON_GPU])
@pytest.mark.parametrize(
    "model,tp_src,tp_dst,layout",
    [
        ("llama-3.1-8b", 2, 4, Layout.NHD),
        ("llama-3.1-8b", 4, 1, Layout.PAGE_FIRST),
        ("qwen3-next-80b-a3b", 2, 4, Layout.HND),
    ],
)
def test_device_executor_is_byte_exact(model, tp_src, tp_dst, layout, device, per_run_max):
    spec = load_preset(model)
    shape = {"page_size": 16, "num_pages": 5, "num_slots": 2, "num_aux_rows": 2}
    prefill = build_instance(spec, Role.PREFILL, tp_src, kv_layout=Layout.NHD, **shape)
    decode = build_instance(spec, Role.DECODE, tp_dst, kv_layout=layout, **shape)
    recon = reconcile(prefill, decode)
    world = World.build(prefill, decode, 3)
    requests = {Pool.KV: (np.array([4, 0, 2]), np.array([1, 3, 0])), Pool.AUX: (np.array([1]), np.array([0]))}
    if any(v.pool is Pool.MAMBA for v in prefill[0].views):
        requests[Pool.MAMBA] = (np.array([1]), np.array([0]))
    src = {
        g.rank_id: {k: torch.from_numpy(v).to(device) for k, v in world.prefill_buffers[g.rank_id].items()}
        for g in prefill
    }
    dst = {
        g.rank_id: {k: torch.from_numpy(v).to(device) for k, v in world.decode_buffers[g.rank_id].items()}
        for g in decode
    }
    assert _execute_all(world, recon, requests, src, dst, per_run_max) == []


@pytest.mark.parametrize("per_run_max", [0, 1 << 20], ids=["rows", "per-run"])
@pytest.mark.parametrize("device", ["cpu", ON_GPU])
@pytest.mark.parametrize("host_side", ["source", "destination"])
def test_host_regions_as_numpy_arrays_meet_tensors_byte_exact(host_side, device, per_run_max):
    """A sidecar maps host pools as numpy arrays (it loads torch only for CUDA): the device
    executor views them as tensors, on either side of a copy."""
    spec = load_preset("llama-3.1-8b")
    shape = {"page_size": 16, "num_pages": 5, "num_aux_rows": 2}
    prefill = build_instance(spec, Role.PREFILL, 2, kv_layout=Layout.NHD, **shape)
    decode = build_instance(spec, Role.DECODE, 4, kv_layout=Layout.HND, **shape)
    recon = reconcile(prefill, decode)
    world = World.build(prefill, decode, 5)
    requests = {Pool.KV: (np.array([3, 1]), np.array([0, 4])), Pool.AUX: (np.array([0]), np.array([1]))}

    def regions(buffers, host):
        return {k: v if host else torch.from_numpy(v.copy()).to(device) for k, v in buffers.items()}

    src = {g.rank_id: regions(world.prefill_buffers[g.rank_id], host_side == "source") for g in prefill}
    dst = {g.rank_id: regions(world.decode_buffers[g.rank_id], host_side == "destination") for g in decode}
    assert _execute_all(world, recon, requests, src, dst, per_run_max) == []


def _execute_all(world, recon, requests, src: dict, dst: dict, per_run_max: int) -> list[str]:
    """Every rank pair's plan through the device executor; what landed in tensors goes back
    into the oracle's decode buffers (returned means landed: no sync here); the verdict."""
    prefill = {g.rank_id: g for g in recon.prefill}
    for d in recon.decode:
        for s in recon.sources_for(d):
            execute_on_device(
                plan_pair(recon, prefill[s], d, requests), src[s], dst[d.rank_id], per_run_max=per_run_max
            )
    for d in recon.decode:
        for k, memory in dst[d.rank_id].items():
            if isinstance(memory, torch.Tensor):
                world.decode_buffers[d.rank_id][k][:] = memory.cpu().numpy()
    return world.verify(requests)


def test_device_executor_refuses_out_of_bounds_runs_before_moving_anything():
    from pd_transfer.layout.lowering import RunBatch, TransferPlan

    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(32, dtype=torch.uint8)
    one = np.ones(2, np.int64)
    plan = TransferPlan(
        "p", "d", (RunBatch("a", "b", np.array([0, 8]), np.array([0, 30]), np.array([8, 8]), one, 8, 8),)
    )
    with pytest.raises(TransportError):
        execute_on_device(plan, {"a": src}, {"b": dst})
    assert int(dst.sum()) == 0
