"""`make gpu-check`: prove rmsft's CUDA paths on one offline GPU host in a few minutes, in one report.

    python scripts/gpu_check.py [--out DIR] [--wheels DIR] [--budget-s 450]

Made for a host like many enterprise nodes: one GPU, no network, an image with CUDA torch, transformers, peft
and grpcio but not vLLM, and only a small bundle brought in (the git tree plus the wheels of
requirements/gpu-check-wheels.txt, fetched beforehand by `make gpu-check-wheels`). Nothing here touches the
network: the wheels are installed from the folder alone (pip --no-index --no-deps) into a private folder put
first on PYTHONPATH; a wheel whose distribution the host already has is left out (unless the list marks it
`replace-older` and the host's is older), so the host's torch and transformers stay what they are.

Parts, each PASS / FAIL / SKIP with its reason and figures:
- wheels: what was installed, what the host already had, and that the host has what it must bring itself.
- tests: the `gpu`-marked tests (tests/gpu and any other file that marks tests `gpu`), through pytest.
- step:SHAPE:ckpt0/1: benchmarks/gpu_step.py at Qwen3-VL-2B-like (8192 tokens) and 7B-like (4096 tokens)
  decoder sizes, bf16, gradient checkpointing off and on: tokens/s and peak memory.
- plan:SHAPE:ckpt0/1: the memory plan's estimate for the same job and shape beside that peak; FAIL when the
  measured peak is above the estimate (the plan would let a job through that does not fit).
- packing: one packed row vs a padded batch of the same segments (tokens/s ratio).
- offload: the offload context's freed bytes (learner/train/offload.py).
- colocate: a few colocated steps with the HF engine on the GPU (no vLLM needed).
- broadcast: transport nccl's data path, NCCL from one GPU to another (GB/s; SKIP on a one-GPU host, with the
  reason), gloo between two processes in the CPU form.
Without CUDA the CPU-possible parts run at a tiny shape (step, packing; the plan's estimates for the real
shapes are still computed) and the rest say SKIP with the reason; tests/test_gpu_check.py runs that form.

Each part ends with a `RESULT part=... status=...` line, the run with `RESULT part=overall ...`; the report is
DIR/gpu-check-report.json and .md (DIR: --out, else $OUT when set, else ./gpu-check). Exit status 1 when a
part failed. Figures a GPU produced go to docs/benchmarks.md ("GPU"), with the date and the card.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEEL_LIST = ROOT / "requirements" / "gpu-check-wheels.txt"
DEFAULT_WHEELS = ROOT / ".gpu-check-wheels"
# The code under test as the repository lays it out (pyproject's package folders), without installing rmsft.
SOURCE_PATHS = [ROOT, ROOT / "protos", ROOT / "operator"]
# Real shapes: (shape, packed row length). 4096 for the 7B-like: without checkpointing its activations at 8192
# tokens would not fit 80 GB (the memory plan says ~105 GiB).
REAL_SHAPES = (("qwen3-vl-2b", 8192), ("7b", 4096))
STATUSES = ("PASS", "FAIL", "SKIP")


@dataclass
class Part:
    name: str
    status: str
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def result_line(self) -> str:
        figs = " ".join(f"{k}={_plain(v)}" for k, v in self.figures.items())
        return f"RESULT part={self.name} status={self.status}" + (f" {figs}" if figs else "")


def _plain(v: Any) -> str:
    return str(v).replace(" ", "_")


def read_wheel_list(path: Path = WHEEL_LIST) -> tuple[dict[str, tuple[str, bool]], list[str]]:
    """The pinned wheels {normalized name: (version, replace_older)} and the modules the host must have itself."""
    wheels: dict[str, tuple[str, bool]] = {}
    host: list[str] = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line, _, comment = raw.partition("#")
        line = line.strip()
        if line.startswith("host:"):
            host += line.removeprefix("host:").split()
            continue
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", line)
        if not m:
            raise SystemExit(f"{path}:{n}: expected NAME==VERSION or 'host: module ...', got {line!r}")
        wheels[normalize(m.group(1))] = (m.group(2), "replace-older" in comment)
    return wheels, host


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version_key(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.+-]", v))


def _older(a: str, b: str) -> bool:
    try:
        from packaging.version import Version

        return Version(a) < Version(b)
    except Exception:  # no packaging or an odd version: compare the numeric fields
        return _version_key(a) < _version_key(b)


def _host_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def select_wheels(
    wheels: list[Path], pinned: dict[str, tuple[str, bool]], host_version: Any
) -> tuple[list[Path], list[str], list[str]]:
    """(wheels to install, their descriptions, the host's own kept): a listed wheel goes in when the host lacks
    its distribution, or has an older one and the list marks it `replace-older`; wheels the list does not name
    (an older list's) never do. `host_version(dist)` is the host's version or None."""
    chosen, installed, kept = [], [], []
    for whl in wheels:
        name, version = whl.name.split("-")[:2]
        key = normalize(name)
        if key not in pinned or pinned[key][0] != version:
            continue
        have = host_version(key)
        if have is None or (pinned[key][1] and _older(have, version)):
            chosen.append(whl)
            installed.append(f"{key}=={version}" + (f"(host:{have})" if have else ""))
        else:
            kept.append(f"{key}=={have}")
    return chosen, installed, kept


def install_wheels(wheels_dir: Path, site: Path) -> Part:
    """Install the bundle's wheels the host lacks into `site` (no network, no dependencies resolved) and put it
    first on this process's path and its children's PYTHONPATH."""
    t0 = time.perf_counter()
    pinned, host_modules = read_wheel_list()
    figures: dict[str, Any] = {}
    installed: list[str] = []
    kept: list[str] = []
    if wheels_dir.is_dir():
        chosen, installed, kept = select_wheels(sorted(wheels_dir.glob("*.whl")), pinned, _host_version)
        if chosen:
            site.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--disable-pip-version-check",
                "--upgrade",
                "--target",
                str(site),
                *map(str, chosen),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                return Part(
                    "wheels",
                    "FAIL",
                    f"pip install from {wheels_dir} failed: {proc.stderr[-800:]}",
                    seconds=time.perf_counter() - t0,
                )
            _prepend_path(site)
        figures = {"installed": len(installed), "host_kept": len(kept)}
    importlib.invalidate_caches()
    missing_host = [m for m in host_modules if importlib.util.find_spec(m) is None]
    reason_parts = []
    if installed:
        reason_parts.append("installed " + ", ".join(installed))
    if kept:
        reason_parts.append("host's own kept: " + ", ".join(kept))
    if missing_host:
        reason_parts.append(
            "the host lacks " + ", ".join(missing_host) + ": the image must bring them (they are "
            "too large for the bundle or must match its CUDA build)"
        )
        return Part("wheels", "FAIL", "; ".join(reason_parts), figures, time.perf_counter() - t0)
    if not wheels_dir.is_dir():
        still = [n for n in ("pydantic", "grpc_health") if importlib.util.find_spec(n) is None]
        status = "FAIL" if still else "SKIP"
        return Part(
            "wheels",
            status,
            f"no wheel folder {wheels_dir} (run `make gpu-check-wheels` beforehand)"
            + (f"; missing here: {', '.join(still)}" if still else "; everything is installed here already"),
            figures,
            time.perf_counter() - t0,
        )
    return Part("wheels", "PASS", "; ".join(reason_parts) or "nothing to install", figures, time.perf_counter() - t0)


def _prepend_path(folder: Path) -> None:
    sys.path.insert(0, str(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [*(os.environ.get("PYTHONPATH") or "").split(os.pathsep), *map(str, SOURCE_PATHS)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def gpu_marked_test_files() -> list[Path]:
    """Every test file that marks tests `gpu` (tests/gpu and any other)."""
    out = []
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        if "pytest.mark.gpu" in p.read_text(errors="replace"):
            out.append(p)
    return out


def run_tests(timeout: float, scratch: Path) -> Part:
    files = gpu_marked_test_files()
    if not files:
        return Part("tests", "FAIL", "no test file marks tests `gpu` (grep for pytest.mark.gpu found none)")
    xml = scratch / "gpu-tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
        *(str(f.relative_to(ROOT)) for f in files),
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Part("tests", "FAIL", f"pytest ran past {timeout:.0f} s", seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    if not xml.exists():
        return Part(
            "tests",
            "FAIL",
            f"pytest exited {proc.returncode} without a report: {(proc.stdout + proc.stderr)[-1500:]}",
            seconds=seconds,
        )
    passed, failed, skipped = [], [], {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            node = case.find("failure") if case.find("failure") is not None else case.find("error")
            failed.append(f"{name}: {(node.get('message') or '')[:300]}")
        elif case.find("skipped") is not None:
            skipped[name] = case.find("skipped").get("message", "")
        else:
            passed.append(name)
    figures = {"passed": len(passed), "failed": len(failed), "skipped": len(skipped), "files": len(files)}
    if failed or proc.returncode not in (0, 5):
        why = "; ".join(failed) or f"pytest exited {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}"
        return Part("tests", "FAIL", why, figures, seconds)
    skips = "; ".join(f"{k}: {v}" for k, v in skipped.items())
    if not passed:
        return Part(
            "tests", "SKIP", f"every gpu test skipped: {skips}" if skips else "no gpu test collected", figures, seconds
        )
    return Part("tests", "PASS", f"skipped: {skips}" if skips else "", figures, seconds)


def _bench_child(args: list[str], timeout: float, scratch: Path, tag: str) -> dict[str, Any]:
    """benchmarks/gpu_step.py in its own process (its own CUDA context, peak counter and out-of-memory)."""
    out = scratch / f"{tag}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), *args, "--json", str(out)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "FAIL", "reason": f"ran past its {timeout:.0f} s"}
    if proc.returncode != 0 or not out.exists():
        return {"status": "FAIL", "reason": f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"}
    return json.loads(out.read_text())


def _bench_inline(args: list[str]) -> dict[str, Any]:
    """The same runs in this process (the CPU form: no device memory to isolate, and no second start-up)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_step

    ns = argparse.Namespace(
        device="cpu", shape="tiny", length=512, segments=4, gradient_checkpointing=False, steps=1, json=None
    )
    it = iter(args)
    for a in it:
        if a == "--gradient-checkpointing":
            ns.gradient_checkpointing = True
        elif a.startswith("--"):
            value = next(it)
            key = a[2:].replace("-", "_")
            setattr(ns, key, type(getattr(ns, key))(value))
    return gpu_step.RUNNERS[args[0]](ns)


def _part_from(name: str, result: dict[str, Any], keys: tuple[str, ...], seconds: float) -> Part:
    figures = {k: result[k] for k in keys if k in result}
    return Part(name, result.get("status", "FAIL"), result.get("reason", ""), figures, seconds)


STEP_KEYS = ("device", "length", "params_m", "step_ms", "tokens_per_s", "peak_gib", "reserved_gib", "plan_estimate_gib")
PACK_KEYS = (
    "device",
    "segments",
    "real_tokens",
    "padded_tokens",
    "packed_tokens_per_s",
    "padded_tokens_per_s",
    "speedup",
    "packed_peak_gib",
    "padded_peak_gib",
)
OFFLOAD_KEYS = ("moved_gib", "freed_gib", "resident_gib", "during_gib", "back_equal", "offload_s", "reload_s")
COLOCATE_KEYS = ("device", "steps_done", "s_per_step", "rollouts", "peak_gib", "final_loss")
BROADCAST_KEYS = ("device", "backend", "mib", "wall_s", "gbps")


def plan_part(shape: str, length: int, ckpt: bool, step: dict[str, Any] | None) -> Part:
    """The memory plan's estimate beside the measured peak; the estimate alone when no GPU measured one."""
    t0 = time.perf_counter()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_step

    name = f"plan:{shape}:ckpt{int(ckpt)}"
    estimate = gpu_step.plan_estimate(
        gpu_step.job_for(length, ckpt, "cuda"), gpu_step.decoder_config(shape, max(8192, length))
    )
    figures: dict[str, Any] = {"length": length, "plan_estimate_gib": round(estimate / gpu_step.GiB, 3)}
    oom = step is not None and str(step.get("reason", "")).startswith("out of memory") and "gpu_gib" in step
    if oom and estimate / gpu_step.GiB + 1 <= step["gpu_gib"]:
        figures["gpu_gib"] = step["gpu_gib"]
        return Part(
            name,
            "FAIL",
            f"the step ran out of memory on a {step['gpu_gib']} GiB GPU, which the plan says "
            "it fits (with its 1 GiB CUDA-context reserve): the plan would let this job through",
            figures,
            time.perf_counter() - t0,
        )
    if step is None or step.get("status") != "PASS" or "plan_ratio" not in step:
        why = (
            "no GPU peak to compare (needs CUDA)"
            if step is None
            else f"the step did not run ({step.get('reason', step.get('status'))})"
        )
        return Part(name, "SKIP", why, figures, time.perf_counter() - t0)
    figures |= {"peak_gib": step["peak_gib"], "reserved_gib": step.get("reserved_gib"), "ratio": step["plan_ratio"]}
    if step["plan_ratio"] > 1.0:
        why = (
            "the measured peak is above the plan's estimate: the plan would let through a job that does not fit "
            "(rmsft/memory_plan/arithmetic.py ASSUMPTIONS)"
        )
        return Part(name, "FAIL", why, figures, time.perf_counter() - t0)
    return Part(name, "PASS", "", figures, time.perf_counter() - t0)


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    try:
        env["commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        env["commit"] = "unknown"  # a bundle copied without .git
    for dist in ("torch", "transformers", "peft", "grpcio", "pydantic", "protobuf"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    try:
        import torch

        env["cuda"] = torch.cuda.is_available()
        if env["cuda"]:
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / (1 << 30), 1)
            env["cuda_version"] = torch.version.cuda
    except ImportError:
        env["cuda"] = False
    return env


def write_report(out: Path, env: dict[str, Any], parts: list[Part], total_s: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    counts = {s: sum(p.status == s for p in parts) for s in STATUSES}
    doc = {"environment": env, "seconds": round(total_s, 1), "counts": counts, "parts": [asdict(p) for p in parts]}
    (out / "gpu-check-report.json").write_text(json.dumps(doc, indent=1))
    lines = [
        f"# rmsft gpu-check, {env['date']}",
        "",
        f"{env.get('gpu') or 'no CUDA device'}; torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"Python {env['python']}, commit {env.get('commit')}; {total_s:.0f} s; "
        + ", ".join(f"{n} {s}" for s, n in counts.items()),
        "",
        "| part | status | figures | reason |",
        "|---|---|---|---|",
    ]
    for p in parts:
        figs = ", ".join(f"{k} {v}" for k, v in p.figures.items())
        lines.append(f"| {p.name} | {p.status} | {figs} | {p.reason.replace('|', '/')[:400]} |")
    lines += ["", "```", *(p.result_line() for p in parts), "```", ""]
    (out / "gpu-check-report.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="report folder (default: $OUT, else ./gpu-check)")
    ap.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS, help="wheel folder of `make gpu-check-wheels`")
    ap.add_argument(
        "--site",
        type=Path,
        default=Path(tempfile.gettempdir()) / "rmsft-gpu-check-site",
        help="private folder the wheels are installed into (put first on PYTHONPATH)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="parts that would start with less time left than their own limit are skipped",
    )
    ap.add_argument("--cpu", action="store_true", help="the CPU form even where CUDA is available")
    args = ap.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT") or ROOT / "gpu-check")
    start = time.perf_counter()
    parts: list[Part] = []

    def emit(part: Part) -> Part:
        parts.append(part)
        print(part.result_line() + (f"  # {part.reason[:300]}" if part.reason else ""), flush=True)
        return part

    def left() -> float:
        return args.budget_s - (time.perf_counter() - start)

    emit(install_wheels(args.wheels, args.site))
    for p in reversed(SOURCE_PATHS):
        sys.path.insert(0, str(p))
    try:
        import torch
    except ImportError as exc:
        env = environment() | {"form": "none"}
        write_report(out, env, parts, time.perf_counter() - start)
        print(
            f"RESULT part=overall status=FAIL form=none reason=no_torch ({exc}) report={out / 'gpu-check-report.json'}"
        )
        return 1

    cuda = torch.cuda.is_available() and not args.cpu
    env = environment() | {"form": "cuda" if cuda else "cpu"}
    scratch = Path(tempfile.mkdtemp(prefix="rmsft-gpu-check-"))

    def bench(name: str, argv_: list[str], limit: float, keys: tuple[str, ...]) -> dict[str, Any] | None:
        if limit > left():
            emit(
                Part(
                    name,
                    "SKIP",
                    f"time budget: {left():.0f} s left of --budget-s {args.budget_s:.0f}, this part "
                    f"may take {limit:.0f} s",
                )
            )
            return None
        t0 = time.perf_counter()
        try:
            result = (
                _bench_child(argv_ + ["--device", "cuda"], limit, scratch, name.replace(":", "-"))
                if cuda
                else _bench_inline(argv_)
            )
        except Exception as exc:  # a CPU-form failure is this part's FAIL, not the end of the report
            result = {"status": "FAIL", "reason": f"{type(exc).__name__}: {exc}"}
        emit(_part_from(name, result, keys, time.perf_counter() - t0))
        return result

    emit(run_tests(min(150.0, max(30.0, left())), scratch))
    if cuda:
        for shape, length in REAL_SHAPES:
            for ckpt in (False, True):
                flag = ["--gradient-checkpointing"] if ckpt else []
                step = bench(
                    f"step:{shape}:ckpt{int(ckpt)}",
                    ["step", "--shape", shape, "--length", str(length), "--steps", "3", *flag],
                    120,
                    STEP_KEYS,
                )
                emit(plan_part(shape, length, ckpt, step))
        bench(
            "packing",
            ["packing", "--shape", "qwen3-vl-2b", "--length", "8192", "--steps", "3", "--gradient-checkpointing"],
            120,
            PACK_KEYS,
        )
        bench("offload", ["offload", "--shape", "qwen3-vl-2b", "--length", "2048"], 90, OFFLOAD_KEYS)
        bench("colocate", ["colocate", "--steps", "3"], 120, COLOCATE_KEYS)
        bench("broadcast", ["broadcast", "--length", "4096"], 90, BROADCAST_KEYS)
    else:
        why = "needs CUDA (no GPU here): the CPU form ran the tiny shape instead"
        bench("step:tiny:ckpt0", ["step", "--shape", "tiny", "--length", "512", "--steps", "1"], 60, STEP_KEYS)
        for shape, length in REAL_SHAPES:
            for ckpt in (False, True):
                emit(Part(f"step:{shape}:ckpt{int(ckpt)}", "SKIP", why))
                emit(plan_part(shape, length, ckpt, None))
        bench("packing", ["packing", "--shape", "tiny", "--length", "512", "--steps", "1"], 60, PACK_KEYS)
        emit(
            Part(
                "offload",
                "SKIP",
                "needs CUDA: on the CPU nothing is freed (the plan and the bit-exact return are "
                "tested on the CPU in tests/learner/test_colocate_offload.py)",
            )
        )
        emit(
            Part(
                "colocate",
                "SKIP",
                "needs CUDA here; the same HF-engine colocated run on the CPU is "
                "tests/learner/test_colocate.py::test_hf_engine_colocated_trains_and_matches_hf_server",
            )
        )
        bench("broadcast", ["broadcast", "--length", "256"], 60, BROADCAST_KEYS)
    total = time.perf_counter() - start
    write_report(out, env, parts, total)
    counts = {s: sum(p.status == s for p in parts) for s in STATUSES}
    overall = "FAIL" if counts["FAIL"] else "PASS"
    print(
        f"RESULT part=overall status={overall} form={env['form']} pass={counts['PASS']} fail={counts['FAIL']} "
        f"skip={counts['SKIP']} seconds={total:.0f} report={out / 'gpu-check-report.json'}",
        flush=True,
    )
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
