"""Builds the image users build, from this Dockerfile, unchanged: what a machine without a registry or
the PyTorch index needs comes in through the Dockerfile's build args (README, "Building the image
without the internet"), found on this machine:
- PIP_FIND_LINKS: pip's own find-links folder (PIP_FIND_LINKS or `pip config`), served over HTTP on
  loopback for the build (the CPU torch wheel lies there: the PyTorch CPU index is unreachable and
  PyPI's torch is the CUDA build); TORCH_INDEX_URL empty then;
- EXTRA_CA_CERTS: the CA certificates added to this machine's trust store
  (/usr/local/share/ca-certificates), e.g. a TLS-intercepting proxy's;
- the build runs on the host's network (`--network host`) and with the legacy builder (BuildKit would
  pull a frontend image; the Dockerfile has no `# syntax=` line).
RMSFT_BUILD_ARGS (`K=V;K=V`) adds or overrides build args."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from host import run

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE_PORT = 38311


def _pip_config(key: str) -> str | None:
    env = os.environ.get(f"PIP_{key.replace('-', '_').upper()}")
    if env:
        return env
    proc = subprocess.run(["python3", "-m", "pip", "config", "get", f"global.{key}"], capture_output=True, text=True)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


@contextlib.contextmanager
def _serve(folder: Path) -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # pip's requests are not worth a line each
            pass

    handler = functools.partial(Quiet, directory=str(folder))
    # A fixed port when it is free: the URL is a build arg, and the legacy builder keys every RUN
    # step's cache on the build args' values (a new port each build would rebuild every layer).
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELHOUSE_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def machine_build_args() -> tuple[dict[str, str], Path | None]:
    """Build args this machine needs, and the local wheelhouse to serve (if any)."""
    args: dict[str, str] = {}
    wheelhouse = None
    links = _pip_config("find-links")
    if links and Path(links.split()[0]).is_dir():
        wheelhouse = Path(links.split()[0])
        if any(wheelhouse.glob("torch-*.whl")):
            args["TORCH_INDEX_URL"] = ""
    certs = sorted(Path("/usr/local/share/ca-certificates").rglob("*.crt"))
    if certs:
        args["EXTRA_CA_CERTS"] = "\n".join(c.read_text().strip() for c in certs)
    for item in filter(None, os.environ.get("RMSFT_BUILD_ARGS", "").split(";")):
        key, _, value = item.partition("=")
        args[key.strip()] = value
    return args, wheelhouse


def build_image(tag: str, variant: str = "cpu", log: Path | None = None, timeout: float = 3000) -> tuple[str, float]:
    """`docker build --build-arg VARIANT=<variant> -t <tag> .` with this machine's build args.
    Returns the image ID and the seconds it took."""
    args, wheelhouse = machine_build_args()
    t0 = time.monotonic()
    with _serve(wheelhouse) if wheelhouse else contextlib.nullcontext(None) as url:
        if url:
            args["PIP_FIND_LINKS"] = url
        cmd = ["docker", "build", "--network", "host", "--build-arg", f"VARIANT={variant}", "-t", tag]
        for key, value in args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        env = {**os.environ, "DOCKER_BUILDKIT": "0"}
        with open(log, "w") if log else contextlib.nullcontext(None) as out:
            proc = subprocess.run(
                [*cmd, "."],
                cwd=ROOT,
                env=env,
                stdout=out or subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
        if proc.returncode != 0:
            tail = log.read_text()[-6000:] if log else (proc.stdout or "")[-6000:]
            raise RuntimeError(f"docker build of {tag} failed ({proc.returncode}):\n{tail}")
    image_id = run("docker", "image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
    return image_id, time.monotonic() - t0
