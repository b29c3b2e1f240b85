"""The rollout engine inside the learner's ranks (`spec.rollout.mode: colocate`, issue 24): vLLM (or the HF
engine) lives in the training processes, on the training devices, and decodes without gradients between
optimizer steps, so there is no server pool and no weight transport. What lets both share one accelerator
lives here too: `offload.py` moves the training parameters and/or the optimizer state to host memory while the
engine generates, and brings them back bit for bit before the next step.
"""
