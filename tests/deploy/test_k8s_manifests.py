"""deploy/kubernetes: objects are well-formed and wired together (pods, sidecar config,
probes, shared /dev/shm, Services, PodMonitor, PrometheusRule)."""

import dataclasses
import shutil
import subprocess
import tomllib
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_files import KUBERNETES, PROMETHEUS

from pd_transfer.config.sidecar import SidecarConfig, load_sidecar_config

SIDECAR_IMAGE = "pd-transfer:0.1.0"  # the Dockerfile's (test_dockerfile.py)
CONFIG_PATH = "/etc/pd-transfer/sidecar.toml"


def _pod(statefulset):
    return statefulset["spec"]["template"]["spec"]


def _containers(statefulset):
    spec = _pod(statefulset)
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def _sidecar(statefulset):
    return _containers(statefulset)["pd-transfer"]


def _ports(container):
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _sidecar_config(kustomization, statefulset):
    """The sidecar's config: the TOML file behind the ConfigMap its pod mounts."""
    volume = next(v for v in _pod(statefulset)["volumes"] if "configMap" in v)
    generator = next(
        g for g in kustomization["configMapGenerator"] if g["name"] == volume["configMap"]["name"]
    )
    key, source = generator["files"][0].split("=")
    assert key == CONFIG_PATH.rsplit("/", 1)[1]
    return volume, load_sidecar_config(str(KUBERNETES / source), {})


def test_kustomization_lists_every_manifest_and_generated_config(kustomization):
    manifests = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests
    for generator in kustomization["configMapGenerator"]:
        for entry in generator["files"]:
            assert (KUBERNETES / entry.split("=")[-1]).is_file(), entry


def test_every_object_has_api_version_kind_and_name(k8s_docs):
    for path, doc in k8s_docs:
        assert doc.get("apiVersion") and doc.get("kind"), path
        assert doc.get("metadata", {}).get("name"), f"{path}: {doc['kind']} without metadata.name"


def test_there_is_a_prefill_and_a_decode_statefulset(statefulsets):
    assert set(statefulsets) == {"prefill", "decode"}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pod_runs_a_placeholder_worker_and_the_sidecar(statefulsets, role):
    containers = _containers(statefulsets[role])
    assert set(containers) == {"worker", "pd-transfer"}
    assert "PLACEHOLDER" in containers["worker"]["image"]
    sidecar = containers["pd-transfer"]
    assert sidecar["image"] == SIDECAR_IMAGE
    assert sidecar["command"] == ["pd-transfer", "serve", "--role", role, "--config", CONFIG_PATH]
    # a native sidecar: started before the worker, stopped after it
    assert sidecar in _pod(statefulsets[role])["initContainers"]
    assert sidecar["restartPolicy"] == "Always"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sidecar_config_loads_and_matches_the_pod(statefulsets, kustomization, role):
    statefulset = statefulsets[role]
    volume, config = _sidecar_config(kustomization, statefulset)
    assert config.role.value == role
    mounts = {m["name"]: m["mountPath"] for m in _sidecar(statefulset)["volumeMounts"]}
    assert mounts[volume["name"]] == CONFIG_PATH.rsplit("/", 1)[0]
    # kubelet probes and Prometheus reach the pod IP, not loopback
    assert config.http_host == "0.0.0.0"
    assert _ports(_sidecar(statefulset))["metrics"] == config.http_port == 9400
    # the worker socket (unix://) lies in a volume both containers mount
    socket_dir = urlsplit(config.worker_endpoint).path.rsplit("/", 1)[0]
    for container in _containers(statefulset).values():
        assert socket_dir in {m["mountPath"] for m in container["volumeMounts"]}, container["name"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sidecar_probes_hit_healthz_and_readyz_on_the_metrics_port(statefulsets, role):
    sidecar = _sidecar(statefulsets[role])
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert sidecar["startupProbe"]["httpGet"]["port"] == "metrics"
    assert _ports(sidecar)["metrics"] == 9400


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_dev_shm_is_a_memory_emptydir_shared_by_both_containers(statefulsets, role):
    statefulset = statefulsets[role]
    shm_volumes = {
        m["name"]
        for c in _containers(statefulset).values()
        for m in c["volumeMounts"]
        if m["mountPath"] == "/dev/shm"
    }
    assert len(shm_volumes) == 1
    volume = next(v for v in _pod(statefulset)["volumes"] if v["name"] in shm_volumes)
    assert volume["emptyDir"]["medium"] == "Memory"
    assert volume["emptyDir"]["sizeLimit"]
    for container in _containers(statefulset).values():
        assert "/dev/shm" in {m["mountPath"] for m in container["volumeMounts"]}, container["name"]


def test_sidecar_ports_match_each_roles_config(statefulsets, kustomization):
    prefill, decode = statefulsets["prefill"], statefulsets["decode"]
    _, prefill_config = _sidecar_config(kustomization, prefill)
    _, decode_config = _sidecar_config(kustomization, decode)
    assert _ports(_sidecar(prefill)) == {
        "control": prefill_config.control_port,
        "bootstrap": 8998,
        "metrics": 9400,
    }
    assert _ports(_sidecar(decode)) == {"data": decode_config.data_port, "metrics": 9400}


def test_port_names_are_unique_and_valid_in_each_pod(statefulsets):
    for statefulset in statefulsets.values():
        names = [p["name"] for c in _containers(statefulset).values() for p in c.get("ports", [])]
        assert len(names) == len(set(names))
        assert all(len(name) <= 15 for name in names)


def test_every_container_has_requests_and_limits_and_only_the_worker_a_gpu(statefulsets):
    for statefulset in statefulsets.values():
        for name, container in _containers(statefulset).items():
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), name
            assert "memory" in resources["limits"], name
            has_gpu = "nvidia.com/gpu" in resources["limits"]
            assert has_gpu == (name == "worker"), name


def test_prefill_args_bind_the_bootstrap_at_rank_0_of_the_headless_service(statefulsets):
    statefulset = statefulsets["prefill"]
    args = _sidecar(statefulset)["args"]
    bootstrap = urlsplit(args[args.index("--bootstrap") + 1])
    rank0 = f"{statefulset['metadata']['name']}-0.{statefulset['spec']['serviceName']}."
    assert bootstrap.hostname.startswith(rank0)
    assert bootstrap.port == _ports(_sidecar(statefulset))["bootstrap"]
    assert args[args.index("--control-host") + 1] == "$(POD_IP)"


def test_decode_resolves_prefill_through_its_bootstrap_service(statefulsets, kustomization, k8s_docs):
    _, config = _sidecar_config(kustomization, statefulsets["decode"])
    services = {doc["metadata"]["name"]: doc for _, doc in k8s_docs if doc["kind"] == "Service"}
    (address,) = config.prefill_bootstraps
    target = urlsplit(address)
    service = services[target.hostname]
    assert {p["port"]: p["targetPort"] for p in service["spec"]["ports"]}[target.port] == "bootstrap"
    assert service["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "pd-prefill-0"


def test_services_select_pods_and_target_their_named_ports(statefulsets, k8s_docs):
    services = [doc for _, doc in k8s_docs if doc["kind"] == "Service"]
    assert services
    for service in services:
        selector = dict(service["spec"]["selector"])
        pod_name = selector.pop("statefulset.kubernetes.io/pod-name", None)
        matches = [
            s
            for s in statefulsets.values()
            if selector.items() <= s["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matches) == 1, service["metadata"]["name"]
        statefulset = matches[0]
        if pod_name is not None:
            ordinal = int(pod_name.removeprefix(statefulset["metadata"]["name"] + "-"))
            assert 0 <= ordinal < statefulset["spec"]["replicas"]
        ports = {n for c in _containers(statefulset).values() for n in _ports(c)}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)


def test_each_statefulset_has_its_headless_service_publishing_unready_pods(statefulsets, k8s_docs):
    services = {doc["metadata"]["name"]: doc for _, doc in k8s_docs if doc["kind"] == "Service"}
    for statefulset in statefulsets.values():
        headless = services[statefulset["spec"]["serviceName"]]["spec"]
        assert headless["clusterIP"] == "None"
        assert headless["publishNotReadyAddresses"] is True


def test_podmonitor_scrapes_the_metrics_port_of_both_roles(statefulsets, k8s_docs):
    (monitor,) = [doc for _, doc in k8s_docs if doc["kind"] in ("PodMonitor", "ServiceMonitor")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    for statefulset in statefulsets.values():
        assert selector <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    # the job name the alert rules select on
    assert {"targetLabel": "job", "replacement": "pd-transfer"} in endpoint["relabelings"]


def test_prometheus_rule_carries_the_same_groups_as_the_alerts_file(k8s_docs):
    (rule,) = [doc for _, doc in k8s_docs if doc["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    alerts = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def test_sidecar_config_files_are_plain_toml_with_a_sidecar_table():
    for path in KUBERNETES.glob("*.toml"):
        assert set(tomllib.loads(path.read_text())) == {"sidecar"}, path


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_with_generated_configmaps_wired_in():
    result = subprocess.run(
        ["kubectl", "kustomize", str(KUBERNETES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    configmaps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    for doc in docs:
        if doc["kind"] == "StatefulSet":
            volumes = doc["spec"]["template"]["spec"]["volumes"]
            names = {v["configMap"]["name"] for v in volumes if "configMap" in v}
            assert names and names <= configmaps


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sidecar_environment_holds_no_unknown_config_variables(statefulsets, kustomization, role):
    # PD_TRANSFER_* variables are settings, and any other is refused (exit 2). Service links
    # could inject one (PD_TRANSFER_HTTP_PORT for a Service named pd-transfer-http): off.
    statefulset = statefulsets[role]
    assert _pod(statefulset)["enableServiceLinks"] is False
    env = _sidecar(statefulset).get("env", [])
    fields = {f.name.upper() for f in dataclasses.fields(SidecarConfig)}
    for name in {e["name"] for e in env}:
        if name.startswith("PD_TRANSFER_"):
            assert name.removeprefix("PD_TRANSFER_") in fields, name
    # the start as the sidecar sees it: the ConfigMap's file, the literal variables, --role
    volume = next(v for v in _pod(statefulset)["volumes"] if "configMap" in v)
    generator = next(
        g for g in kustomization["configMapGenerator"] if g["name"] == volume["configMap"]["name"]
    )
    source = KUBERNETES / generator["files"][0].split("=")[1]
    environ = {e["name"]: e["value"] for e in env if "value" in e}
    flags = {"role": "--role"}
    assert load_sidecar_config(str(source), {"role": role}, environ, flags=flags).role.value == role


def _secret_mounts(container, pod) -> dict[str, str]:
    """mountPath -> Secret name of the Secret volumes ``container`` mounts."""
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    return {
        m["mountPath"]: secrets[m["name"]] for m in container.get("volumeMounts", []) if m["name"] in secrets
    }


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sidecar_and_worker_read_the_shared_secret_from_a_mounted_secret(statefulsets, kustomization, role):
    statefulset = statefulsets[role]
    pod, containers = _pod(statefulset), _containers(statefulset)
    volume = next(v for v in pod["volumes"] if "configMap" in v)
    generator = next(
        g for g in kustomization["configMapGenerator"] if g["name"] == volume["configMap"]["name"]
    )
    source = generator["files"][0].split("=")[1]
    # read without this process's environment: PD_TRANSFER_SECRET_FILE would override the file
    config = load_sidecar_config(str(KUBERNETES / source), {}, {})
    assert config.secret_file and not config.allow_insecure
    if role == "decode":  # one name for every rank: rooms are bound to it (docs/security.md)
        assert config.instance_id == statefulset["metadata"]["name"]
    secret_dir, secret_name = config.secret_file.rsplit("/", 1)[0], "pd-transfer-secret"
    assert _secret_mounts(containers["pd-transfer"], pod) == {secret_dir: secret_name}
    # the worker's client proves the same secret to its sidecar
    env = {e["name"]: e.get("value") for e in containers["worker"]["env"]}
    assert env["PD_TRANSFER_SECRET_FILE"] == config.secret_file
    assert _secret_mounts(containers["worker"], pod) == {secret_dir: secret_name}
    secret_volume = next(v for v in pod["volumes"] if "secret" in v)
    assert secret_volume["secret"]["defaultMode"] == 0o400
    assert secret_volume["secret"].get("optional", False) is False  # no Secret: the pod waits


def test_the_secret_is_made_per_deployment_never_committed(kustomization):
    assert "secretGenerator" not in kustomization
    assert not list(KUBERNETES.glob("*secret*"))
