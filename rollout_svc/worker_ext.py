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
        reload = getattr(self, "reload_weights", None) or self.model_runner.reload_weights
        reload(weights_iterator=weights, is_checkpoint_format=True)
        return count
