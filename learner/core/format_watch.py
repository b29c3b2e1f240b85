"""A run whose answers are in another format than `training.format` says so, once.

Why: a checkpoint trained in one answer format (the reference's stage 1 writes CoordJSON, `{"objects": [...]}` with
bare coordinate tokens) read with another (`coordexp`, `{"object_N": ...}` with quoted ones) parses to no object at
all; rollout matching then turns every channel-B step into the ground truth alone, and nothing fails. So when the
rollouts of `steps` rollout-matching steps in a row parse to no object while their ground truth has objects, the
same answers are read with every other format, and one warning names the format that finds objects in them (or
says that none does).

Public API
- `FormatWatch(fmt, vocab, steps=3)`; `.observe(responses, predicted, gt_objects) -> str | None`: one step's
  anchor answers (response token ids), how many objects they parsed to and how many the ground truth has; returns
  the warning the one time it is given (and logs it), else None.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from learner.core.codec import FORMAT_NAMES, OutputFormat, output_format
from learner.core.parse import parse
from learner.core.vocab import VocabView

log = logging.getLogger("rmsft.learner")

DEFAULT_STEPS = 3


class FormatWatch:
    def __init__(self, fmt: OutputFormat, vocab: VocabView, steps: int = DEFAULT_STEPS) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.fmt, self.vocab, self.steps = fmt, vocab, steps
        self.empty_steps = 0
        self.gt_objects = 0
        self.responses: list[list[int]] = []
        self.warned = False

    def observe(self, responses: Sequence[Sequence[int]], predicted: int, gt_objects: int) -> str | None:
        if self.warned or gt_objects == 0:
            return None  # said already; or a step whose ground truth is empty says nothing about the format
        if predicted > 0 or not any(len(r) for r in responses):
            self.empty_steps, self.gt_objects, self.responses = 0, 0, []
            return None
        self.empty_steps += 1
        self.gt_objects += gt_objects
        self.responses.extend(list(r) for r in responses)
        if self.empty_steps < self.steps:
            return None
        self.warned = True
        message = self._message()
        log.warning("%s", message)
        return message

    def _objects_as(self, name: str) -> int | None:
        """Objects the kept answers parse to in format `name` (None: this vocabulary cannot read that format, e.g.
        coordinate tokens it does not have; a pixels format has no image size here, so relative coordinates)."""
        fmt = output_format(name)
        try:
            return sum(len(parse(r, self.vocab, fmt).objects) for r in self.responses)
        except ValueError:
            return None

    def _message(self) -> str:
        head = (
            f"the rollouts of {self.empty_steps} rollout-matching steps in a row ({len(self.responses)} answers) "
            f"parsed to no object in training.format {self.fmt.name} while their ground truth has "
            f"{self.gt_objects} objects, so those steps trained on the ground truth alone"
        )
        found = {n: k for n in FORMAT_NAMES if n != self.fmt.name and (k := self._objects_as(n))}
        if not found:
            others = ", ".join(n for n in FORMAT_NAMES if n != self.fmt.name)
            return (
                f"{head}; read as {others} they give no object either: check the prompt and that spec.model.path "
                "is a checkpoint trained to answer in this format"
            )
        best = max(found, key=lambda n: found[n])
        return (
            f"{head}; the same answers read as {best} give {found[best]} objects: the checkpoint likely writes "
            f"{best} (a reference CoordExp stage-1 checkpoint writes coordjson): set spec.training.format: {best}"
        )
