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

MLflow (`mlflow=MlflowTarget(uri, experiment)`, spec.training.report_to: [mlflow]) gets the same scalars, the
job's config flattened to params (`training.lr`) plus the whole job as the artifact `job.yaml`, and the images;
one MLflow run per process. A `file:` URI is MLflow's file store, which MLflow 3 refuses unless
MLFLOW_ALLOW_FILE_STORE is true: it is set for that URI only (rmsft's default store, no database needed).
`wandb_options` (project, mode, dir) are passed to `wandb.init`; spec.training.wandb.mode: offline (the default)
writes run files with no network. The optional packages come with `pip install 'rmsft[tracking]'`;
`require_trackers(names)` says so before a run starts. After start, a tracker that fails to log (a tracking
server down) is warned about once and skipped: tracking must never stop a paid-for run.

`read_events(log_dir)` reads a folder back (TensorBoard's own reader): for tests and for users' scripts.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import struct
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from PIL import Image

    from rmsft.jobspec import RolloutMatchingJob

log = logging.getLogger("rmsft.learner")

WANDB_PROJECT_ENV = "WANDB_PROJECT"


TRACKING_EXTRA = "pip install 'rmsft[tracking]'"
# report_to name -> (import name, the distribution pyproject's `tracking` extra installs).
OPTIONAL_TRACKERS = {"mlflow": ("mlflow", "mlflow-skinny"), "wandb": ("wandb", "wandb")}


class TrackingError(RuntimeError):
    """The tracking destination cannot be used; the message names it and what to change."""


@dataclass(frozen=True)
class MlflowTarget:
    uri: str
    experiment: str


def check_trackers(report_to: Sequence[str], tensorboard_dir: str) -> None:
    """Rank 0, before anything is paid for: every optional tracker `report_to` names installed (require_trackers),
    and TensorBoard's folder writable when it is one of them (now, not after training)."""
    require_trackers(report_to)
    if "tensorboard" in report_to:
        check_writable(Path(tensorboard_dir))


def require_trackers(names: Iterable[str]) -> None:
    """Raise TrackingError naming each optional tracker in `names` whose package cannot be imported, with the
    extra that installs it: at job start, not after the model loaded."""
    missing = []
    for name in names:
        if name not in OPTIONAL_TRACKERS:
            continue
        module, dist = OPTIONAL_TRACKERS[name]
        try:
            importlib.import_module(module)
        except Exception as e:
            why = (
                "not installed"
                if isinstance(e, ModuleNotFoundError)
                else f"cannot be imported: {type(e).__name__}: {e}"
            )
            missing.append(f"{name} ({dist} {why})")
    if missing:
        raise TrackingError(
            f"spec.training.report_to names a tracker this environment lacks: {', '.join(missing)}; "
            f"install it with `{TRACKING_EXTRA}` (pinned: -c requirements/constraints.txt), or drop "
            "it from report_to"
        )


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"spec": {"training": {"lr": 1e-5}}}` -> `{"spec.training.lr": "1e-05"}` (MLflow params are flat strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, name + "."))
        else:
            out[name] = (json.dumps(value) if isinstance(value, list | dict | bool) or value is None else str(value))[
                :6000
            ]  # MLflow's longest param value
    return out


class _Mlflow:
    """One MLflow run through MlflowClient (no fluent API: no process-global active run)."""

    def __init__(self, target: MlflowTarget, run_name: str, config: Mapping[str, Any] | None) -> None:
        if target.uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the file store, chosen in the job
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=target.uri)
        found = self.client.get_experiment_by_name(target.experiment)
        experiment = found.experiment_id if found is not None else self.client.create_experiment(target.experiment)
        self.run_id = self.client.create_run(experiment, run_name=run_name or None).info.run_id
        self._warned = False
        if config is not None:
            params = [Param(k, v) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
            self.client.log_text(self.run_id, yaml.safe_dump(dict(config), sort_keys=False), "job.yaml")

    def _guard(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:
            if not self._warned:
                log.warning("MLflow could not log %s (%s): training goes on; later failures are not reported", what, e)
                self._warned = True

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, float(v), now, int(step)) for tag, v in values.items()]
        self._guard("scalars", self.client.log_batch, self.run_id, metrics=metrics)

    def image(self, step: int, tag: str, rgb: Any) -> None:
        self._guard("an image", self.client.log_image, self.run_id, rgb, key=tag, step=int(step))

    def close(self) -> None:
        self._guard("the run's end", self.client.set_terminated, self.run_id)


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
            raise TrackingError(
                f"Weights & Biases was asked for but cannot be imported ({e}); install it with "
                f"`{TRACKING_EXTRA}`, or leave it off"
            ) from e
        log.warning("%s is set but the wandb package is not installed: tracking to TensorBoard only", WANDB_PROJECT_ENV)
        return None


def tracker_of(job: RolloutMatchingJob, *, resume_step: int | None = None) -> Tracker:
    """Rank 0's tracker of `job`: the trackers spec.training.report_to names, each given the job as its config."""
    t, name = job.spec.training, job.metadata.name
    return Tracker(
        t.tensorboard_dir if "tensorboard" in t.report_to else None,
        run_name=name,
        config=job.to_manifest(),
        resume_step=resume_step,
        mlflow=MlflowTarget(t.mlflow_uri, t.mlflow.experiment or name) if "mlflow" in t.report_to else None,
        wandb="wandb" in t.report_to,
        wandb_options={
            "project": t.wandb.project or os.environ.get(WANDB_PROJECT_ENV) or name,
            "mode": t.wandb.mode,
            "dir": t.wandb_dir,
        },
    )


class Tracker:
    """Scalars and images of one run, to TensorBoard (and Weights & Biases when asked for)."""

    def __init__(
        self,
        log_dir: str | Path | None,
        *,
        run_name: str = "",
        config: Mapping[str, Any] | None = None,
        wandb: bool | None = None,
        resume_step: int | None = None,
        mlflow: MlflowTarget | None = None,
        wandb_options: Mapping[str, Any] | None = None,
    ) -> None:
        """`resume_step`: the first step this process will write when it resumes a run; TensorBoard then
        hides what an earlier process wrote at that step and later (a crashed run's steps done again).
        `log_dir=None` leaves TensorBoard off; `mlflow` turns MLflow on."""
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._writer: Any = None
        self._wandb_run: Any = None
        self._wandb: Any = None
        self._mlflow: _Mlflow | None = None
        if mlflow is not None:
            require_trackers(["mlflow"])
            try:
                self._mlflow = _Mlflow(mlflow, run_name, config)
            except Exception as e:
                raise TrackingError(
                    f"MLflow could not start a run at {mlflow.uri}: {e}; check spec.training.mlflow.tracking_uri"
                ) from e
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
                options = {
                    "project": os.environ.get(WANDB_PROJECT_ENV) or None,
                    "dir": str(self._log_dir) if self._log_dir is not None else None,
                    **(wandb_options or {}),
                }
                if options.get("dir"):
                    Path(options["dir"]).mkdir(parents=True, exist_ok=True)
                self._wandb_run = module.init(name=run_name or None, config=dict(config or {}), **options)
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
        return self._writer is not None or self._wandb_run is not None or self._mlflow is not None

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """One point per tag at `step` (tags like `train/loss` group in TensorBoard by their prefix)."""
        if self._writer is not None:
            for tag, value in values.items():
                self._writer.add_scalar(tag, float(value), int(step))
        if self._wandb_run is not None:
            self._wandb_run.log({tag: float(v) for tag, v in values.items()}, step=int(step))
        if self._mlflow is not None:
            self._mlflow.scalars(step, values)

    def image(self, step: int, tag: str, image: Image.Image) -> None:
        """A picture at `step` (stored as PNG)."""
        if not self.enabled:
            return
        import numpy as np

        rgb = image.convert("RGB")
        if self._writer is not None:
            self._writer.add_image(tag, np.asarray(rgb), int(step), dataformats="HWC")
        if self._wandb_run is not None:
            self._wandb_run.log({tag: self._wandb.Image(rgb)}, step=int(step))
        if self._mlflow is not None:
            self._mlflow.image(step, tag, rgb)

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
        if self._mlflow is not None:
            ml, self._mlflow = self._mlflow, None
            ml.close()

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


def read_wandb_offline(run_file: str | Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, Any]]:
    """The scalars (by key, `(step, value)` in order; images left out) and the config of a W&B run file
    (`run-<id>.wandb` in an offline run's folder): for tests and users' scripts. wandb ships no reader of its own
    now, so this reads its format (LevelDB's log: 7-byte header, then 32 KiB blocks of CRC-framed chunks, each a
    protobuf Record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    ident, magic, _version = struct.unpack_from("<4sHB", data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{run_file} is not a W&B run file")
    scalars: dict[str, list[tuple[int, float]]] = {}
    config: dict[str, Any] = {}
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL / FIRST start a record, MIDDLE / LAST extend it
        if kind not in (1, 4):
            continue
        rec = pb.Record()  # type: ignore[attr-defined]  # protoc-generated: wandb ships no stubs for its messages
        rec.ParseFromString(buf)
        which = rec.WhichOneof("record_type")
        if which == "history":
            for item in rec.history.item:
                parts, value = [item.key] if item.key else list(item.nested_key), json.loads(item.value_json)
                # wandb's own _step, _runtime, _timestamp left out, and images (nested keys: width, path, ...)
                if (
                    len(parts) == 1
                    and not parts[0].startswith("_")
                    and isinstance(value, int | float)
                    and not isinstance(value, bool)
                ):
                    scalars.setdefault(parts[0], []).append((rec.history.step.num, float(value)))
        elif which in ("run", "config"):
            items = rec.run.config.update if which == "run" else rec.config.update
            for item in items:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    config[key] = json.loads(item.value_json)
    return scalars, config
