# The pd-transfer sidecar image: one `pd-transfer serve` per GPU worker.
#
#   docker build -t pd-transfer:0.1.0 .
#
# deploy/kubernetes runs this image as pd-transfer:0.1.0; push it to your registry and set
# the name there once (kustomization.yaml, images:). The user is 1000:1000, as the pods'
# securityContext expects (worker and sidecar share one user: see deploy/kubernetes).
#
# torch: by default pip's index (a CUDA build, several GB). Host-memory pools never use
# torch on the sidecar; for a smaller image point --build-arg PIP_EXTRA_INDEX_URL at a
# CPU-only torch wheel index.

ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0

# -- build: the wheel, with the native copy loop compiled into it (hatch_build.py) --------
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG TORCH_VERSION
ARG PIP_EXTRA_INDEX_URL=""
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV CC=gcc PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml hatch_build.py README.md ./
COPY configs/models ./configs/models
COPY docs/operations.md ./docs/operations.md
COPY pd_transfer ./pd_transfer
RUN python -m venv /opt/pd-transfer \
    && /opt/pd-transfer/bin/pip install "torch==${TORCH_VERSION}" \
    && /opt/pd-transfer/bin/pip install . \
    && /opt/pd-transfer/bin/python -c "import sys; from pd_transfer.transport.copy import native_loop as n; sys.exit(0 if n.AVAILABLE else 'native copy loop missing: ' + n.UNAVAILABLE_WHY)"

# -- run: the interpreter, the virtual environment, no compiler, not root -----------------
FROM python:${PYTHON_VERSION}-slim-bookworm
RUN groupadd --gid 1000 pd-serving \
    && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin pd-serving
COPY --from=build /opt/pd-transfer /opt/pd-transfer
# read-only root filesystem in the pods: no bytecode written at run time
ENV PATH=/opt/pd-transfer/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
# control (prefill), data (decode), bootstrap (prefill rank 0), HTTP: as in deploy/kubernetes
EXPOSE 7100 7200 8998 9400
ENTRYPOINT ["pd-transfer"]
CMD ["serve", "--help"]
