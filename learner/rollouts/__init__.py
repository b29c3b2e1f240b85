"""Rollouts: the learner's side of the rollout pool.

- `pool`: `ServerPool`, one gRPC channel per server in order, with what the learner knows of each.
- `servers_file`: the server list as a file that changes during a run (the operator's ConfigMap).
- `requests`: what goes into and comes out of a rollout (requests, completions, the chunk plan, errors).
- `client`: `RolloutClient`, ordered and fenced rollouts over the pool, with failover.

May import `learner.tracking` (tests/test_imports.py).
"""
