"""Methods vLLM mixes into its worker (`worker_extension_cls`); they run inside the engine process.

For a server's engine only a path crosses the process boundary: tensors sent through `collective_rpc` would
arrive as Python lists, so the worker maps the staged file itself. An in-process engine (colocate) is handed
the tensors directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout_engine.engine import HEAD_NAME, tied_head_alias
from rollout_engine.weight_transfer_gloo import register as _register_gloo_transfer

# vLLM imports this module in every engine worker (worker_extension_cls): the gloo weight-transfer engine is added to
# the worker's registry before the engine is created (rollout_engine/weight_transfer_gloo.py).
_register_gloo_transfer()


class RmsftWorkerExtension:
    if TYPE_CHECKING:  # vLLM's worker, which this class extends (worker_extension_cls), has it
        model_runner: Any

    def rmsft_reload_weights(self, index_path: str | None) -> int:
        """Reload weights in place from a staged stream (None = the original checkpoint)."""
        if index_path is None:
            weights = None
            count = -1
        else:
            from rollout_engine.staged_file import iter_staged_tensors

            weights = list(iter_staged_tensors(index_path))
            count = len(weights)
            weights += _tied_head(self, weights)
        reload = getattr(self, "reload_weights", None) or self.model_runner.reload_weights
        reload(weights_iterator=weights, is_checkpoint_format=True)
        return count

    def rmsft_load_tensors(self, weights, names: list[str]) -> int:
        """In-process engines (colocate: the engine lives in the learner's process, so the tensors themselves
        arrive, by reference): load `weights`, an iterable of (checkpoint name, tensor) consumed once, layer by
        layer, whose names `names` lists in advance (for the tied head below)."""
        head = _tied_head_source(self, names)
        count = 0

        def stream():
            nonlocal count
            embed = None
            for name, t in weights:
                count += 1
                if name == head:
                    embed = t
                yield name, t
            if head is not None and embed is not None:
                yield HEAD_NAME, embed

        reload = getattr(self, "reload_weights", None) or self.model_runner.reload_weights
        reload(weights_iterator=stream(), is_checkpoint_format=True)
        return count


def _tied_head_source(worker, names: list[str]) -> str | None:
    """The embedding's name when the head must be fed again under its own name (see `_tied_head`), else None."""
    return next(iter(tied_head_alias(_ties_head(worker), names)), None)


def _ties_head(worker) -> bool:
    runner = getattr(worker, "model_runner", None)
    config = getattr(getattr(runner, "model_config", None), "hf_config", None)
    if getattr(config, "tie_word_embeddings", False):
        return True
    text = getattr(config, "get_text_config", None)
    return text is not None and bool(getattr(text(), "tie_word_embeddings", False))


def _tied_head(worker, weights: list) -> list:
    """With tied embeddings, checkpoints (and the learner) carry only the embedding, but vLLM's CPU
    backend keeps a repacked copy of the output projection that a reload refreshes only when
    `lm_head.weight` itself arrives: without it, rollouts keep the old head (measured: greedy output
    differs from the synced model). Feed the embedding again under the head's name."""
    embed = _tied_head_source(worker, [name for name, _ in weights])
    if embed is None:
        return []
    return [(HEAD_NAME, next(t for name, t in weights if name == embed))]
