"""Import a script of benchmarks/ or of a study (studies/method/) by its file. Neither folder is a package: a
folder's scripts import each other by name, as Python lets a script do with its own folder, so the folder goes on
sys.path here as running the script puts it there."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
METHOD_STUDY = ROOT / "studies" / "method"


def load_benchmark(name: str, folder: Path = BENCHMARKS) -> ModuleType:
    """<folder>/<name>.py as a fresh module named `name` (registered in sys.modules: its dataclasses look their
    module up)."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_study(name: str) -> ModuleType:
    """studies/method/<name>.py (the method study: plain SFT against the recipes over seeds)."""
    return load_benchmark(name, METHOD_STUDY)
