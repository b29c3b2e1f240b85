"""The trained model as a Hugging Face folder that transformers and vLLM load directly.

Two ways in, one writer:
- `export_checkpoint(CHECKPOINT, OUT, ...)` (`rmsft export`): rebuilds the learner's model from the
  job spec (`--config`, else `run.json` beside the checkpoint) the way `load_policy` builds it, loads
  the checkpoint's trained weights into it, and writes OUT.
- `export_trained(model, policy_or_processor, OUT, ...)`: the live model at the end of a run.

What OUT holds:
- merged (LoRA/DoRA, the default): every LoRA/DoRA layer merged into its base weight with peft's own
  `merge`, one layer at a time, and the live model put back bit for bit afterwards
  (learner/sync/weights.py's FULL stream, the one the rollout servers already load): no merged copy
  of the whole model is ever held and the caller's model stays trainable. Full fine-tunes: the whole
  model. Weights go to `model.safetensors` (or shards + index) under the names `save_pretrained`
  writes, with config.json, generation_config.json and the processor / tokenizer (chat template
  included).
- adapter (`adapter_only`): adapter_config.json + adapter_model.safetensors, as PEFT saves them; load
  with `PeftModel.from_pretrained(base, OUT)` (vLLM: as a LoRA adapter, except DoRA).
- `rmsft_export.json`: where it came from (checkpoint, step, base model, mode, dtype).

Dtype: the base checkpoint's (its config's dtype) unless `dtype` says otherwise; a bf16 run's fp32
master weights are cast once, as they are written. Adapter tensors stay as trained (fp32) unless a
dtype is given: PEFT and vLLM cast them to the base's dtype themselves.

OUT appears whole or not at all: everything is written into a temporary sibling folder that is
renamed into place at the end (rmsft/output_folder.py).
"""

from __future__ import annotations

import copy
import json
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from learner.tracking.run_record import RUN_FILE
from rmsft.jobspec import JobSpecError
from rmsft.model_folder import forget_load_options
from rmsft.output_folder import OutputFolderError, check_output_folder, staged_folder

if TYPE_CHECKING:
    import torch

    from rmsft.jobspec import RolloutMatchingJob, TrainingConfig

log = logging.getLogger(__name__)

EXPORT_INFO_FILE = "rmsft_export.json"
MAX_SHARD_BYTES = 4 << 30
_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


class ExportError(RuntimeError):
    """The export cannot be made; the message says why and what to do."""


@dataclass(frozen=True)
class ExportResult:
    path: Path
    mode: str  # "merged" (LoRA/DoRA merged into the base), "full" (full fine-tune), "adapter"
    dtype: str  # of the written floating tensors
    tensors: int
    nbytes: int
    files: tuple[str, ...]
    info: dict[str, Any] = field(default_factory=dict)

    def lines(self) -> list[str]:
        what = {
            "merged": "LoRA/DoRA merged into the base weights",
            "full": "the fully fine-tuned model",
            "adapter": "the PEFT adapter alone",
        }[self.mode]
        out = [
            f"exported {what} to {self.path}",
            f"{self.tensors} tensors, {self.nbytes / 2**20:.1f} MiB, {self.dtype}; files: {', '.join(self.files)}",
        ]
        if self.info.get("step") is not None:
            out.insert(1, f"from checkpoint {self.info.get('checkpoint')} (step {self.info['step']})")
        if self.mode == "adapter" and self.info.get("use_dora"):
            out.append("note: vLLM cannot load DoRA adapters; export merged weights to serve this model with vLLM")
        return out


# ---------------------------------------------------------------- the live model


def export_trained(
    model: Any,
    policy_or_processor: Any,
    out_dir: str | Path,
    *,
    adapter_only: bool = False,
    dtype: str | torch.dtype | None = "auto",
    base_model_dir: str | Path | None = None,
    overwrite: bool = True,
    info: dict[str, Any] | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write `model` (a peft LoRA/DoRA model, or a fully fine-tuned transformers model) to `out_dir` as
    a Hugging Face folder and return its path; see the module docstring for what it holds.

    `policy_or_processor`: the `Policy` (its processor, else its tokenizer is saved), a processor or a
    tokenizer; None saves weights and configs only. `dtype`: "auto" = the base checkpoint's dtype
    (`base_model_dir`, else the folder the model was loaded from), a dtype name or torch dtype, None =
    as trained. An existing `out_dir` is replaced once the new folder is complete (`overwrite=False`
    refuses a non-empty one instead). `info` is added to rmsft_export.json; weights larger than
    `max_shard_bytes` are split into shards with an index. The model is left exactly as it was.
    Call it where the whole weights are visible (under ZeRO-3: inside `learner.train.updater.gathered_weights`,
    which every rank enters, with rank 0 exporting). Raises `ExportError` (unwritable path, an adapter
    export of a model without one, a bad dtype, a model the writer cannot rename)."""
    return _export(
        model,
        _saver(policy_or_processor),
        Path(out_dir),
        adapter_only=adapter_only,
        dtype=dtype,
        base_model_dir=base_model_dir,
        overwrite=overwrite,
        info=info or {},
        max_shard_bytes=max_shard_bytes,
    ).path


def _saver(policy_or_processor: Any) -> Any:
    from learner.train.policy import Policy

    if isinstance(policy_or_processor, Policy):
        return policy_or_processor.processor or policy_or_processor.tokenizer
    return policy_or_processor


def _export(
    model: Any,
    processor: Any,
    out: Path,
    *,
    adapter_only: bool,
    dtype: str | torch.dtype | None,
    base_model_dir: str | Path | None,
    overwrite: bool,
    info: dict[str, Any],
    flag: str = "overwrite=True",
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> ExportResult:
    from learner.sync.weights import is_peft_model

    peft = is_peft_model(model)
    if adapter_only and not peft:
        raise ExportError(
            "an adapter export needs a LoRA/DoRA model (training.finetune: lora); this model was "
            "fully fine-tuned: export the whole model instead (no --adapter)"
        )
    _refuse_own_inputs(
        out,
        {
            "base model": base_model_dir or getattr(_hf_model(model), "name_or_path", None),
            **{k: v for k, v in info.items() if k == "checkpoint"},
        },
    )
    wire = _resolve_dtype(dtype, model, base_model_dir, adapter_only)
    mode = "adapter" if adapter_only else ("merged" if peft else "full")
    try:
        with staged_folder(out, overwrite=overwrite, flag=flag) as tmp:
            if adapter_only:
                tensors, nbytes, dtype_str = _write_adapter(model, tmp, wire)
                info = {**info, "use_dora": bool(_peft_config(model).use_dora)}
            else:
                tensors, nbytes, dtype_str = _write_merged(model, tmp, wire, max_shard_bytes)
                if processor is not None:
                    forget_load_options(processor)
                    processor.save_pretrained(tmp)
            info = {**info, "mode": mode, "dtype": dtype_str}
            (tmp / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2, default=str) + "\n")
            files = tuple(sorted(p.name for p in tmp.iterdir()))
    except OutputFolderError as exc:
        raise ExportError(str(exc)) from None
    except ExportError:
        raise
    except OSError as exc:
        raise ExportError(
            f"cannot write the export to {out}: {exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
        ) from None
    except (ValueError, RuntimeError) as exc:  # e.g. a model whose tensors cannot be named or merged
        raise ExportError(f"cannot export the model to {out}: {type(exc).__name__}: {exc}") from exc
    return ExportResult(out, mode, dtype_str, tensors, nbytes, files, info)


def _refuse_own_inputs(out: Path, inputs: dict[str, Any]) -> None:
    """An export replaces its folder: never let that folder be what it was made from."""
    target = out.resolve()
    for what, path in inputs.items():
        if not path:
            continue
        p = Path(path).resolve()
        if target == p or target in p.parents:
            raise ExportError(f"the export folder {out} would replace the {what} ({path}); choose another folder")


def _peft_config(model: Any) -> Any:
    from learner.sync.weights import active_adapter

    return model.peft_config[active_adapter(model)]


def _hf_model(model: Any) -> Any:
    from learner.sync.weights import is_peft_model

    return model.get_base_model() if is_peft_model(model) else model


def _resolve_dtype(
    dtype: str | torch.dtype | None, model: Any, base_model_dir: str | Path | None, adapter_only: bool
) -> torch.dtype | None:
    """The torch dtype floating tensors are written in; None = as they are."""
    import torch

    from learner.sync.weights import serving_dtype

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPE_CHOICES:
        raise ExportError(f"export dtype must be one of {', '.join(_DTYPE_CHOICES)}, got {dtype!r}")
    if dtype == "auto":
        if adapter_only:
            return None  # adapters stay as trained; PEFT and vLLM cast them to the base's dtype
        base = base_model_dir or getattr(_hf_model(model), "name_or_path", None)
        if not base or not (Path(base) / "config.json").is_file():
            log.warning("export: the base model folder is unknown, so its dtype is too; writing weights as trained")
            return None
        return serving_dtype("auto", base)
    return serving_dtype(dtype)


def _dtype_of(specs: list[Any]) -> str:
    """The floating dtype that holds most of the written bytes, as a torch name ("bfloat16")."""
    from rmsft.serving_dtype import CASTABLE_DTYPES
    from rmsft.weight_wire import torch_dtype

    by: dict[str, int] = {}
    for spec in specs:
        if spec.dtype in CASTABLE_DTYPES:
            by[spec.dtype] = by.get(spec.dtype, 0) + spec.nbytes
    if not by:
        return "float32"
    return str(torch_dtype(max(by, key=by.__getitem__))).removeprefix("torch.")


def _write_merged(
    model: Any, out: Path, dtype: torch.dtype | None, max_shard_bytes: int = MAX_SHARD_BYTES
) -> tuple[int, int, str]:
    """Weights (merged, under checkpoint names, tied duplicates dropped, cast to `dtype`), config and
    generation config into `out`. Returns (tensors, bytes, dtype name)."""
    from safetensors.torch import save_file

    from learner.sync.weights import checkpoint_name_map, full_export

    hf = _hf_model(model)
    stream = full_export(model, dtype=dtype, name_map=checkpoint_name_map(model))
    names = [n for n, _ in stream.specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ExportError(f"{type(hf).__name__}: several tensors map to the same checkpoint name ({dup[:3]})")
    # Shards planned from the metadata alone, so each file's name (model-0000i-of-0000n) is known up front.
    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in stream.specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += spec.nbytes
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    file_of = {name: files[i] for i, shard in enumerate(shards) for name in shard}
    current: dict[str, Any] = {}
    current_file = files[0]
    for name, t in stream:
        if file_of[name] != current_file:
            save_file(current, out / current_file, metadata={"format": "pt"})
            current, current_file = {}, file_of[name]
        # A CPU copy: the stream's tensors are views of the live model (or of a layer merged for a moment).
        current[name] = t.detach().to("cpu", copy=True).contiguous()
    save_file(current, out / current_file, metadata={"format": "pt"})
    current.clear()
    total = stream.total_bytes
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(file_of.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    dtype_str = _dtype_of([s for _, s in stream.specs])
    # What save_pretrained writes beside the weights, from a copy: the live config stays as it is.
    config = copy.deepcopy(hf.config)
    config.dtype = dtype_str
    config.architectures = [type(hf).__name__]
    config.save_pretrained(out)
    if getattr(hf, "generation_config", None) is not None and hf.can_generate():
        hf.generation_config.save_pretrained(out)
    return len(names), total, dtype_str


def _write_adapter(model: Any, out: Path, dtype: torch.dtype | None) -> tuple[int, int, str]:
    """adapter_model.safetensors + adapter_config.json, as `PeftModel.save_pretrained` writes them for the
    active adapter (the same tensors and config ADAPTER sync sends the rollout servers)."""
    from safetensors.torch import save_file

    from learner.sync.weights import adapter_named_tensors
    from rmsft.serving_dtype import CASTABLE_DTYPES
    from rmsft.weight_wire import TensorSpec, dtype_name

    items, config_json = adapter_named_tensors(model)
    tensors = {}
    for name, t in items:
        cast = dtype is not None and dtype_name(t.dtype) in CASTABLE_DTYPES
        tensors[name] = t.detach().to("cpu", dtype=dtype if cast else t.dtype, copy=True).contiguous()
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = json.loads(config_json)
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base and Path(base).is_dir():
        # An absolute path, so AutoPeftModel finds the base from anywhere (a job's path is often relative).
        config["base_model_name_or_path"] = str(Path(base).resolve())
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    specs = [TensorSpec(dtype_name(t.dtype), tuple(t.shape)) for t in tensors.values()]
    return len(tensors), sum(s.nbytes for s in specs), _dtype_of(specs)


# ---------------------------------------------------------------- from a learner checkpoint


def resolve_checkpoint(path: str | Path) -> Path:
    """The `step-<n>` folder to export: `path` itself when it holds a checkpoint (state.pt), else the
    newest checkpoint in `path` (a training.checkpoint.dir)."""
    from learner.train.checkpoint_files import list_checkpoints

    path = Path(path)
    if (path / "state.pt").is_file():
        return path
    found = list_checkpoints(path)
    if found and (found[-1] / "state.pt").is_file():
        return found[-1]
    if not path.exists():
        raise ExportError(f"no checkpoint at {path}: no such folder")
    raise ExportError(
        f"no learner checkpoint at {path}: expected a step-<n> folder holding state.pt "
        "(<training.checkpoint.dir>/step-<n>) or a training.checkpoint.dir that holds such folders"
    )


def job_for_checkpoint(checkpoint: str | Path, config: str | Path | None = None) -> RolloutMatchingJob:
    """The job a checkpoint was trained with: `config` (a manifest YAML) when given, else the
    `run.json` the learner writes beside its checkpoints (its "job" key). JobSpecError for a bad
    manifest; ExportError when there is neither."""
    from learner.tracking.run_record import job_from_run_record
    from rmsft.jobspec import load_job

    if config is not None:
        return load_job(config)
    run = Path(checkpoint).parent / RUN_FILE
    if not run.is_file():
        raise ExportError(
            f"cannot tell which job trained {checkpoint}: there is no {RUN_FILE} in {run.parent}; pass the job "
            "manifest it was trained with: --config JOB.yaml"
        )
    try:
        return job_from_run_record(run)
    except (OSError, ValueError) as exc:
        if isinstance(exc, JobSpecError):
            raise
        raise ExportError(f"cannot read {run}: {exc}; pass the job manifest with --config JOB.yaml") from None


def export_config(cfg: TrainingConfig) -> TrainingConfig:
    """The training config with what only training needs switched off: the model is built on the CPU
    in fp32 precision (no autocast, weights in the export dtype), sdpa attention, no gradient
    checkpointing. Fine-tuning mode, LoRA settings and freezes (which decide the trainable tensors a
    checkpoint holds) stay as trained."""
    return cfg.model_copy(
        update={
            "precision": "fp32",
            "gradient_checkpointing": False,
            "attn_implementation": "sdpa",
            "device": "cpu",
            "deepspeed_stage": 0,
        }
    )


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    config: str | Path | None = None,
    adapter_only: bool = False,
    dtype: str = "auto",
    base_model: str | Path | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ExportResult:
    """`rmsft export`: the model of a learner checkpoint as a Hugging Face folder at `out_dir`.

    `checkpoint`: a `step-<n>` folder (or a checkpoint dir: its newest); `config`: the job manifest
    (default: run.json beside the checkpoint); `base_model`: the base model folder when it is not at
    spec.model.path as seen from here; `dtype`: "auto" = the base checkpoint's. Raises ExportError,
    JobSpecError or ModelLoadError with the reason."""
    say = progress or (lambda _msg: None)
    step_dir = resolve_checkpoint(checkpoint)
    job = job_for_checkpoint(step_dir, config)
    cfg = job.spec.training
    if adapter_only and cfg.finetune != "lora":
        raise ExportError(
            f"--adapter needs a LoRA/DoRA run; {step_dir} was trained with training.finetune: "
            f"{cfg.finetune}: export the whole model instead (no --adapter)"
        )
    try:
        check_output_folder(out_dir, overwrite=overwrite)  # before minutes of loading
    except OutputFolderError as exc:
        raise ExportError(str(exc)) from None
    base = Path(base_model) if base_model is not None else Path(job.spec.model.path)
    if dtype not in _DTYPE_CHOICES:
        raise ExportError(f"--dtype must be one of {', '.join(_DTYPE_CHOICES)}, got {dtype!r}")
    import torch

    from learner.train.checkpoint_files import trainable_state
    from learner.train.policy import load_policy

    say(f"reading {step_dir / 'state.pt'}")
    try:
        # mmap: only the model's tensors are read, not the optimizer state beside them.
        state = torch.load(step_dir / "state.pt", weights_only=False, mmap=True, map_location="cpu")
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        raise ExportError(f"cannot read the checkpoint {step_dir / 'state.pt'}: {exc}") from None
    weights = state.get("model") if isinstance(state, dict) else None
    if not isinstance(weights, dict) or not weights:
        raise ExportError(f"{step_dir / 'state.pt'} holds no model weights (not a learner checkpoint?)")
    # The base is read in the dtype the export is written in ("auto": its own): weights the run did not
    # train are then copied, never rounded twice, and memory is the export's size.
    kind = "DoRA" if cfg.finetune == "lora" and cfg.lora.use_dora else cfg.finetune
    say(f"loading the base model {base} ({kind})")
    try:
        policy = load_policy(base, export_config(cfg), dtype, job.spec.model.vision)
    except ValueError as exc:  # peft: e.g. training.lora.target_modules that match no module of this model
        raise ExportError(f"cannot build the model the job describes from {base}: {exc}") from None
    model = policy.model
    trainable = set(trainable_state(model))
    missing = sorted(trainable - set(weights))
    unexpected = sorted(set(weights) - set(model.state_dict()))
    if missing or unexpected:
        raise ExportError(
            f"checkpoint {step_dir} does not match the model the job builds from {base} "
            f"({len(missing)} trained tensors missing, e.g. {missing[:2]}; {len(unexpected)} unknown, e.g. "
            f"{unexpected[:2]}): was it trained with this job (training.finetune, training.lora, training.freeze)?"
        )
    try:
        model.load_state_dict({k: weights[k] for k in trainable}, strict=False)
    except RuntimeError as exc:  # shapes: another base model, or another LoRA rank
        raise ExportError(f"checkpoint {step_dir} does not fit the model built from {base}: {exc}") from None
    model.eval()
    info = {
        "source": "checkpoint",
        "checkpoint": str(step_dir.resolve()),
        "step": state.get("step"),
        "weight_version": state.get("version"),
        "base_model": str(base.resolve()),
        "job": job.metadata.name,
    }
    say(f"writing {out_dir}")
    return _export(
        model,
        policy.processor or policy.tokenizer,
        Path(out_dir),
        adapter_only=adapter_only,
        dtype=dtype,
        base_model_dir=base,
        overwrite=overwrite,
        info=info,
        flag="--overwrite",
    )
