"""The small interface every engine implements, and the request/answer types it speaks."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rmsft.model_folder import model_config
from rmsft.weight_wire import TensorSpec


class EngineError(RuntimeError):
    """The engine failed (start, generate or apply); the message says what to do about it."""


class EngineInputError(EngineError):
    """The engine refused the request itself (e.g. a prompt that expands past max_model_len once its
    images are tokenized): sending it again, anywhere, cannot help."""


class EngineDead(EngineError):
    """The engine process is gone (vLLM's EngineDeadError): every later call would fail the same way, so the
    server reports NOT_SERVING and exits for its pod to be restarted (under `rmsft local` it stays down and
    the learner fails over to the other servers)."""


@dataclass(frozen=True)
class VisionLimits:
    """What a vision-language engine accepts per prompt (None on an engine for text models)."""

    max_images_per_prompt: int
    max_image_pixels: int


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = False  # return each sampled token's log-probability
    min_tokens: int = 0  # no end-of-sequence or stop token before this many new tokens


@dataclass
class GenItem:
    prompt_token_ids: list[int]
    sampling: Sampling
    images: list = field(default_factory=list)  # PIL images (multimodal models only)
    prompt_text: str | None = None  # set when images need the engine's own multimodal processing


@dataclass
class GenOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[float] | None = None  # one per token id, when the sampling asked for them
    # (engine label, start, end): token_ids[start:end) came from the weights labelled so (`label_weights`); None
    # from an engine that does not label its weights (one version per call: the runner drains before applies).
    version_spans: list[tuple[str, int, int]] | None = None


class Engine(Protocol):
    """What the servicer drives. An engine may also offer `submit(items) -> Future[list[GenOutput]]`, safe to
    call from many threads at once, whose requests join the running batch and whose `Future.cancel()` aborts
    them (the vLLM engine does); `EngineRunner` runs a `generate`-only engine one call at a time instead. An
    engine whose process can die offers `dead_reason() -> str` ("" while alive), which the server watches.
    An engine that can update its weights under running requests (vLLM) offers `pause_keep()` / `resume()` (freeze
    them where they are, and go on) and `label_weights(label)` (the label its outputs' `version_spans` name for the
    tokens sampled from now on); `EngineRunner.call(fn, keep=True)` uses them, others are drained."""

    backend: str
    model: str
    tensor_parallel_size: int
    lora_enabled: bool
    max_lora_rank: int
    max_model_len: int
    vocab_size: int

    def generate(self, items: list[GenItem]) -> list[GenOutput]: ...

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def apply_full(self, index_path: str | None) -> None:
        """Load the staged weights described by `index_path` (None = the original checkpoint)."""

    def apply_adapter(self, adapter_dir: str, adapter_id: int, name: str) -> None:
        """Make the PEFT adapter in `adapter_dir` the one every generate uses."""

    def clear_adapter(self) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def close(self) -> None: ...


class BatchingEngine(Engine, Protocol):
    """An engine whose `submit` joins the running batch (see `Engine`)."""

    def submit(self, items: list[GenItem]) -> Future[list[GenOutput]]: ...


class InFlightEngine(BatchingEngine, Protocol):
    """A batching engine that can hold its running requests across a weight update (the vLLM engine): paused with
    their KV kept, its prefix cache reset with them running, resumed; and that labels the tokens it samples from
    now on with the weight version (rollout_svc.runner, rollout_svc.servicer)."""

    def pause_keep(self) -> None: ...

    def resume(self) -> None: ...

    def reset_prefix_cache(self, running: bool = False) -> None: ...

    def label_weights(self, label: str) -> None: ...


class TransferEngine(Engine, Protocol):
    """An engine that joins the learner's weight-transfer group (`--weight-transfer`, spec.sync.transport nccl)
    and receives FULL updates over it (rollout_svc.weight_group)."""

    def join_weight_group(self, init_info: dict[str, Any]) -> None: ...

    def receive_weights(self, update_info: dict[str, Any]) -> None: ...


class MortalEngine(Engine, Protocol):
    """An engine whose process can die (see `Engine`)."""

    def dead_reason(self) -> str: ...


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """A chat's prompt ids with the generation prompt appended, as every engine renders it (`render_chat`);
    tokenizers answer a list or a mapping with `input_ids` depending on their version."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def checkpoint_table(model_dir: str | Path) -> dict[str, TensorSpec]:
    """Names, dtypes and shapes of the tensors in a model folder's safetensors files."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {model_dir}; rmsft serves safetensors checkpoints only")
    table: dict[str, TensorSpec] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = sf.get_slice(name)
                table[name] = TensorSpec(sl.get_dtype(), tuple(int(d) for d in sl.get_shape()))
    return table


def tied_lm_head(model_dir: str | Path) -> bool:
    cfg = model_config(model_dir)
    text = cfg.get("text_config", cfg)
    return bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


# Checkpoint names of the input embedding: text models and Qwen2.5-VL, then Qwen3-VL; and of the output head.
EMBED_NAMES, HEAD_NAME = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"), "lm_head.weight"


def tied_head_alias(tied: bool, names: list[str]) -> dict[str, str]:
    """{embedding's name: the head's} when an update of `names` must feed the head again under its own name, else
    {}: vLLM's CPU backend refreshes a tied head only when `lm_head.weight` itself arrives
    (rollout_engine.worker_ext._tied_head); the servicer's transfer-group updates pass the same to the gloo engine."""
    if not tied or HEAD_NAME in names:
        return {}
    embed = next((e for e in EMBED_NAMES if e in names), None)
    return {} if embed is None else {embed: HEAD_NAME}
