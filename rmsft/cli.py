"""The `rmsft` command. Heavy imports (torch, vLLM, kopf) happen inside the commands that need them."""

from __future__ import annotations

import os
from pathlib import Path

import typer

app = typer.Typer(help="Rollout-matching SFT for vision-language detection models.", no_args_is_help=True)
dev_app = typer.Typer(help="Developer tools.", no_args_is_help=True)
app.add_typer(dev_app, name="dev")


@dev_app.command("tiny-model")
def tiny_model(
    out_dir: Path = typer.Argument(..., help="Folder to write the tokenizer and weights to."),
    seed: int = typer.Option(0, help="Seed for the tokenizer corpus and the random weights."),
    vl: bool = typer.Option(False, "--vl", help="A vision-language model (tiny Qwen-VL with a processor)."),
    arch: str = typer.Option("qwen3_vl", help="With --vl: qwen3_vl or qwen2_5_vl."),
) -> None:
    """Build a tiny random model with the CoordExp vocabulary (no downloads): a Qwen2 text model, or with
    --vl a Qwen-VL model whose processor transformers and vLLM both load."""
    from rich.console import Console

    console = Console(stderr=True)
    with console.status(f"building tiny {'vision-language ' if vl else ''}model in {out_dir}"):
        if vl:
            from rmsft.tiny_vl import build_tiny_vl_model

            try:
                path = build_tiny_vl_model(out_dir, arch=arch, seed=seed)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--arch") from None
        else:
            from rmsft.tiny_model import build_tiny_model

            path = build_tiny_model(out_dir, seed=seed)
    console.print(f"[green]tiny model written to[/green] {path}")


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


def _fail(exc: Exception) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[red]error:[/red] {exc}")
    raise typer.Exit(2)


@app.command("train")
def train(
    config: Path = typer.Option(..., "--config", help="RolloutMatchingJob manifest (YAML)."),
    servers: str = typer.Option(
        "", envvar="RMSFT_ROLLOUT_SERVERS", show_default=False,
        help="Comma-separated host:port of the rollout servers, in order (a fixed list).",
    ),
    servers_file: Path | None = typer.Option(
        None, "--servers-file", envvar="RMSFT_ROLLOUT_SERVERS_FILE", show_default=False,
        help="File with one host:port per line, in order, followed during the run (the operator's "
        "/etc/rmsft/servers). Give exactly one of --servers and --servers-file.",
    ),
    auth_token: str = typer.Option("", envvar="RMSFT_AUTH_TOKEN", help="Shared gRPC auth token.", show_default=False),
    resume: bool = typer.Option(True, help="Resume from the newest checkpoint in training.checkpoint.dir."),
    metrics_port: int = typer.Option(
        -1, envvar="RMSFT_METRICS_PORT", help="Prometheus /metrics port (-1 = spec.learner.metricsPort, 0 = off)."
    ),
) -> None:
    """Run the learner against running rollout servers (what the learner Job runs)."""
    from learner.data import DataError, load_records
    from learner.servers import ServersFile, ServersFileError
    from rmsft.jobspec import JobSpecError, load_job
    from rmsft.logs import LogLevelError, configure_logging
    from rmsft.requirements import MissingRequirementError, require_learner_runtime

    try:
        configure_logging("info")
        if bool(servers.strip()) == (servers_file is not None):
            raise ValueError(
                "give exactly one of --servers (RMSFT_ROLLOUT_SERVERS) and --servers-file (RMSFT_ROLLOUT_SERVERS_FILE)"
            )
        job = load_job(config)  # validate the inputs before paying for torch's import
        if servers_file is not None:
            addresses: list[str] | ServersFile = ServersFile(servers_file)
            addresses.read()  # missing or empty: fail now, naming the file
        else:
            addresses = [a.strip() for a in servers.split(",") if a.strip()]
        # e.g. deepspeed_stage > 0 without DeepSpeed: say so now, not after the model loaded
        require_learner_runtime(job)
        load_records(job.spec.training.data.path)
        from learner.trainer import Trainer

        port = job.spec.learner.metrics_port if metrics_port < 0 else metrics_port
        if port and os.environ.get("RANK", "0") == "0":  # one endpoint per learner pod: rank 0's
            from prometheus_client import start_http_server

            start_http_server(port)
        trainer = Trainer(job, addresses, auth_token=auth_token or None)
    except (JobSpecError, DataError, ServersFileError, LogLevelError, MissingRequirementError, ValueError,
            RuntimeError, OSError) as exc:
        _fail(exc)
    from learner.distributed import RankFailedError
    from learner.servers import NoServerAvailableError

    try:
        if resume:
            trainer.resume()
        trainer.run()
    except (RankFailedError, NoServerAvailableError) as exc:  # every learner rank exits with the cause
        _fail(exc)
    finally:
        trainer.close()


@app.command("local")
def local(
    job: Path = typer.Argument(..., help="RolloutMatchingJob manifest (YAML)."),
    work_dir: Path = typer.Option(Path(".rmsft"), help="Where server logs go."),
    resume: bool = typer.Option(False, help="Resume from the newest checkpoint in training.checkpoint.dir."),
) -> None:
    """Run a whole job on this machine: rollout servers as local processes, the learner in-process."""
    from learner.data import DataError
    from rmsft.jobspec import JobSpecError
    from rmsft.logs import LogLevelError, configure_logging

    try:
        # warning by default: info lines would break up the progress bar
        configure_logging("warning", fmt="%(name)s %(levelname)s %(message)s")
        from learner.local import run_local

        run_local(job, work_dir=work_dir, resume=resume)
    except (JobSpecError, DataError, LogLevelError) as exc:
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
    app()


if __name__ == "__main__":
    main()
