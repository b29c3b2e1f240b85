"""rmsft rollout server (`rmsft serve`): one engine from `rollout_engine` (vLLM, or HF) behind the gRPC contract in
protos/: the servicer, the gate between Generate calls and weight applies, weight staging, the relay to the next
servers, auth, the flags, and the launcher `rmsft local` starts servers with."""
