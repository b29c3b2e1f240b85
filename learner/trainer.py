"""The learner's training loop: rollouts -> segments -> packed rows -> optimizer step -> weight sync.

One optimizer step = `grad_accumulation` packed rows (micro-steps). With the rollout buffer on, an
E-step (rollouts + targets + packing) feeds `m_steps` optimizer steps; weights are synced only
before fresh rollouts (and once before the first), never per micro-step.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from learner import metrics as m
from learner.checkpoint import load_latest, rng_state, save_checkpoint, set_rng_state, trainable_state
from learner.core.losses import LossSums, LossWeights, loss_sums
from learner.core.match import MatchConfig
from learner.core.packing import PackedRow, Packer
from learner.core.rollout_buffer import RolloutBuffer
from learner.data import Record, load_records
from learner.episode import EpisodeStats, build_segments
from learner.model import Policy, load_policy, prompt_ids
from learner.rollout_client import Rollout, RolloutClient, RolloutRequest
from learner.servers import ServerPool
from learner.sync_client import WeightSyncClient
from rmsft.jobspec import RolloutMatchingJob

log = logging.getLogger("rmsft.learner")


@dataclass
class StepResult:
    step: int  # 1-based optimizer step just finished
    weight_version: int  # version the step's rollouts came from
    rollouts: list[Rollout]  # this step's fresh rollouts, in input order (empty on M-steps)
    record_ids: list[str]  # raw batch this step trained on
    loss: float
    parts: dict[str, float]
    stats: EpisodeStats | None  # None on M-steps that reuse a built batch
    rows: int
    fill: float
    seconds: float


@dataclass
class Summary:
    steps: int
    first_loss: float
    last_loss: float
    losses: list[float]
    f1: list[float]
    weight_version: int
    phase_seconds: dict[str, float]
    wall_seconds: float
    retries: int = 0
    history: list[StepResult] = field(default_factory=list)


@dataclass
class _Built:
    rows: list[PackedRow]
    stats: EpisodeStats
    rollouts: list[Rollout]


class DataOrder:
    """Raw batch k (across epochs) is a pure function of (seed, k): resume needs only k."""

    def __init__(self, n_records: int, batch_size: int, seed: int) -> None:
        if batch_size > n_records:
            raise ValueError(f"prompts_per_step ({batch_size}) exceeds the dataset size ({n_records})")
        self.n, self.bs, self.seed = n_records, batch_size, seed
        self.per_epoch = n_records // batch_size  # the tail of an epoch is dropped, reshuffled next epoch
        self._cache: tuple[int, tuple[int, ...]] | None = None

    def batch(self, k: int) -> tuple[int, ...]:
        if self._cache and self._cache[0] == k:
            return self._cache[1]  # same object: RolloutBuffer checks identity across M-steps
        epoch, i = divmod(k, self.per_epoch)
        order = list(range(self.n))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        out = tuple(order[i * self.bs : (i + 1) * self.bs])
        self._cache = (k, out)
        return out


class Trainer:
    def __init__(
        self,
        job: RolloutMatchingJob,
        addresses: Sequence[str],
        *,
        auth_token: str | None = None,
        model_path: str | Path | None = None,
        on_step: Callable[[StepResult], None] | None = None,
    ) -> None:
        self.job = job
        self.cfg = job.spec.training
        self.on_step = on_step
        self.records: list[Record] = load_records(self.cfg.data.path)
        torch.manual_seed(self.cfg.seed)
        random.seed(self.cfg.seed)
        self.policy: Policy = load_policy(model_path or job.spec.model.path, self.cfg, job.spec.model.dtype)
        self.model = self.policy.model
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.params = params
        self.order = DataOrder(len(self.records), self.cfg.prompts_per_step, self.cfg.seed)
        self.packer = Packer(self.cfg.packing_length, self.cfg.packing_buffer, self.cfg.packing_min_fill)
        self.buffer: RolloutBuffer = RolloutBuffer(self.cfg.buffer.m_steps if self.cfg.buffer.enabled else 1)
        self.weights = LossWeights(
            ce=self.cfg.loss.ce, soft_ce=self.cfg.loss.coord_soft_ce, w1=self.cfg.loss.coord_w1,
            gate=self.cfg.loss.coord_gate, sigma=self.cfg.loss.coord_sigma,
        )  # fmt: skip
        self.matching = MatchConfig(
            iou_gate=self.cfg.matching.iou_gate, fp_cost=self.cfg.matching.fp_cost, fn_cost=self.cfg.matching.fn_cost
        )
        dec = self.cfg.rollout
        self.sampling = {
            "max_tokens": dec.max_tokens, "temperature": dec.temperature, "top_p": dec.top_p,
            "top_k": dec.top_k, "repetition_penalty": dec.repetition_penalty,
        }  # fmt: skip
        self.pool = ServerPool(list(addresses), auth_token=auth_token)
        sync = job.spec.sync
        self.sync_client = WeightSyncClient(
            self.pool, self.model, mode=sync.mode, fallback_to_full=sync.fallback_to_full,
            frame_bytes=sync.frame_bytes, timeout_s=sync.timeout_seconds,
        )  # fmt: skip
        self.rollouts = RolloutClient(
            self.pool, timeout_s=dec.request_timeout_s, generate_batch_size=dec.generate_batch_size,
            resync=self.sync_client.resync_server,
        )  # fmt: skip
        self.step = 0
        self.version = 0
        self.phase_seconds: dict[str, float] = {}
        self.history: list[StepResult] = []
        self._prompt_cache: dict[int, list[int]] = {}
        self._retries_at_start = _counter_total(m.ROLLOUT_RETRIES)

    # -- helpers ------------------------------------------------------------------------------
    @contextmanager
    def _phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._add_phase(name, time.perf_counter() - t0)

    def _add_phase(self, name: str, seconds: float) -> None:
        m.PHASE_SECONDS.labels(name).observe(seconds)
        self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds

    def _prompt(self, idx: int) -> list[int]:
        if idx not in self._prompt_cache:
            msgs = [msg.model_dump() for msg in self.records[idx].messages]
            self._prompt_cache[idx] = prompt_ids(self.policy.tokenizer, msgs)
        return self._prompt_cache[idx]

    def _sync(self) -> None:
        self.version += 1
        with self._phase("sync"):
            self.sync_client.sync(self.version)  # counts bytes and sets the version gauge itself

    # -- E-step -------------------------------------------------------------------------------
    def _e_step(self, batch: tuple[int, ...]) -> _Built:
        k = self.step // self.buffer.m_steps
        base = self.cfg.rollout.seed + k * self.cfg.prompts_per_step
        requests = [
            RolloutRequest(token_ids=self._prompt(idx), seed=base + j, request_id=self.records[idx].id)
            for j, idx in enumerate(batch)
        ]
        with self._phase("rollout"):
            outs = self.rollouts.generate(requests, self.sampling, weight_version=self.version)
        versions = {o.weight_version for o in outs}
        if versions - {self.version}:  # the client fences too; never train on stale data
            raise RuntimeError(f"rollouts from weight versions {sorted(versions)}, learner at {self.version}")
        recs = [self.records[i] for i in batch]
        segments, stats = build_segments(
            recs, [r.token_ids for r in requests], [o.prompt_token_ids for o in outs],
            [o.token_ids for o in outs], self.policy.vocab, self.matching,
        )  # fmt: skip
        self._add_phase("parse", stats.parse_s)
        self._add_phase("match", stats.match_s)
        self._add_phase("targets", stats.targets_s)
        with self._phase("pack"):
            self.packer.add(segments)
            rows = []
            for _ in range(self.cfg.grad_accumulation):
                row = self.packer.next_row()
                if row is None:
                    break
                rows.append(row)
        m.OBJECTS.labels("matched").inc(stats.matched)
        m.OBJECTS.labels("fp").inc(stats.false_positives)
        m.OBJECTS.labels("fn").inc(stats.false_negatives)
        m.DROPPED_OBJECTS.inc(stats.dropped)
        m.TRUNCATED_ROLLOUTS.inc(stats.truncated)
        m.BUFFER_SEGMENTS.set(self.packer.pending)
        return _Built(rows, stats, outs)

    # -- M-step -------------------------------------------------------------------------------
    def _train_rows(self, rows: list[PackedRow]) -> tuple[float, dict[str, float]]:
        """Forward/backward each row, scaled so the step's loss is the token-level mean over all
        rows (same as one big packed row), then one optimizer step."""
        ce_total = sum(int((r.labels != -100).sum()) for r in rows)
        coord_total = sum(int(r.coord_positions.numel()) for r in rows)
        coord_ids = self.policy.vocab.coord_token_ids
        total_loss, parts_acc = 0.0, {}
        self.optimizer.zero_grad(set_to_none=True)
        for row in rows:
            with self._phase("forward"):
                logits = self.model(**row.model_inputs()).logits
                s = loss_sums(logits, row, coord_ids, self.weights.sigma)
                # Normalise by the step's totals: summing rows' losses gives the pooled mean.
                out = LossSums(s.ce_sum, ce_total, s.soft_ce_sum, s.w1_sum, s.gate_sum, coord_total).finish(
                    self.weights
                )
            with self._phase("backward"):
                out.loss.backward()
            total_loss += float(out.loss.detach())
            for k, v in out.parts.items():
                if not k.endswith("_count"):
                    parts_acc[k] = parts_acc.get(k, 0.0) + float(v)
            m.TRAINED_TOKENS.inc(row.length)
        with self._phase("optimizer"):
            warm = self.cfg.warmup_steps
            lr = self.cfg.lr * min(1.0, (self.step + 1) / warm) if warm else self.cfg.lr
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
            self.optimizer.step()
        return total_loss, parts_acc

    # -- checkpoint -----------------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "step": self.step, "version": self.version, "model": trainable_state(self.model),
            "optimizer": self.optimizer.state_dict(), "rng": rng_state(),
            "packer": list(self.packer._buf), "phase_seconds": dict(self.phase_seconds),
        }  # fmt: skip

    def save(self) -> Path:
        ck = self.cfg.checkpoint
        return save_checkpoint(ck.dir, self.step, self.state(), keep=ck.keep)

    def resume(self) -> bool:
        """Load the newest checkpoint in training.checkpoint.dir; False when there is none."""
        state = load_latest(self.cfg.checkpoint.dir)
        if state is None:
            return False
        missing = set(trainable_state(self.model)) - set(state["model"])
        if missing:
            raise RuntimeError(f"checkpoint does not match the model: {len(missing)} trainable tensors missing")
        self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        self.packer._buf = list(state["packer"])
        self.step, self.version = state["step"], state["version"]
        self.phase_seconds = dict(state["phase_seconds"])
        log.info("resumed from step %d (weight version %d)", self.step, self.version)
        return True

    # -- loop -----------------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> Summary:
        """Train until training.steps (or `max_steps` more steps); returns the summary."""
        t_start = time.perf_counter()
        target = self.cfg.steps if max_steps is None else min(self.cfg.steps, self.step + max_steps)
        log.info(
            "rmsft learner: %d record(s), servers %s, sync %s, seed %d, steps %d -> %d",
            len(self.records), [s.address for s in self.pool.servers], self.job.spec.sync.mode,
            self.cfg.seed, self.step, target,
        )  # fmt: skip
        self.pool.wait_ready(timeout_s=self.cfg.rollout.request_timeout_s)
        self._sync()  # once before the first rollout, and again on resume
        ck_every = self.cfg.checkpoint.every
        while self.step < target:
            t0 = time.perf_counter()
            batch = self.order.batch(self.step // self.buffer.m_steps)
            fresh = self.buffer.uses_left == 0
            built: _Built = self.buffer.get(batch, self._e_step)
            if not built.rows:
                raise RuntimeError("packer produced no row for this step (empty rollouts and carry buffer)")
            loss, parts = self._train_rows(built.rows)
            self.step += 1
            result = StepResult(
                step=self.step, weight_version=self.version, rollouts=built.rollouts if fresh else [],
                record_ids=[self.records[i].id for i in batch], loss=loss, parts=parts,
                stats=built.stats if fresh else None, rows=len(built.rows),
                fill=sum(r.fill for r in built.rows) / len(built.rows), seconds=time.perf_counter() - t0,
            )  # fmt: skip
            self.history.append(result)
            self._publish(result)
            if self.step < target and self.buffer.uses_left == 0:
                self._sync()  # the next step starts with fresh rollouts
            if ck_every and self.step % ck_every == 0:
                self.save()
        if ck_every == 0 or self.step % ck_every:
            self.save()
        return self.summary(time.perf_counter() - t_start)

    def _publish(self, r: StepResult) -> None:
        m.GLOBAL_STEP.set(r.step)
        m.STEP_SECONDS.observe(r.seconds)
        m.PACKING_FILL.set(r.fill)
        m.LOSS.labels("total").set(r.loss)
        for k, v in r.parts.items():
            m.LOSS.labels(k).set(v)
        f1 = f"{r.stats.f1:.3f}" if r.stats else "reuse"
        log.info(
            "step %d v%d loss %.4f (ce %.4f coord %.4f) f1 %s rows %d fill %.3f %.2fs",
            r.step, r.weight_version, r.loss, r.parts.get("ce", 0.0), r.parts.get("coord", 0.0), f1,
            r.rows, r.fill, r.seconds,
        )  # fmt: skip
        if self.on_step:
            self.on_step(r)

    def summary(self, wall: float) -> Summary:
        losses = [h.loss for h in self.history]
        return Summary(
            steps=self.step, first_loss=losses[0] if losses else float("nan"),
            last_loss=losses[-1] if losses else float("nan"), losses=losses,
            f1=[h.stats.f1 for h in self.history if h.stats], weight_version=self.version,
            phase_seconds=dict(self.phase_seconds), wall_seconds=wall,
            retries=int(_counter_total(m.ROLLOUT_RETRIES) - self._retries_at_start), history=list(self.history),
        )  # fmt: skip

    def close(self) -> None:
        self.rollouts.close()
        self.sync_client.close()
        self.pool.close()


def _counter_total(counter) -> float:
    return sum(s.value for mf in counter.collect() for s in mf.samples if s.name.endswith("_total"))
