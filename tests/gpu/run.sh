#!/usr/bin/env bash
# The GPU checks, on a CUDA host: the gpu-marked tests, then sidecar_bench with
# CUDA pools and with host pools. Logs go to $OUT (or /tmp/pdt-gpu).
#   bash tests/gpu/run.sh
# Wheels in .whl/ (e.g. pyzmq, where the host has none) are installed to /tmp/site first.
set -uo pipefail
out=${OUT:-/tmp/pdt-gpu}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, zmq, msgpack, uvloop; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'zmq', zmq.__version__)"
timeout 150 python3 -m pytest -m gpu -rs -p no:cacheprovider tests/gpu tests/transport/copy/test_device_copy.py \
    tests/agent/test_device_transfers.py 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}
timeout 60 python3 benchmarks/sidecar_bench.py --device cuda --tokens 4096 --repeats 3 2>&1 | tee "$out/bench-cuda.log"
timeout 60 python3 benchmarks/sidecar_bench.py --only shm --tokens 4096 --repeats 3 2>&1 | tee "$out/bench-host.log"
exit "$status"
