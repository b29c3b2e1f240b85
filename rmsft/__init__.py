"""rmsft: rollout-matching SFT for vision-language detection models.

The base every part imports: the job spec, the weight-update contract (`weight_wire`), the rules both the
learner and the rollout server follow (`chat`, `serving_dtype`, `model_folder`, `serve_options`, ...). It
imports none of the parts (learner, rollout_svc, rollout_engine, rmsft_operator, rmsft_dev, rmsft_cli).
tests/test_imports.py checks all of this. The base must stay importable without torch or vLLM: the operator
image has neither.
"""

__version__ = "0.1.0"
