from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rmsft.prepare_model import COORD_TOKENS
from rmsft_dev.tiny_model import build_tiny_model

PROMPTS = [
    "Detect every object in the image and answer in JSON.",
    "The image shows a person, a dog and a red apple.",
    "Find the cars.",
    "Where is the umbrella?",
    "Describe the traffic light and the bench.",
]


def _digest(folder: Path) -> dict[str, str]:
    return {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in ("model.safetensors", "tokenizer.json", "config.json")
    }


def test_same_seed_same_bytes(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert _digest(again) == _digest(tiny_model_dir)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert _digest(other)["model.safetensors"] != _digest(tiny_model_dir)["model.safetensors"]


def test_vocabulary(tiny_tokenizer) -> None:
    ids = tiny_tokenizer.convert_tokens_to_ids(COORD_TOKENS)
    assert len(set(ids)) == 1000 and tiny_tokenizer.unk_token_id not in ids
    text = '"bbox_2d": ["<|coord_0|>", "<|coord_999|>"]'
    enc = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] in enc and ids[999] in enc
    assert tiny_tokenizer.decode(enc) == text
    chat = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.eos_token == "<|im_end|>"


def test_cli_builds_model(tmp_path: Path) -> None:
    out = tmp_path / "cli-model"
    res = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "dev", "tiny-model", str(out)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def _hf_greedy(model_dir: Path, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
            outs.append(gen[0, len(ids) :].tolist())
    return outs


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_and_transformers_agree_greedy(tmp_path: Path, tiny_model_dir: Path, tiny_tokenizer) -> None:
    prompt_ids = [
        tiny_tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
        for p in PROMPTS
    ]
    max_tokens = 24
    (tmp_path / "prompts.json").write_text(json.dumps({"ids": prompt_ids, "max_tokens": max_tokens}))
    script = Path(__file__).with_name("vllm_greedy.py")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    res = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), str(tmp_path / "prompts.json"), str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    vllm_out = json.loads((tmp_path / "out.json").read_text())
    hf_out = _hf_greedy(tiny_model_dir, prompt_ids, max_tokens)
    eos = tiny_tokenizer.eos_token_id
    # HF keeps the eos token and stops; vLLM returns it too. Compare token for token.
    assert len(vllm_out) == len(PROMPTS) >= 4
    # Guard against a vacuous pass (e.g. every answer being a lone end-of-turn).
    assert sum(len(v) for v in vllm_out) >= 4 * max_tokens
    for v, h in zip(vllm_out, hf_out, strict=True):
        assert v == h, (v, h, eos)
