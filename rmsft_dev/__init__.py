"""Developer builders, not runtime code: tiny random models and synthetic tasks, made on this machine with no
download. `rmsft dev tiny-model` and the tests use them, and `rmsft local` builds what a manifest's
annotations ask for (`rmsft.io/build-tiny-model`, `rmsft.io/synthetic-records`, learner/local.py) from them.

- `tiny_model`: a tiny Qwen2 text model with the CoordExp vocabulary (`coord_tokens=False`: a stock one).
- `tiny_vl`: a tiny Qwen3-VL or Qwen2.5-VL with its torchvision-free processor.
- `real_width`: a random Qwen3-VL at a memory-plan preset's real widths and vocabulary (`rmsft dev real-width`).
- `synthetic`: synthetic datasets for those models (text, the visual shapes task, the GRPO short-answer task
  and its reward `CoordAnswerReward`).

May import the base (`rmsft`) and the pure core (`learner.core`), nothing else of the project
(tests/test_imports.py checks).
"""
