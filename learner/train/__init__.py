"""Training: the loops and what they are made of.

- `loop`: `TrainingLoop`, the one training loop (step, sync, checkpoint, evaluation, export, reporting).
- `build`: `build_loop`, the loop's parts made in the order a real start pays for them, then the loop over them.
- `objectives/`: what a step trains on and its loss, one module per objective (`rollout_matching`: channel A the
  ground truth, channel B the model's answers; `grpo`), chosen by `spec.trainer` from `OBJECTIVES`.
- `feed`: `RolloutFeed`, what a step reads from the engines: prompts, rollouts handed out between ranks, the
  staleness window, what the engines serve.
- `start_checks`: what is refused before anything loads (memory plan, images), the ranks' collective timeout.
- `updater`: how the optimizer steps (`PlainUpdater`, `ZeroUpdater`); it also owns the device and the autocast.
- `zero`: DeepSpeed ZeRO-1/2/3.
- `ranks`: data-parallel ranks (`Ranks`), rank 0's hand-out, failure agreement.
- `policy`: the model being trained (`load_policy`: HF model, tokenizer, processor, LoRA/DoRA, precision).
- `config`: the job spec's `training` section as the core's configs; the learning-rate schedule.
- `checkpoint_files`: a checkpoint folder on disk (written atomically, listed, loaded).
- `checkpointer`: `TrainState` and the `Checkpointer` that saves and restores it.
- `results`: what a step and a run report (`StepResult`, `GrpoStats`, `Summary`).
- `reporting`: where rank 0's figures go (TensorBoard, Prometheus gauges, pictures).
- `export`: the trained model as a Hugging Face folder (`rmsft export`, `training.export`).
- `server_setup`: rank 0's server home wired: the pool, its weight-sync client, the rollout interface over both.
- `offload`: training parameters and/or optimizer state in host memory while a colocated engine generates.

May import every other learner subpackage (tests/test_imports.py); nothing imports it but the modules on
top (learner/local.py, learner/checkpoint_eval.py) and the CLI.
"""
