"""Runs greedy vLLM generation in its own process (vLLM spawns an engine process, which needs a
`__main__` guard that pytest's process does not give). Usage: MODEL_DIR PROMPTS_JSON OUT_JSON."""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    model_dir, prompts_path, out_path = sys.argv[1:4]
    with open(prompts_path) as f:
        prompts = json.load(f)
    llm = LLM(model=model_dir, dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=1024,
              enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=prompts["max_tokens"])
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts["ids"]], params)
    with open(out_path, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outs], f)


if __name__ == "__main__":
    main()
