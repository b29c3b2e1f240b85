"""Generated gRPC stubs for the learner <-> rollout server contract (rollout.proto)."""
