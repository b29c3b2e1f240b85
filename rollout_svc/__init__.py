"""rmsft rollout server: one vLLM (or HF) engine behind the gRPC contract in protos/."""
