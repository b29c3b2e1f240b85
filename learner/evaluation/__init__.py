"""Evaluation of answers as detections.

- `held_out`: the held-out evaluation (`training.eval`): greedy answers from the pool, F1 and COCO mAP.
- `coco_map`: COCO bbox mAP (faster-coco-eval).
- `draw`: pictures of answers, ground truth and predictions drawn on the image.

`rmsft eval` (the same evaluation of a checkpoint, on local servers it starts) sits on top: learner/checkpoint_eval.py.
May import `learner.core`, `learner.data`, `learner.rollouts` (tests/test_imports.py).
"""
