# syntax=docker/dockerfile:1
# asyncrl images, one target per accelerator; every role runs from the same image:
#   docker build --target cpu  -t asyncrl:cpu  .   # torch CPU build
#   docker build --target cuda -t asyncrl:cuda .   # torch CUDA build; SGLang in /opt/sglang
#   docker build --target npu  -t asyncrl:npu  .   # CANN toolkit + torch-npu (Ascend)
# The entry point is the `asyncrl` CLI: `docker run asyncrl:cpu launch --role rollout ...`.
# Each target installs into /opt/venv in a build stage and copies only that venv into its
# runtime stage, so compilers and pip caches stay out of the image. Every target has the `ray`
# extra, so the same image serves as the nodes of a KubeRay cluster (deploy/k8s/ray).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG CANN_IMAGE=ascendai/cann:8.2.rc1-910b-ubuntu22.04-py3.11
ARG TORCH_VERSION=2.13.0
# SGLang pins torch and transformers exactly, to versions asyncrl's pins exclude: it gets a venv
# of its own (/opt/sglang), which asyncrl only starts (`rollout.engine.python`) and talks to
# over HTTP. `tools/check_resolve.py` resolves both environments of the cuda target.
ARG SGLANG_VERSION=0.5.23

# ---- the asyncrl wheel, built once for all targets --------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY asyncrl ./asyncrl
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- cpu ---------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu-build
ARG TORCH_VERSION
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The CPU index first: PyPI's Linux torch is the CUDA build, gigabytes this target never uses.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
        "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/asyncrl-*.whl)[ray]"

FROM ${PYTHON_IMAGE} AS cpu
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=cpu-build /opt/venv /opt/venv
COPY configs /opt/asyncrl/configs
# KubeRay's default probes run wget in the Ray containers.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*
# KubeRay starts Ray under `bash -l`, whose /etc/profile resets PATH: the commands must also be
# on the default one. A fixed uid, so Kubernetes' runAsNonRoot can check it and volumes can be
# chowned to it.
RUN ln -s /opt/venv/bin/asyncrl /opt/venv/bin/ray /usr/local/bin/ \
    && useradd --uid 10001 --user-group --create-home asyncrl \
    && install -d -o asyncrl -g asyncrl /work /data
USER 10001
WORKDIR /work
EXPOSE 9400
ENTRYPOINT ["asyncrl"]
CMD ["--help"]

# ---- cuda --------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS cuda-base
# Ubuntu's own Python (3.12 on 24.04); PyPI's torch wheels bring their CUDA libraries, the base
# image the driver-facing runtime and cuDNN. wget: for KubeRay's probes, as in `cpu`.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates wget \
    && rm -rf /var/lib/apt/lists/*

FROM cuda-base AS cuda-build
ARG TORCH_VERSION
ARG SGLANG_VERSION
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir "$(ls /wheels/asyncrl-*.whl)[ray]" \
    && python3 -m venv /opt/sglang \
    && /opt/sglang/bin/pip install --no-cache-dir "sglang==${SGLANG_VERSION}"

FROM cuda-base AS cuda
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=cuda-build /opt/venv /opt/venv
COPY --from=cuda-build /opt/sglang /opt/sglang
COPY configs /opt/asyncrl/configs
RUN ln -s /opt/venv/bin/asyncrl /opt/venv/bin/ray /usr/local/bin/ \
    && useradd --uid 10001 --user-group --create-home asyncrl \
    && install -d -o asyncrl -g asyncrl /work /data
USER 10001
WORKDIR /work
EXPOSE 9400
ENTRYPOINT ["asyncrl"]
CMD ["--help"]

# ---- npu ---------------------------------------------------------------------------------------
# The CANN image brings the Ascend toolkit and exports its environment (ASCEND_TOOLKIT_HOME,
# LD_LIBRARY_PATH, PYTHONPATH) as image ENV, so the exec-form entry point needs no set_env.sh.
FROM ${CANN_IMAGE} AS npu-build
ARG TORCH_VERSION
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY --from=wheel /wheels /wheels
# torch-npu extends the CPU build of torch.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
        "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir "$(ls /wheels/asyncrl-*.whl)[npu,ray]"

FROM ${CANN_IMAGE} AS npu
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=npu-build /opt/venv /opt/venv
COPY configs /opt/asyncrl/configs
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*
# The user is in HwHiAiUser when the image defines it: the Ascend driver's device nodes belong
# to that group.
RUN ln -s /opt/venv/bin/asyncrl /opt/venv/bin/ray /usr/local/bin/ \
    && useradd --uid 10001 --user-group --create-home asyncrl \
    && if getent group HwHiAiUser >/dev/null; then usermod -aG HwHiAiUser asyncrl; fi \
    && install -d -o asyncrl -g asyncrl /work /data
USER 10001
WORKDIR /work
EXPOSE 9400
ENTRYPOINT ["asyncrl"]
CMD ["--help"]
