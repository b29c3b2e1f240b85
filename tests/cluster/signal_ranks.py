"""Run inside a learner pod (`python -c <this file's text> key=value ...`; every image has python): send a signal
to the processes of torchrun's ranks there, at a moment the learner reaches, so that a test faults a job of any
speed exactly mid-run. From outside, one scrape and one `kubectl exec` take seconds: as long as a whole job of the
cluster tier's tiny model on a fast machine (pod-1x2's 12 steps ran in 4 s, the fault job's 40 in 7 s).

    sig=STOP|CONT|KILL        the signal
    rank=1|all                the ranks: the processes whose environment (from torchrun's agent) has RANK=<rank>,
                              or every process with a LOCAL_RANK (a rank's children inherit it and are signalled too)
    step=<n>                  first poll the learner's /metrics every 20 ms until rmsft_learner_global_step >= n
    url=<metrics url>         the /metrics polled (default: rank 0's in this pod, http://127.0.0.1:9090/metrics)
    pending=TERM              first wait until that signal is pending at one of the ranks' processes (SigPnd or
                              ShdPnd of /proc/<pid>/status): a SIGTERM that an eviction queued at a stopped rank

Prints the pids signalled and, with step=, the step seen; exits 1 naming what it waited for after 420 s, or when no
process of the rank is found.

Stopping rank 1 (SIGSTOP) holds a learner: rank 0 waits for it in the step's next collective (gloo, a 30-minute
timeout) with its /metrics still answering, and runs its SIGTERM handler when rank 1 goes on (SIGCONT).
"""

import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Callable

args = dict(a.split("=", 1) for a in sys.argv[1:])
who = args.get("rank", "all")
url = args.get("url", "http://127.0.0.1:9090/metrics")
deadline = time.monotonic() + 420
seen = -1.0


def ranks() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        mine = who == "all" or f"RANK={who}".encode() in env
        if int(pid) != os.getpid() and mine and any(e.startswith(b"LOCAL_RANK=") for e in env):
            found.append(int(pid))
    return found


def pending(pid: int, signum: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except OSError:
        return False
    masks = re.findall(r"^(?:SigPnd|ShdPnd):\s*([0-9a-f]+)", status, re.M)
    return any(int(m, 16) >> (signum - 1) & 1 for m in masks)


def reached() -> bool:
    global seen
    try:
        page = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError:
        return False
    m = re.search(r"^rmsft_learner_global_step (\S+)", page, re.M)
    seen = float(m.group(1)) if m else -1.0
    return seen >= int(args["step"])


def wait(what: str, ok: Callable[[], bool]) -> None:
    while not ok():
        if time.monotonic() > deadline:
            sys.exit(f"signal_ranks: timed out after 420 s waiting for {what}")
        time.sleep(0.02)


if "step" in args:
    wait(f"step {args['step']} at {url}", reached)
if "pending" in args:
    signum = getattr(signal, "SIG" + args["pending"])
    wait(f"SIG{args['pending']} pending at rank {who}", lambda: any(pending(p, signum) for p in ranks()))
pids = ranks()
if not pids:
    sys.exit(f"signal_ranks: no process of rank {who} in this pod")
for pid in pids:
    os.kill(pid, getattr(signal, "SIG" + args["sig"]))
print(" ".join(map(str, pids)))
if "step" in args:
    print("step", seen)
