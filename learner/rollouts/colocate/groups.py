"""TP groups of learner ranks. With `tensorParallelSize` k, ranks [0, k), [k, 2k), ... each share one engine:
vLLM's external launcher makes every rank of a group one shard of it, and every shard must be handed the same
requests. So the group gathers its members' requests (in rank order), each rank generates for the whole group,
and keeps its own slice: the completions of the requests it brought, in their order. Sizes may differ between
ranks (a global batch that does not divide evenly); a rank may bring none.

With k = 1 every rank is its own group and nothing is exchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class GroupSizeError(ValueError):
    """The learner's ranks do not form whole TP groups."""


def group_ranks(world_size: int, tp: int) -> list[list[int]]:
    """The global ranks of every TP group, in order."""
    if tp < 1 or world_size % tp:
        raise GroupSizeError(
            f"spec.rollout.colocate.tensorParallelSize ({tp}) must divide the learner's ranks ({world_size})"
        )
    return [list(range(g * tp, (g + 1) * tp)) for g in range(world_size // tp)]


class TpGroup:
    """This rank's TP group. `world_size`/`rank`: the learner's world (global ranks). Every rank must build its
    TpGroup at the same point (creating a process group is collective over the world)."""

    def __init__(self, world_size: int, rank: int, tp: int) -> None:
        self.tp, self.rank = tp, rank
        groups = group_ranks(world_size, tp)
        self.members = groups[rank // tp]
        self.group = None
        if tp > 1:
            for ranks in groups:  # every rank creates every group, in the same order (torch requires it)
                pg = dist.new_group(ranks)
                if rank in ranks:
                    self.group = pg

    def gather(self, mine: Sequence[T]) -> tuple[list[T], tuple[int, int]]:
        """The group's items (members in rank order) and the bounds of this rank's own in that list."""
        if self.group is None:
            return list(mine), (0, len(mine))
        got: list[Any] = [None] * self.tp
        dist.all_gather_object(got, list(mine), group=self.group)
        lo = sum(len(got[i]) for i in range(self.members.index(self.rank)))
        return [x for part in got for x in part], (lo, lo + len(mine))
