"""rmsft Kubernetes operator (kopf). Never imports torch, vLLM or the learner."""
