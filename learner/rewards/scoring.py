"""From reward names to scored batches: resolution, specs, the weighted sum, and batch scoring.

- `RewardSpec(name, params={}, weight=1.0)`: a reward as a job spec names it; `RewardSpec.from_mapping`
  reads `{"name": "detection", "metric": "f1", "format_weight": 0.1, "weight": 2.0}` (keys other than
  `name`/`weight`/`params` are params; a nested `params` mapping works too).
- `resolve_reward(name, params=None) -> Reward`, `build_rewards(specs) -> RewardSum` (the weighted sum,
  itself a `Reward`; `RewardSum.scores(inp)` gives each component's unweighted value).
- `score_batch(rewards, inputs, *, workers=4, executor=None) -> RewardScores`: a batch scored on a thread
  pool, results in input order.

Resolution of a name, in this order:
1. `"package.module:attr"` (a colon): that module's attribute (`attr` may be dotted: `Class.method`);
2. a built-in's short name (`BUILTIN_REWARDS`, learner/rewards/builtins.py);
3. an entry point of the group `rmsft.rewards` (`importlib.metadata.entry_points(group="rmsft.rewards")`),
   as a third-party package declares it in its pyproject.toml:
   `[project.entry-points."rmsft.rewards"] my_reward = "my_pkg.rewards:my_reward"`.
   A built-in name wins over an entry point of the same name; two entry points of one name are an error.
The resolved object becomes a reward this way: a class is instantiated with the params (its instances are
the rewards); a function with no params is the reward itself; a function given params is a factory, called
with them, and must return the reward.

Threads: `score_batch` calls rewards from several threads at once; a reward must be thread-safe or run with
`workers=1`. The built-ins are (no state is written after construction).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from learner.rewards.builtins import BUILTIN_REWARDS
from learner.rewards.interface import (
    Reward,
    RewardConfigError,
    RewardError,
    RewardInput,
    UnknownRewardError,
    reward_name,
)

ENTRY_POINT_GROUP = "rmsft.rewards"

# --------------------------------------------------------------------------------------------- resolution


def _import_path(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise UnknownRewardError(f"reward {path!r}: an import path is 'package.module:callable'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UnknownRewardError(
                f"reward {path!r}: no module named {exc.name!r} (looked up as an import path 'package.module:callable')"
            ) from exc
        raise UnknownRewardError(
            f"reward {path!r}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    except Exception as exc:
        raise UnknownRewardError(
            f"reward {path!r}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    walked = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise UnknownRewardError(
                f"reward {path!r}: {walked!r} has no attribute {part!r} (its public callables: "
                f"{', '.join(public) or 'none'})"
            )
        obj = getattr(obj, part)
        walked = f"{walked}:{part}" if walked == module_name else f"{walked}.{part}"
    return obj


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _lookup(name: str) -> Any:
    if ":" in name:
        return _import_path(name)
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    eps = _entry_points()
    found = [ep for ep in eps if ep.name == name]
    if not found:
        installed = sorted({ep.name for ep in eps})
        raise UnknownRewardError(
            f"unknown reward {name!r}: looked up as a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) and as an "
            f"entry point of group {ENTRY_POINT_GROUP!r} (installed: {', '.join(installed) or 'none'}); a reward "
            "outside both is named by its import path, 'package.module:callable'"
        )
    if len(found) > 1:
        raise RewardConfigError(
            f"reward {name!r}: {len(found)} entry points of group {ENTRY_POINT_GROUP!r} have "
            f"that name ({', '.join(ep.value for ep in found)}); name one by its import path"
        )
    ep = found[0]
    try:
        return ep.load()
    except Exception as exc:
        raise UnknownRewardError(
            f"reward {name!r}: entry point {ep.value!r} of group {ENTRY_POINT_GROUP!r} failed "
            f"to load: {type(exc).__name__}: {exc}"
        ) from exc


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def resolve_reward(name: str, params: Mapping[str, Any] | None = None) -> Reward:
    """The reward `name` names (an import path, a built-in, an entry point; see the module docstring), built
    with `params`."""
    if not isinstance(name, str) or not name.strip():
        raise RewardConfigError(f"reward name must be a non-empty string, got {name!r}")
    params = dict(params or {})
    obj = _lookup(name.strip())
    if isinstance(obj, type) or params:
        try:
            reward = obj(**params)
        except (TypeError, ValueError) as exc:
            raise RewardConfigError(
                f"reward {name!r}: cannot build it with params {params}: {exc} (it takes {_signature(obj)})"
            ) from exc
    else:
        reward = obj
    if not callable(reward):
        raise RewardConfigError(f"reward {name!r} resolved to {type(reward).__name__} {reward!r}, not a callable")
    return reward


# ------------------------------------------------------------------------------------------- specs, sums


@dataclass(frozen=True)
class RewardSpec:
    """A reward as a job spec holds it: its name (built-in, entry point or import path), its params, and its
    weight in the sum."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise RewardConfigError(f"name: expected a non-empty string, got {self.name!r}")
        if not isinstance(self.params, Mapping) or not all(isinstance(k, str) for k in self.params):
            raise RewardConfigError(f"params: expected a mapping of names to values, got {self.params!r}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise RewardConfigError(f"weight: expected a finite number, got {w!r}")
        object.__setattr__(self, "name", self.name.strip())
        object.__setattr__(self, "params", dict(self.params))
        object.__setattr__(self, "weight", float(w))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | str) -> RewardSpec:
        """`"detection"`, or `{"name": ..., "weight": ..., <param>: ...}` (params flat, or under `params`)."""
        if isinstance(data, str):
            return cls(data)
        if not isinstance(data, Mapping):
            raise RewardConfigError(f"expected a reward name or a mapping with 'name', got {data!r}")
        if "name" not in data:
            raise RewardConfigError(f"name: missing (a reward needs a name; got keys {', '.join(map(str, data))})")
        params = dict(data.get("params") or {})
        for k, v in data.items():
            if k in ("name", "weight", "params"):
                continue
            if k in params:
                raise RewardConfigError(f"params.{k}: given both flat and under 'params'")
            params[k] = v
        return cls(data["name"], params, data.get("weight", 1.0))

    def to_mapping(self) -> dict[str, Any]:
        return {"name": self.name, "weight": self.weight, "params": dict(self.params)}


class RewardSum:
    """The weighted sum of named rewards; itself a `Reward`. `components`: (label, weight, reward), the label
    being the reward's name (with `#i`, its position, when two components share a name)."""

    name = "sum"

    def __init__(self, components: Sequence[tuple[str, float, Reward]]) -> None:
        if not components:
            raise RewardConfigError("a reward sum needs at least one reward")
        self.components = tuple((str(n), float(w), r) for n, w, r in components)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(n for n, _, _ in self.components)

    def scores(self, inp: RewardInput) -> dict[str, float]:
        """Each component's unweighted value; a failure is a `RewardError` naming the component and record."""
        return {label: _call(label, reward, inp) for label, _, reward in self.components}

    def total(self, scores: Mapping[str, float]) -> float:
        return math.fsum(w * scores[label] for label, w, _ in self.components)

    def __call__(self, inp: RewardInput) -> float:
        return self.total(self.scores(inp))


def _spec_name(raw: object) -> str | None:
    if isinstance(raw, RewardSpec):
        return raw.name
    if isinstance(raw, str):
        return raw
    name = raw.get("name") if isinstance(raw, Mapping) else None
    return name if isinstance(name, str) else None


def build_rewards(specs: Iterable[RewardSpec | Mapping[str, Any] | str]) -> RewardSum:
    """The weighted sum of the rewards `specs` name; an error says which entry (`rewards[i]`) is at fault."""
    built: list[tuple[str, float, Reward]] = []
    for i, raw in enumerate(specs):
        try:
            spec = raw if isinstance(raw, RewardSpec) else RewardSpec.from_mapping(raw)
            reward = resolve_reward(spec.name, spec.params)
        except RewardConfigError as exc:
            where = f"rewards[{i}]" + (f" ({_spec_name(raw)})" if _spec_name(raw) else "")
            raise type(exc)(f"{where}: {exc}") from exc
        built.append((spec.name, spec.weight, reward))
    if not built:
        raise RewardConfigError("rewards: at least one reward is needed")
    names = [n for n, _, _ in built]
    labels = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
    return RewardSum([(lab, w, r) for lab, (_, w, r) in zip(labels, built, strict=True)])


# ------------------------------------------------------------------------------------------------ scoring


def _call(label: str, reward: Reward, inp: RewardInput) -> float:
    rid = getattr(inp.record, "id", "?")
    try:
        value = reward(inp)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(label, rid, inp.sample_index, f"{type(exc).__name__}: {exc}") from exc
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(label, rid, inp.sample_index, f"returned {type(value).__name__} {value!r}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(label, rid, inp.sample_index, f"returned {value}, not a finite number")
    return value


@dataclass(frozen=True)
class RewardScores:
    """A batch's rewards, in input order: `totals` (the weighted sums) and `per_reward` (each component's
    unweighted values, by label), for the advantages and the metrics."""

    totals: tuple[float, ...]
    per_reward: Mapping[str, tuple[float, ...]]


def score_batch(
    rewards: RewardSum | Reward,
    inputs: Sequence[RewardInput],
    *,
    workers: int = 4,
    executor: Executor | None = None,
) -> RewardScores:
    """Score every input with every reward on a pool of `workers` threads (1: inline; `executor`: that
    pool instead), results in input order whatever the finishing order. A failure raises the `RewardError`
    of the first failing input (in input order) once the batch is done; the message says how many failed."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    total = rewards if isinstance(rewards, RewardSum) else RewardSum([(reward_name(rewards), 1.0, rewards)])
    inputs = list(inputs)

    def one(inp: RewardInput) -> dict[str, float] | RewardError:
        try:
            return total.scores(inp)
        except RewardError as exc:
            return exc

    if executor is not None:
        results = list(executor.map(one, inputs))
    elif workers == 1 or len(inputs) <= 1:
        results = [one(inp) for inp in inputs]
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(inputs)), thread_name_prefix="rmsft-reward") as pool:
            results = list(pool.map(one, inputs))
    failures = [r for r in results if isinstance(r, RewardError)]
    if failures:
        first = failures[0]
        if len(failures) > 1:
            err = RewardError(
                first.reward,
                first.record_id,
                first.sample_index,
                f"{first.detail} (and {len(failures) - 1} more failing completion(s) in this batch of {len(inputs)})",
            )
            raise err from first.__cause__
        raise first
    scores = [r for r in results if not isinstance(r, RewardError)]
    return RewardScores(
        totals=tuple(total.total(s) for s in scores),
        per_reward={label: tuple(s[label] for s in scores) for label in total.labels},
    )
