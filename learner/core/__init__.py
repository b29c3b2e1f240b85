"""The rollout-matching algorithm as pure code: no I/O, no gRPC, no vLLM, no Kubernetes.

Modules: codec (object format), vocab (tokenizer facts), parse, match, targets, packing, losses,
grpo (the GRPO objective on the same packed rows). See docs/architecture.md, "learner.core API".
"""
