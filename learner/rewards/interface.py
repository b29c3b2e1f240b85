"""The reward interface: what a reward is given (`RewardInput`), what it is (`Reward`), and the errors.

- `RewardInput`: one completion to score: its `record`, `text`, `token_ids`, and when the output is a
  detection its `parsed` rollout (rmsft's own parser) and `fmt` (the output format, bound to the record's
  image size), plus `finish_reason`, `sample_index`, `image_size` and `answer` (a short-answer task's
  expected answer; learner/rewards/builtins.py, "Text answers"). `RewardInput.from_completion(...)` parses
  with the real parser. `RewardInput.objects`: the parsed objects (`DetObject`s), or None when nothing was
  parsed.
- `Reward`: the protocol, `reward(inp: RewardInput) -> float`. Any callable will do; a `name` attribute,
  when present, is what errors and metrics call it (`reward_name`).
- Errors: `RewardConfigError` (a spec or params that cannot build a reward; `UnknownRewardError` for a name
  that resolves to nothing, saying what was looked up and what exists), `RewardError` (a reward that raised
  or returned a non-number while scoring; names the reward and the record, the original chained).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from learner.core.codec import DetObject, FormatError, OutputFormat
from learner.core.parse import ParsedRollout, parse
from learner.core.vocab import VocabView
from learner.data.episode import record_format
from learner.data.records import Record


class RewardConfigError(ValueError):
    """A reward spec, name or params that cannot build a reward; the message says which and why."""


class UnknownRewardError(RewardConfigError, LookupError):
    """A reward name that resolves to nothing; the message lists what was looked up and what exists."""


class RewardError(RuntimeError):
    """A reward that failed while scoring a completion: names the reward and the record (the original
    exception is chained as `__cause__`)."""

    def __init__(self, reward: str, record_id: str, sample_index: int, detail: str) -> None:
        self.reward = reward
        self.record_id = record_id
        self.sample_index = sample_index
        self.detail = detail
        super().__init__(f"reward {reward!r} failed on record {record_id!r} (sample {sample_index}): {detail}")


# ----------------------------------------------------------------------------------------------- the input


@dataclass(frozen=True)
class RewardInput:
    """One completion to score. `parsed` and `fmt` are set when the output is a detection (`fmt` already
    bound to the record's image size, `OutputFormat.for_image`); `answer` overrides the record's own
    expected answer for text rewards."""

    record: Record
    text: str
    token_ids: tuple[int, ...] = ()
    parsed: ParsedRollout | None = None
    fmt: OutputFormat | None = None
    image_size: tuple[int, int] | None = None  # (width, height) as the processor resized the image
    finish_reason: str | None = None  # the server's: "stop", "length", ...
    sample_index: int = 0  # which of the prompt's n samples
    answer: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if isinstance(self.answer, list):
            object.__setattr__(self, "answer", tuple(self.answer))

    @property
    def objects(self) -> tuple[DetObject, ...] | None:
        """The valid predicted objects, or None when the completion was not parsed as a detection."""
        return None if self.parsed is None else tuple(o.obj for o in self.parsed.objects)

    @classmethod
    def from_completion(
        cls,
        record: Record,
        text: str,
        token_ids: Sequence[int],
        *,
        vocab: VocabView | None = None,
        fmt: OutputFormat | None = None,
        image_size: tuple[int, int] | None = None,
        finish_reason: str | None = None,
        sample_index: int = 0,
        answer: str | Sequence[str] | None = None,
    ) -> RewardInput:
        """The input for one completion; with `vocab` and `fmt` (a detection output) the token ids are parsed
        by `learner.core.parse.parse` with `fmt` bound to `image_size`. Callers cut a vision-language
        response at its first image token first (`learner.data.episode.vision_safe_response`), as the E-step does."""
        if (vocab is None) != (fmt is None):
            raise ValueError("RewardInput.from_completion: give both vocab and fmt (a detection output), or neither")
        bound = parsed = None
        if fmt is not None and vocab is not None:
            bound = record_format(fmt, image_size)
            try:
                parsed = parse(token_ids, vocab, bound)
            except FormatError as exc:  # e.g. a pixels format and a record without an image size
                raise FormatError(f"record {record.id!r}: {exc}") from exc
        ans = tuple(answer) if answer is not None and not isinstance(answer, str) else answer
        return cls(
            record=record,
            text=text,
            token_ids=tuple(token_ids),
            parsed=parsed,
            fmt=bound,
            image_size=image_size,
            finish_reason=finish_reason,
            sample_index=sample_index,
            answer=ans,
        )


@runtime_checkable
class Reward(Protocol):
    """A reward: any callable from one `RewardInput` to a float (higher is better)."""

    def __call__(self, inp: RewardInput, /) -> float: ...


def reward_name(reward: Any) -> str:
    """What errors and metrics call a reward: its `name` attribute, else its (qualified) name."""
    name = getattr(reward, "name", None)
    if isinstance(name, str) and name:
        return name
    name = getattr(reward, "__qualname__", None) or type(reward).__qualname__
    return str(name)
