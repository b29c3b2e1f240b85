"""The training loop's checkpoint/resume (a mixin of `learner.trainer.Trainer`, kept apart for size).

Rank 0 writes model, optimizer, step and version; every rank's packer carry buffer and RNG (and,
under DeepSpeed, its ZeRO optimizer partition) are gathered into the same `state.pt` as
`rank_states`, so one atomic folder holds the whole group's state.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from learner.checkpoint import list_checkpoints, rng_state, save_checkpoint, set_rng_state, trainable_state
from learner.zero import gathered

log = logging.getLogger("rmsft.learner")


class CheckpointMixin:
    """Needs the Trainer's `ranks`, `cfg`, `model`, `optimizer`, `engine`, `packer`, `step`, `version`,
    `phase_seconds`."""

    def _rank_state(self) -> dict:
        out = {"packer": list(self.packer._buf), "rng": rng_state()}
        if self.engine is not None:  # ZeRO partitions the optimizer: every rank holds its own part
            out["zero_optimizer"] = self.engine.optimizer.state_dict()
        return out

    def gathered_trainable_state(self) -> dict[str, torch.Tensor]:
        """The trainable weights as CPU copies, whole under ZeRO-3 too. Collective."""
        with gathered(self.engine, self.model):
            return {k: v.detach().to("cpu", copy=True) for k, v in trainable_state(self.model).items()}

    def state(self, model_state: dict[str, torch.Tensor]) -> dict:
        """Rank 0's checkpoint (the single-rank layout plus `world_size` and `rank_states`);
        `model_state` from `gathered_trainable_state` (whole weights under ZeRO-3 too)."""
        return {
            "step": self.step, "version": self.version, "model": model_state,
            "optimizer": self.optimizer.state_dict() if self.engine is None else None, "rng": rng_state(),
            "packer": list(self.packer._buf), "phase_seconds": dict(self.phase_seconds),
            "world_size": self.ranks.world_size, "deepspeed_stage": self.cfg.deepspeed_stage,
        }  # fmt: skip

    def save(self) -> Path | None:
        """Collective: every rank's packer carry buffer and RNG (and ZeRO optimizer part) go into
        the one checkpoint rank 0 writes. Returns its path on rank 0, None elsewhere."""
        rank_states = self.ranks.gather_to_main(self._rank_state())
        model_state = self.gathered_trainable_state()
        path = None
        with self.ranks.guard("saving the checkpoint (rank 0)"):
            if self.ranks.is_main:
                state = self.state(model_state)
                state["rank_states"] = rank_states
                ck = self.cfg.checkpoint
                path = save_checkpoint(ck.dir, self.step, state, keep=ck.keep)
        return path

    def resume(self) -> bool:
        """Load the newest checkpoint in training.checkpoint.dir; False when there is none.
        Collective; every rank reads the folder rank 0 picked (one pod: a shared filesystem)."""
        name = None
        with self.ranks.guard("looking for a checkpoint (rank 0)"):
            if self.ranks.is_main:
                found = list_checkpoints(self.cfg.checkpoint.dir)
                name = str(found[-1]) if found else None
        name = self.ranks.broadcast_from_main(name)
        if name is None:
            return False
        with self.ranks.guard(f"loading checkpoint {name}"):
            # Our own file: it holds Python objects (packer segments, RNG state), hence weights_only=False.
            state = torch.load(Path(name) / "state.pt", weights_only=False)
            self._load_state(state, name)
        log.info("resumed from step %d (weight version %d)", self.step, self.version)
        return True

    def _load_state(self, state: dict, name: str) -> None:
        saved_ws, ws = state.get("world_size", 1), self.ranks.world_size
        if saved_ws != ws:
            raise RuntimeError(f"checkpoint {name} was written by {saved_ws} learner rank(s), this run has {ws}: "
                               "resume with the same number of ranks (each rank's carry buffer and RNG are its own)")
        if state.get("deepspeed_stage", 0) != self.cfg.deepspeed_stage:
            raise RuntimeError(f"checkpoint {name} was written with deepspeed_stage {state.get('deepspeed_stage', 0)}, "
                               f"this run uses {self.cfg.deepspeed_stage}")  # fmt: skip
        missing = set(trainable_state(self.model)) - set(state["model"])
        if missing:
            raise RuntimeError(f"checkpoint does not match the model: {len(missing)} trainable tensors missing")
        with gathered(self.engine, self.model, modifier_rank=0):  # ZeRO-3: rank 0's load is re-partitioned
            self.model.load_state_dict(state["model"], strict=False)
        rank_states = state.get("rank_states") or [{"packer": state["packer"], "rng": state["rng"]}]
        mine = rank_states[self.ranks.rank]
        if self.engine is None:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            from learner.zero import load_zero_optimizer

            load_zero_optimizer(self.engine, [s["zero_optimizer"] for s in rank_states])
        set_rng_state(mine["rng"])
        self.packer._buf = list(mine["packer"])
        self.step, self.version = state["step"], state["version"]
        self.phase_seconds = dict(state["phase_seconds"])
