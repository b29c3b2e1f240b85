"""Generates the Python stubs of protos/rmsft_protos/*.proto with grpcio-tools (never hand-edit them).

Usage: python scripts/gen_protos.py [OUT_DIR]   (default: in place, next to the .proto files)
tests/test_protos.py runs this into a temporary folder and fails when the committed stubs differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_ROOT.glob("rmsft_protos/*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    for proto in protos:
        rel = proto.relative_to(PROTO_ROOT)
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(rel),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {rel}")
    return sorted(
        p
        for p in (out_dir / "rmsft_protos").iterdir()
        if p.name.startswith(tuple(proto.stem for proto in protos)) and p.suffix in (".py", ".pyi")
    )


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT
    for path in generate(target):
        print(path)
