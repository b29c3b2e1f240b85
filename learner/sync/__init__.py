"""Weight sync: the learner's weights to the rollout servers.

- `weights`: what the servers load: FULL (merged, under the checkpoint's names, streamed layer by layer) or
  ADAPTER (the PEFT tensors and adapter_config.json).
- `client`: `WeightSyncClient`, one update per sync whatever the pool's size (grpc relayed, or shm).

May import `learner.rollouts`, `learner.tracking` (tests/test_imports.py).
"""
