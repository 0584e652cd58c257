"""CUDA IPC registration and device copies. These need a GPU; without one they skip."""

import subprocess
import sys

import pytest

from pd_transfer.memory.cuda_ipc import cuda_available, open_handle, share

needs_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="no CUDA device on this machine"),
]


@needs_gpu[0]
@needs_gpu[1]
def test_cuda_ipc_handle_opens_the_same_memory_in_another_process():
    import torch

    tensor = torch.arange(256, dtype=torch.uint8, device="cuda")
    handle = share(tensor)
    code = (
        "import sys, torch; from pd_transfer.memory.cuda_ipc import open_handle\n"
        "t = open_handle(sys.argv[1], 256)\n"
        "assert t.is_cuda and int(t[:256].sum()) == sum(range(256)) % (1 << 64)\n"
        "t[:4] = 7; torch.cuda.synchronize()\n"
    )
    subprocess.run([sys.executable, "-c", code, handle], check=True, timeout=120)
    torch.cuda.synchronize()
    assert tensor[:4].tolist() == [7, 7, 7, 7]


@pytest.mark.parametrize(
    "handle", ["cuda-ipc:not-base64!!", "cuda-ipc:" + "A" * 5000, "cuda-ipc:kgE=", "shm-name"]
)
def test_malformed_handles_are_refused_without_unpickling(handle):
    from pd_transfer.errors import PdTransferError

    with pytest.raises(PdTransferError):
        open_handle(handle, 1)
