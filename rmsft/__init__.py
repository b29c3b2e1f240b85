"""rmsft: rollout-matching SFT for vision-language detection models.

This package holds what every component shares (CLI, job spec, dev tools). It must stay importable
without torch or vLLM: the operator image has neither.
"""

__version__ = "0.1.0"
