"""`make setup` on a CPU machine takes torch's CPU wheel from TORCH_INDEX_URL, the variable the Dockerfile takes
(scripts/torch_index.sh, issue 44): pyproject.toml's CPU index by default, an index that does not answer left out
with a one-line note (pip's configured index then serves torch), "" for none."""

from __future__ import annotations

import functools
import http.server
import os
import socket
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(env_extra: dict[str, str], drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in drop and k != "TORCH_INDEX_URL"}
    return subprocess.run(
        ["bash", str(ROOT / "scripts/torch_index.sh")],
        capture_output=True,
        text=True,
        env={**env, "PYTHON": sys.executable, **env_extra},
        timeout=60,
    )


def test_an_index_that_answers_is_given_to_pip(tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "index.html").write_text("<a href='torch-2.13.0+cpu.whl'>torch</a>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        out = _run({"TORCH_INDEX_URL": url})
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["--extra-index-url", url] and out.stderr == ""


def test_an_index_that_does_not_answer_is_left_out_with_a_note() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/simple"
    out = _run({"TORCH_INDEX_URL": url})
    assert out.returncode == 0 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and url in out.stderr and "configured index" in out.stderr


def test_none_when_set_empty_and_pyprojects_cpu_index_by_default() -> None:
    out = _run({"TORCH_INDEX_URL": ""})
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")
    default = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["rmsft"]["image"]["cpu"]["torch-index"]
    assert "download.pytorch.org/whl/cpu" in default
    out = _run({})  # unset: the default, given to pip or named in the note, whether this machine reaches it or not
    assert out.returncode == 0 and default in out.stdout + out.stderr


def test_setup_installs_torch_with_what_the_script_prints() -> None:
    setup = (ROOT / "scripts/setup.sh").read_text()
    assert "bash scripts/torch_index.sh)" in setup and '"${TORCH_FROM[@]}" "torch==$TORCH_VERSION"' in setup
