"""Where an E-step's rollouts come from and who gets which: the hand-out between ranks, the channel schedule and
the staleness window. A mixin of the training loop (`learner.train.loop.TrainingLoop`, so of every objective): its
methods read the loop's `ranks`, `rollouts` (the rollout source), `ahead` (rank 0's prefetcher), `cfg`, `core`,
`state`, `order`, `records`, `images`, `policy` and `vision_token_ids`; it holds no state of its own.

- Server mode: rank 0 alone talks to the pool; it takes the E-step's batch (generated now, or ahead of time within
  `max_staleness`: learner/train/overlap.py) and scatters each rank its contiguous share of the prompts.
- Colocate: every rank's engine generates its own share (seeded by the prompt's place in the global batch, as in
  server mode) and rank 0 gathers the token ids of the rest for its records.
- Recipe generation 2: only channel-B E-steps sample (`_e_step_samples`), with explorer rollouts beside the anchors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from learner.data.episode import rollout_request, vision_safe_response
from learner.rollouts.client import Rollout, RolloutRequest
from learner.train.ranks import share_bounds

# Explorer rollouts (recipe generation 2) are seeded apart from the anchors': a request's explorer never repeats
# another request's anchor.
EXPLORER_SEED_OFFSET = 1 << 30


class RolloutHandout:
    """The loop's rollout hand-out (module doc); mixed into `TrainingLoop`."""

    ranks: Any
    rollouts: Any
    ahead: Any
    cfg: Any
    core: Any
    state: Any
    order: Any
    records: Any
    images: Any
    policy: Any
    vision_token_ids: frozenset[int]

    def _rollouts_for(self, k: int, sampling: object, *, n: int = 1) -> tuple[list[Rollout], list[Rollout] | None]:
        """E-step `k`'s completions of this rank's share of its batch (n per prompt, prompt by prompt) and, on
        rank 0, the whole batch's (None elsewhere). Server mode: rank 0 takes them from the pool (generated now,
        or ahead of time within max_staleness: overlap.py) and hands each rank its share. Colocate: every rank's
        engine generates its own share (seeded by the prompt's place in the global batch, as in server mode) and
        rank 0 gathers the rest for its records (token ids only)."""
        ranks = self.ranks
        if self.rollouts is not None and self.rollouts.per_rank:
            lo, hi = ranks.share(self.cfg.prompts_per_step)
            with ranks.guard("generating rollouts (in-process engine)"):
                mine = self.rollouts.generate(self._rollout_requests(k, lo, hi), sampling,
                                              weight_version=self.state.version)
            parts = ranks.gather_to_main(mine)
            return mine, [o for part in parts for o in part] if parts is not None else None
        everything = None
        with ranks.guard("generating rollouts (rank 0)"):
            if ranks.is_main:
                everything = self._take_rollouts(k, sampling)
        return self._scatter(everything, self.cfg.prompts_per_step, n), everything

    def _scatter(self, everything: list[Rollout] | None, prompts: int, n: int = 1) -> list[Rollout]:
        """Rank 0 hands each rank the completions of its contiguous share of the prompts (token-id lists)."""
        ranks = self.ranks
        if not ranks.enabled:
            return everything
        shares = None
        if ranks.is_main:
            bounds = [share_bounds(prompts, ranks.world_size, r) for r in range(ranks.world_size)]
            shares = [everything[lo * n : hi * n] for lo, hi in bounds]
        return ranks.scatter_from_main(shares)

    def _rollout_requests(self, k: int, lo: int = 0, hi: int | None = None,
                          seed_offset: int = 0) -> list[RolloutRequest]:
        """E-step `k`'s requests (prompts lo..hi of its batch), each with its own seed, from the prompt's place in
        the global batch (the same whenever and wherever they are made: a regenerated batch reproduces)."""
        base = self.cfg.rollout.seed + seed_offset + k * self.cfg.prompts_per_step
        batch = self.order.batch(k)
        # Messages (+ image bytes): the engine renders the prompt with its own processor and returns the ids it
        # used, which the E-step checks against the learner's rendering.
        recs = [self.records[i] for i in batch]
        return [rollout_request(recs[j], [img.data for img in self.images.load(recs[j])], seed=base + j)
                for j in range(lo, len(recs) if hi is None else hi)]

    def _take_rollouts(self, k: int, sampling: object) -> list[Rollout]:
        """Rank 0 (server mode): E-step `k`'s rollouts, then the next rollout-matching E-steps (up to max_staleness,
        within the run) submitted to generate while this one trains (learner/train/overlap.py). The client fences
        each call to the version it was made with; `_within_window` is what the trainer accepts."""
        st, ahead = self.state, self.ahead
        taken = ahead.take(k, self._rollout_requests(k), sampling, st.version)
        last = -(-self.cfg.steps // self.core.m_steps)  # E-steps in the run
        upcoming = [j for j in range(k + 1, last) if self._e_step_samples(j)][: ahead.max_staleness]
        for j in upcoming:
            ahead.submit(j, self._rollout_requests(j), sampling, st.version)
        return taken.rollouts

    def _e_step_samples(self, k: int) -> bool:
        """E-step `k` is rollout matching (channel B): after the warm start, on the recipe's schedule (generation 1:
        every step); the others teach the ground truth (channel A: no generation, no sync before them)."""
        m_steps = self.core.m_steps
        first = -(-self.cfg.warm_start_steps // m_steps)  # the first E-step after the warm start
        return k * m_steps >= self.cfg.warm_start_steps and self.core.recipe.channel_b(k - first)

    def _explorer_rollouts(self, k: int) -> list[list[list[int]]]:
        """Recipe generation 2, a B step: this rank's prompts' explorer answers (`explorers` sampled completions per
        prompt, seeded apart from the anchors), grouped per prompt. A Generate call of their own: with rollouts
        generated ahead there are no explorers (the spec refuses them), so no other call is in flight."""
        recipe, ranks, st = self.core.recipe, self.ranks, self.state
        n = recipe.explorers
        if self.rollouts is not None and self.rollouts.per_rank:
            lo, hi = ranks.share(self.cfg.prompts_per_step)
            with ranks.guard("generating explorer rollouts (in-process engine)"):
                mine = self.rollouts.generate(self._rollout_requests(k, lo, hi, EXPLORER_SEED_OFFSET),
                                              recipe.explorer_sampling, weight_version=st.version)
        else:
            everything = None
            with ranks.guard("generating explorer rollouts (rank 0)"):
                if ranks.is_main:
                    everything = self.rollouts.generate(self._rollout_requests(k, seed_offset=EXPLORER_SEED_OFFSET),
                                                        recipe.explorer_sampling, weight_version=st.version)
            mine = self._scatter(everything, self.cfg.prompts_per_step, n)
        if not self._within_window(mine):
            raise RuntimeError(f"explorer rollouts from a weight version other than {st.weights}")
        responses = [list(o.token_ids) for o in mine]
        if self.policy.is_vision_language:
            responses = [vision_safe_response(r, self.vision_token_ids) for r in responses]
        return [responses[i * n : (i + 1) * n] for i in range(len(responses) // n)]

    def _within_window(self, outs: Sequence[Rollout]) -> bool:
        """Every rollout is from a weight version the learner may train on: its current one (max_staleness 0,
        exactly), or this run's, at most max_staleness versions behind. A batch put back from a checkpoint
        carries the version of the run that generated it (one the resumed run descends from): rank 0 checked
        its lag when it took it."""
        st, window = self.state, self.cfg.rollout.max_staleness
        if not window:
            return all(o.weights == st.weights for o in outs)
        restored = set(st.resumed.run_ids) if st.resumed is not None else set()
        return all((o.weight_run_id == st.run_id and 0 <= st.version - o.weight_version <= window)
                   or o.weight_run_id in restored for o in outs)
