"""A newcomer's first hour at the terminal (issue 64): sizes need their unit, refusals name the fix that applies,
wrong files are named with the command for them, help and output are wrapped one way, `rmsft local --dry-run`
says what it would start. Each test fails without its fix; none starts a model or vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rmsft.memory_plan import GiB, parse_bytes

ROOT = Path(__file__).resolve().parent.parent


def _rmsft(*args: str, cwd: Path = ROOT, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    # The installed rmsft (or the caller's own PYTHONPATH): not this process's sys.path, whose repository root
    # entry would put the checkout's `operator/` folder before the standard library's `operator` module.
    env = {"PATH": "/usr/bin:/bin", **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run(
        [sys.executable, "-m", "rmsft_cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120, env=env
    )


# 2: units ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["80", "80.5", " 96 "])
def test_a_typed_size_without_a_unit_is_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"--gpu-memory .* has no unit: write .*GiB .*accepted forms: 80GiB"):
        parse_bytes(text, what="--gpu-memory")
    # a Kubernetes quantity (a pod's memory limit) still reads plain bytes
    assert parse_bytes(text) == int(float(text))


@pytest.mark.parametrize("text", ["0GiB", "0Gi", "0.0G", "0"])
def test_a_typed_size_of_zero_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--gpu-memory"):
        parse_bytes(text, what="--gpu-memory")


def test_typed_sizes_with_units_read_as_before() -> None:
    assert parse_bytes("80GiB", what="--gpu-memory") == parse_bytes("80Gi", what="x") == 80 * GiB
    assert parse_bytes("96G", what="--gpu-memory") == 96 * 10**9
    with pytest.raises(ValueError, match="not a memory size"):
        parse_bytes("1e999GiB", what="--gpu-memory")  # no OverflowError


def test_plan_refuses_gpu_memory_without_a_unit_in_one_line() -> None:
    job = str(ROOT / "configs" / "job.yaml")
    for value, expected in (("80", "'80' has no unit: write 80GiB"), ("0GiB", "must be more than zero")):
        res = _rmsft("plan", job, "--gpu-memory", value)
        assert res.returncode == 2, res.stdout
        assert expected in res.stderr and "KV cache" not in res.stderr and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


# 4: the wrong file, named with the command for it (the data commands' cases: tests/learner/test_coco_robust.py) --

COCO = ROOT / "tests" / "learner" / "coco_fixtures" / "instances_val2017_sample.json"


def test_a_data_file_given_as_a_job_and_a_job_given_as_data_are_named() -> None:
    res = _rmsft("plan", str(COCO))
    said = " ".join(res.stderr.split())
    assert res.returncode == 2 and "this is a COCO instances file" in said and "rmsft data from-coco" in said
    job = str(ROOT / "configs" / "local-tiny.yaml")
    for args in (("data", "check", job), ("data", "from-coco", job, str(ROOT), "/tmp/never-written.jsonl")):
        res = _rmsft(*args)
        said = " ".join(res.stderr.split())
        assert res.returncode == 2 and "this is a RolloutMatchingJob manifest (YAML)" in said, said
        assert "`rmsft plan FILE`" in said and "not valid JSON" not in said
    assert not Path("/tmp/never-written.jsonl").exists()


# 7: wording, and "did you mean" -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key", "meant"),
    [
        ("rollout", "replicaz", "replicas"),
        ("rollout", "maxmodellen", "maxModelLen"),
        ("training", "stpes", "steps"),
        ("model", "vison", "vision"),
        ("placement", "nodeSelectr", "nodeSelector"),
    ],
)
def test_an_unknown_key_names_the_nearest_keys_of_its_section(section: str, key: str, meant: str) -> None:
    import copy

    import yaml

    from rmsft.jobspec import JobSpecError, parse_job

    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    doc["spec"][section][key] = 1
    with pytest.raises(JobSpecError) as err:
        parse_job(doc)
    (line,) = err.value.errors
    assert line.startswith(
        f"spec.{section}.{key}: unknown key (not part of the RolloutMatchingJob schema; did you mean {meant}"
    )


def test_an_unknown_key_far_from_every_key_gets_no_guess() -> None:
    import yaml

    from rmsft.jobspec import JobSpecError, parse_job

    doc = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    doc["spec"]["training"]["checkpoint"]["zzzzqqq"] = 1
    with pytest.raises(JobSpecError) as err:
        parse_job(doc)
    assert err.value.errors == [
        "spec.training.checkpoint.zzzzqqq: unknown key (not part of the RolloutMatchingJob schema)"
    ]


def test_local_without_a_job_says_so_before_importing_torch() -> None:
    res = _rmsft("local")
    assert res.returncode == 2 and "give a job manifest (JOB), or --clean alone" in res.stderr
    # it used to take 5-8 s: the learner's imports (torch) came before the check
    probe = (
        "import sys; from typer.testing import CliRunner; from rmsft_cli.app import app; "
        "r = CliRunner().invoke(app, ['local']); print(r.exit_code, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr


def test_one_record_over_the_images_limit_carries(tmp_path: Path) -> None:
    import json

    from learner.data.check import check_records

    record = {
        "id": "r",
        "width": 4,
        "height": 4,
        "messages": [{"role": "user", "content": "x"}],
        "images": ["a.png", "b.png"],
    }
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(record) + "\n")
    check = check_records(path, max_images_per_prompt=1)
    assert "1 record carries more than spec.model.vision.maxImagesPerPrompt=1 images (first: 'r')" in check.refusals


# 1: plan and preflight on every example job; relative paths are the job file's -------------------------------

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _in_process(*args: str) -> tuple[int, str]:
    from typer.testing import CliRunner

    from rmsft_cli.app import app

    res = CliRunner().invoke(app, list(args))
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, " ".join((res.stdout + res.stderr).split())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_example_job_passes_plan_and_preflight_or_is_told_the_fix_that_applies(config: Path) -> None:
    import yaml

    from rmsft.jobspec import load_job

    job = load_job(config)
    builds = yaml.safe_load(config.read_text())["metadata"].get("annotations", {}).get("rmsft.io/build-tiny-model")
    built = (Path(job.spec.model.path) / "config.json").is_file()
    prepare = f"run `rmsft dev prepare {config}` (what `rmsft local` does before it starts), then this command again"
    for command in ("plan", "preflight"):
        code, said = _in_process(command, str(config))
        if code == 0:
            continue
        assert code == 2, (command, said)
        if builds and not built:  # an example job before its first run: the fix is to build its model
            assert prepare in said and "--model-config" not in said, (command, said)
        else:  # a cluster job: its model is where the pods see it; only preflight checks the folder
            assert command == "preflight" and "in a cluster: inside the pods" in said, (command, said)


def test_relative_paths_are_the_job_files_folder_from_any_working_directory(tmp_path: Path) -> None:
    from rmsft.jobspec import PATH_FIELDS, load_job

    a = load_job(ROOT / "configs" / "local-tiny-vl.yaml")
    assert a.spec.model.path == str(ROOT / "assets" / "tiny-vl-grid-model")
    assert a.spec.training.data.path == str(ROOT / ".rmsft" / "tiny-vl-grid-data.jsonl")
    assert a.spec.training.checkpoint.dir == str(ROOT / ".rmsft" / "checkpoints-vl")
    # from another folder, the same files; preflight passes from there (the shipped model is found)
    code, said = _in_process("preflight", str(ROOT / "configs" / "local-tiny-vl.yaml"))
    res = _rmsft("preflight", "local-tiny-vl.yaml", cwd=ROOT / "configs")
    assert code == 0 and res.returncode == 0, (said, res.stderr)
    assert f"{ROOT / 'assets' / 'tiny-vl-grid-model'}: the tokenizer has the 1000" in res.stdout
    # every path field, relative in a job elsewhere; absolute ones stay as written
    doc = (ROOT / "configs" / "local-tiny.yaml").read_text()
    (tmp_path / "sub").mkdir()
    job = tmp_path / "sub" / "job.yaml"
    extra = (
        "    eval: {data: held.jsonl, image_root: imgs}\n    export: {dir: out/export}\n    log_dir: tb\n"
        "    wandb: {dir: w}\n"
        "    checkpoint: {dir: /abs/ckpt}\n"
    )
    job.write_text(
        doc.replace("    checkpoint: {dir: ../.rmsft/checkpoints, every: 10, keep: 2}\n", extra).replace(
            "data: {path: ../.rmsft/tiny-data.jsonl}", "data: {path: d.jsonl, image_root: ./i}"
        )
    )
    spec = load_job(job).spec
    got = {".".join(f): _get(spec, f) for f in PATH_FIELDS}
    sub = tmp_path / "sub"
    assert got == {
        "model.path": str(tmp_path / ".rmsft" / "tiny-model"),
        "training.data.path": str(sub / "d.jsonl"),
        "training.data.image_root": str(sub / "i"),
        "training.eval.data": str(sub / "held.jsonl"),
        "training.eval.image_root": str(sub / "imgs"),
        "training.checkpoint.dir": "/abs/ckpt",
        "training.export.dir": str(sub / "out" / "export"),
        "training.log_dir": str(sub / "tb"),
        "training.wandb.dir": str(sub / "w"),
    }


def _get(spec: object, fields: tuple[str, ...]) -> object:
    for name in fields:
        spec = getattr(spec, name)
    return spec


# 3: help and output wrapping --------------------------------------------------------------------------------


def _commands() -> list[tuple[list[str], object]]:
    """Every command of `rmsft` with its click command, `serve` (argparse's own help) left out."""
    import typer

    from rmsft_cli.app import app

    out = []

    def walk(cmd: object, path: list[str]) -> None:
        out.append((path, cmd))
        for name, sub in getattr(cmd, "commands", {}).items():
            if name != "serve":
                walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return out


def test_help_at_80_columns_keeps_every_word_and_option_text_whole() -> None:
    from typer.testing import CliRunner

    from rmsft_cli.app import app

    checked = 0
    for path, cmd in _commands():
        res = CliRunner().invoke(app, [*path, "--help"], terminal_width=80)
        assert res.exit_code == 0, (path, res.output)
        lines = res.output.splitlines()
        assert all(len(line) <= 80 for line in lines), (path, max(lines, key=len))
        assert "…" not in res.output, (path, res.output)  # rich's help cut long words so
        flat = " ".join(res.output.split())
        for param in getattr(cmd, "params", []):
            text = getattr(param, "help", None)
            if text and not getattr(param, "hidden", False):  # a hidden option (a test's knob) is never printed
                assert " ".join(text.split()) in flat, (path, param.name, text)
                checked += 1
    assert checked > 40  # every command's options were read


def test_plan_output_is_not_wrapped_when_piped_like_the_data_commands() -> None:
    res = _rmsft("plan", str(ROOT / "configs" / "job.yaml"))  # stdout is a pipe; no COLUMNS
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[0]
    assert first.startswith("memory plan of qwen3vl-det: ") and first.endswith("(analytic)"), first
    assert len(first) > 80
    assert "…" not in res.stdout


# 8: `rmsft local --dry-run` and `--set` -------------------------------------------------------------------------


def _vl_job(tmp_path: Path) -> Path:
    """configs/local-tiny-vl.yaml in a folder of its own: the shipped model, data and checkpoints beside it."""
    text = (ROOT / "configs" / "local-tiny-vl.yaml").read_text()
    job = tmp_path / "job" / "vl.yaml"
    job.parent.mkdir()
    job.write_text(
        text.replace("../assets/tiny-vl-grid-model", str(ROOT / "assets" / "tiny-vl-grid-model")).replace(
            "../.rmsft/", "run/"
        )
    )
    return job


def test_local_dry_run_says_what_it_would_start_and_starts_nothing(tmp_path: Path) -> None:
    job, work = _vl_job(tmp_path), tmp_path / "work"
    code, said = _in_process(
        "local",
        str(job),
        "--dry-run",
        "--work-dir",
        str(work),
        "--set",
        "training.steps=7",
        "--set",
        "rollout.replicas=3",
        "--set",
        "sync.transport=grpc",
    )
    assert code == 0, said
    for part in (
        "job local-tiny-vl: trainer rollout_matching, format coordexp",
        f"model: {ROOT / 'assets' / 'tiny-vl-grid-model'}",
        f"data: {job.parent / 'run' / 'tiny-vl-grid-data.jsonl'} (not there yet: 1024 synthetic records "
        "written at start)",
        "rollout servers: 3 x `rmsft serve` (vllm, TP 1, maxModelLen 1024), each on 127.0.0.1 at a free "
        "gRPC port and a free /metrics port picked at start",
        "weight sync: grpc (spec.sync.transport grpc",
        "steps: 7 of 8 prompts",
        f"checkpoints in {job.parent / 'run' / 'checkpoints-vl'} at the end only",
        "memory plan of local-tiny-vl: model 0.86M parameters",
        "3 x rollout process: peak",
        "dry run: nothing was started, built or written",
    ):
        assert part in said, (part, said)
    assert not work.exists() and not (job.parent / "run").exists()  # no log, no data, no checkpoint folder


@pytest.mark.parametrize(
    ("override", "said"),
    [
        (
            "training.stpes=7",
            "spec.training.stpes: unknown key (not part of the RolloutMatchingJob schema; did you mean steps?)",
        ),
        ("training.steps=many", "spec.training.steps: Input should be a valid integer"),
        ("training.steps.x=1", "--set 'training.steps.x=1': spec.training.steps is int, not a mapping with keys"),
        ("steps", "--set 'steps': expected key=value, e.g. training.steps=10"),
        ("sync.transport=carrier-pigeon", "spec.sync.transport: Input should be"),
    ],
)
def test_set_is_validated_as_the_file_is(tmp_path: Path, override: str, said: str) -> None:
    code, out = _in_process("local", str(_vl_job(tmp_path)), "--dry-run", "--set", override)
    assert code == 2 and said in out and "Traceback" not in out, out


def test_the_job_with_set_applied_is_what_every_process_reads(tmp_path: Path) -> None:
    import yaml

    from rmsft.jobspec import load_job, write_effective_job

    job = _vl_job(tmp_path)
    overrides = ["training.steps=3", "rollout.replicas=1", "training.lr=1e-4", "model.vision.maxImagePixels=200000"]
    written = write_effective_job(job, overrides, tmp_path / "work" / "job.yaml")
    direct, again = load_job(job, overrides), load_job(written)
    assert again.spec == direct.spec and direct.spec.training.steps == 3 and direct.spec.rollout.replicas == 1
    assert direct.spec.model.vision.max_image_pixels == 200_000 and direct.spec.training.lr == 1e-4
    # annotations kept (they build the run's inputs), paths absolute (the written file lives elsewhere)
    doc = yaml.safe_load(written.read_text())
    assert doc["metadata"]["annotations"]["rmsft.io/synthetic-records"] == "1024"
    assert doc["spec"]["training"]["data"]["path"] == str(job.parent / "run" / "tiny-vl-grid-data.jsonl")


def test_serve_help_wraps_between_words_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_svc.config import build_parser

    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser("rmsft serve")
    text = parser.format_help()
    assert all(len(line) <= 80 for line in text.splitlines()), max(text.splitlines(), key=len)
    flat = " ".join(text.split())
    helps = [a.help for a in parser._actions if a.help and "%" not in a.help]
    assert len(helps) > 20
    for h in helps:  # `--kv-cache-bytes` was cut as `--kv-` | `cache-bytes`
        assert " ".join(h.split()) in flat, h


def test_a_job_copied_elsewhere_keeps_its_files_with_absolute_paths(tmp_path: Path) -> None:
    import yaml

    from rmsft.jobspec import absolute_paths, load_job

    src = ROOT / "configs" / "local-tiny-vl.yaml"
    copy_ = tmp_path / "copy.yaml"  # what benchmarks/local_run.py and overlap.py do
    copy_.write_text(yaml.safe_dump(absolute_paths(yaml.safe_load(src.read_text()), src.parent)))
    assert load_job(copy_).spec == load_job(src).spec
