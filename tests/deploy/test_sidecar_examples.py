"""configs/sidecars: a prefill and a decode example per model preset, each a valid sidecar
config that fits the systemd unit (deploy/systemd) and a shared host."""

from pathlib import Path
from urllib.parse import urlsplit

import pytest
from deploy_files import ROOT, SIDECARS

from pd_transfer.config.sidecar import load_sidecar_config

PRESETS = sorted(p.stem for p in (ROOT / "configs" / "models").glob("*.toml"))
EXAMPLES = sorted(SIDECARS.glob("*.toml"))


def test_there_is_a_prefill_and_a_decode_example_per_preset():
    assert PRESETS
    expected = {f"{preset}.{role}.toml" for preset in PRESETS for role in ("prefill", "decode")}
    assert {p.name for p in EXAMPLES} == expected


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads_with_the_role_in_its_name(path):
    config = load_sidecar_config(str(path), {})
    assert config.role.value == path.name.split(".")[-2]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_worker_endpoint_and_ready_file_lie_in_the_instances_runtime_directory(path):
    # pd-transfer@gpuN.service creates /run/pd-transfer/gpuN (RuntimeDirectory=pd-transfer/%i)
    config = load_sidecar_config(str(path), {})
    socket = Path(urlsplit(config.worker_endpoint).path)
    assert socket.parent.parent == Path("/run/pd-transfer")
    assert Path(config.ready_file).parent == socket.parent


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_and_decode_examples_can_share_a_host(preset):
    prefill = load_sidecar_config(str(SIDECARS / f"{preset}.prefill.toml"), {})
    decode = load_sidecar_config(str(SIDECARS / f"{preset}.decode.toml"), {})
    assert {prefill.control_port, prefill.http_port}.isdisjoint({decode.data_port, decode.http_port})
    assert prefill.worker_endpoint != decode.worker_endpoint
    # decode resolves the prefill instance this example binds
    assert decode.prefill_bootstraps == (prefill.bootstrap,)
