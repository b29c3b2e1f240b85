"""`rmsft torchrun`: torchrun in a child process, whose exit code is its ranks' verdict.

torchrun exits 1 when any rank failed, whatever the rank's own code, and a learner pod's container exit code is what
the Job's podFailurePolicy reads (2: a refused configuration, fail at once; anything else: retry). So the pod runs
this wrapper instead: it names a folder in RMSFT_RANK_EXIT_DIR, every rank's `rmsft` process writes its exit code
there as it ends (rmsft_cli.app.main), and the wrapper returns `rmsft.exit_codes.verdict` of them.

Signals: the wrapper passes SIGTERM, SIGINT and SIGHUP on to torchrun, whose agent passes them on to its ranks and
waits `--shutdown-timeout` (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, set by the operator from the pod's grace period) for
them to exit before it SIGKILLs them. Torch-free until torchrun itself runs."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from rmsft import lifeline
from rmsft.exit_codes import EXIT_DIR_ENV, read_rank_exits, verdict

log = logging.getLogger("rmsft.launch")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def torchrun_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run_torchrun(args: list[str]) -> int:
    """Run torchrun with `args` until it ends; returns the ranks' verdict (module doc)."""
    folder = tempfile.mkdtemp(prefix="rmsft-rank-exits-")
    previous = {}
    try:
        env = {**os.environ, EXIT_DIR_ENV: folder}
        proc = subprocess.Popen(torchrun_command(args), **lifeline.popen_options(env))

        def forward(signum: int, _frame) -> None:
            if proc.poll() is None:
                proc.send_signal(signum)

        for sig in FORWARDED:
            previous[sig] = signal.signal(sig, forward)
        rc = proc.wait()
        codes = read_rank_exits(folder)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(folder, ignore_errors=True)
    code = verdict(codes, rc)
    said = ", ".join(f"rank {r}: {c}" for r, c in sorted(codes.items())) or "no rank said"
    print(f"rmsft torchrun: torchrun exited {rc} ({said}): exit {code}", file=sys.stderr, flush=True)
    return code
