"""`make gpu-check` (scripts/gpu_check.py) in its CPU form, so the command a GPU host runs cannot rot; the wheel
list it brings there (requirements/gpu-check-wheels.txt) and the install choice it makes on the host."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import read_wheel_list, select_wheels  # noqa: E402
from gpu_check_wheels import check_list, git_tree_bytes  # noqa: E402

MiB = 1 << 20


@pytest.mark.slow
def test_cpu_form_runs_what_a_cpu_can_and_skips_the_rest_saying_why(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_check.py"),
            "--out",
            str(tmp_path / "r"),
            "--wheels",
            str(tmp_path / "no-wheels"),
            "--cpu",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "r" / "gpu-check-report.json").read_text())
    parts = {p["name"]: p for p in report["parts"]}
    real = [f"{kind}:{shape}:ckpt{c}" for kind in ("step", "plan") for shape in ("qwen3-vl-2b", "7b") for c in (0, 1)]
    assert set(parts) == {"wheels", "tests", "step:tiny:ckpt0", "packing", "offload", "colocate", "broadcast", *real}
    assert report["environment"]["form"] == "cpu"
    # every status is one of three, every SKIP says why
    assert {p["status"] for p in parts.values()} <= {"PASS", "SKIP"}
    assert all(p["reason"] for p in parts.values() if p["status"] == "SKIP")
    # the gpu tests were collected and skipped for want of CUDA (not "none found")
    assert parts["tests"]["status"] == "SKIP" and parts["tests"]["figures"]["skipped"] >= 3
    assert "needs CUDA" in parts["tests"]["reason"]
    step = parts["step:tiny:ckpt0"]
    assert step["status"] == "PASS" and step["figures"]["tokens_per_s"] > 0 and step["figures"]["length"] == 512
    # the plan's estimates for the real shapes, computed without a GPU: checkpointing saves memory, 7B > 2B
    est = {n: parts[n]["figures"]["plan_estimate_gib"] for n in real if n.startswith("plan")}
    assert (
        est["plan:7b:ckpt0"] > est["plan:7b:ckpt1"] > 0
        and est["plan:qwen3-vl-2b:ckpt0"] > est["plan:qwen3-vl-2b:ckpt1"] > 0
    )
    assert est["plan:7b:ckpt1"] > est["plan:qwen3-vl-2b:ckpt1"]
    assert all(parts[n]["status"] == "SKIP" and "CUDA" in parts[n]["reason"] for n in real)
    packing = parts["packing"]["figures"]
    assert parts["packing"]["status"] == "PASS" and packing["real_tokens"] < packing["padded_tokens"]
    assert packing["packed_tokens_per_s"] > 0 and packing["padded_tokens_per_s"] > 0 and packing["speedup"] > 0
    assert "CUDA" in parts["offload"]["reason"] and "CUDA" in parts["colocate"]["reason"]
    # transport nccl's data path in its CPU form: a gloo broadcast between two processes, arrived equal
    bcast = parts["broadcast"]
    assert bcast["status"] == "PASS" and bcast["figures"]["backend"] == "gloo" and bcast["figures"]["gbps"] > 0
    # one RESULT line per part and one overall, in the output and the markdown report
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [re.search(r"part=(\S+)", line).group(1) for line in lines] == [*parts, "overall"]
    assert "status=PASS" in lines[-1] and "form=cpu" in lines[-1]
    md = (tmp_path / "r" / "gpu-check-report.md").read_text()
    assert all(f"| {name} | {p['status']} |" in md for name, p in parts.items())


def test_wheel_list_pins_the_lock_and_never_carries_the_hosts_cuda_builds() -> None:
    pinned, host = read_wheel_list()
    locks: dict[str, dict[str, str]] = {}
    for name in ("constraints.txt", "constraints-gpu.txt"):
        locks[name] = {}
        for line in (ROOT / "requirements" / name).read_text().splitlines():
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.split("  #")[0].strip())
            if m:
                locks[name][re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    # The CPU lock's pin; what only the GPU image installs (liger-kernel, the fused loss's kernel) the gpu lock's.
    lock = {
        **{n: v for n, v in locks["constraints-gpu.txt"].items() if n not in locks["constraints.txt"]},
        **locks["constraints.txt"],
    }
    assert {"pydantic", "pydantic-core", "grpcio-health-checking", "protobuf", "liger-kernel"} <= set(pinned)
    assert {name: version for name, (version, _) in pinned.items()} == {name: lock[name] for name in pinned}
    assert check_list(pinned) == []
    assert {"torch", "transformers", "peft"} <= set(host)
    # the guard itself: a list naming the host's builds is refused
    assert check_list({"torch": ("2.13.0", False), "nvidia-cublas": ("13", False), "pydantic": ("2", False)}) == [
        "torch",
        "nvidia-cublas",
    ]


def test_the_host_keeps_its_own_packages_unless_older_than_a_replace_older_pin() -> None:
    pinned = {"pydantic": ("2.14.3", False), "grpcio": ("1.85.1", True), "typing-inspection": ("0.4.5", False)}
    wheels = [
        Path(w)
        for w in (
            "pydantic-2.14.3-py3-none-any.whl",
            "grpcio-1.85.1-cp312-cp312-manylinux2014.whl",
            "typing_inspection-0.4.5-py3-none-any.whl",
            "pydantic-2.0.0-py3-none-any.whl",
            "scipy-1.17.1-cp312-cp312-manylinux2014.whl",
        )
    ]

    def host(versions: dict[str, str]):
        return lambda dist: versions.get(dist)

    chosen, _, kept = select_wheels(wheels, pinned, host({"grpcio": "1.60.0", "typing-inspection": "0.4.0"}))
    # missing -> installed; older and replace-older -> installed; older but not marked -> the host's kept;
    # a wheel of another version or not on the list -> never
    assert [w.name.split("-")[0] for w in chosen] == ["pydantic", "grpcio"]
    assert kept == ["typing-inspection==0.4.0"]
    chosen, _, kept = select_wheels(wheels, pinned, host({"grpcio": "1.90.0", "pydantic": "2.15.0"}))
    assert [w.name.split("-")[0] for w in chosen] == ["typing_inspection"]
    assert sorted(kept) == ["grpcio==1.90.0", "pydantic==2.15.0"]


def test_the_tree_leaves_room_for_the_wheels_in_a_hosts_64_mib() -> None:
    """`make gpu-check-wheels` measured the wheels at 10.4 MiB; the tree must leave them 16 MiB."""
    assert 0 < git_tree_bytes() <= 48 * MiB


def test_the_real_shapes_build_as_a_job_trains_them_and_the_plan_counts_them() -> None:
    """The 2B- and 7B-like policies gpu-check trains, built on the meta device (no memory): peft's DoRA on the
    decoder, fp32 adapters over a bf16 base, and exactly the parameters the memory plan counts for that job."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_step import build_policy, decoder_config, job_for

    from rmsft.memory_plan import shape_from_config, trainable_params

    for name, length, hidden in (("qwen3-vl-2b", 8192, 2048), ("7b", 4096, 3584)):
        job = job_for(length, True, "cuda")
        config = decoder_config(name, length)
        policy = build_policy(config, job.spec.training, torch.device("meta"))
        params = list(policy.model.parameters())
        trained = [p for p in params if p.requires_grad]
        shape = shape_from_config(config.to_dict())
        assert shape.hidden == hidden and shape.layers == 28
        assert sum(p.numel() for p in trained) == trainable_params(job.spec, shape) > 0
        assert sum(p.numel() for p in params) == shape.total_params + trainable_params(job.spec, shape)
        assert {p.dtype for p in trained} == {torch.float32}
        assert {p.dtype for p in params if not p.requires_grad} == {torch.bfloat16}
        assert policy.model.base_model.model.config.num_hidden_layers == 28


def test_the_plan_part_fails_when_a_gpu_peak_or_an_out_of_memory_proves_the_plan_low() -> None:
    """Judged from a step's figures as a GPU run reports them (the judgement runs only there otherwise)."""
    from gpu_check import plan_part

    within = plan_part("7b", 4096, True, {"status": "PASS", "peak_gib": 20.0, "reserved_gib": 21.5, "plan_ratio": 0.8})
    assert within.status == "PASS" and within.figures["ratio"] == 0.8 and within.figures["plan_estimate_gib"] > 20
    above = plan_part("7b", 4096, True, {"status": "PASS", "peak_gib": 30.0, "reserved_gib": 31.0, "plan_ratio": 1.2})
    assert above.status == "FAIL" and "above the plan's estimate" in above.reason
    oom = {"status": "FAIL", "reason": "out of memory: CUDA out of memory. Tried to allocate 2 GiB", "gpu_gib": 79.2}
    # 7B at 4096 tokens without checkpointing: the plan says ~60 GiB, so running out on 79 GiB proves it low ...
    assert plan_part("7b", 4096, False, oom).status == "FAIL"
    # ... at 8192 tokens it says ~105 GiB: an out-of-memory there is what it predicted, no verdict on it
    assert plan_part("7b", 8192, False, oom).status == "SKIP"
    assert plan_part("7b", 4096, False, None).status == "SKIP"
