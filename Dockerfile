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
COPY scripts/image_install.py scripts/image_install.py
COPY pyproject.toml README.md ./
COPY rmsft rmsft
COPY learner learner
COPY rollout_svc rollout_svc
COPY operator operator
COPY protos protos

# What each variant installs is declared once, in pyproject.toml's [tool.rmsft.image.<variant>]
# (pins as in scripts/setup.sh; tests/operator/test_operator_image.py checks every config in
# configs/ against it): torch, the vLLM build, this project's extras, then DeepSpeed on GPU.
FROM base AS cpu
RUN python scripts/image_install.py cpu
RUN rmsft dev tiny-model /opt/rmsft/tiny-model \
 && python -c "from learner.synthetic import write_synthetic_dataset as w; w('/opt/rmsft/tiny-model/train.jsonl', n=64)" \
 && chmod -R a+rX /opt/rmsft

FROM base AS gpu
# DeepSpeed is built against the CUDA torch vllm installed (--no-build-isolation, see the script).
# DS_BUILD_OPS=0: no kernels compiled now (the learner uses torch's AdamW; the slim image has no
# nvcc); DS_ACCELERATOR=cpu: its setup.py asks for nvcc when the builder happens to see a GPU.
# At runtime DeepSpeed detects the GPUs itself.
RUN DS_BUILD_OPS=0 DS_ACCELERATOR=cpu python scripts/image_install.py gpu

FROM ${VARIANT} AS final
LABEL org.opencontainers.image.title="rmsft" \
      org.opencontainers.image.description="Rollout-matching SFT: operator, rollout server and learner"
USER 1000:1000
ENTRYPOINT ["rmsft"]
CMD ["--help"]
