"""The rollout feed: what an objective's step reads from the outside world, and the state of that exchange.

- **Prompts**: the learner's own rendering of a record's prompt (text ids, or ids with the images expanded and
  their pixels for a vision-language model), which every rollout's prompt ids are checked against.
- **Rollouts** of an E-step, handed out between ranks. Server mode: rank 0 alone talks to the pool; it takes the
  E-step's batch (generated now, or ahead of time within `max_staleness`: learner/train/overlap.py) and scatters
  each rank its contiguous share of the prompts. Colocate: every rank's engine generates its own share (seeded by
  the prompt's place in the global batch, as in server mode) and rank 0 gathers the token ids of the rest.
- **The staleness window**: which weight versions a rollout may come from (`within_window`).
- **What the engines serve**: the step whose weights they hold (`served_step`), and the batches generated ahead,
  which go into a checkpoint through `state_dict` and come back through `load_state_dict`.

An objective asks the feed for what its step needs (`learner.train.objectives`); the loop syncs the engines and
tells the feed (`synced`). Nothing here knows what a step trains on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any

from learner.core.codec import OutputFormat
from learner.core.match import MatchConfig
from learner.data.episode import rollout_request, vision_safe_response, vision_token_ids
from learner.data.images import ImageStore
from learner.data.order import DataOrder
from learner.data.records import Record
from learner.data.vision import VisionPrompt, render_prompt, resized_image_size
from learner.evaluation.held_out import EvalSetup
from learner.rollouts.client import Rollout, RolloutRequest
from learner.rollouts.interface import RolloutSource
from learner.tracking import metrics as m
from learner.train.checkpointer import TrainState
from learner.train.overlap import RolloutsAhead
from learner.train.policy import Policy, prompt_ids
from learner.train.ranks import Ranks, share_bounds
from rmsft.jobspec import TrainingConfig

__all__ = ["EXPLORER_SEED_OFFSET", "RESAMPLE_SEED_OFFSET", "RolloutFeed"]

# Explorer rollouts (recipe generation 2) are seeded apart from the anchors': a request's explorer never repeats
# another request's anchor.
EXPLORER_SEED_OFFSET = 1 << 30
# GRPO's dynamic-sampling round r (1, 2, ...) seeds its prompts r * this apart: never an anchor's or explorer's seed.
RESAMPLE_SEED_OFFSET = 1 << 40


def _versions(o: Rollout) -> list:
    """The weight versions a rollout names: its call's fence and each of its tokens' spans."""
    return [o.weights, *(w for w, _, _ in o.spans)]


class RolloutFeed:
    """Prompts, rollouts and the serving state of one learner rank (module doc). `source` is the rollout source
    (rank 0's server pool, or this rank's in-process engine; None on a rank that talks to no engine, or in a run
    without rollouts); `ahead` rank 0's prefetcher in server mode."""

    def __init__(
        self,
        *,
        cfg: TrainingConfig,
        ranks: Ranks,
        state: TrainState,
        order: DataOrder,
        records: Sequence[Record],
        images: ImageStore,
        policy: Policy,
        source: RolloutSource | None,
        ahead: RolloutsAhead | None,
    ) -> None:
        self.cfg, self.ranks, self.state, self.order = cfg, ranks, state, order
        self.records, self.images, self.policy = records, images, policy
        self.source, self.ahead = source, ahead
        # Image/video tokens a rollout may sample: its answer is cut before the first (episode.vision_safe_response).
        self.vision_token_ids = vision_token_ids(policy.tokenizer) if policy.is_vision_language else frozenset()
        self.served_step = -1  # the step whose weights the engines hold (after a sync); -1: none of this run's
        self._resumed_ahead: list[dict] = []  # rank 0: a checkpoint's batches ahead, put back by `restore_ahead`
        self._prompt_cache: dict[int, list[int]] = {}  # text models: a record's prompt ids
        self._step_prompts: dict[int, VisionPrompt] = {}  # vision-language models: this E-step's renderings

    # -- prompts ------------------------------------------------------------------------------------
    def new_e_step(self) -> None:
        """Drop the last E-step's image renderings (pixels are not kept longer than an E-step)."""
        self._step_prompts.clear()

    def vision_prompt(self, idx: int) -> VisionPrompt:
        """The learner's rendering of a record's prompt with its images (read through the image store's cache, the
        same bytes the servers got); rendered once per E-step."""
        if idx not in self._step_prompts:
            rec = self.records[idx]
            images = [img.pil() for img in self.images.load(rec)]
            self._step_prompts[idx] = render_prompt(
                self.policy.processor, [m.model_dump() for m in rec.messages], images
            )
        return self._step_prompts[idx]

    def prompt_ids(self, idx: int) -> list[int]:
        """The learner's prompt ids of a record (with its images expanded, for a vision-language model)."""
        return self.vision_prompt(idx).input_ids if self.policy.is_vision_language else self.text_prompt(idx)

    def text_prompt(self, idx: int) -> list[int]:
        """A record's prompt ids as text (its chat template), cached for the run."""
        if idx not in self._prompt_cache:
            msgs = [msg.model_dump() for msg in self.records[idx].messages]
            self._prompt_cache[idx] = prompt_ids(self.policy.tokenizer, msgs)
        return self._prompt_cache[idx]

    def trainable_responses(self, outs: Iterable[Rollout]) -> list[list[int]]:
        """The completions' token ids as they can be trained on: cut before a sampled image/video token, which
        cannot be teacher-forced (vision-language models)."""
        responses = [list(o.token_ids) for o in outs]
        if self.policy.is_vision_language:
            responses = [vision_safe_response(r, self.vision_token_ids) for r in responses]
        return responses

    def eval_setup(self, images: ImageStore, fmt: OutputFormat, matching: MatchConfig) -> EvalSetup:
        """How the model's answers to records whose images `images` holds are scored: the vocabulary, the output
        format (bound to each image's resized size when it measures in resized pixels) and the matcher."""
        size = None
        if fmt.needs_image_size:

            def size(rec: Record) -> tuple[int, int] | None:
                imgs = images.load(rec)
                return resized_image_size(self.policy.processor, imgs[0].pil()) if imgs else None

        return EvalSetup(
            vocab=self.policy.vocab, fmt=fmt, matching=matching, vision_ids=self.vision_token_ids, image_size=size
        )

    # -- rollouts -----------------------------------------------------------------------------------
    def rollouts(
        self,
        k: int,
        sampling: object,
        *,
        n: int = 1,
        upcoming: Iterable[int] = (),
        seed_offset: int = 0,
        gather: bool = True,
    ) -> tuple[list[Rollout], list[Rollout] | None]:
        """E-step `k`'s completions of this rank's share of its batch (n per prompt, prompt by prompt) and, on rank 0,
        the whole batch's (None elsewhere). Server mode: rank 0 takes them from the pool, generated now or ahead of
        time (overlap.py); `upcoming` names the later E-steps that sample, of which the first `max_staleness` are
        submitted to generate while this one trains. Colocate: every rank's engine generates its own share and rank 0
        gathers the rest for its records (token ids only; `gather=False`: not gathered, None on every rank).
        `seed_offset` seeds a second call apart from the first (explorers); such a call is made now, never ahead."""
        ranks, what = self.ranks, "explorer rollouts" if seed_offset else "rollouts"
        if self.source is not None and self.source.per_rank:
            lo, hi = ranks.share(self.cfg.prompts_per_step)
            with ranks.guard(f"generating {what} (in-process engine)"):
                mine = self.source.generate(
                    self.requests(k, lo, hi, seed_offset), sampling, weight_version=self.state.version
                )
            if not gather:
                return mine, None
            parts = ranks.gather_to_main(mine)
            return mine, [o for part in parts for o in part] if parts is not None else None
        everything = None
        with ranks.guard(f"generating {what} (rank 0)"):
            if ranks.is_main:
                if seed_offset or self.ahead is None:
                    assert self.source is not None, "server mode: the pool's client is the source"
                    everything = self.source.generate(
                        self.requests(k, seed_offset=seed_offset), sampling, weight_version=self.state.version
                    )
                else:
                    everything = self._take(k, sampling, upcoming)
        return self.scatter(everything, self.cfg.prompts_per_step, n), everything

    def resample(self, k: int, positions: Sequence[int], sampling: object, *, seed_offset: int) -> list[Rollout]:
        """Fresh completions (the `n` of `sampling` per prompt, prompt by prompt) of the prompts at `positions` of
        E-step `k`'s batch (global places, this rank's own), generated now from the current weights and seeded
        `seed_offset` apart. Collective in server mode: every rank calls it (with no position, if it has none);
        rank 0 asks the pool for every rank's prompts at once and hands each rank its own."""
        ranks = self.ranks
        if self.source is not None and self.source.per_rank:
            with ranks.guard("resampling flat groups (in-process engine)"):
                if not positions:
                    return []
                reqs = [self.requests(k, p, p + 1, seed_offset)[0] for p in positions]
                return self.source.generate(reqs, sampling, weight_version=self.state.version)
        asked = ranks.gather_to_main(list(positions))
        shares = None
        with ranks.guard("resampling flat groups (rank 0)"):
            if ranks.is_main:
                assert asked is not None, "rank 0 gathers every rank's positions"
                flat = [p for part in asked for p in part]
                outs: list[Rollout] = []
                if flat:
                    assert self.source is not None, "server mode: the pool's client is the source"
                    reqs = [self.requests(k, p, p + 1, seed_offset)[0] for p in flat]
                    outs = self.source.generate(reqs, sampling, weight_version=self.state.version)
                n = len(outs) // max(len(flat), 1)
                shares, at = [], 0
                for part in asked:
                    shares.append(outs[at * n : (at + len(part)) * n])
                    at += len(part)
        return ranks.scatter_from_main(shares)

    def scatter(self, everything: list[Rollout] | None, prompts: int, n: int = 1) -> list[Rollout]:
        """Rank 0 hands each rank the completions of its contiguous share of the prompts (token-id lists)."""
        ranks = self.ranks
        if not ranks.enabled:
            assert everything is not None, "one process: it is rank 0, which has the whole batch"
            return everything
        shares = None
        if ranks.is_main:
            assert everything is not None, "rank 0 has the whole batch"
            bounds = [share_bounds(prompts, ranks.world_size, r) for r in range(ranks.world_size)]
            shares = [everything[lo * n : hi * n] for lo, hi in bounds]
        return ranks.scatter_from_main(shares)

    def requests(self, k: int, lo: int = 0, hi: int | None = None, seed_offset: int = 0) -> list[RolloutRequest]:
        """E-step `k`'s requests (prompts lo..hi of its batch), each with its own seed, from the prompt's place in
        the global batch (the same whenever and wherever they are made: a regenerated batch reproduces)."""
        base = self.cfg.rollout.seed + seed_offset + k * self.cfg.prompts_per_step
        batch = self.order.batch(k)
        # Messages (+ image bytes): the engine renders the prompt with its own processor and returns the ids it
        # used, which the objective checks against the learner's rendering.
        recs = [self.records[i] for i in batch]
        return [
            rollout_request(recs[j], [img.data for img in self.images.load(recs[j])], seed=base + j)
            for j in range(lo, len(recs) if hi is None else hi)
        ]

    def _take(self, k: int, sampling: object, upcoming: Iterable[int]) -> list[Rollout]:
        """Rank 0 (server mode): E-step `k`'s rollouts, then the next sampling E-steps (up to max_staleness) submitted
        to generate while this one trains. The client fences each call to the version it was made with;
        `within_window` is what the learner accepts."""
        st, ahead = self.state, self.ahead
        assert ahead is not None, "rollouts() takes from the ahead queue only when there is one"
        taken = ahead.take(k, self.requests(k), sampling, st.version)
        spanning = sum(len({w for w, _, _ in o.spans}) > 1 for o in taken.rollouts)
        if spanning:
            m.SPANNING_ROLLOUTS.inc(spanning)
        for j in islice(upcoming, ahead.max_staleness):
            ahead.submit(j, self.requests(j), sampling, st.version)
        return taken.rollouts

    def within_window(self, outs: Sequence[Rollout]) -> bool:
        """Every rollout is from a weight version the learner may train on: its current one (max_staleness 0,
        exactly), or this run's, at most max_staleness versions behind. A rollout whose tokens span versions (an
        in-flight update, `rollout.inflight`) is counted by its oldest tokens' version: every span, and the
        version its call was fenced to, must be within the window. A batch put back from a checkpoint carries the
        version of the run that generated it (one the resumed run descends from): rank 0 checked its lag when it
        took it."""
        st, window = self.state, self.cfg.rollout.max_staleness
        if not window:
            return all(w == st.weights for o in outs for w in _versions(o))
        restored = set(st.resumed.run_ids) if st.resumed is not None else set()
        return all(
            (w.run_id == st.run_id and 0 <= st.version - w.number <= window) or w.run_id in restored
            for o in outs
            for w in _versions(o)
        )

    # -- what the engines serve ---------------------------------------------------------------------
    def served_version(self) -> int:
        """The version number that serves the model's current weights: the last synced one, or the next when the
        weights moved since (a batch ahead keeps its lag behind these weights across a checkpoint or a re-sync)."""
        return self.state.version + (self.served_step != self.state.step)

    def before_sync(self) -> None:
        """No Generate call in flight across a weight update, including one whose batch was abandoned
        (learner/train/overlap.py); with `rollout.inflight` the servers pause those calls instead, so nothing is
        waited for here."""
        if self.ahead is not None and self.ahead.pending() and not self.cfg.rollout.inflight:
            self.ahead.drain()

    def synced(self) -> None:
        """The engines confirmed the weights of `state.step` as `state.version`."""
        self.served_step = self.state.step
        if self.ahead is not None:
            self.ahead.synced()

    def hold_ahead(self) -> list[dict]:
        """Before the first sync of a `run()`: batches ahead (of a checkpoint, or of this process's previous run()
        call) keep their lag behind the weights across that sync, which announces the same weights under a new
        number. A batch still generating is kept too (`saved` takes complete ones)."""
        if self.ahead is None:
            return []
        self.ahead.drain()
        return self.ahead.saved(self.served_version())

    def restore_ahead(self, held: list[dict]) -> None:
        """After that sync: the held batches (or the checkpoint's) back in the prefetcher."""
        if self.ahead is not None:
            self.ahead.restore(held or self._resumed_ahead, self.state.version)
        self._resumed_ahead = []

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the feed: rank 0's rollouts generated ahead (overlap.py)."""
        return {"rollouts_ahead": self.ahead.saved(self.served_version())} if self.ahead is not None else {}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A checkpoint's feed: the engines hold none of its weights under this run's id; its batches ahead are
        put back at the first sync."""
        self.served_step = -1
        self._resumed_ahead = list(saved.get("rollouts_ahead", []))
