"""The `rmsft` command. Heavy imports (torch, vLLM, kopf) happen inside the commands that need them."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import typer

from rmsft.exit_codes import CONFIG_EXIT, RETRY_EXIT, STOPPED_EXIT, exit_code_for, record_rank_exit

try:  # typer >= 0.20 vendors click; older ones use click itself
    import typer._click._textwrap as _typer_textwrap
except ImportError:  # pragma: no cover
    import click._textwrap as _typer_textwrap  # type: ignore[no-redef]


class _WholeWords(_typer_textwrap.TextWrapper):
    """Help text wrapped between words only: textwrap's defaults break at hyphens and inside words longer than the
    column (`/dev/shm/rmsft-` | `run-*`), which read as a cut. Typer's (vendored) click builds its wrapper from
    this module's name at each call, so the help of every command (and of none else: this is the `rmsft` process)
    wraps this way."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.update(break_on_hyphens=False, break_long_words=False)
        super().__init__(*args, **kwargs)


_typer_textwrap.TextWrapper = _WholeWords  # type: ignore[misc]

# rich_markup_mode=None: click's plain help, wrapped at words. Rich's help panels cut option text that does not
# fit a column with an ellipsis (`spec.model.vision.maxIma...` at 80 columns).
app = typer.Typer(
    help="Rollout-matching SFT for vision-language detection models.", no_args_is_help=True, rich_markup_mode=None
)
dev_app = typer.Typer(help="Developer tools.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(dev_app, name="dev")
data_app = typer.Typer(
    help="Datasets: convert detection annotations to training records, check a records file.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(data_app, name="data")


@dev_app.command("tiny-model")
def tiny_model(
    out_dir: Path = typer.Argument(..., help="Folder to write the tokenizer and weights to."),
    seed: int = typer.Option(0, help="Seed for the tokenizer corpus and the random weights."),
    vl: bool = typer.Option(False, "--vl", help="A vision-language model (tiny Qwen-VL with a processor)."),
    arch: str = typer.Option("qwen3_vl", help="With --vl: qwen3_vl or qwen2_5_vl."),
    stock: bool = typer.Option(
        False, "--stock", help="Without the <|coord_k|> tokens, as a stock checkpoint comes (for prepare-model)."
    ),
) -> None:
    """Build a tiny random model with the CoordExp vocabulary (no downloads): a Qwen2 text model, or with
    --vl a Qwen-VL model whose processor transformers and vLLM both load. --stock leaves the coord tokens out."""

    console = _console(stderr=True)
    with console.status(f"building tiny {'vision-language ' if vl else ''}model in {out_dir}"):
        if vl:
            from rmsft_dev.tiny_vl import build_tiny_vl_model

            try:
                path = build_tiny_vl_model(out_dir, arch=arch, seed=seed, coord_tokens=not stock)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--arch") from None
        else:
            from rmsft_dev.tiny_model import build_tiny_model

            path = build_tiny_model(out_dir, seed=seed, coord_tokens=not stock)
    console.print(f"[green]tiny {'stock ' if stock else ''}model written to[/green] {path}")


@dev_app.command("real-width")
def dev_real_width(
    out_dir: Path = typer.Argument(..., help="Folder to write the processor, config and weights to."),
    preset: str = typer.Option(
        "Qwen3-VL-2B",
        help="The memory-plan preset whose widths and vocabulary to build (Qwen3-VL-2B, Qwen3-VL-4B, Qwen3-VL-8B).",
    ),
    text_layers: int | None = typer.Option(
        None, "--text-layers", min=1, show_default=False, help="Decoder layers (default: the preset's)."
    ),
    vision_layers: int | None = typer.Option(
        None, "--vision-layers", min=1, show_default=False, help="Vision blocks (default: the preset's)."
    ),
    seed: int = typer.Option(0, help="Seed for the tokenizer corpus and the random weights."),
    stock: bool = typer.Option(
        False,
        "--stock",
        help="Without the <|coord_k|> tokens (the preset's vocabulary "
        "exactly, as a stock checkpoint comes, for prepare-model).",
    ),
    width_divisor: int = typer.Option(
        1,
        "--width-divisor",
        min=1,
        hidden=True,
        help="Divide every width (tests: a cheap folder of the same structure).",
    ),
) -> None:
    """Build a random Qwen3-VL at a preset's real widths and vocabulary (no download): the preset's vocabulary
    plus the 1000 coordinate tokens, deepstack off (vLLM's CPU path cannot run it), bf16 weights. The depths
    are options: Qwen3-VL-2B at 2 text layers and 1 vision block writes about 0.9 GB."""
    from rmsft_dev.real_width import RealWidthError, build_real_width_model

    console = _console(stderr=True)
    try:
        path = build_real_width_model(
            out_dir,
            preset,
            text_layers,
            vision_layers,
            seed=seed,
            coord_tokens=not stock,
            width_divisor=width_divisor,
            progress=console.print,
        )
    except RealWidthError as exc:
        raise typer.BadParameter(str(exc)) from None
    except OSError as exc:
        _fail(exc)
    console.print(f"[green]real-width model written to[/green] {path}")


@dev_app.command("prepare")
def dev_prepare(
    configs: list[Path] = typer.Argument(..., help="Job manifests whose rmsft.io/ annotations say what to build."),
) -> None:
    """Build the tiny models and synthetic data that job manifests ask for in their annotations
    (rmsft.io/build-tiny-model, rmsft.io/synthetic-records, ...), where they are absent: what `rmsft local`
    does before it starts, without starting anything. The CPU image bakes its cluster jobs' inputs so."""

    from learner.local import prepare_inputs
    from rmsft.jobspec import load_job

    console = _console(stderr=True)
    for config in configs:
        try:
            job = load_job(config)
            prepare_inputs(job, console)
        except (OSError, ValueError) as exc:
            _fail(exc)


@data_app.command("from-coco")
def data_from_coco(
    annotations: Path = typer.Argument(..., help="COCO instances file (JSON with images, annotations, categories)."),
    images_dir: Path = typer.Argument(..., help="Folder the images' file_name entries are relative to."),
    out: Path = typer.Argument(
        ..., help="Training records to write (replaced if present): a .jsonl file, or .jsonl.gz for gzip."
    ),
    fmt: str = typer.Option(
        "coordexp",
        "--format",
        help="The job's training.format (coordexp, coordjson or qwen_json): picks the default prompt.",
    ),
    prompt: str | None = typer.Option(
        None,
        show_default=False,
        help="The user message of every record (default: the --format's detection prompt). {categories} in it is "
        "replaced by the names of the categories the written objects have, comma-separated.",
    ),
    boxes: bool = typer.Option(False, "--boxes", help="Every object as its bbox_2d, polygons too."),
    max_objects: int | None = typer.Option(
        None,
        "--max-objects",
        min=1,
        show_default=False,
        help="Skip images with more objects than this (their answer would outgrow training.rollout.max_tokens).",
    ),
    keep_empty: bool = typer.Option(
        True, "--keep-empty/--drop-empty", help="Write images without any annotation as records with no objects."
    ),
    max_image_pixels: int | None = typer.Option(
        None,
        "--max-image-pixels",
        min=1,
        show_default=False,
        help="Skip images larger than this (width x height): the job's spec.model.vision.maxImagePixels "
        "(default: that field's default).",
    ),
    paths: str = typer.Option(
        "out",
        help="Image references: out (relative to OUT's folder), images (relative to IMAGES_DIR: set "
        "spec.training.data.image_root to it) or absolute.",
    ),
    allow_no_annotations: bool = typer.Option(
        False,
        "--allow-no-annotations",
        help="Convert a file without any annotation (an image list or test split) into records without objects; "
        "refused otherwise.",
    ),
) -> None:
    """Convert COCO detection annotations to training records: category names as descs, one-part polygons as
    poly, other objects as bbox_2d, crowd annotations skipped, every image checked. Prints what was converted
    and what was skipped, with a count per reason (docs/data.md)."""
    from rich.markup import escape

    from learner.data.coco import CocoError, CocoOptions, convert_coco

    try:
        limit = {} if max_image_pixels is None else {"max_image_pixels": max_image_pixels}
        options = CocoOptions(
            format=fmt,
            prompt=prompt,
            geometry="box" if boxes else "auto",  # type: ignore[arg-type]
            max_objects=max_objects,
            keep_empty=keep_empty,
            allow_no_annotations=allow_no_annotations,
            paths=paths,
            **limit,
        )  # type: ignore[arg-type]
        summary = convert_coco(annotations, images_dir, out, options)
    except (CocoError, ValueError, OSError) as exc:
        _fail(exc)
    console = _console(stderr=True)
    head, *rest = summary.lines()
    console.print(f"[green]{escape(head)}[/green]")
    for line in rest:
        console.print(escape(line), highlight=False)
    if paths == "images":
        console.print(f"set spec.training.data.image_root: {escape(str(images_dir.resolve()))}", highlight=False)


@data_app.command("check")
def data_check(
    file: Path = typer.Argument(..., help="Training records (.jsonl or .jsonl.gz), as spec.training.data.path."),
    images: Path | None = typer.Option(
        None,
        "--images",
        show_default=False,
        help="Folder the records' relative image paths are relative to: the job's spec.training.data.image_root "
        "(default: FILE's folder, as when that is unset).",
    ),
    max_image_pixels: int | None = typer.Option(
        None,
        "--max-image-pixels",
        min=1,
        show_default=False,
        help="The job's spec.model.vision.maxImagePixels (default: that field's default).",
    ),
    max_images_per_prompt: int | None = typer.Option(
        None,
        "--max-images-per-prompt",
        min=0,
        show_default=False,
        help="The job's spec.model.vision.maxImagesPerPrompt (default: that field's default).",
    ),
) -> None:
    """Load a records file with the learner's own loader and image check, as a job does: counts, a label
    histogram, the images found and missing and their sizes, and what a job would refuse. Exit 0 when a job
    would accept the file, 2 when not (docs/data.md)."""
    from rich.markup import escape

    from learner.data.check import check_records
    from learner.data.records import DataError

    limits = {
        k: v
        for k, v in (("max_image_pixels", max_image_pixels), ("max_images_per_prompt", max_images_per_prompt))
        if v is not None
    }
    try:
        report = check_records(file, images, **limits)
    except (DataError, ValueError, OSError) as exc:  # the records themselves do not load: one line, as a job says
        _fail(exc)
    # The report is the command's output (stdout); escape as in _fail: labels and paths are text.
    console = _console()
    for line in report.lines():
        text = escape(line)
        if line.startswith("a job would "):  # the verdict
            text = f"[{'green' if report.accepted else 'red'}]{text}[/]"
        console.print(text, highlight=False)
    if not report.accepted:
        raise typer.Exit(2)


@app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def serve(ctx: typer.Context) -> None:
    """Run one rollout server (gRPC + vLLM or HF engine). Flags: `rmsft serve --help`."""
    from rollout_svc.server import main as serve_main

    # The flag set lives in rollout_svc.config (shared with `python -m rollout_svc`).
    serve_main(list(ctx.args), prog="rmsft serve")


def _console(stderr: bool = False):
    """The console of every command's output, one rule for all: rich never wraps a line (soft_wrap: a message,
    a path or a label stays one line, which a terminal folds at its edge and a pipe keeps whole for grep), and
    when piped a table gets the width it needs instead of being squeezed into 80 columns (rich's default off a
    terminal, which cut `rmsft plan`'s lines while the data commands kept theirs)."""
    from rich.console import Console

    console = Console(stderr=stderr, soft_wrap=True)
    if not console.is_terminal:
        console.width = 1 << 12
    return console


def _fail(exc: Exception, code: int = 2) -> None:
    """Print `exc` as one line and exit with `code`: 2, the learner Job's podFailurePolicy reads as a configuration
    that no retry fixes; another code (e.g. BUSY_EXIT) is retried under its backoffLimit."""
    from rich.markup import escape

    # soft_wrap: a message is one line even when piped (rich would cut it at 80 columns, paths mid-name);
    # escape: a path with square brackets is text, not markup
    _console(stderr=True).print(f"[red]error:[/red] {escape(_message(exc))}")
    raise typer.Exit(code)


def _message(exc: Exception) -> str:
    """The one line of `exc`: an OS error as "PATH: what is wrong" (not "[Errno 36] File name too long: '...'"),
    the rest as they say themselves."""
    if type(exc) is not OSError and not (isinstance(exc, OSError) and type(exc).__module__ == "builtins"):
        return str(exc)
    import errno

    what = {
        errno.ENAMETOOLONG: "file name too long (a name over 255 bytes, or a path over 4096)",
        errno.EISDIR: "is a folder, where a file is expected",
        errno.ENOTDIR: "a part of the path is a file, not a folder",
        errno.ENOENT: "no such file or folder",
        errno.EACCES: "permission denied",
    }.get(exc.errno or 0, exc.strerror or str(exc))
    return f"{exc.filename}: {what}" if exc.filename else what


# `rmsft train`'s exit codes (rmsft.exit_codes): 2 a refused configuration, 75 a failure a retry may not meet
# again (another learner holding the checkpoint folder among them), 143 stopped by SIGTERM with a checkpoint.
BUSY_EXIT = RETRY_EXIT


class Interrupted(BaseException):  # a signal, not an error
    """SIGTERM before the first step of this process: nothing new to save, so the setup (loading the model,
    waiting for the servers, resuming) is left at once rather than waited out to the grace period's SIGKILL. A
    BaseException, so no `except Exception` of the setup (a rank's failure agreement) takes it for an error."""

    def __init__(self, signum: int) -> None:
        super().__init__(
            f"stopped ({signal.Signals(signum).name}) before the first step: nothing new to save; "
            "a restart resumes from the last checkpoint"
        )


class StopOnSignal:
    """`rmsft train`'s SIGTERM handler, installed on its first line (before torch is imported and the model
    loaded). Before the training loop's first step it raises Interrupted; from then on it asks the loop to stop
    after the step in progress (TrainingLoop.request_stop: every rank agrees on that step and saves it). `received`: a
    signal came, so what the run ends with after it is the stop (exit 143), not an error of its own: a rank left in
    a collective by a peer that stopped sees that peer's connection close."""

    def __init__(self) -> None:
        self.loop = None  # the TrainingLoop, once built
        self.received: int | None = None

    def install(self) -> StopOnSignal:
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, _frame) -> None:
        self.received = signum
        loop = self.loop
        if loop is None or not loop.history:
            raise Interrupted(signum)
        loop.request_stop(signal.Signals(signum).name)


@app.command("train")
def train(
    config: Path = typer.Option(..., "--config", help="RolloutMatchingJob manifest (YAML)."),
    servers: str = typer.Option(
        "",
        envvar="RMSFT_ROLLOUT_SERVERS",
        show_default=False,
        help="Comma-separated host:port of the rollout servers, in order (a fixed list).",
    ),
    servers_file: Path | None = typer.Option(
        None,
        "--servers-file",
        envvar="RMSFT_ROLLOUT_SERVERS_FILE",
        show_default=False,
        help="File with one host:port per line, in order, followed during the run (the operator's "
        "/etc/rmsft/servers). Give exactly one of --servers and --servers-file.",
    ),
    auth_token: str = typer.Option("", envvar="RMSFT_AUTH_TOKEN", help="Shared gRPC auth token.", show_default=False),
    resume: bool = typer.Option(True, help="Resume from the newest checkpoint in training.checkpoint.dir."),
    metrics_port: int = typer.Option(
        -1, envvar="RMSFT_METRICS_PORT", help="Prometheus /metrics port (-1 = spec.learner.metricsPort, 0 = off)."
    ),
) -> None:
    """Run the learner against running rollout servers, or with its own engine in colocate mode (what the learner
    Job runs). Exit 0 when it finished, 2 for a refused configuration, 75 for a failure a retry may not meet again,
    143 when stopped by SIGTERM (its checkpoint written when a step was trained)."""
    # First: an eviction, a drain or a preemption sends SIGTERM, then SIGKILL after the pod's grace period; a stop
    # during the setup must not wait that out, and one during training keeps the step in progress (StopOnSignal).
    stop = StopOnSignal().install()
    try:
        _train(stop, config, servers, servers_file, auth_token, resume, metrics_port)
    except Interrupted as exc:
        import logging

        logging.getLogger("rmsft.train").warning("%s", exc)
        raise typer.Exit(STOPPED_EXIT) from None


def _train(
    stop: StopOnSignal,
    config: Path,
    servers: str,
    servers_file: Path | None,
    auth_token: str,
    resume: bool,
    metrics_port: int,
) -> None:
    from learner.data.records import DataError, load_records
    from learner.rollouts.pool import ServersFile, ServersFileError
    from rmsft.jobspec import JobSpecError, load_job
    from rmsft.logs import LogLevelError, configure_logging
    from rmsft.requirements import MissingRequirementError, require_learner_runtime

    try:
        configure_logging("info")
        job = load_job(config)  # validate the inputs before paying for torch's import
        given = bool(servers.strip()) or servers_file is not None
        if job.spec.rollout.colocated and given:
            raise ValueError(
                "spec.rollout.mode is colocate (the rollout engine runs in the learner): give neither "
                "--servers nor --servers-file"
            )
        if not job.spec.rollout.colocated and bool(servers.strip()) == (servers_file is not None):
            raise ValueError(
                "give exactly one of --servers (RMSFT_ROLLOUT_SERVERS) and --servers-file (RMSFT_ROLLOUT_SERVERS_FILE)"
            )
        if job.spec.rollout.colocated:
            addresses: list[str] | ServersFile = []
        elif servers_file is not None:
            addresses = ServersFile(servers_file)
            addresses.read()  # missing or empty: fail now, naming the file
        else:
            addresses = [a.strip() for a in servers.split(",") if a.strip()]
        # e.g. deepspeed_stage > 0 without DeepSpeed: say so now, not after the model loaded
        require_learner_runtime(job)
        load_records(job.spec.training.data.path)
        from learner.train.build import build_loop

        port = job.spec.learner.metrics_port if metrics_port < 0 else metrics_port
        if port and os.environ.get("RANK", "0") == "0":  # one endpoint per learner pod: rank 0's
            from rmsft.metrics_http import learner_registry, start_metrics_server

            start_metrics_server(port, registry=learner_registry(colocated=job.spec.rollout.colocated))
        # the objective spec.trainer names (learner.train.objectives: rollout_matching or grpo)
        loop = build_loop(job, addresses, auth_token=auth_token or None)
    except (
        JobSpecError,
        DataError,
        ServersFileError,
        LogLevelError,
        MissingRequirementError,
        ValueError,
        RuntimeError,
        OSError,
    ) as exc:
        # A refusal (the spec, the model folder, another job's checkpoint) is 2; a CUDA error, EIO on the claim, the
        # process group's rendezvous, a busy checkpoint folder are retried (rmsft.exit_codes.exit_code_for).
        _fail(exc, _after_signal(stop, exc))
    from learner.rollouts.pool import NoServerAvailableError
    from learner.sync.client import WeightSyncError
    from learner.train.loop import StopRequested
    from learner.train.ranks import RankFailedError

    stop.loop = loop
    try:
        if resume:
            loop.resume()
        summary = loop.run()
        if os.environ.get("RANK", "0") == "0":
            _log_summary(summary)
            from rmsft.termination import final_progress_message
            from rollout_svc.preflight import write_termination_log

            # In a pod: the operator reads the final step from here (status.step); /metrics ends with the process.
            write_termination_log(final_progress_message(summary.steps, summary.weight_version))
    except StopRequested as exc:
        import logging

        logging.getLogger("rmsft.train").warning("%s", exc)
        raise typer.Exit(STOPPED_EXIT) from None
    except (RankFailedError, NoServerAvailableError, WeightSyncError, ValueError, RuntimeError, OSError) as exc:
        # every rank exits with the cause: a lineage refusal 2 on every rank (RankFailedError carries the failed
        # rank's code), one server restarting longer than spec.rollout.recoveryTimeout a retry
        _fail(exc, _after_signal(stop, exc))
    finally:
        loop.close()


def _after_signal(stop: StopOnSignal, exc: BaseException) -> int:
    """The exit code of a learner that ends with `exc`: its own (rmsft.exit_codes), except that after a SIGTERM
    anything but a refusal is the stop's consequence (a peer that stopped first closes the collective this rank
    waited in) and exits 143, as the stop does."""
    code = exit_code_for(exc)
    if stop.received is not None and code != CONFIG_EXIT:
        return STOPPED_EXIT
    return code


def _log_summary(summary) -> None:
    """The run's closing lines: what `rmsft local` prints as a table, as log lines."""
    import logging

    log = logging.getLogger("rmsft.train")
    log.info(
        "training done: %d steps, loss %.4f -> %.4f, weight version %d of run %s, rollout retries %d, %.1fs",
        summary.steps,
        summary.first_loss,
        summary.last_loss,
        summary.weight_version,
        summary.run_id,
        summary.retries,
        summary.wall_seconds,
    )
    for label, text in summary.objective_rows():  # the objective's own figures, as rmsft local's table has them
        log.info("%s: %s", label, text)
    figures = {f.step: f for f in summary.held_out}
    for step, f1, mean_ap in summary.evaluations:
        fig = figures.get(step)
        log.info(
            "held-out evaluation at step %d: label-aware F1@%g %.3f mAP %.3f%s",
            step,
            summary.eval_iou,
            f1,
            mean_ap,
            ""
            if fig is None
            else f"; geometry F1 {fig.f1_geometry:.3f}, class-agnostic mAP {fig.map_agnostic:.3f}, truncated "
            f"{fig.truncation_rate:.1%}, duplicates {fig.duplicate_rate:.1%}, objects "
            f"{fig.predicted_per_answer:.2f}/answer vs {fig.gt_per_record:.2f} true",
        )
    total = sum(summary.phase_seconds.values()) or 1.0
    log.info(
        "time by phase: %s",
        ", ".join(
            f"{k} {v:.1f}s ({100 * v / total:.0f}%)"
            for k, v in sorted(summary.phase_seconds.items(), key=lambda kv: -kv[1])
        ),
    )
    if summary.exported is not None:
        log.info("trained model exported to %s", summary.exported)


@app.command(
    "torchrun",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def torchrun_cmd(ctx: typer.Context) -> None:
    """torchrun (`python -m torch.distributed.run`) with these arguments, ending with its ranks' verdict: 2 when
    a rank refused its configuration, the first failure's code, 143 when they stopped on SIGTERM; torchrun's own
    exit (1 whatever its ranks said) only when no rank said. SIGTERM, SIGINT and SIGHUP are passed on to torchrun,
    which passes them on to its ranks. What a learner pod of several ranks runs (rmsft.launch)."""
    from rmsft.launch import run_torchrun

    raise typer.Exit(run_torchrun(list(ctx.args)))


@app.command("local")
def local(
    job: Path | None = typer.Argument(None, help="RolloutMatchingJob manifest (YAML).", show_default=False),
    work_dir: Path = typer.Option(Path(".rmsft"), help="Where server logs go."),
    resume: bool = typer.Option(False, help="Resume from the newest checkpoint in training.checkpoint.dir."),
    clean: bool = typer.Option(
        False,
        "--clean",
        help="Remove the shared-memory folders (/dev/shm/rmsft-run-*) of "
        "runs that were killed, then run JOB if one is given. A live run's are never "
        "touched; every run also does this when it starts.",
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Print what the run would start (inputs, servers and "
        "ports, weight sync transport, learner, steps, memory plan) and exit: nothing is "
        "started, built or written.",
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        help="KEY=VALUE: set a field of JOB for this run, a dotted "
        "path under spec as in the file (training.steps=10, rollout.replicas=1), "
        "the value read as YAML; validated as the file is. Repeatable.",
        show_default=False,
    ),
    metrics_port: int = typer.Option(
        -1,
        min=-1,
        max=65535,
        show_default=False,
        help="The learner's Prometheus /metrics port on 127.0.0.1 (-1 = "
        "a free one, printed at start; 0 = none). The servers' /metrics are on free ports, printed too.",
    ),
) -> None:
    """Run a whole job on this machine: rollout servers as local processes, the learner in-process."""

    if job is None and not clean:  # before the imports below, which take seconds (torch)
        _fail(ValueError("give a job manifest (JOB), or --clean alone"))
    from learner.data.records import DataError
    from learner.local import MetricsPortError
    from learner.rewards.interface import RewardConfigError
    from learner.tracking.tracker import TrackingError
    from learner.train.checkpoint_owner import CheckpointFolderBusyError, CheckpointLineageError
    from rmsft.jobspec import JobSpecError
    from rmsft.logs import LogLevelError, configure_logging
    from rmsft.memory_plan import MemoryPlanSettingError
    from rmsft.model_check import ModelCheckError

    console = _console(stderr=True)
    if clean:
        from rmsft import run_dir

        removed = run_dir.remove_stale()
        for path in removed:
            console.print(f"removed {path} (its run is gone)")
        kept = run_dir.live()
        console.print(
            f"{len(removed)} folder(s) of killed runs removed"
            + (f"; {len(kept)} of live runs kept: {', '.join(map(str, kept))}" if kept else "")
        )
        if job is None:
            return
    if job is None:
        _fail(ValueError("give a job manifest (JOB), or --clean alone"))
    try:
        if dry_run:
            from learner.local import dry_run as describe
            from rmsft.jobspec import load_job

            out = _console()
            for line in describe(load_job(job, overrides), work_dir=work_dir):
                out.print(line, highlight=False, markup=False)
            return
        if overrides:  # every process of the run (the torchrun ranks too) reads the job with them set
            from rmsft.jobspec import write_effective_job

            job = write_effective_job(job, overrides, Path(work_dir) / "job.yaml")
            console.print(f"the job with --set applied: {job}", highlight=False)
        # warning by default: info lines would break up the progress bar
        configure_logging("warning", fmt="%(name)s %(levelname)s %(message)s")
        from learner.local import run_local

        run_local(job, work_dir=work_dir, resume=resume, console=console, metrics_port=metrics_port)
    except (
        JobSpecError,
        DataError,
        LogLevelError,
        RewardConfigError,
        ModelCheckError,
        MemoryPlanSettingError,
        CheckpointLineageError,
        CheckpointFolderBusyError,
        TrackingError,
        MetricsPortError,
    ) as exc:
        _fail(exc)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (learner.local.Terminated)
        import signal

        signum = getattr(exc, "signum", signal.SIGINT)
        console.print(
            f"stopped ({signal.Signals(signum).name}): the rollout servers and the run's shared memory "
            "are gone; --resume continues from the last checkpoint"
        )
        raise typer.Exit(128 + signum) from None


@app.command("plan")
def plan_cmd(
    job: Path = typer.Argument(..., help="RolloutMatchingJob manifest (YAML)."),
    gpu_memory: str | None = typer.Option(
        None,
        "--gpu-memory",
        show_default=False,
        help="Memory of one GPU, e.g. 80GiB, 141GiB (default: the size in the node selector's "
        "nvidia.com/gpu.product, else 80 GiB).",
    ),
    model_config: str | None = typer.Option(
        None,
        "--model-config",
        show_default=False,
        help="config.json, model folder or preset (Qwen2.5-VL-7B, Qwen3-VL-2B, Qwen3-VL-4B, Qwen3-VL-8B) to plan "
        "with, when spec.model.path is not on this machine.",
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        help="KEY=VALUE: a field of JOB set for this plan, as `rmsft local --set` (e.g. rollout.replicas=2).",
        show_default=False,
    ),
) -> None:
    """The memory plan of a job, per GPU, in server and colocate mode: weights, gradients, optimizer state,
    activations, engine and KV cache. Exit 0 when the job's own mode fits, 2 (with the knobs to turn) when not."""

    from rmsft.jobspec import JobSpecError, load_job
    from rmsft.memory_plan import ModelShapeError, parse_bytes, plan_memory

    try:
        manifest = load_job(job, overrides)
        memory = parse_bytes(gpu_memory, what="--gpu-memory") if gpu_memory is not None else None
        plan = plan_memory(manifest, gpu_memory=memory, model_config=model_config)
    except ModelShapeError as exc:
        _fail(ValueError(_not_built(manifest, job) or str(exc)))
    except (JobSpecError, ValueError, OSError) as exc:
        _fail(exc)
    _console().print(plan.render())
    if not plan.fits:
        _fail(ValueError(plan.message()))


def _not_built(manifest, job: Path) -> str | None:
    """The fix for an example job whose model is not built yet (its `rmsft.io/build-tiny-model` annotation says
    how): `rmsft dev prepare JOB`, not "pass --model-config" or "point spec.model.path" elsewhere; None for any
    other job, or when the model is there."""
    notes = manifest.metadata.model_extra.get("annotations") or {} if manifest.metadata.model_extra else {}
    build = str(notes.get("rmsft.io/build-tiny-model", "")).lower() if isinstance(notes, dict) else ""
    model = Path(manifest.spec.model.path)
    if build in ("", "false") or (model / "config.json").is_file():
        return None
    return (
        f"spec.model.path {model} is not built yet: this example job builds its own tiny model "
        f"(metadata.annotations rmsft.io/build-tiny-model: {build}); run `rmsft dev prepare {job}` (what "
        "`rmsft local` does before it starts), then this command again"
    )


@app.command("prepare-model")
def prepare_model_cmd(
    src: Path = typer.Argument(..., help="Stock model folder (Qwen2 / Qwen2.5-VL / Qwen3-VL layout)."),
    dst: Path = typer.Argument(..., help="Folder to write the CoordExp-ready model to (new or empty)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace DST when it is not empty."),
) -> None:
    """Add the 1000 <|coord_k|> tokens to a stock checkpoint: tokenizer, embedding rows (mean of the existing
    rows plus a small ordered component), output head, config; writes a complete model folder to DST."""

    from rmsft.prepare_model import PrepareModelError, prepare_model

    console = _console(stderr=True)
    try:
        with console.status(f"preparing {src} -> {dst}"):
            summary = prepare_model(src, dst, overwrite=overwrite)
    except PrepareModelError as exc:
        _fail(exc)
    head, *rest = summary.lines()
    console.print(f"[green]{head}[/green]" if summary.changed else head)
    for line in rest:
        console.print(f"  {line}")


@app.command("preflight")
def preflight_cmd(
    job: Path = typer.Argument(..., help="RolloutMatchingJob manifest (YAML)."),
) -> None:
    """Check, in a second and without a GPU, that spec.model.path is a model folder whose tokenizer fits
    spec.training.format (coordexp needs the 1000 <|coord_k|> tokens). Exit 0, or 2 with the fix. The operator
    runs it in an init container of every pod before the model is loaded; `rmsft local` runs it too."""
    import sys

    from rmsft.jobspec import JobSpecError, load_job
    from rmsft.model_check import ModelCheckError, check_model
    from rollout_svc.preflight import write_termination_log

    try:
        manifest = load_job(job)
        line = check_model(manifest.spec.model.path, manifest.spec.training.format)
    except (JobSpecError, ModelCheckError) as exc:
        hint = _not_built(manifest, job) if isinstance(exc, ModelCheckError) else None
        message = f"rmsft preflight: {hint or exc}"
        # Plain text, one line (no rich wrapping): in a pod the operator quotes it from the termination
        # message, which is this file or, failing that, the log's tail.
        write_termination_log(message)
        print(message, file=sys.stderr)
        raise typer.Exit(2) from None
    print(f"rmsft preflight: {line}")


@app.command("export")
def export_cmd(
    checkpoint: Path = typer.Argument(
        ..., help="Learner checkpoint: <training.checkpoint.dir>/step-<n> (or the dir itself: its newest)."
    ),
    out: Path = typer.Argument(..., help="Folder to write the Hugging Face model to (new or empty)."),
    config: Path | None = typer.Option(
        None,
        "--config",
        show_default=False,
        help="The job manifest the checkpoint was trained with (default: run.json beside the checkpoint).",
    ),
    adapter: bool = typer.Option(False, "--adapter", help="The PEFT adapter alone instead of merged weights."),
    dtype: str = typer.Option("auto", help="Weights' dtype: auto (the base model's), bfloat16, float16, float32."),
    base_model: Path | None = typer.Option(
        None, "--base-model", show_default=False, help="Base model folder, when not at spec.model.path from here."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT when it is not empty."),
) -> None:
    """Write a learner checkpoint as a model folder transformers and vLLM load: LoRA/DoRA merged into the base
    weights (or, with --adapter, the adapter alone), full fine-tunes whole, with processor/tokenizer."""

    from learner.train.export import ExportError, export_checkpoint
    from learner.train.policy import ModelLoadError
    from rmsft.jobspec import JobSpecError
    from rmsft.logs import configure_logging

    console = _console(stderr=True)
    configure_logging("warning")
    try:
        with console.status("exporting") as status:
            result = export_checkpoint(
                checkpoint,
                out,
                config=config,
                adapter_only=adapter,
                dtype=dtype,
                base_model=base_model,
                overwrite=overwrite,
                progress=status.update,
            )
    except (ExportError, JobSpecError, ModelLoadError) as exc:
        _fail(exc)
    head, *rest = result.lines()
    console.print(f"[green]{head}[/green]")
    for line in rest:
        console.print(f"  {line}")


@app.command("eval")
def eval_cmd(
    model: Path = typer.Argument(..., help="Model folder, or a learner checkpoint (step-<n> or a checkpoint dir)."),
    data: Path = typer.Argument(..., help="JSONL of held-out records (the training data's schema)."),
    config: Path | None = typer.Option(
        None,
        "--config",
        show_default=False,
        help="Job manifest: output format, matcher, image bounds (default: run.json beside a checkpoint, else "
        "the defaults).",
    ),
    image_root: str | None = typer.Option(None, help="Base folder for the records' relative image paths."),
    max_samples: int = typer.Option(64, min=1, help="Records evaluated (the file's first N)."),
    max_tokens: int | None = typer.Option(None, min=1, help="Answer length (default: training.rollout.max_tokens)."),
    iou: float = typer.Option(0.5, min=0.0, max=1.0, help="IoU threshold of the reported F1."),
    out: Path | None = typer.Option(None, help="Write eval.json and pictures of the first answers here."),
    fmt: str | None = typer.Option(
        None, "--format", help="Override training.format: coordexp, coordjson or qwen_json."
    ),
    coordinates: str | None = typer.Option(
        None, help="Override training.format_options.coordinates (qwen_json): relative or pixels."
    ),
    work_dir: Path = typer.Option(Path(".rmsft/eval"), help="Where server logs go."),
) -> None:
    """Held-out evaluation of a checkpoint: greedy answers from local rollout servers on MODEL, scored as the training
    loop scores training.eval (F1 at an IoU threshold, COCO mAP)."""

    from learner.checkpoint_eval import EvalOptions, run_eval
    from learner.data.records import DataError
    from learner.train.export import ExportError
    from learner.train.policy import ModelLoadError
    from rmsft.jobspec import JobSpecError
    from rmsft.logs import configure_logging

    configure_logging("warning")
    opts = EvalOptions(
        config=config,
        image_root=image_root,
        max_samples=max_samples,
        max_tokens=max_tokens,
        iou=iou,
        out=out,
        format=fmt,
        coordinates=coordinates,
        work_dir=work_dir,
    )
    try:
        run_eval(model, data, opts, _console(stderr=True))
    except (ExportError, JobSpecError, ModelLoadError, DataError, ValueError, RuntimeError, OSError) as exc:
        _fail(exc)


@app.command("operator")
def operator_cmd(
    namespace: list[str] = typer.Option([], "--namespace", "-n", help="Namespace to watch (repeatable)."),
    all_namespaces: bool = typer.Option(False, "--all-namespaces", "-A", help="Watch every namespace."),
    liveness: str = typer.Option("", help="Liveness endpoint, e.g. http://0.0.0.0:8081/healthz."),
    verbose: bool = typer.Option(False, help="Debug logging."),
) -> None:
    """Run the Kubernetes operator (kopf) that reconciles RolloutMatchingJobs."""
    from rmsft_operator.__main__ import run

    run(list(namespace), all_namespaces, liveness or None, verbose)


def main() -> None:
    """The `rmsft` command. A command that returns or exits with a code ends the process at once, logs and output
    flushed: by then it has closed what it opened (servers, the learner, checkpoint and TensorBoard files), and
    the interpreter's own exit would spend 2-3 s on a last garbage-collection pass over torch, transformers and
    vLLM, paid by every run, every learner rank under torchrun, and every test that starts one. An exception that
    escapes a command still exits the normal way, with its traceback."""
    try:
        app()
        code: int | str | None = 0
    except SystemExit as e:
        code = e.code
    except BaseException:
        record_rank_exit(1)  # under `rmsft torchrun`: this rank failed with a traceback (Python's exit 1)
        raise
    if isinstance(code, str):  # sys.exit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    record_rank_exit(code or 0)  # under `rmsft torchrun`: the code torchrun's own 1 would hide
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    main()
