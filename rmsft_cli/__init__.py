"""The `rmsft` command (`app.py`): the top of the tree, the one place that imports every part (learner,
rollout_svc, rmsft_operator, rmsft_dev), each inside the command that needs it. `python -m rmsft_cli` runs it
(`__main__.py`), as torchrun does for the learner's ranks."""
