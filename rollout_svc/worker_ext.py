"""Methods vLLM mixes into its worker (`worker_extension_cls`); they run inside the engine process.

Only a path crosses the process boundary: tensors sent through `collective_rpc` would arrive as
Python lists. The worker maps the staged file itself.
"""

from __future__ import annotations


class RmsftWorkerExtension:
    def rmsft_reload_weights(self, index_path: str | None) -> int:
        """Reload weights in place from a staged stream (None = the original checkpoint)."""
        if index_path is None:
            weights = None
            count = -1
        else:
            from rollout_svc.staging import iter_staged_tensors

            weights = list(iter_staged_tensors(index_path))
            count = len(weights)
            weights += _tied_head(self, weights)
        reload = getattr(self, "reload_weights", None) or self.model_runner.reload_weights
        reload(weights_iterator=weights, is_checkpoint_format=True)
        return count


# Checkpoint names of the input embedding: text models and Qwen2.5-VL, then Qwen3-VL.
_EMBEDS, _HEAD = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"), "lm_head.weight"


def _tied_head(worker, weights: list) -> list:
    """With tied embeddings, checkpoints (and the learner) carry only the embedding, but vLLM's CPU
    backend keeps a repacked copy of the output projection that a reload refreshes only when
    `lm_head.weight` itself arrives: without it, rollouts keep the old head (measured: greedy output
    differs from the synced model). Feed the embedding again under the head's name."""
    runner = getattr(worker, "model_runner", None)
    config = getattr(getattr(runner, "model_config", None), "hf_config", None)
    if not getattr(config, "tie_word_embeddings", False):
        text = getattr(config, "get_text_config", None)
        if text is None or not getattr(text(), "tie_word_embeddings", False):
            return []
    names = {name for name, _ in weights}
    embed = next((e for e in _EMBEDS if e in names), None)
    if embed is None or _HEAD in names:
        return []
    return [(_HEAD, next(t for name, t in weights if name == embed))]
