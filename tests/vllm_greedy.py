"""Runs greedy vLLM generation in its own process (vLLM spawns an engine process, which needs a
`__main__` guard that pytest's process does not give). Usage: MODEL_DIR PROMPTS_JSON OUT_JSON.

PROMPTS_JSON: {"ids": [[token ids], ...], "max_tokens": N}, or, for prompts with images,
{"texts": [rendered chat prompt, ...], "images": [[png path, ...], ...], "max_tokens": N} (vLLM's
processor expands each image placeholder); optional "llm": extra `LLM(...)` arguments (e.g.
model_impl "transformers" and limit_mm_per_prompt, which the tiny Qwen-VL models need on the CPU).

The engine runs in this one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as the learner's colocated engine runs):
the same engine and outputs (checked), without two more processes that each import vLLM again (25 s instead of
64 s per call on 2 cores, measured)."""

from __future__ import annotations

import json
import sys


def main() -> None:
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    model_dir, prompts_path, out_path = sys.argv[1:4]
    with open(prompts_path) as f:
        prompts = json.load(f)
    llm = LLM(
        model=model_dir,
        dtype="float32",
        kv_cache_memory_bytes=256 << 20,
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        **prompts.get("llm", {}),
    )
    params = SamplingParams(temperature=0.0, max_tokens=prompts["max_tokens"])
    if "texts" in prompts:
        from PIL import Image

        requests = [
            {
                "prompt": text,
                **({"multi_modal_data": {"image": [Image.open(p).convert("RGB") for p in paths]}} if paths else {}),
            }
            for text, paths in zip(prompts["texts"], prompts["images"], strict=True)
        ]
    else:
        requests = [{"prompt_token_ids": ids} for ids in prompts["ids"]]
    outs = llm.generate(requests, params)
    with open(out_path, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outs], f)


if __name__ == "__main__":
    main()
