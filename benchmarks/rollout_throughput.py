"""Rollout throughput: rmsft serve (vLLM) vs HF generate, same prompts, same random Qwen2.

    python benchmarks/rollout_throughput.py [--prompts 64] [--max-tokens 64] [--hf-single 8]
                                            [--hidden 128 --layers 2]

The defaults are the tiny test model (2 layers, hidden 128). There, compute is negligible and
the comparison measures per-step overheads, which depend on the machine's load more than on the
engines: `--hidden 1024 --layers 8` (~70M parameters) is a model where the work per token counts.

Three ways to produce the same greedy rollouts (float32 everywhere):
  1. `rmsft serve` with the vLLM engine, one Generate call carrying all prompts over gRPC;
  2. HF `generate` one sample at a time (measured on --hf-single prompts: it is slow);
  3. HF `generate` on the whole left-padded batch.
Throughput = generated tokens (up to and including end-of-turn) per second of wall time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rmsft_protos import rollout_pb2  # noqa: E402

from rmsft.tiny_model import CLASS_NAMES, build_tiny_model  # noqa: E402
from rollout_svc.launcher import RolloutServer  # noqa: E402


def make_prompts(tok, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        names = ", ".join(CLASS_NAMES[(i + k) % len(CLASS_NAMES)] for k in range(3))
        msgs = [{"role": "user", "content": f"Image {i}: detect every object. The image shows {names}."}]
        out.append(list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"]))
    return out


def cut(toks: list[int], eos: int) -> list[int]:
    return toks[: toks.index(eos) + 1] if eos in toks else toks


def hf_single(model, prompts, max_tokens, eos) -> list[list[int]]:
    res = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                           do_sample=False, eos_token_id=eos, pad_token_id=eos)
        res.append(cut(y[0, len(ids):].tolist(), eos))
    return res


def hf_batched(model, prompts, max_tokens, eos, pad) -> list[list[int]]:
    width = max(map(len, prompts))
    x = torch.full((len(prompts), width), pad)
    mask = torch.zeros_like(x)
    for i, ids in enumerate(prompts):
        x[i, width - len(ids):] = torch.tensor(ids)
        mask[i, width - len(ids):] = 1
    y = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                       eos_token_id=eos, pad_token_id=pad)
    return [cut(y[i, width:].tolist(), eos) for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-single", type=int, default=8, help="prompts timed one at a time with HF")
    ap.add_argument("--repeats", type=int, default=3, help="rmsft serve calls (best is reported)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size of the random Qwen2 (multiple of 64)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the random Qwen2")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_tiny_model(Path(tempfile.gettempdir()) / f"rmsft-bench-h{args.hidden}-l{args.layers}", seed=0,
                                 hidden_size=args.hidden, num_layers=args.layers)
    tok = AutoTokenizer.from_pretrained(model_dir)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    prompts = make_prompts(tok, args.prompts)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.set_grad_enabled(False)

    print("starting rmsft serve (vLLM) ...", flush=True)
    with RolloutServer.start(model_dir, dtype="float32", timeout=600) as srv:
        stub = srv.stub()
        req = rollout_pb2.GenerateRequest(sampling=rollout_pb2.SamplingParams(max_tokens=args.max_tokens))
        for ids in prompts:
            req.prompts.add(token_ids=ids)
        stub.Generate(req, timeout=600)  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            resp = stub.Generate(req, timeout=600)
            best = min(best, time.perf_counter() - t0)
        served = [list(c.token_ids) for c in resp.completions]
    served_tokens = sum(map(len, served))
    served_tps = served_tokens / best
    print(f"rmsft serve (vLLM, gRPC): {served_tokens} tokens in {best:.2f}s = {served_tps:.0f} tok/s", flush=True)

    hf_batched(model, prompts[:2], 4, eos, pad)  # warm-up
    t0 = time.perf_counter()
    batched = hf_batched(model, prompts, args.max_tokens, eos, pad)
    dt_b = time.perf_counter() - t0
    batched_tps = sum(map(len, batched)) / dt_b
    print(f"HF batched generate:      {sum(map(len, batched))} tokens in {dt_b:.2f}s = {batched_tps:.0f} tok/s",
          flush=True)

    sub = prompts[: args.hf_single]
    t0 = time.perf_counter()
    single = hf_single(model, sub, args.max_tokens, eos)
    dt_s = time.perf_counter() - t0
    single_tps = sum(map(len, single)) / dt_s
    print(f"HF one at a time ({len(sub)} of {len(prompts)} prompts): {sum(map(len, single))} tokens in "
          f"{dt_s:.2f}s = {single_tps:.0f} tok/s", flush=True)

    agree = sum(a == b for a, b in zip(served[: len(sub)], single, strict=True))
    print(f"greedy agreement served vs HF single: {agree}/{len(sub)}")
    r_single = served_tps / single_tps
    r_batched = served_tps / batched_tps
    print(f"ratio vs HF per-sample: {r_single:.0f}x (target >= 100x)   vs HF batched: {r_batched:.1f}x "
          "(target >= 8x)")
    print(
        f"RESULT hidden={args.hidden} layers={args.layers} prompts={len(prompts)} max_tokens={args.max_tokens} "
        f"served_tok_s={served_tps:.0f} "
        f"hf_single_tok_s={single_tps:.1f} hf_batched_tok_s={batched_tps:.0f} "
        f"ratio_vs_single={r_single:.1f} ratio_vs_batched={r_batched:.1f} greedy_agree={agree}/{len(sub)}"
    )


if __name__ == "__main__":
    main()
