"""The `rmsft` command. Heavy imports (torch, vLLM, kopf) happen inside the commands that need them."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Rollout-matching SFT for vision-language detection models.", no_args_is_help=True)
dev_app = typer.Typer(help="Developer tools.", no_args_is_help=True)
app.add_typer(dev_app, name="dev")


@dev_app.command("tiny-model")
def tiny_model(
    out_dir: Path = typer.Argument(..., help="Folder to write the tokenizer and weights to."),
    seed: int = typer.Option(0, help="Seed for the tokenizer corpus and the random weights."),
) -> None:
    """Build a tiny random Qwen2 model with the CoordExp vocabulary (no downloads)."""
    from rich.console import Console

    from rmsft.tiny_model import build_tiny_model

    console = Console(stderr=True)
    with console.status(f"building tiny model in {out_dir}"):
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
