"""Writes the import picture of docs/architecture.md: the layers as the source imports them (a Mermaid flowchart,
read from the source by tests/test_imports.py's graph, nothing imported), between its two marker lines.
tests/test_imports.py fails when the picture in the docs is not this one."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_imports import PICTURE_BEGIN, PICTURE_DOC, PICTURE_END, import_graph, import_picture  # noqa: E402


def main() -> None:
    text = PICTURE_DOC.read_text()
    if PICTURE_BEGIN not in text or PICTURE_END not in text:
        sys.exit(f"{PICTURE_DOC}: the marker lines {PICTURE_BEGIN!r} and {PICTURE_END!r} are missing")
    head, rest = text.split(PICTURE_BEGIN, 1)
    tail = rest.split(PICTURE_END, 1)[1]
    PICTURE_DOC.write_text(head + import_picture(import_graph()) + tail)
    print(f"wrote the import picture into {PICTURE_DOC}")


if __name__ == "__main__":
    main()
