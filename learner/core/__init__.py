"""The rollout-matching algorithm as pure code: no I/O, no gRPC, no vLLM, no Kubernetes."""
