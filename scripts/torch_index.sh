#!/usr/bin/env bash
# Where `make setup` takes a CPU machine's torch from (issue 44): prints the pip arguments, one per line
# (nothing: the configured index alone), and a one-line note on stderr when it falls back.
#   TORCH_INDEX_URL  the index of the CPU torch, the variable the Dockerfile takes; unset: pyproject.toml's
#                    [tool.rmsft.image.cpu] torch-index (PyTorch's CPU index); "": none, the configured index
# An index that does not answer within 5 s is left out, with a note: pip's own index (a mirror, a wheelhouse)
# then serves torch, which on the public PyPI is the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${TORCH_INDEX_URL+set}" ]; then
  TORCH_INDEX_URL=$("$PY" - <<'PYEOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    print(tomllib.load(f)["tool"]["rmsft"]["image"]["cpu"].get("torch-index", ""))
PYEOF
)
fi
[ -n "$TORCH_INDEX_URL" ] || exit 0
if "$PY" - "$TORCH_INDEX_URL" <<'PYEOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
except Exception as e:  # unreachable, refused, no such index: the configured index serves torch
    print(f"[setup] note: the torch index {sys.argv[1]} did not answer ({type(e).__name__}): torch from pip's "
          "configured index (set TORCH_INDEX_URL to another CPU index, or \"\" to skip this check)", file=sys.stderr)
    sys.exit(1)
PYEOF
then
  printf '%s\n' --extra-index-url "$TORCH_INDEX_URL"
fi
