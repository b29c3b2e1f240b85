"""`rmsft local job.yaml`: the job's rollout servers as local processes, the learner in-process.

A manifest annotated `rmsft.io/build-tiny-model: "true"` gets the tiny model built at
`spec.model.path` when that folder is absent, and `rmsft.io/synthetic-records: "N"` gets N
synthetic detection records written to `spec.training.data.path` when that file is absent: the
shipped `configs/local-tiny.yaml` runs on a fresh machine with no downloads.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rmsft.jobspec import RolloutMatchingJob, load_job
from rmsft.logs import ENV as LOG_LEVEL_ENV
from rmsft.serve_options import serve_options

log = logging.getLogger("rmsft.local")
BUILD_TINY_MODEL = "rmsft.io/build-tiny-model"
SYNTHETIC_RECORDS = "rmsft.io/synthetic-records"


def _annotations(job: RolloutMatchingJob) -> dict[str, str]:
    return dict((job.metadata.model_extra or {}).get("annotations") or {})


def prepare_inputs(job: RolloutMatchingJob, console: Console) -> None:
    """Build the tiny model / synthetic data the manifest asks for, when they are absent."""
    notes = _annotations(job)
    model_dir = Path(job.spec.model.path)
    if notes.get(BUILD_TINY_MODEL, "").lower() == "true" and not (model_dir / "config.json").exists():
        from rmsft.tiny_model import build_tiny_model

        with console.status(f"building the tiny model in {model_dir}"):
            build_tiny_model(model_dir, seed=job.spec.training.seed)
    data = Path(job.spec.training.data.path)
    if notes.get(SYNTHETIC_RECORDS) and not data.exists():
        from learner.synthetic import write_synthetic_dataset

        write_synthetic_dataset(data, n=int(notes[SYNTHETIC_RECORDS]), seed=job.spec.training.seed)
        console.print(f"wrote {notes[SYNTHETIC_RECORDS]} synthetic records to {data}")


def server_options(job: RolloutMatchingJob) -> dict[str, Any]:
    """`rmsft serve` options from the spec: the operator's translation (rmsft.serve_options), on
    GPUs when this machine has CUDA."""
    import torch

    return serve_options(job, gpus=torch.cuda.is_available())


def start_servers(job: RolloutMatchingJob, log_dir: Path, console: Console) -> list:
    from rollout_svc.launcher import RolloutServer

    n = job.spec.rollout.replicas
    if n < 1:
        raise ValueError("spec.rollout.replicas must be >= 1 for `rmsft local`")
    log_dir.mkdir(parents=True, exist_ok=True)
    opts = server_options(job)
    # The servers log at the job's spec.monitoring.logLevel, as they would in their pods.
    env = {LOG_LEVEL_ENV: job.spec.monitoring.log_level}
    started: list = []
    with console.status(f"starting {n} rollout server(s) ({opts['backend']}), logs in {log_dir}"):
        with ThreadPoolExecutor(max_workers=n) as pool:
            futures = [
                pool.submit(RolloutServer.start, job.spec.model.path, log_path=log_dir / f"rollout-{i}.log",
                            replica_ordinal=i, env=env, **opts)
                for i in range(n)
            ]
            errors = []
            for f in futures:
                try:
                    started.append(f.result())
                except Exception as exc:  # noqa: BLE001 - reported together below
                    errors.append(exc)
        if errors:
            for s in started:
                s.stop()
            raise RuntimeError(f"{len(errors)} of {n} rollout server(s) failed to start: {errors[0]}")
    console.print(f"rollout servers ready: {', '.join(s.address for s in started)}")
    return started


def print_summary(summary, console: Console) -> None:
    table = Table(title="rmsft local: summary", show_header=False)
    table.add_row("optimizer steps", str(summary.steps))
    table.add_row("loss (first -> last)", f"{summary.first_loss:.4f} -> {summary.last_loss:.4f}")
    if summary.f1:
        table.add_row("rollout F1 (first -> last)", f"{summary.f1[0]:.3f} -> {summary.f1[-1]:.3f}")
    table.add_row("weight version", str(summary.weight_version))
    table.add_row("rollout retries", str(summary.retries))
    table.add_row("wall time", f"{summary.wall_seconds:.1f}s")
    total = sum(summary.phase_seconds.values()) or 1.0
    for name, sec in sorted(summary.phase_seconds.items(), key=lambda kv: -kv[1]):
        table.add_row(f"  {name}", f"{sec:.2f}s ({100 * sec / total:.0f}%)")
    console.print(table)


def run_local(job_path: str | Path, *, work_dir: str | Path = ".rmsft", resume: bool = False,
              console: Console | None = None):
    """Run the whole job on this machine; servers are stopped on success, error or Ctrl-C."""
    from learner.trainer import Trainer

    console = console or Console(stderr=True)
    job = load_job(job_path)
    prepare_inputs(job, console)
    servers = start_servers(job, Path(work_dir) / "logs", console)
    trainer = None
    try:
        trainer = Trainer(job, [s.address for s in servers])
        if resume:
            trainer.resume()
        columns = (TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[info]}"))
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("train", total=job.spec.training.steps, completed=trainer.step, info="")

            def on_step(r) -> None:
                f1 = f" f1 {r.stats.f1:.2f}" if r.stats else ""
                progress.update(task, completed=r.step, info=f"loss {r.loss:.3f}{f1} v{r.weight_version}")

            trainer.on_step = on_step
            summary = trainer.run()
        print_summary(summary, console)
        return summary
    finally:
        if trainer is not None:
            trainer.close()
        for s in servers:
            with contextlib.suppress(Exception):
                s.stop()
