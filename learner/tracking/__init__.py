"""What a run leaves for people to watch and to reproduce it.

- `metrics`: the learner's Prometheus metrics (every one declared here; dashboards may query only these).
- `tracker`: TensorBoard event files (and W&B when installed and asked for); `read_events` reads them back.
- `run_record`: `run.json` beside the checkpoints (the resolved job, seeds, versions, digests).

May import no other learner subpackage (tests/test_imports.py).
"""
