"""The project's import graph: no import cycle anywhere, and every part imports only the parts below it.

The graph is read from the source with `ast` (nothing is imported): one node per module of every top-level
package (`PACKAGES`), one edge per import of another project module.

What counts: every `import` and `from ... import` in a module, wherever it stands: at module level, inside a
function (a lazy import is still a dependency: it runs when the function does), under `if TYPE_CHECKING:`
(the annotations depend on it). `from pkg import name` is an edge to the module `pkg.name` when there is one,
else to `pkg`. What does not count: the packages Python also runs on the way to a module (importing `a.b.c`
runs `a/__init__.py` and `a/b/__init__.py`); a package whose `__init__` re-exports its modules would
otherwise always close a circle. A package's own `__init__` imports are edges like any module's.

The layers (docs/architecture.md has the same table): `LAYERS` maps each part to the parts it may import;
a module belongs to the part with the longest matching name. The folder tree is the layering: each top-level
package is one layer, except `learner`, which holds a stack of its own (one subpackage per idea).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "rmsft": ROOT / "rmsft",
    "rmsft_cli": ROOT / "rmsft_cli",
    "rmsft_dev": ROOT / "rmsft_dev",
    "learner": ROOT / "learner",
    "rollout_svc": ROOT / "rollout_svc",
    "rollout_engine": ROOT / "rollout_engine",
    "rmsft_operator": ROOT / "operator" / "rmsft_operator",
    "rmsft_protos": ROOT / "protos" / "rmsft_protos",
}

# The base: `rmsft` (the job spec, the weight-update contract, the rules learner and server share) and the
# generated gRPC stubs. Every part may import it; it imports none of them.
BASE = {"rmsft", "rmsft_protos"}
LEARNER_BELOW_TOP = {
    "learner.core",
    "learner.tracking",
    "learner.rollouts",
    "learner.sync",
    "learner.data",
    "learner.rewards",
    "learner.evaluation",
    "learner.rollouts.colocate",
    "learner.train",
}
LAYERS: dict[str, set[str]] = {
    "rmsft_protos": set(),
    "rmsft": {"rmsft_protos"},
    # learner, bottom to top: core <- data <- rewards / evaluation / colocate <- train <- the modules on top
    "learner.core": set(),  # the pure algorithm: nothing of the project
    "learner.tracking": BASE,
    # the rollout interface and its server home; it is given its weight sender (learner.sync sits above it)
    "learner.rollouts": BASE | {"learner.tracking"},
    "learner.sync": BASE | {"learner.rollouts", "learner.tracking"},
    "learner.data": BASE | {"learner.core", "learner.rollouts"},
    "learner.rewards": BASE | {"learner.core", "learner.data"},
    "learner.evaluation": BASE | {"learner.core", "learner.data", "learner.rollouts"},
    # the other home, the engine inside the learner's ranks: it drives the rollout engines, syncs weights
    # in-process, reports
    "learner.rollouts.colocate": BASE
    | {"learner.rollouts", "learner.sync", "learner.tracking", "learner.core", "rollout_engine"},
    "learner.train": BASE | LEARNER_BELOW_TOP - {"learner.train"},
    # learner's top-level modules (`rmsft local`, `rmsft eval`, the GPU assignment of `rmsft local`)
    "learner": BASE | LEARNER_BELOW_TOP | {"rmsft_dev", "rollout_svc"},
    "rmsft_dev": BASE | {"learner.core"},  # tiny models and synthetic tasks: dev builders, not runtime code
    "rollout_engine": BASE,  # the engines both homes drive: the gRPC server and the colocated engine
    "rollout_svc": BASE | {"rollout_engine"},  # `rmsft serve`: the gRPC server around one engine
    "rmsft_operator": {"rmsft"},  # the operator image has no grpc: not even rmsft_protos
    "rmsft_cli": BASE | LEARNER_BELOW_TOP | {"learner", "rmsft_dev", "rollout_svc", "rmsft_operator"},  # the command
}
# What sits at learner's top level; everything else lives in a subpackage of one idea.
LEARNER_TOP_MODULES = {"__init__", "local", "checkpoint_eval", "gpu_assignment"}


def _module_name(top: str, path: Path) -> str:
    parts = [top, *path.relative_to(PACKAGES[top]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {_module_name(top, f): f for top, folder in PACKAGES.items() for f in sorted(folder.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an imported name lives in (the longest module prefix), or None outside the project."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, source: str, modules: dict[str, Path], is_package: bool = False) -> set[str]:
    """The project modules `module` imports, wherever the import statement stands."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                src = ".".join([*base, *([node.module] if node.module else [])])
            else:
                src = node.module or ""
            # `from pkg import name`: the module pkg.name if there is one, else pkg itself
            names = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(m, f.read_text(), modules, f.name == "__init__.py") for m, f in modules.items()}


def layer_of(module: str) -> str:
    matches = [layer for layer in LAYERS if module == layer or module.startswith(layer + ".")]
    assert matches, f"{module} belongs to no layer: add it to LAYERS"
    return max(matches, key=len)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_every_part_and_every_kind_of_import(graph: dict[str, set[str]]) -> None:
    for top in PACKAGES:
        assert top in graph
    assert "learner.core.packing" in graph["learner.train.objectives.rollout_matching"]  # module level
    assert "learner.train.build" in graph["learner.local"]  # inside a function
    assert "rmsft_cli.app" in graph["rmsft_cli.__main__"]
    modules = project_modules()
    lazy = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from learner.data.records import Record
def f():
    from learner.train import zero
    import learner.rollouts.client as c
"""
    assert imports_of("learner.x", lazy, modules) == {
        "learner.data.records",
        "learner.train.zero",
        "learner.rollouts.client",
    }
    relative = "from . import codec\nfrom .parse import parse\nfrom .. import local\n"
    assert imports_of("learner.core.x", relative, modules) == {
        "learner.core.codec",
        "learner.core.parse",
        "learner.local",
    }


def test_no_import_cycle_anywhere(graph: dict[str, set[str]]) -> None:
    assert find_cycle(graph) is None, "import cycle: " + " -> ".join(find_cycle(graph) or [])
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself


def test_the_layers_form_no_cycle_themselves() -> None:
    assert find_cycle({k: v - {k} for k, v in LAYERS.items()}) is None


def test_every_part_imports_only_the_layers_below_it(graph: dict[str, set[str]]) -> None:
    bad = sorted(
        f"{src} ({layer_of(src)}) imports {dst} ({layer_of(dst)})"
        for src, targets in graph.items()
        for dst in targets
        if layer_of(dst) != layer_of(src) and layer_of(dst) not in LAYERS[layer_of(src)]
    )
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("part", "never"),
    [
        # the base
        ("rmsft", ("learner", "rollout_svc", "rollout_engine", "rmsft_operator", "rmsft_cli", "rmsft_dev")),
        ("rollout_engine", ("learner", "rollout_svc", "rmsft_operator", "rmsft_cli", "rmsft_dev")),
        ("rollout_svc", ("learner", "rmsft_operator", "rmsft_cli", "rmsft_dev")),
        ("rmsft_operator", ("learner", "rollout_svc", "rollout_engine", "rmsft_protos", "rmsft_cli", "rmsft_dev")),
        ("learner.core", ("rmsft", "rmsft_protos", "rollout_svc", "rollout_engine", "rmsft_operator")),
        # the server home is given its weight sender; only the colocated home reaches the engines
        (
            "learner.rollouts",
            ("learner.sync", "learner.rollouts.colocate", "learner.train", "rollout_engine", "rollout_svc"),
        ),
        (
            "rmsft_dev",
            (
                "learner.rollouts",
                "learner.sync",
                "learner.train",
                "rollout_svc",
                "rollout_engine",
                "rmsft_operator",
                "rmsft_cli",
            ),
        ),
    ],
)
def test_part_never_imports(graph: dict[str, set[str]], part: str, never: tuple[str, ...]) -> None:
    bad = sorted(
        f"{src} imports {dst}"
        for src, targets in graph.items()
        if layer_of(src) == part
        for dst in targets
        if any(layer_of(dst) == n or layer_of(dst).startswith(n + ".") for n in never) and layer_of(dst) != part
    )
    assert not bad, "\n".join(bad)


def test_learner_top_level_holds_only_the_modules_on_top() -> None:
    top = {f.stem for f in (ROOT / "learner").glob("*.py")}
    assert top == LEARNER_TOP_MODULES, "a new learner module belongs in a subpackage (learner/__init__.py lists them)"
    for sub in LEARNER_BELOW_TOP:
        assert (ROOT / sub.replace(".", "/") / "__init__.py").exists(), sub


def test_each_top_level_folder_is_one_layer(graph: dict[str, set[str]]) -> None:
    """Every module of a top-level package is in that package's layer; only `learner` is split further (its
    subpackages are layers of their own, learner/__init__.py lists them)."""
    for top in PACKAGES:
        assert top in LAYERS, f"{top} is a top-level package with no layer"
    split = sorted(layer for layer in LAYERS if "." in layer and not layer.startswith("learner."))
    assert not split, f"layers inside a top-level package other than learner: {split}"
    mixed = sorted(m for m in graph if m.split(".")[0] != "learner" and layer_of(m) != m.split(".")[0])
    assert not mixed, mixed


# -- the picture in docs/architecture.md ------------------------------------------------------------------------
PICTURE_DOC = ROOT / "docs" / "architecture.md"
PICTURE_BEGIN = "<!-- import picture: generated by scripts/gen_import_picture.py from the source; do not edit -->"
PICTURE_END = "<!-- end of import picture -->"


def layer_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The imports between layers as the source has them (not what LAYERS allows), without the edges another path
    already implies (A -> C when A -> B -> C), so the picture shows the layering rather than every import."""
    edges = {(layer_of(s), layer_of(d)) for s, ts in graph.items() for d in ts if layer_of(s) != layer_of(d)}
    nxt: dict[str, set[str]] = {}
    for a, b in edges:
        nxt.setdefault(a, set()).add(b)

    def path(a: str, b: str) -> bool:
        seen, todo = {a}, [a]
        while todo:
            for n in nxt.get(todo.pop(), ()):
                if n == b:
                    return True
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return False

    # implied: another path from a to b, through a part a imports other than b itself
    return {(a, b) for a, b in edges if not any(path(mid, b) for mid in nxt[a] if mid != b)}


def import_picture(graph: dict[str, set[str]]) -> str:
    """A Mermaid flowchart of the layers: an arrow from a part to a part it imports (reduced as `layer_edges`)."""
    ident = {layer: layer.replace(".", "_") for layer in LAYERS}
    lines = ["```mermaid", "flowchart TD"]
    lines += [f'    {ident[layer]}["{layer}"]' for layer in sorted(LAYERS)]
    lines += [f"    {ident[a]} --> {ident[b]}" for a, b in sorted(layer_edges(graph))]
    lines.append("```")
    return "\n".join([PICTURE_BEGIN, *lines, PICTURE_END])


def test_the_import_picture_in_the_docs_is_current(graph: dict[str, set[str]]) -> None:
    text = PICTURE_DOC.read_text()
    assert PICTURE_BEGIN in text and PICTURE_END in text, f"{PICTURE_DOC} has no import picture"
    shown = text[text.index(PICTURE_BEGIN) : text.index(PICTURE_END) + len(PICTURE_END)]
    assert shown == import_picture(graph), "the import picture is stale: run python scripts/gen_import_picture.py"
    # The base sits at the bottom: no arrow leaves it for a part above it.
    assert not [e for e in layer_edges(graph) if e[0] in BASE and e[1] not in BASE]
    # The reduction itself: train -> core is implied by train -> data -> core.
    toy = {"learner.train.x": {"learner.data.y", "learner.core.z"}, "learner.data.y": {"learner.core.z"}}
    assert layer_edges(toy) == {("learner.train", "learner.data"), ("learner.data", "learner.core")}


MAX_CLASS_LINES = 400  # issue 42: the training loop's parts stay readable in one sitting


def test_no_class_of_the_training_loop_grows_past_its_limit_and_none_is_a_mixin() -> None:
    """Every class in learner/train/ fits MAX_CLASS_LINES (the loop's step reads in one place; what grows goes into
    a collaborator: an objective, the feed, the checkpointer), and none is a mixin (a class another one inherits
    besides its real base)."""
    sizes: dict[str, int] = {}
    bases: dict[str, list[str]] = {}
    for path in sorted((ROOT / "learner" / "train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                name = f"{path.relative_to(ROOT)}::{node.name}"
                sizes[name] = node.end_lineno - node.lineno + 1
                bases[name] = [ast.unparse(b) for b in node.bases]
    assert any(name.endswith("::TrainingLoop") for name in sizes), sorted(sizes)  # the scan sees the loop
    assert {n: s for n, s in sizes.items() if s > MAX_CLASS_LINES} == {}
    assert {n: b for n, b in bases.items() if len([x for x in b if x not in ("Protocol", "Generic")]) > 1} == {}
