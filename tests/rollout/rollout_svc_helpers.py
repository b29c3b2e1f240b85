"""Shared helpers of the rollout-service tests: HF oracle, gRPC call shorthands, metric scraping."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import torch
from rmsft_protos import rollout_pb2

TOKEN = "s3cret-token"
MAX_FRAME = 256 << 10  # small, so the "oversize frame" case needs only the tiny model
PROMPT_TEXTS = [
    "Detect every object in the image and answer in JSON.",
    '{"object_1": {"desc": "person", "bbox_2d": [',
    "The image shows car, dog, cat.",
    "red apple on a bench",
    '"object_2": {"desc": "traffic light", "poly": [',
    "bird horse truck boat",
    "Detect every object. The image shows umbrella, chair.",
    '{"object_1": {"desc": "cup", "bbox_2d": ["<|coord_12|>", "<|coord_400|>",',
]


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompts: list[list[int]], max_tokens: int, eos: int) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
            toks = y[0, len(ids) :].tolist()
            if eos in toks:
                toks = toks[: toks.index(eos) + 1]
            outs.append(toks)
    return outs


def prompt_ids(tok) -> list[list[int]]:
    return [tok(t)["input_ids"] for t in PROMPT_TEXTS]


def generate(
    stub,
    md,
    prompts,
    *,
    max_tokens=16,
    temperature=0.0,
    seeds=None,
    expected=None,
    timeout=120,
    min_tokens=0,
    future=False,
):
    """One Generate call; with `future`, its grpc.Future (which can be cancelled) instead of the reply."""
    req = rollout_pb2.GenerateRequest(
        sampling=rollout_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, min_tokens=min_tokens),
    )
    if expected is not None:
        req.expected_weight_version = expected
    for i, ids in enumerate(prompts):
        p = req.prompts.add(token_ids=ids, request_id=f"r{i}")
        if seeds is not None:
            p.seed = seeds[i]
    return (stub.Generate.future if future else stub.Generate)(req, metadata=md, timeout=timeout)


def status(srv):
    return srv.stub().GetStatus(rollout_pb2.StatusRequest(), metadata=srv.metadata(), timeout=10)


def update(srv, chunks, timeout=120):
    return srv.stub().UpdateWeights(iter(chunks), metadata=srv.metadata(), timeout=timeout)


def scrape(srv) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels or "{" in line[: len(name) + 1] else " ")) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else -1.0


def random_full_weights(model_dir: Path, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def lora_adapter(base, seed: int, tmp: Path):
    """A PEFT LoRA (r=8, random A and B) on `base`: returns (tensors, config json, merged model)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(copy.deepcopy(base), cfg)
    out = tmp / f"adapter-{seed}"
    peft_model.save_pretrained(out)
    tensors = load_file(out / "adapter_model.safetensors")
    config_json = (out / "adapter_config.json").read_text()
    merged = peft_model.merge_and_unload().eval()
    return sorted(tensors.items()), config_json, merged


class Ref:
    """The HF model equal to what the server serves now, and its greedy answers."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok
        self.eos = tok.eos_token_id
        self.prompts = prompt_ids(tok)
        self.expected = hf_greedy(model, self.prompts, 16, self.eos)

    def set(self, model) -> None:
        self.model = model
        self.expected = hf_greedy(model, self.prompts, 16, self.eos)
