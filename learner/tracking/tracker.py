"""Experiment tracking: TensorBoard event files, and Weights & Biases when it is installed and asked for.

`Tracker(log_dir)` writes scalars and images as TensorBoard events into `log_dir` (torch's own
`SummaryWriter`; `tensorboard --logdir <dir>` shows them). A resumed run appends a new event file to the
same folder, which TensorBoard shows as one run; pass `resume_step` so the steps a crashed run wrote past its
last checkpoint, and that the resumed run writes again, are not shown twice.
`Tracker(None)` does nothing, so callers need no `if`: ranks other than 0 and runs without tracking use it.

Weights & Biases is optional and never needed: with `wandb=None` (the default) it is used when the
`WANDB_PROJECT` environment variable is set and the `wandb` package is installed (a warning, not an error,
when it is not, or when the run cannot start: tracking must never stop a paid-for training run); `wandb=True`
requires it (an error at construction); `wandb=False` never uses it. `wandb` is imported only then.

`read_events(log_dir)` reads a folder back (TensorBoard's own reader): for tests and for users' scripts.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger("rmsft.learner")

WANDB_PROJECT_ENV = "WANDB_PROJECT"


class TrackingError(RuntimeError):
    """The tracking destination cannot be used; the message names it and what to change."""


def check_writable(root: Path) -> None:
    """Create `root` and write + remove a probe file: an unwritable folder fails at start, not after
    training was paid for (SummaryWriter would only fail on its first flush, in a background thread)."""
    probe = root / f".rmsft-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"rmsft")
        probe.unlink()
    except OSError as e:
        with contextlib.suppress(OSError):
            probe.unlink()
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(root) else ""
        raise TrackingError(
            f"the TensorBoard folder {root} is not writable: {e.strerror or e}{where}; point "
            "spec.training.log_dir at a writable path (unset, it is <spec.training.checkpoint.dir>/tensorboard)"
        ) from e


def _wandb_module(wanted: bool | None) -> Any | None:
    """The `wandb` module when this run should use it, else None."""
    if wanted is False or (wanted is None and not os.environ.get(WANDB_PROJECT_ENV)):
        return None
    try:
        return importlib.import_module("wandb")
    except ImportError as e:
        if wanted:
            raise TrackingError(f"Weights & Biases was asked for but cannot be imported ({e}); install it with "
                                "`pip install wandb`, or leave it off") from e
        log.warning("%s is set but the wandb package is not installed: tracking to TensorBoard only",
                    WANDB_PROJECT_ENV)
        return None


class Tracker:
    """Scalars and images of one run, to TensorBoard (and Weights & Biases when asked for)."""

    def __init__(self, log_dir: str | Path | None, *, run_name: str = "", config: Mapping[str, Any] | None = None,
                 wandb: bool | None = None, resume_step: int | None = None) -> None:
        """`resume_step`: the first step this process will write when it resumes a run; TensorBoard then
        hides what an earlier process wrote at that step and later (a crashed run's steps done again)."""
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._writer: Any = None
        self._wandb_run: Any = None
        self._wandb: Any = None
        if self._log_dir is None and not wandb:
            return  # the no-op tracker: never starts a W&B run from WANDB_PROJECT alone (e.g. on rank 1)
        if self._log_dir is not None:
            check_writable(self._log_dir)
            # Imported here: a rank that never tracks does not pay for TensorBoard's import.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self._log_dir), purge_step=resume_step)
            if config is not None or run_name:
                # The job as TensorBoard's TEXT tab shows it (markdown: indented = code block).
                text = yaml.safe_dump(dict(config or {}), sort_keys=False) if config is not None else ""
                body = "\n".join("    " + line for line in text.splitlines())
                self._writer.add_text("run", (f"**{run_name}**\n\n" if run_name else "") + body, 0)
        module = _wandb_module(wandb)
        if module is not None:
            try:
                self._wandb_run = module.init(project=os.environ.get(WANDB_PROJECT_ENV) or None,
                                              name=run_name or None, config=dict(config or {}),
                                              dir=str(self._log_dir) if self._log_dir is not None else None)
                self._wandb = module
            except Exception as e:  # W&B's own errors (auth, network) have no common base
                if wandb:
                    self.close()
                    raise TrackingError(f"Weights & Biases could not start a run: {e}") from e
                log.warning("Weights & Biases could not start a run (%s): tracking to TensorBoard only", e)

    @property
    def log_dir(self) -> Path | None:
        """The TensorBoard folder; None when TensorBoard is off."""
        return self._log_dir

    @property
    def enabled(self) -> bool:
        return self._writer is not None or self._wandb_run is not None

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """One point per tag at `step` (tags like `train/loss` group in TensorBoard by their prefix)."""
        if self._writer is not None:
            for tag, value in values.items():
                self._writer.add_scalar(tag, float(value), int(step))
        if self._wandb_run is not None:
            self._wandb_run.log({tag: float(v) for tag, v in values.items()}, step=int(step))

    def image(self, step: int, tag: str, image: Image.Image) -> None:
        """A picture at `step` (stored as PNG)."""
        if self._writer is None and self._wandb_run is None:
            return
        import numpy as np

        rgb = image.convert("RGB")
        if self._writer is not None:
            self._writer.add_image(tag, np.asarray(rgb), int(step), dataformats="HWC")
        if self._wandb_run is not None:
            self._wandb_run.log({tag: self._wandb.Image(rgb)}, step=int(step))

    def flush(self) -> None:
        """Write what is buffered to disk now (the writer otherwise flushes every two minutes)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close; safe to call twice."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            run.finish()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(log_dir: str | Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[tuple[int, bytes]]]]:
    """Every scalar and image in the event files of `log_dir`, by tag, in step order: `(scalars, images)`,
    scalars as `(step, value)`, images as `(step, encoded PNG bytes)`. Read with TensorBoard's own reader,
    so what it returns is what TensorBoard shows (steps hidden by a resumed run's `resume_step` left out)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    path = Path(log_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"no TensorBoard folder at {path}")
    acc = ea.EventAccumulator(str(path), size_guidance=ea.STORE_EVERYTHING_SIZE_GUIDANCE)
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, float(e.value)) for e in acc.Scalars(t)] for t in tags.get(ea.SCALARS, [])}
    images = {t: [(e.step, bytes(e.encoded_image_string)) for e in acc.Images(t)] for t in tags.get(ea.IMAGES, [])}
    return scalars, images


def decode_png(data: bytes) -> Image.Image:
    """An image `read_events` returned, decoded."""
    from PIL import Image as PILImage

    img = PILImage.open(io.BytesIO(data))
    img.load()
    return img
