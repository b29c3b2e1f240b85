"""The rollout engines both homes drive: the gRPC server (`rollout_svc`, `rmsft serve`) and the engine inside
the learner's ranks (`learner.rollouts.colocate`, spec.rollout.mode: colocate). Imports only the base
(`rmsft`, `rmsft_protos`).

    engine.py        the interface every engine implements (`Engine`) and the types it speaks
    vllm_engine.py   vLLM's asynchronous engine; `engine_args` / `sampling_params`, one set of rules for both homes
    hf_engine.py     the transformers engine (explicit only, never a fallback)
    async_loop.py    the event loop thread vLLM's engine runs on, driven from other threads
    worker_ext.py    methods vLLM mixes into its worker: weight reloads in place
    weight_transfer_gloo.py  a gloo engine for vLLM's weight-transfer API (the CPU stand-in for its NCCL one)
    staged_file.py   reading a staged weight update (data file + JSON index) back as tensors
    prompts.py       rollout requests (the proto) -> engine items: chat rendering, images, per-sample seeds
    config.py        `ServeConfig`: the engine's options and the server's around it
    metrics.py       the rollout metrics both homes report (`rmsft_rollout_*`)
    vllm_metrics.py  vLLM's own metric names the dashboards use
"""
