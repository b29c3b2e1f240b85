"""Issue 45, item 2's CPU stand-in: vLLM's own weight-transfer API (init_weight_transfer_engine,
start/update/finish_weight_update) with rmsft's gloo engine (rollout_engine/weight_transfer_gloo.py), registered in
vLLM's registry from the engine's worker process, on the real vLLM CPU engine. After the weights are sent, the
engine's greedy answers equal HF's with those weights; the original weights sent back over the same group give the
first answers again. (Not yet wired to spec.sync.transport: the gRPC control path is the next step.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
RUN = Path(__file__).with_name("gloo_transfer_run.py")
ROOT = Path(__file__).resolve().parents[2]


def test_an_engine_after_a_gloo_weight_transfer_answers_as_hf_with_those_weights(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(RUN), str(tiny_model_dir), str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert all(len(a) == 12 for a in r["before"] + r["perturbed"] + r["restored"])
    assert r["perturbed"] != r["before"]  # the weights arrived...
    assert r["perturbed"] == r["hf_perturbed"]  # ...all of them, as HF holds them (the tied head included)
    assert r["restored"] == r["before"]  # and a second update over the same group puts the first weights back
