"""`rmsft local job.yaml`: the job's rollout servers as local processes, then the learner.

On a GPU machine `learner.gpu_assignment` gives every server its own `spec.rollout.tensorParallelSize`
GPUs and the learner the next `spec.learner.gpus`, and refuses a job the machine cannot hold before
anything starts. The learner runs in this process on its GPU (or on CPUs); with more than one
learner GPU it runs as `torchrun` ranks in a subprocess, whose output is streamed and kept in
`<work-dir>/logs/learner.log`.

A manifest annotated `rmsft.io/build-tiny-model: "true"` gets the tiny text model built at
`spec.model.path` when that folder is absent (`"qwen3_vl"` or `"qwen2_5_vl"`: a tiny vision-language
model, `rmsft.io/tiny-model-size: "small"` a larger one, `rmsft.io/tiny-model-stock: "true"` one with a
stock vocabulary, without coordinate tokens, for `training.format: qwen_json`; `rmsft.io/tiny-model-coords:
"smooth"` one whose coordinate tokens start as smooth functions of the bin, as a pretrained model's would), and
`rmsft.io/synthetic-records: "N"` gets N synthetic detection records written to
`spec.training.data.path` when that file is absent (`rmsft.io/synthetic-task: "visual"`: rendered
images of shapes, the prompt giving nothing away; `"visual-grid"`: the same shapes on a grid of
image-token cells, which a tiny model learns within minutes; `rmsft.io/synthetic-max-objects: "N"`: at
most N objects per image), and `rmsft.io/synthetic-eval-records: "N"` N more, rendered with another
seed, to `spec.training.eval.data`. The shipped `configs/local-tiny*.yaml` run on a fresh machine with
no downloads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from learner.gpu_assignment import CUDA_ENV, GpuAssignment, assign_gpus, visible_gpu_count
from learner.tracking.tracker import require_trackers
from rmsft import lifeline, run_dir
from rmsft.jobspec import JobSpecError, RolloutMatchingJob, load_job
from rmsft.logs import ENV as LOG_LEVEL_ENV
from rmsft.memory_plan import memory_plan_setting
from rmsft.model_check import check_model
from rmsft.serve_options import serve_options

if TYPE_CHECKING:
    from learner.train.results import Summary

log = logging.getLogger("rmsft.local")
BUILD_TINY_MODEL = "rmsft.io/build-tiny-model"
SYNTHETIC_RECORDS = "rmsft.io/synthetic-records"
SYNTHETIC_TASK = "rmsft.io/synthetic-task"
SYNTHETIC_EVAL_RECORDS = "rmsft.io/synthetic-eval-records"
TINY_MODEL_SIZE = "rmsft.io/tiny-model-size"
TINY_MODEL_STOCK = "rmsft.io/tiny-model-stock"  # "true": a stock vocabulary, without the coordinate tokens
TINY_MODEL_COORDS = "rmsft.io/tiny-model-coords"  # "smooth": coordinate embeddings smooth in the bin
SYNTHETIC_MAX_OBJECTS = "rmsft.io/synthetic-max-objects"
PRETRAIN_TINY_MODEL = "rmsft.io/pretrain-tiny-model"  # "N": N plain SFT steps on a separate synthetic set
PRETRAIN_COORD_SIGMA = "rmsft.io/pretrain-coord-sigma"  # the pretraining's own coordinate target width
PRETRAIN_SEED_OFFSET = 20_000  # the pretraining set's seed: neither the training set's (+0) nor the held-out one's
SYNTHETIC_TASKS = ("text", "visual", "visual-grid", "answer")
AUTH_TOKEN_ENV = "RMSFT_AUTH_TOKEN"


class Terminated(KeyboardInterrupt):
    """`rmsft local` was sent SIGTERM or SIGHUP: raised in the main thread like Ctrl-C's KeyboardInterrupt, so the
    run unwinds the same way (the learner closes, the servers stop, the run's shared memory is removed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class LearnerExitError(SystemExit):
    """The learner subprocess (torchrun) exited with an error. A SystemExit carrying its exit code:
    its own output, streamed above, says why, so `rmsft local` ends with that code and one line
    instead of a traceback of this process."""

    def __init__(self, returncode: int, message: str) -> None:
        # A rank killed by a signal shows as -N; a shell would report 128+N.
        super().__init__(returncode if returncode > 0 else 128 - returncode)
        self.returncode, self.message = returncode, message

    def __str__(self) -> str:
        return self.message


def _annotations(job: RolloutMatchingJob) -> dict[str, str]:
    return dict((job.metadata.model_extra or {}).get("annotations") or {})


def prepare_inputs(job: RolloutMatchingJob, console: Console) -> None:
    """Build the tiny model / synthetic data the manifest asks for, when they are absent."""
    notes = _annotations(job)
    model_dir = Path(job.spec.model.path)
    build = notes.get(BUILD_TINY_MODEL, "").lower()
    task = notes.get(SYNTHETIC_TASK, "text")
    if task not in SYNTHETIC_TASKS:  # before anything is built
        raise ValueError(
            f"metadata.annotations[{SYNTHETIC_TASK!r}] must be one of "
            f"{', '.join(map(repr, SYNTHETIC_TASKS))}, got {task!r}"
        )
    pretrain_steps = int(notes.get(PRETRAIN_TINY_MODEL, "0"))
    if pretrain_steps < 0 or (pretrain_steps and build in ("", "false")):
        raise ValueError(
            f"metadata.annotations[{PRETRAIN_TINY_MODEL!r}] needs a number of steps >= 0 and "
            f"{BUILD_TINY_MODEL!r} (it pretrains the tiny model that annotation builds)"
        )
    final_dir = model_dir
    if pretrain_steps and not (final_dir / "config.json").exists():
        model_dir = pretrain_dir(final_dir) / "random"  # the random build, then pretrained into spec.model.path
    _build_model(job, notes, build, model_dir, console)
    if pretrain_steps and not (final_dir / "config.json").exists():
        pretrain_tiny_model(job, model_dir, final_dir, pretrain_steps, console)
    _write_data(job, notes, console)


def _build_model(job: RolloutMatchingJob, notes: dict[str, str], build: str, model_dir: Path, console: Console) -> None:
    coord_tokens = notes.get(TINY_MODEL_STOCK, "false").lower() != "true"
    if build and build != "false" and not (model_dir / "config.json").exists():
        with console.status(f"building the tiny model in {model_dir}"):
            if build == "true":
                from rmsft_dev.tiny_model import build_tiny_model

                build_tiny_model(model_dir, seed=job.spec.training.seed, coord_tokens=coord_tokens)
            else:
                from rmsft_dev.tiny_vl import build_tiny_vl_model

                coords = notes.get(TINY_MODEL_COORDS, "random").lower()
                if coords not in ("random", "smooth"):
                    raise ValueError(
                        f'metadata.annotations[{TINY_MODEL_COORDS!r}] must be "random" or "smooth", got {coords!r}'
                    )
                try:
                    build_tiny_vl_model(
                        model_dir,
                        arch=build,
                        seed=job.spec.training.seed,
                        size=notes.get(TINY_MODEL_SIZE, "tiny"),
                        coord_tokens=coord_tokens,
                        smooth_coords=coords == "smooth",
                    )
                except ValueError as exc:
                    raise ValueError(
                        f'metadata.annotations[{BUILD_TINY_MODEL!r}]: {exc} (or "true": a text model)'
                    ) from None
        console.print(f"built the tiny model in {model_dir}")


def pretrain_dir(model_dir: Path) -> Path:
    """Where the pretraining of the tiny model at `model_dir` keeps its random start, data and checkpoint."""
    return model_dir.with_name(model_dir.name + "-pretrain")


def pretrain_tiny_model(job: RolloutMatchingJob, random_dir: Path, out_dir: Path, steps: int, console: Console) -> Path:
    """`steps` of plain SFT (every step a warm-start step: the targets are the whole ground truth) of the model
    at `random_dir` on a synthetic set of the job's task rendered with a seed of its own (never the training or
    held-out records), with the job's own optimizer settings (the coordinate target's width from
    `rmsft.io/pretrain-coord-sigma` when set); the result is exported to `out_dir`.

    Why: a real user starts from a pretrained Qwen-VL that already sees and names objects and writes
    coordinates; rollout matching then refines its own answers. A random tiny model has nothing worth
    matching, so the local demo gives it that starting point once, cached under `.rmsft/` (a later run
    reuses `out_dir`). Runs in this process without rollout servers; deterministic (same job, same weights)."""
    from learner.train.build import build_loop

    work = pretrain_dir(out_dir)
    doc = job.to_manifest()
    doc["metadata"] = {"name": f"{job.metadata.name}-pretrain"}
    t = doc["spec"]["training"]
    data = work / "data.jsonl"
    t.update(
        steps=steps,
        warm_start_steps=steps,
        data={"path": str(data)},
        eval={},
        checkpoint={"dir": str(work / "checkpoints"), "every": 0, "keep": 1},
        export={"enabled": True, "dir": str(out_dir)},
    )
    doc["spec"]["model"]["path"] = str(random_dir)
    # Stage 1 is plain SFT with the first generation's coordinate losses (soft CE + W1 at weight 1, no box terms):
    # the objective the shipped start (assets/tiny-vl-grid-model) was made with, whatever the job's recipe.
    t["recipe"] = {"generation": 1}
    notes = _annotations(job)
    if notes.get(PRETRAIN_COORD_SIGMA):
        # A wide target while the coordinates are far off gives them credit from afar; the run then sharpens it.
        t["loss"]["coord_sigma"] = float(notes[PRETRAIN_COORD_SIGMA])
    pre = RolloutMatchingJob.model_validate(doc)
    n = int(notes.get(SYNTHETIC_RECORDS, "1024"))
    _write_records(pre, notes, data, n, job.spec.training.seed + PRETRAIN_SEED_OFFSET, "pretraining ", console)
    loop = build_loop(pre, [])
    try:
        columns = (
            TextColumn("[bold]pretraining the tiny model"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
        )
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task("pretrain", total=steps, info="")
            loop.on_step = lambda r: progress.update(bar, completed=r.step, info=f"loss {r.loss:.3f}")
            loop.run()
    finally:
        loop.close()
    console.print(f"pretrained the tiny model ({steps} plain SFT steps on {n} records of its own) into {out_dir}")
    return out_dir


def _write_data(job: RolloutMatchingJob, notes: dict[str, str], console: Console) -> None:
    seed = job.spec.training.seed
    wanted = [(SYNTHETIC_RECORDS, job.spec.training.data.path, seed, "")]
    if job.spec.training.eval.data:  # held-out records: the same task rendered with another seed
        wanted.append((SYNTHETIC_EVAL_RECORDS, job.spec.training.eval.data, seed + 10_000, "held-out "))
    for key, path, data_seed, what in wanted:
        data = Path(path)
        if not notes.get(key) or data.exists():
            continue
        _write_records(job, notes, data, int(notes[key]), data_seed, what, console)


def _write_records(
    job: RolloutMatchingJob, notes: dict[str, str], data: Path, n: int, data_seed: int, what: str, console: Console
) -> None:
    """`n` records of the annotated synthetic task, rendered with `data_seed`, to `data`."""
    task = notes.get(SYNTHETIC_TASK, "text")
    max_objects = int(notes.get(SYNTHETIC_MAX_OBJECTS, "0")) or None
    if task in ("visual", "visual-grid"):
        from rmsft_dev.synthetic import write_visual_dataset

        with console.status(f"rendering {n} synthetic {what}images for {data}"):
            # The instruction asks for the job's own output format (same images and objects either way).
            fmt = job.spec.training.format
            if fmt == "coordjson":  # found by the type checker: the task has no coordjson instruction yet
                raise ValueError(
                    "the synthetic visual task writes coordexp or qwen_json instructions; "
                    "spec.training.format coordjson has none"
                )
            write_visual_dataset(
                data,
                n=n,
                seed=data_seed,
                fmt=fmt,
                layout="grid" if task == "visual-grid" else "free",
                **({"max_objects": max_objects} if max_objects else {}),
            )
    elif task == "answer":  # a short-answer task for GRPO (rmsft_dev.synthetic.CoordAnswerReward)
        from rmsft_dev.synthetic import write_answer_dataset

        write_answer_dataset(data, n=n, seed=data_seed)
    else:
        from rmsft_dev.synthetic import write_synthetic_dataset

        write_synthetic_dataset(data, n=n, seed=data_seed)
    console.print(f"wrote {n} synthetic {what}{task} records to {data}")


def machine_gpus(job: RolloutMatchingJob) -> GpuAssignment:
    """The job placed on this machine's visible GPUs; GpuAssignmentError when they are too few."""
    return assign_gpus(job, visible_gpu_count(), visible_devices=os.environ.get(CUDA_ENV))


def server_options(job: RolloutMatchingJob, assignment: GpuAssignment | None = None) -> dict[str, Any]:
    """`rmsft serve` options from the spec: the operator's translation (rmsft.serve_options), on
    GPUs when the assignment puts the servers there (without one: when this machine has CUDA)."""
    if assignment is not None:
        return serve_options(job, gpus=assignment.accelerated)
    import torch

    return serve_options(job, gpus=torch.cuda.is_available())


def start_servers(
    job: RolloutMatchingJob,
    log_dir: Path,
    console: Console,
    assignment: GpuAssignment | None = None,
    *,
    staging: list[Path] | None = None,
    timeout_s: float | None = None,
) -> list:
    """Start the job's servers and wait until every one serves (spawn_servers, then await_servers), at most
    `timeout_s` (default: the job's spec.rollout.startupTimeout)."""
    started = spawn_servers(job, log_dir, assignment, staging=staging)
    await_servers(
        started,
        log_dir,
        console,
        backend=job.spec.rollout.engine,
        timeout_s=job.spec.rollout.startup_timeout_seconds if timeout_s is None else timeout_s,
    )
    return started


def spawn_servers(
    job: RolloutMatchingJob,
    log_dir: Path,
    assignment: GpuAssignment | None = None,
    *,
    staging: list[Path] | None = None,
) -> list:
    """Start the job's server processes, each on the GPUs `assignment` gives it (default: this machine's) and, when
    given, with `staging[i]` as its staging dir, and return at once: they load their engines while the caller does
    something else (await_servers waits for them). The processes are started from this thread (their parent-death
    signal is tied to it: rmsft.lifeline); if starting one fails, those already started are killed."""
    from rollout_svc.launcher import RolloutServer

    n = job.spec.rollout.replicas
    assert n is not None, "RolloutSpec's validator sets replicas"
    if n < 1:
        raise ValueError("spec.rollout.replicas must be >= 1 for `rmsft local`")
    assignment = assignment or machine_gpus(job)
    log_dir.mkdir(parents=True, exist_ok=True)
    opts = server_options(job, assignment)
    # The servers log at the job's spec.monitoring.logLevel, as they would in their pods. They take callers with
    # this run's token only: the user's RMSFT_AUTH_TOKEN, else a random one made for this run, so another process
    # on the machine (another user's, another run's learner) cannot generate on them or push weights into them.
    env = {
        LOG_LEVEL_ENV: job.spec.monitoring.log_level,
        AUTH_TOKEN_ENV: os.environ.get(AUTH_TOKEN_ENV) or secrets.token_urlsafe(24),
    }
    started: list = []
    try:
        for i in range(n):
            extra: dict[str, Any] = {"staging_dir": str(staging[i])} if staging else {}
            started.append(
                RolloutServer.spawn(
                    job.spec.model.path,
                    log_path=log_dir / f"rollout-{i}.log",
                    replica_ordinal=i,
                    env={**env, **assignment.server_env(i)},
                    **opts,
                    **extra,
                )
            )
    except BaseException:
        for s in started:
            s.kill()
        raise
    return started


def await_servers(
    started: list, log_dir: Path, console: Console, *, backend: str = "", timeout_s: float = 300.0
) -> None:
    """Wait for every spawned server to serve, together. If anything stops the wait (a server that fails, a
    signal), every server is killed before this raises: none outlives a failed start."""
    cancel = threading.Event()
    try:
        with console.status(
            f"starting {len(started)} rollout server(s){f' ({backend})' if backend else ''}, logs in {log_dir}"
        ):
            pool = ThreadPoolExecutor(max_workers=len(started))
            try:
                futures = [pool.submit(s.wait_healthy, timeout_s, cancel) for s in started]
                errors = []
                for f in futures:
                    try:
                        f.result()
                    except Exception as exc:  # reported together below
                        errors.append(exc)
                        cancel.set()  # one failed: the run cannot start, stop waiting for the others
            finally:
                cancel.set()
                pool.shutdown(wait=True)
            if errors:
                first = next((e for e in errors if "stopped waiting" not in str(e)), errors[0])
                raise RuntimeError(f"rollout server(s) failed to start: {first}")
    except BaseException:
        for s in started:  # not serving yet: nothing to drain
            s.kill()
        raise
    console.print(f"rollout servers ready: {', '.join(s.address for s in started)}")


def print_summary(summary, console: Console) -> None:
    table = Table(title="rmsft local: summary", show_header=False)
    table.add_row("optimizer steps", str(summary.steps))
    table.add_row("loss (first -> last)", f"{summary.first_loss:.4f} -> {summary.last_loss:.4f}")
    for label, text in summary.objective_rows():  # the objective's own figures (StepFigures.summary_rows)
        table.add_row(label, text)
    table.add_row(
        "weight version",
        f"{summary.weight_version} of run {summary.run_id}" if summary.run_id else str(summary.weight_version),
    )
    table.add_row("rollout retries", str(summary.retries))
    table.add_row("wall time", f"{summary.wall_seconds:.1f}s")
    if summary.pictures:
        table.add_row("rollout pictures", f"{len(summary.pictures)} in {summary.pictures[0].parent}")
    figures = {f.step: f for f in summary.held_out}
    for step, f1, mean_ap in summary.evaluations:
        fig = figures.get(step)
        table.add_row(
            f"held-out, step {step}",
            f"label-aware F1 {f1:.3f}  mAP {mean_ap:.3f}"
            + (
                ""
                if fig is None
                else f"  | geometry F1 {fig.f1_geometry:.3f}, class-agnostic mAP {fig.map_agnostic:.3f} | "
                f"truncated {fig.truncation_rate:.1%}, duplicates {fig.duplicate_rate:.1%}, "
                f"objects {fig.predicted_per_answer:.2f}/answer vs {fig.gt_per_record:.2f} true"
            ),
        )
    final, best = summary.final_evaluation, summary.best_evaluation
    if final is not None and best is not None:
        # The final figure is what the exported model scores; the best says whether it peaked earlier.
        # Label-aware: a prediction counts only when its box and its label match (COCO practice).
        name = f"held-out label-aware F1@{summary.eval_iou:g}"
        table.add_row(
            f"[bold]{name}, final[/bold]", f"[bold]{final[1]:.3f}[/bold] (mAP {final[2]:.3f}) at step {final[0]}"
        )
        table.add_row(f"{name}, best", f"{best[1]:.3f} (mAP {best[2]:.3f}) at step {best[0]}")
    if summary.eval_pictures:
        table.add_row(
            "held-out pictures",
            f"{len(summary.eval_pictures)} in {summary.eval_pictures[0].parent} (predicted solid, ground truth dashed)",
        )
    if summary.log_dir is not None:
        table.add_row("TensorBoard", f"tensorboard --logdir {summary.log_dir}")
    if summary.exported is not None:
        table.add_row("trained model", str(summary.exported))
    total = sum(summary.phase_seconds.values()) or 1.0
    for name, sec in sorted(summary.phase_seconds.items(), key=lambda kv: -kv[1]):
        table.add_row(f"  {name}", f"{sec:.2f}s ({100 * sec / total:.0f}%)")
    console.print(table)


def local_learner(job: RolloutMatchingJob, addresses: list[str], *, auth_token: str, resume: bool):
    """The learner of this process (imports, data, model, optimizer, a resumed checkpoint), on
    `job.spec.training.device`. Talks to no server: `rmsft local` builds it while its servers load their engines."""
    from learner.train.build import build_loop

    device = job.spec.training.device
    if device.startswith("cuda"):
        import torch

        # The learner's GPU becomes this process's current device, so anything that allocates on
        # "cuda" without an index lands there and not on cuda:0, a rollout server's GPU.
        torch.cuda.set_device(device)
    loop = build_loop(job, addresses, auth_token=auth_token or None)  # the objective spec.trainer names
    try:
        if resume:
            loop.resume()
    except BaseException:
        loop.close()
        raise
    return loop


def train_in_process(
    job: RolloutMatchingJob, addresses: list[str], *, auth_token: str, resume: bool, console: Console, loop=None
) -> Summary:
    """The learner in this process, with a progress bar; `job.spec.training.device` says where. `loop`: one
    local_learner made already (it is closed here either way)."""
    try:
        if loop is None:
            loop = local_learner(job, addresses, auth_token=auth_token, resume=resume)
        console.print("tracking: " + "; ".join(job.spec.training.tracking_destinations))
        columns = (
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("train", total=job.spec.training.steps, completed=loop.step, info="")

            def on_step(r) -> None:
                own = r.figures.bar()  # the objective's words (StepFigures.bar)
                progress.update(
                    task, completed=r.step, info=f"loss {r.loss:.3f}{' ' + own if own else ''} v{r.weight_version}"
                )

            loop.on_step = on_step
            # A held-out evaluation gets its own line above the bar (the log is at warning level here).
            loop.on_eval = lambda ev: progress.console.print(f"step {ev.step}: {ev.describe()}")
            summary = loop.run()
        print_summary(summary, console)
        return summary
    finally:
        if loop is not None:
            loop.close()


def learner_command(
    job_path: str | Path, ranks: int, addresses: list[str], *, resume: bool, metrics_port: int = 0
) -> list[str]:
    """`rmsft train` under torchrun: `ranks` data-parallel ranks on one node; rank 0 serves /metrics on
    `metrics_port` (0: none). Never spec.learner.metricsPort: that is the pod's port and may well be taken on a
    workstation (Prometheus itself uses 9090)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "-m",
        "rmsft_cli",
        "train",
        "--config",
        str(job_path),
        "--servers",
        ",".join(addresses),
        "--resume" if resume else "--no-resume",
        "--metrics-port",
        str(metrics_port),
    ]


class MetricsPortError(ValueError):
    """The learner's /metrics port cannot be bound (`rmsft local --metrics-port`)."""


FREE_PORT = -1  # `rmsft local --metrics-port`'s default: a free port, picked at start


@contextlib.contextmanager
def learner_metrics(port: int, console: Console, *, colocated: bool) -> Iterator[int]:
    """The in-process learner's Prometheus /metrics on 127.0.0.1:`port` (FREE_PORT: a free one, picked now; 0: no
    endpoint) while the run lasts, as the learner pod serves spec.learner.metricsPort. Yields the port (0: none)
    and prints where it is, so a Prometheus can be pointed at it."""
    if port == 0:
        yield 0
        return
    from rmsft.metrics_http import learner_registry, start_metrics_server

    try:
        httpd = start_metrics_server(max(port, 0), addr="127.0.0.1", registry=learner_registry(colocated=colocated))
    except OSError as exc:
        raise MetricsPortError(
            f"cannot serve the learner's /metrics on 127.0.0.1:{port}: {exc}; give another --metrics-port (0: none)"
        ) from exc
    console.print(f"learner /metrics: http://127.0.0.1:{httpd.server_port}/metrics", highlight=False)
    try:
        yield httpd.server_port
    finally:
        httpd.shutdown()
        httpd.server_close()


def run_learner_process(cmd: list[str], env: dict[str, str], log_path: Path, console: Console) -> int:
    """Run `cmd` with `env` added to this process's environment, its output (stdout and stderr)
    streamed to the console and to `log_path`; returns its exit code. Stopped if this process is
    interrupted."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log_file:
        # Same process group: a Ctrl-C in the terminal reaches torchrun, which stops its ranks. SIGTERM (which
        # torchrun passes on to its ranks) when this process ends without stopping it: rmsft.lifeline.
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **lifeline.popen_options({**os.environ, **env})
        )
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                log_file.write(raw)
                log_file.flush()
                console.out(raw.decode(errors="replace").rstrip("\r\n"), highlight=False)
            return proc.wait()
        except BaseException:
            _stop_process(proc)
            raise
        finally:
            if proc.stdout is not None:
                proc.stdout.close()


def _stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its ranks
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def train_with_torchrun(
    job_path: str | Path,
    job: RolloutMatchingJob,
    assignment: GpuAssignment,
    addresses: list[str],
    *,
    auth_token: str,
    resume: bool,
    log_dir: Path,
    console: Console,
    metrics_port: int = 0,
) -> None:
    """The learner as `len(assignment.learner)` torchrun ranks in a subprocess on the learner's GPUs.

    A subprocess because the ranks must see only their own GPUs (torchrun's `auto` device is
    cuda:LOCAL_RANK) and `CUDA_VISIBLE_DEVICES` can only be set for a process before it starts.
    Rank 0 serves /metrics on `metrics_port` (FREE_PORT: a free one, picked now; 0: none).
    Raises LearnerExitError when it fails."""
    ranks = len(assignment.learner)
    if metrics_port == FREE_PORT:
        from rollout_svc.launcher import free_port

        metrics_port = free_port()
    if metrics_port:
        console.print(f"learner /metrics (rank 0): http://127.0.0.1:{metrics_port}/metrics", highlight=False)
    env = {
        **assignment.learner_env(),
        LOG_LEVEL_ENV: job.spec.monitoring.log_level,  # as the servers, and the learner pod
        "PYTHONUNBUFFERED": "1",  # lines reach the console as the ranks write them
    }
    if auth_token:  # in the environment, not on the command line, where `ps` would show it
        env[AUTH_TOKEN_ENV] = auth_token
    log_path = log_dir / "learner.log"
    console.print(
        f"learner: {ranks} ranks under torchrun on GPUs {assignment.names(assignment.learner)}, "
        f"output also in {log_path}"
    )
    cmd = learner_command(job_path, ranks, addresses, resume=resume, metrics_port=metrics_port)
    rc = run_learner_process(cmd, env, log_path, console)
    if rc != 0:
        message = f"the learner ({ranks} torchrun ranks) exited with {rc}; its output is in {log_path}"
        console.print(f"[red]error:[/red] {message}")  # a SystemExit with a code prints nothing itself
        raise LearnerExitError(rc, message)
    console.print(f"[green]learner finished[/green] ({ranks} ranks); its output is in {log_path}")


def dry_run(job: RolloutMatchingJob, *, work_dir: str | Path = ".rmsft") -> list[str]:
    """What `rmsft local JOB` would start, as lines, with nothing started, built or written (`--dry-run`): the
    inputs (and what the annotations would build), the rollout servers with their GPUs and ports, the weight
    sync's transport, the learner, the steps, checkpoints and evaluation, and the memory plan."""
    from rmsft.memory_plan import ModelShapeError, plan_memory

    spec, t = job.spec, job.spec.training
    notes = _annotations(job)
    out = [f"job {job.metadata.name}: trainer {spec.trainer}, format {t.format}, {t.finetune} fine-tune"]
    model = Path(spec.model.path)
    build = notes.get(BUILD_TINY_MODEL, "").lower()
    if (model / "config.json").is_file():
        out.append(f"model: {model}")
    elif build and build != "false":
        out.append(f"model: {model} (not there yet: built at start, {BUILD_TINY_MODEL}: {build})")
    else:
        out.append(f"model: {model} (missing: the run would stop here)")
    for key, path, what in (
        (SYNTHETIC_RECORDS, t.data.path, "data"),
        (SYNTHETIC_EVAL_RECORDS, t.eval.data, "held-out data"),
    ):
        if not path:
            continue
        there = Path(path).exists()
        how = (
            ""
            if there
            else (
                f" (not there yet: {notes[key]} synthetic records written at start)"
                if notes.get(key)
                else " (missing: the run would stop here)"
            )
        )
        out.append(f"{what}: {path}{how}")
    if spec.placement.accelerator == "none":
        gpus = "on CPUs (spec.placement.accelerator: none)"
    else:
        try:
            gpus = machine_gpus(job).describe()
        except JobSpecError as exc:  # GpuAssignmentError: too few GPUs here
            gpus = f"cannot be placed on this machine: {exc}"
    r = spec.rollout
    if r.colocated:
        out.append(f"rollouts: colocate: a {r.engine} engine inside each learner rank (no servers); {gpus}")
        out.append("weight sync: in-process (the engine lives in the learner)")
    else:
        out.append(
            f"rollout servers: {r.replicas} x `rmsft serve` ({r.engine}, TP {r.tensor_parallel_size}, "
            f"maxModelLen {r.max_model_len}), each on 127.0.0.1 at a free gRPC port and a free /metrics port "
            f"picked at start, logs in {Path(work_dir) / 'logs'}/rollout-<i>.log; {gpus}"
        )
        transport = spec.sync.local_transport
        out.append(
            f"weight sync: {transport} (spec.sync.transport {spec.sync.transport}; under `rmsft local` auto "
            f"is shm), mode {spec.sync.mode}"
        )
    # the learner's /metrics: `rmsft local --metrics-port` (learner_metrics), never spec.learner.metricsPort (the pod's)
    out.append(
        f"learner: {'in this process' if spec.learner.gpus <= 1 else f'{spec.learner.gpus} torchrun ranks'}"
        ", /metrics on 127.0.0.1 at a free port picked at start (--metrics-port)"
    )
    out.append(
        f"steps: {t.steps} of {t.prompts_per_step} prompts, rollouts of up to {t.rollout.max_tokens} tokens; "
        f"checkpoints in {t.checkpoint.dir} {_every(t.checkpoint.every)} (keep {t.checkpoint.keep})"
        + (f"; held-out evaluation {_every(t.eval.every)}" if t.eval.data else "")
        + "; tracking: "
        + "; ".join(t.tracking_destinations)
    )
    try:
        out.extend(plan_memory(job).lines())
    except ModelShapeError as exc:
        out.append(
            "memory plan: once the model is built (`rmsft dev prepare JOB` builds it without starting anything)"
            if build and build != "false" and not (model / "config.json").is_file()
            else f"memory plan: {exc}"
        )
    out.append("dry run: nothing was started, built or written")
    return out


def _every(n: int) -> str:
    return f"every {n} steps" if n else "at the end only"


def run_local(
    job_path: str | Path,
    *,
    work_dir: str | Path = ".rmsft",
    resume: bool = False,
    console: Console | None = None,
    metrics_port: int = FREE_PORT,
) -> Summary | None:
    """Run the whole job on this machine; servers are stopped on success, error or Ctrl-C.

    Returns the learner's Summary when it ran in this process, None when it ran as torchrun ranks
    (their output says how it went). The learner serves Prometheus /metrics on 127.0.0.1:`metrics_port`
    (FREE_PORT: a free one; 0: none), printed at start, as the servers do on theirs. Raises GpuAssignmentError
    before anything starts when the machine cannot hold the job, ModelCheckError when the model folder does not
    fit training.format, LearnerExitError when the torchrun learner fails."""
    console = console or Console(stderr=True, soft_wrap=True)
    job = load_job(job_path)
    memory_plan_setting()  # a typo in RMSFT_MEMORY_PLAN fails now, not once the servers are up
    require_trackers(job.spec.training.report_to)  # an MLflow / W&B not installed: now, not after the servers
    # Everything that can be refused from the spec and the machine alone, before anything starts.
    assignment = machine_gpus(job)
    # One learner GPU: the learner runs in this process, which already sees every GPU (and may have
    # initialised CUDA), so CUDA_VISIBLE_DEVICES cannot narrow it any more; the learner is pointed
    # at its GPU by index through training.device, which the training loop honours.
    job.spec.training.device = assignment.learner_device(job.spec.training.device)
    if job.spec.trainer == "grpo":  # a reward that resolves to nothing fails before any server starts
        from learner.train.objectives.grpo import build_job_rewards

        build_job_rewards(job)
    prepare_inputs(job, console)
    # The model must fit training.format before any server loads it (the check the operator's pods run first).
    console.print(f"model: {check_model(job.spec.model.path, job.spec.training.format)}", highlight=False)
    log_dir = Path(work_dir) / "logs"
    if assignment.accelerated:
        console.print(f"GPUs: {assignment.describe()}")
    # The in-process learner's /metrics from now on, while the servers load: a Prometheus pointed at it sees the
    # whole run. torchrun's rank 0 serves its own (train_with_torchrun).
    in_process = metrics_port if len(assignment.learner) <= 1 else 0
    with (
        stop_on_signals(),
        shared_weights_dir(job, console) as run,
        learner_metrics(in_process, console, colocated=job.spec.rollout.colocated),
    ):
        return _run_started(
            job_path, job, assignment, log_dir, resume=resume, console=console, run=run, metrics_port=metrics_port
        )


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (what `timeout`, systemd, a CI runner or a closing terminal send) raise `Terminated` in
    the main thread, as SIGINT raises KeyboardInterrupt, so the run shuts down in order instead of dying with its
    servers left behind. A second signal while shutting down is ignored (SIGKILL still ends it; the servers then die
    with this process: rmsft.lifeline). Does nothing off the main thread (Python delivers signals there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}

    def handler(signum: int, frame: object) -> None:
        if stopping.is_set():
            return
        stopping.set()
        if signum == signal.SIGHUP:  # the terminal is gone: writing to it would fail the shutdown
            with contextlib.suppress(OSError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            if old is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(sig, old)


@contextlib.contextmanager
def shared_weights_dir(job: RolloutMatchingJob, console: Console) -> Iterator[run_dir.RunDir | None]:
    """The run's directory in shared memory (rmsft.run_dir: named after this process and locked by it while it
    lives, so a later run can tell it from a live one), for the servers' staging dirs and, with transport shm (the
    default here: every process is on this machine), the shared-weights dir handed to the servers and the learner
    through RMSFT_SHARED_WEIGHTS_DIR. Removed with whatever is in it when the run ends; what dead runs left is
    removed first. Yields None in colocate mode (no servers)."""
    from rmsft.weight_wire import SHARED_DIR_ENV

    if job.spec.rollout.colocated:
        console.print("weight sync: in-process (the rollout engine lives in the learner)")
        yield None
        return
    removed = run_dir.remove_stale()
    if removed:
        console.print(
            f"removed {len(removed)} shared-memory folder(s) of runs that were killed: "
            f"{', '.join(str(p) for p in removed)}"
        )
    before = os.environ.get(SHARED_DIR_ENV)
    with run_dir.owned() as run:
        if job.spec.sync.local_transport == "nccl":
            console.print(
                "weight sync: nccl (full weights broadcast over one weight-transfer group, driven over "
                "gRPC; gloo on the CPU)"
            )
        elif job.spec.sync.local_transport != "shm":
            console.print("weight sync: grpc (one stream from the learner, relayed server to server)")
        else:
            path = str(run.sub("weights"))
            os.environ[SHARED_DIR_ENV] = path  # the servers inherit it; the learner reads it
            console.print(f"weight sync: shm (each update written once to {path}, read by every server)")
        try:
            yield run
        finally:
            if before is None:
                os.environ.pop(SHARED_DIR_ENV, None)
            else:
                os.environ[SHARED_DIR_ENV] = before


def _run_started(
    job_path: str | Path,
    job: RolloutMatchingJob,
    assignment: GpuAssignment,
    log_dir: Path,
    *,
    resume: bool,
    console: Console,
    run: run_dir.RunDir | None = None,
    metrics_port: int = FREE_PORT,
) -> Summary | None:
    ranks = len(assignment.learner)
    if job.spec.rollout.colocated:  # no servers: every learner rank starts its own engine
        console.print(f"rollouts: colocate (a {job.spec.rollout.engine} engine inside the learner)")
        if ranks > 1:
            train_with_torchrun(
                job_path,
                job,
                assignment,
                [],
                auth_token="",
                resume=resume,
                log_dir=log_dir,
                console=console,
                metrics_port=metrics_port,
            )
            return None
        return train_in_process(job, [], auth_token="", resume=resume, console=console)
    assert job.spec.rollout.replicas is not None, "RolloutSpec's validator sets replicas"
    staging = [run.sub(f"serve-{i}") for i in range(job.spec.rollout.replicas)] if run is not None else None
    servers = spawn_servers(job, log_dir, assignment, staging=staging)
    addresses = [s.address for s in servers]
    for i, s in enumerate(servers):  # where to point a Prometheus: the endpoints serve while the engines load
        console.print(
            f"rollout server {i}: gRPC {s.address}, /metrics http://127.0.0.1:{s.metrics_port}/metrics", highlight=False
        )
    # The servers take RMSFT_AUTH_TOKEN from this environment: the learner must send the same.
    token = servers[0].token
    loop = None
    try:
        # One learner in this process: it is built (imports, data, model) while the servers load their engines,
        # which it does not need until its first sync. torchrun's ranks start once the servers serve (their wait
        # for the servers is bounded by the request timeout, shorter than an engine's load).
        if len(assignment.learner) <= 1:
            loop = local_learner(job, addresses, auth_token=token, resume=resume)
        # The job's startupTimeout, as on a cluster (it was a fixed 300 s: a real-width model loads for minutes on a
        # busy CPU machine, benchmarks/real_width.py); a server that dies is seen at once, whatever the timeout.
        await_servers(
            servers,
            log_dir,
            console,
            backend=job.spec.rollout.engine,
            timeout_s=job.spec.rollout.startup_timeout_seconds,
        )
    except BaseException:
        for s in servers:  # none outlives a failed start (await_servers kills them itself when it fails)
            s.kill()
        if loop is not None:
            loop.close()
        raise
    from rollout_svc.launcher import Supervisor

    # A server whose engine died exits 1; like a pod, it is restarted, and the learner re-syncs it.
    supervisor = Supervisor(servers, report=lambda m: console.print(f"[yellow]{m}[/yellow]"))
    try:
        if ranks > 1:
            train_with_torchrun(
                job_path,
                job,
                assignment,
                addresses,
                auth_token=token,
                resume=resume,
                log_dir=log_dir,
                console=console,
                metrics_port=metrics_port,
            )
            return None
        return train_in_process(job, addresses, auth_token=token, resume=resume, console=console, loop=loop)
    finally:
        # In order: the learner has closed (no call in flight), nothing restarts a server any more, the servers
        # drain and stop (together: each may take its grace period).
        supervisor.stop()
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            for s in servers:
                pool.submit(s.stop, 15.0)
