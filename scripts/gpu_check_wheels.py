"""`make gpu-check-wheels`: download requirements/gpu-check-wheels.txt for an offline GPU host, check the bundle.

    python scripts/gpu_check_wheels.py [--dest .gpu-check-wheels] [--check-only] [--limit-mib 64]

Downloads every pinned wheel for CPython 3.12 on manylinux x86_64 (binary wheels only, no dependencies: the list
names each one) into DEST, an ignored folder, drops wheels of names or versions the list no longer has, then
measures the bundle a GPU host is given: the files git would send (tracked, and untracked ones it does not
ignore) plus DEST. Exit status 1 when a wheel is missing or the bundle is over the limit. Prints a RESULT line.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import WHEEL_LIST, normalize, read_wheel_list  # noqa: E402

MiB = 1 << 20
# pip matches manylinux tags exactly: name the ones wheels of these packages are built for.
PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux1_x86_64",
)
FORBIDDEN = ("torch", "transformers", "peft", "tokenizers", "safetensors", "numpy", "triton", "nvidia-")


def check_list(pinned: dict[str, tuple[str, bool]]) -> list[str]:
    """Names the list must never carry: the host image's CUDA builds and what they are built against."""
    return [n for n in pinned if any(n == f or (f.endswith("-") and n.startswith(f)) for f in FORBIDDEN)]


def download(dest: Path, pinned: dict[str, tuple[str, bool]]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--disable-pip-version-check",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--abi",
        "cp312",
        "--abi",
        "abi3",
        "--abi",
        "none",
        *(a for p in PLATFORMS for a in ("--platform", p)),
        "--platform",
        "any",
        "-d",
        str(dest),
        *(f"{name}=={version}" for name, (version, _) in pinned.items()),
    ]
    subprocess.run(cmd, check=True)


def wheel_names(dest: Path) -> dict[str, Path]:
    return {normalize(w.name.split("-")[0]) + "==" + w.name.split("-")[1]: w for w in dest.glob("*.whl")}


def git_tree_bytes() -> int:
    """What a host is sent of the repository: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for rel in filter(None, out.decode().split("\0")):
        p = ROOT / rel
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=ROOT / ".gpu-check-wheels")
    ap.add_argument("--check-only", action="store_true", help="measure, download nothing")
    ap.add_argument("--limit-mib", type=float, default=64.0)
    args = ap.parse_args(argv)
    pinned, _ = read_wheel_list()
    bad = check_list(pinned)
    if bad:
        print(
            f"error: {WHEEL_LIST.relative_to(ROOT)} names {', '.join(bad)}: the host image's own builds must stay; "
            "remove them from the list",
            file=sys.stderr,
        )
        return 1
    if not args.check_only:
        download(args.dest, pinned)
    have = wheel_names(args.dest) if args.dest.is_dir() else {}
    wanted = {f"{n}=={v}" for n, (v, _) in pinned.items()}
    for key, path in have.items():
        if key not in wanted:  # a wheel of an earlier list: two versions would stop the host's install
            path.unlink()
    missing = sorted(wanted - set(have))
    wheels = sum(p.stat().st_size for k, p in have.items() if k in wanted)
    tree = git_tree_bytes()
    total = tree + wheels
    fits = total <= args.limit_mib * MiB
    print(
        f"RESULT part=bundle status={'PASS' if fits and not missing else 'FAIL'} tree_mib={tree / MiB:.1f} "
        f"wheels_mib={wheels / MiB:.1f} total_mib={total / MiB:.1f} limit_mib={args.limit_mib:g} "
        f"wheels={len(wanted) - len(missing)}/{len(wanted)}"
    )
    if missing:
        print(
            f"error: not in {args.dest}: {', '.join(missing)} (run without --check-only, with network)", file=sys.stderr
        )
    if not fits:
        print(
            f"error: the bundle is {total / MiB:.1f} MiB, over {args.limit_mib:g} MiB: a host takes no more",
            file=sys.stderr,
        )
    return 0 if fits and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
