"""tests/shm_sweep.py: what the suite's kills leave in /dev/shm goes at the end of the run; what is held stays."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from shm_sweep import unheld_since


def test_only_files_no_process_holds_made_since_the_start_are_swept(tmp_path: Path) -> None:
    old = tmp_path / "psm_old"
    old.write_bytes(b"x")
    since = time.time() + 1
    time.sleep(1.1)
    left, held, other = tmp_path / "psm_left", tmp_path / "rmsft-stage-1-2-ab.bin", tmp_path / "mine.bin"
    for p in (left, held, other):
        p.write_bytes(b"x")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; f = open(sys.argv[1], 'rb'); print('open', flush=True); time.sleep(60)",
            str(held),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        assert unheld_since(tmp_path, since) == [left]  # not the held one, not an older one, not another kind
    finally:
        holder.kill()
        holder.wait()
    assert unheld_since(tmp_path, since) == [left, held]  # its holder gone
