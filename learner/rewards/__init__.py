"""Rewards of the GRPO objective: what a completion is worth, as a float, by plain Python callables.

- `interface`: `RewardInput` (one completion to score), `Reward` (the protocol), the errors.
- `builtins`: the built-in rewards (`detection`, `text_match`) and their pure scoring.
- `scoring`: names resolved to rewards (import path, built-in, entry point `rmsft.rewards`), `RewardSpec`,
  `build_rewards` (the weighted sum), `score_batch` (a batch on a thread pool).

May import `learner.core`, `learner.data` (tests/test_imports.py).
"""
