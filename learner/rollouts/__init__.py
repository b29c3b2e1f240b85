"""Rollouts: where the learner's rollouts come from. One interface, two homes.

- `interface`: the rollout interface the training loop drives (`RolloutSource`, `SourceInfo`); read it first.
- `server_home`: home 1, the pool of rollout servers over gRPC (`ServerRollouts`, rank 0's), given its weight
  sender by the caller (learner/train/server_setup.py builds both on one pool).
- `colocate/`: home 2, the engine inside every learner rank (`ColocatedRollouts`, spec.rollout.mode: colocate).
- The server home's parts: `pool` (`ServerPool`, one gRPC channel per server in order, with what the learner
  knows of each), `servers_file` (the server list as a file that changes during a run: the operator's
  ConfigMap), `requests` (what goes into and comes out of a rollout: requests, completions, the chunk plan,
  errors), `client` (`RolloutClient`, ordered and fenced rollouts over the pool, with failover).

Everything here but `colocate/` may import `learner.tracking` only; `colocate/` sits above `learner.sync` (it
syncs weights in-process) and drives the engines in `rollout_engine` (tests/test_imports.py).
"""
