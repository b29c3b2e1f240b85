"""What the learner trains on, from the records to the segments.

- `records`: the JSONL records, validated (`Record`, `load_records`, `DataError`).
- `images`: `ImageStore`, the records' images resolved, validated at load, read once.
- `dataset`: `load_dataset`, records plus their `ImageStore`.
- `order`: `DataOrder`, which records each step takes (pure, resumable).
- `vision`: vision-language inputs of a segment (processor rendering, M-RoPE positions).
- `episode`: one E-step's pure glue: records to rollout requests, rollouts to segments and match counts.

May import `learner.core`, `learner.rollouts` (tests/test_imports.py).
"""
