"""`ColocatedRollouts`: the rollout source of spec.rollout.mode colocate (see the package doc).

Requests take the rollout server's own path: the learner's `RolloutRequest`s become the same GenerateRequest
proto a server receives, `rollout_engine.prompts.build_items` renders them with the engine's tokenizer/processor
and derives the per-sample seeds, and the engine answers GenItems. So a colocate run and a server run of one job
render the same prompt ids, sample with the same seeds and give the same greedy rollouts.

Version fencing holds as with servers: the source knows which weight version its engine holds (set only after a
sync completed), refuses to generate for another one, and stamps every completion with it.

Around each generation: the optimizer state and/or parameters go to host memory (`around_generation`, the
trainer's offload context), and with a sleep level the engine wakes before and sleeps after. A level-2 sleep
discards the engine's weights: on wake-up this source writes the learner's current weights back itself
(never a reload from disk, which would silently serve the checkpoint's weights).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from rmsft_protos import rollout_pb2

from learner.rollouts.colocate.groups import TpGroup
from learner.rollouts.interface import SourceInfo
from learner.rollouts.requests import (
    Rollout,
    RolloutError,
    RolloutRequest,
    StaleRolloutError,
    sampling_params,
    to_prompt_proto,
)
from learner.sync.weights import checkpoint_name_map, full_export, serving_dtype
from learner.tracking import metrics as m
from rmsft.jobspec import RolloutMatchingJob
from rmsft.serve_options import serve_options
from rmsft.weight_wire import WeightVersion
from rollout_engine import metrics as engine_metrics
from rollout_engine.engine import EngineError
from rollout_engine.prompts import PromptError, build_items, samples_per_prompt

log = logging.getLogger("rmsft.learner.colocate")


class ColocateError(RuntimeError):
    """The in-process engine failed (start, generate, weights, sleep): the run stops with the cause. Nothing falls
    back to another engine by itself; spec.rollout.engine: hf is the explicit alternative."""


class ColocatedRollouts:
    """The engine in this learner rank. `engine`: an `InProcessVllm` or an `HfEngine` around the training model
    (then the engine IS the model: a sync has nothing to move). `model`: the training model, whose weights
    `sync` writes into a vLLM engine (LoRA/DoRA merged, layer by layer, renamed by `name_map`, cast to
    `dtype`; `changed_only`: only what training can change). `group`: this rank's TP group."""

    per_rank = True

    def __init__(
        self,
        engine: Any,
        model: Any,
        *,
        run_id: str,
        group: TpGroup,
        rank: int = 0,
        generate_batch_size: int = 0,
        sleep_level: int = 0,
        dtype: Any = None,
        name_map: Callable[[str], str] | None = None,
        changed_only: bool = False,
        around_generation: Callable[[], AbstractContextManager] | None = None,
    ) -> None:
        self.engine, self.model, self.run_id, self.group = engine, model, run_id, group
        self.generate_batch_size = generate_batch_size
        self.sleep_level = sleep_level
        self.dtype, self.name_map, self.changed_only = dtype, name_map, changed_only
        self.around_generation = around_generation
        self.name = f"in-process (rank {rank})"
        self.shares_model = getattr(engine, "backend", "") == "hf"  # the HF engine decodes with the model itself
        self.weights: WeightVersion | None = None  # what the engine holds; set once a sync completed
        self._asleep = False
        if sleep_level:
            self._sleep()  # nothing generates until the first step: give the memory to training now

    # -- the rollout interface ------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> None:  # in-process: ready once constructed
        if self.engine is None:
            raise ColocateError("the in-process rollout engine was closed")

    def describe(self) -> SourceInfo:
        return SourceInfo("colocate", (), "full" if not self.shares_model else "shared", "in-process")

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        sampling: Mapping[str, Any] | Any,
        *,
        weight_version: int | None = None,
    ) -> list[Rollout]:
        sp = sampling_params(sampling)
        if weight_version is not None:
            want = WeightVersion(self.run_id, weight_version)
            if self.weights != want:
                raise StaleRolloutError(
                    f"the in-process engine holds weight version "
                    f"{self.weights.describe() if self.weights else 'none'}, not "
                    f"{want.describe()}: sync first"
                )
        group_requests, (lo, hi) = self.group.gather(list(requests))
        n = samples_per_prompt(sp)
        step = self.generate_batch_size or max(1, len(group_requests))
        out: list[Rollout] = []
        t0 = time.perf_counter()
        with self._generating():
            for start in range(0, len(group_requests), step):
                out.extend(self._call(group_requests[start : start + step], sp, n))
        m.PHASE_SECONDS.labels("generate").observe(time.perf_counter() - t0)
        m.ROLLOUT_REQUESTS.inc(hi - lo)
        return out[lo * n : hi * n]

    def sync(self, number: int) -> None:
        """The learner's current weights into the engine, as version `number`. vLLM: every tensor straight from the
        training model (merged, cast, renamed), loaded in place; prefix and encoder caches reset. Asleep: the engine
        wakes for the push and sleeps again, so the weights always go in here, where the training loop calls it: inside
        its ZeRO-3 gather (whole parameters) and outside the offload context (parameters on the device)."""
        t0 = time.perf_counter()
        if not self.shares_model:
            if self._asleep:
                self._wake()
                try:
                    self._push()
                finally:
                    self._sleep()
            else:
                self._push()
        self.weights = WeightVersion(self.run_id, number)
        m.WEIGHT_VERSION.set(number)
        engine_metrics.WEIGHT_SYNC_SECONDS.labels("in-process").observe(time.perf_counter() - t0)

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    # -- inside -------------------------------------------------------------------------------------
    def _push(self) -> None:
        export = full_export(self.model, dtype=self.dtype, name_map=self.name_map, changed_only=self.changed_only)
        try:
            loaded = self.engine.load_weights(iter(export), [name for name, _ in export.specs])
        except EngineError as e:
            raise ColocateError(str(e)) from e
        m.WEIGHT_SYNC_BYTES.labels("in-process").inc(export.total_bytes)
        log.debug("%d tensor(s), %d bytes written into the in-process engine", loaded, export.total_bytes)

    def _call(self, requests: list[RolloutRequest], sp: rollout_pb2.SamplingParams, n: int) -> list[Rollout]:
        if not requests:
            return []
        proto = rollout_pb2.GenerateRequest(prompts=[to_prompt_proto(r) for r in requests], sampling=sp)
        try:
            items = build_items(proto, self.engine)
        except PromptError as e:  # the request itself is wrong: say which
            raise RolloutError(f"the in-process engine refused a prompt: {e}") from e
        t0 = time.perf_counter()
        was_training = self.shares_model and self.model.training
        if was_training:
            self.model.eval()  # no dropout while the training model itself decodes
        try:
            outs = self.engine.generate(items)
        except EngineError as e:
            raise ColocateError(f"the in-process rollout engine failed: {e}") from e
        finally:
            if was_training:
                self.model.train()
        # The rollout servers' own metrics, from the learner's /metrics: the dashboards' rollout row reads the same
        # names in both modes (prompts, images, tokens, generate time).
        engine_metrics.PROMPTS.inc(len(requests))
        engine_metrics.IMAGES.inc(sum(len(r.images) for r in requests))
        engine_metrics.PROMPT_TOKENS.inc(sum(len(o.prompt_token_ids) for k, o in enumerate(outs) if k % n == 0))
        engine_metrics.GENERATED_TOKENS.inc(sum(len(o.token_ids) for o in outs))
        engine_metrics.GENERATE_SECONDS.observe(time.perf_counter() - t0)
        version = self.weights.number if self.weights else 0
        run = self.weights.run_id if self.weights else ""
        return [
            Rollout(
                requests[k // n].request_id,
                o.prompt_token_ids,
                o.token_ids,
                o.finish_reason,
                version,
                self.name,
                sample_index=k % n,
                logprobs=o.logprobs,
                weight_run_id=run,
            )
            for k, o in enumerate(outs)
        ]

    @contextlib.contextmanager
    def _generating(self):
        """The engine awake with the current weights (a level-2 sleep discarded them: written back now, while the
        training parameters are still on the device), then the training state off the device (offload) while it
        decodes, then back, then asleep again."""
        if self.sleep_level:
            self._wake()
            if self.sleep_level == 2:
                self._push()
        try:
            with self.around_generation() if self.around_generation else contextlib.nullcontext():
                yield
        finally:
            if self.sleep_level:
                self._sleep()

    def _sleep(self) -> None:
        try:
            self.engine.sleep(self.sleep_level)
        except Exception as e:  # any failure here ends the run, with its cause
            raise ColocateError(f"the in-process engine could not sleep (level {self.sleep_level}): {e}") from e
        self._asleep = True

    def _wake(self) -> None:
        try:
            self.engine.wake_up()
        except Exception as e:
            raise ColocateError(f"the in-process engine could not wake up: {e}") from e
        self._asleep = False


def colocated_rollouts(
    job: RolloutMatchingJob,
    model: Any,
    tokenizer: Any,
    *,
    run_id: str,
    world_size: int,
    rank: int,
    model_dir: str | Path,
    vision_language: bool,
    around_generation: Callable[[], AbstractContextManager] | None = None,
) -> ColocatedRollouts:
    """This rank's in-process engine for a colocate job: vLLM with the servers' engine settings (or the HF
    engine around the training model itself, when spec.rollout.engine is hf)."""
    import torch

    from learner.rollouts.colocate.engine import InProcessVllm
    from rollout_engine.config import ServeConfig
    from rollout_engine.hf_engine import HfEngine

    r, c = job.spec.rollout, job.spec.rollout.colocate
    on_gpu = torch.cuda.is_available()
    if c.sleep_level and not _sleep_mode_available():
        raise ColocateError(
            f"spec.rollout.colocate.sleepLevel {c.sleep_level} needs vLLM's sleep mode, which this "
            "machine's vLLM platform does not have (CUDA only; the CPU backend would ignore it)"
        )
    group = TpGroup(world_size, rank, c.tensor_parallel_size)
    opts = serve_options(job, gpus=on_gpu)
    try:
        engine: HfEngine | InProcessVllm
        if r.engine == "hf":
            engine = HfEngine.around(
                model,
                tokenizer,
                max_model_len=r.max_model_len,
                logprobs_mode=opts["logprobs_mode"],
                name=str(model_dir),
            )
        else:
            known = set(ServeConfig.__dataclass_fields__)
            cfg = ServeConfig(**{k: v for k, v in opts.items() if k in known}, model=str(model_dir))
            cfg.tensor_parallel_size = c.tensor_parallel_size
            cfg.gpu_memory_utilization = c.gpu_memory_utilization if on_gpu else None
            cfg.kv_cache_bytes = c.kv_cache_bytes or 0
            engine = InProcessVllm(cfg, external_launcher=on_gpu and world_size > 1, sleep_mode=c.sleep_level > 0)
    except EngineError as e:
        raise ColocateError(str(e)) from e
    log.info("in-process rollout engine (%s) on rank %d, TP group %s", r.engine, rank, group.members)
    return ColocatedRollouts(
        engine,
        model,
        run_id=run_id,
        group=group,
        rank=rank,
        generate_batch_size=c.generate_batch_size,
        sleep_level=c.sleep_level,
        dtype=serving_dtype(job.spec.model.dtype, model_dir),
        name_map=checkpoint_name_map(model) if vision_language else None,
        changed_only=vision_language,
        around_generation=around_generation,
    )


def _sleep_mode_available() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_sleep_mode_available())
