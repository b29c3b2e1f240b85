"""The HF backend's own batched decode loop (`rollout_engine.hf_engine`): greedy matches transformers'
`generate`, a seeded sampled row does not depend on its batch, log-probs are the raw model's, stop
tokens and max_tokens end rows, and the whole batch shares one forward pass per step.

Exact token equality between a row alone and the same row in a padded batch is safe here: the test is
deterministic (fixed tiny weights, fixed seeds, CPU), and left padding only moves the logits by float
rounding (~1e-6), which could flip a greedy argmax or a multinomial draw only at a near-exact tie; the
equal-length cases compare rows with no padding at all, where only the position in the batch changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout_engine import hf_engine
from rollout_engine.config import ServeConfig
from rollout_engine.engine import EngineError, EngineInputError, GenItem, Sampling
from rollout_engine.hf_engine import HfEngine

# Prompts of different lengths (token ids of the tiny vocabulary, no special tokens).
PROMPTS = [[5, 17, 300, 42, 9], [100, 200, 300], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [1500, 64, 64, 900]]
# Equal-length prompts: batching them needs no padding, so only the row's position changes.
SAME_LEN = [[11, 22, 33, 44, 55], [66, 77, 88, 99, 110], [120, 130, 140, 150, 160]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HfEngine:
    return HfEngine(ServeConfig(model=str(tiny_model_dir), backend="hf"))


def sampled(seed: int | None, max_tokens: int = 10, temperature: float = 1.0, **kw) -> Sampling:
    return Sampling(max_tokens=max_tokens, temperature=temperature, seed=seed, **kw)


def tokens(engine: HfEngine, prompts: list[list[int]], samplings: list[Sampling]) -> list[list[int]]:
    return [o.token_ids for o in engine.generate([GenItem(p, s) for p, s in zip(prompts, samplings, strict=True)])]


def hf_greedy(engine: HfEngine, prompt: list[int], max_tokens: int, **kw) -> list[int]:
    """transformers' own greedy `generate` on one unpadded prompt: the reference the batch must match."""
    with torch.no_grad():
        out = engine.hf.generate(
            input_ids=torch.tensor([prompt], device=engine.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=engine.device),
            max_new_tokens=max_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=engine.pad_id,
            eos_token_id=sorted(engine.eos_ids),
            **kw,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_batch_equals_transformers_generate_one_prompt_at_a_time(engine: HfEngine) -> None:
    outs = engine.generate([GenItem(p, Sampling(max_tokens=12)) for p in PROMPTS])
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == hf_greedy(engine, p, 12)
        assert o.prompt_token_ids == p and o.logprobs is None


def test_greedy_repetition_penalty_equals_transformers_generate(engine: HfEngine) -> None:
    # Unpadded single prompts: HF's penalty also counts left padding in a batch, ours never does.
    outs = engine.generate([GenItem(p, Sampling(max_tokens=12, repetition_penalty=1.5)) for p in PROMPTS])
    for p, o in zip(PROMPTS, outs, strict=True):
        assert o.token_ids == hf_greedy(engine, p, 12, repetition_penalty=1.5)
    plain = tokens(engine, PROMPTS, [Sampling(max_tokens=12)] * len(PROMPTS))
    assert [o.token_ids for o in outs] != plain  # the penalty did something


def test_seeded_row_does_not_depend_on_its_batch_or_position(engine: HfEngine) -> None:
    short, mid, long_ = [3, 4], PROMPTS[0], PROMPTS[2]
    alone = tokens(engine, [mid], [sampled(7)])[0]
    # Batches sort by prompt length: `mid` is the last, left-unpadded row here ...
    others_short = tokens(engine, [short, mid, [9, 9, 9]], [sampled(1), sampled(7), sampled(None)])[1]
    # ... and the first, left-padded row here, next to greedy and unseeded rows.
    others_long = tokens(engine, [long_, mid, PROMPTS[3] * 3], [Sampling(max_tokens=4), sampled(7), sampled(None)])[1]
    assert alone == others_short == others_long
    assert tokens(engine, [mid], [sampled(7)])[0] == alone  # same seed, same tokens

    # No padding at all: the same rows at every position of the batch.
    ref = [tokens(engine, [p], [sampled(40 + i)])[0] for i, p in enumerate(SAME_LEN)]
    for perm in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        got = tokens(engine, [SAME_LEN[i] for i in perm], [sampled(40 + i) for i in perm])
        assert got == [ref[i] for i in perm]


def test_different_seeds_give_different_samples(engine: HfEngine) -> None:
    a = tokens(engine, PROMPTS, [sampled(1)] * len(PROMPTS))
    b = tokens(engine, PROMPTS, [sampled(2)] * len(PROMPTS))
    assert all(x != y for x, y in zip(a, b, strict=True))
    # Unseeded rows draw fresh randomness each call.
    u1 = tokens(engine, PROMPTS, [sampled(None)] * len(PROMPTS))
    u2 = tokens(engine, PROMPTS, [sampled(None)] * len(PROMPTS))
    assert u1 != u2


def test_logprobs_are_the_raw_model_log_softmax(engine: HfEngine) -> None:
    samplings = [
        sampled(5, logprobs=True, top_k=50, top_p=0.9, repetition_penalty=1.2),  # processed, logprobs still raw
        Sampling(max_tokens=10, logprobs=True),
        sampled(6, temperature=0.7),
        sampled(8, logprobs=True),
    ]
    outs = engine.generate([GenItem(p, s) for p, s in zip(PROMPTS, samplings, strict=True)])
    for p, s, o in zip(PROMPTS, samplings, outs, strict=True):
        if not s.logprobs:
            assert o.logprobs is None
            continue
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids) > 0
        with torch.no_grad():
            logits = engine.hf(input_ids=torch.tensor([p + o.token_ids], device=engine.device)).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        want = [lp[len(p) - 1 + j, t].item() for j, t in enumerate(o.token_ids)]
        assert o.logprobs == pytest.approx(want, abs=1e-4)


def test_processed_logprobs_are_those_of_the_distribution_sampled_from(engine: HfEngine) -> None:
    # --logprobs-mode processed (GRPO): after temperature (and top-k/top-p, the penalty), vLLM's processed_logprobs.
    engine.processed_logprobs = True
    try:
        samplings = [
            sampled(5, logprobs=True, temperature=0.7),
            sampled(6, logprobs=True, temperature=1.3),
            Sampling(max_tokens=6, logprobs=True),
            sampled(7, logprobs=True, top_k=20),
        ]
        outs = engine.generate([GenItem(p, s) for p, s in zip(PROMPTS, samplings, strict=True)])
        same_seed = engine.generate([GenItem(PROMPTS[0], samplings[0])])[0]
    finally:
        engine.processed_logprobs = False
    assert same_seed.token_ids == outs[0].token_ids  # the mode changes what is reported, not what is sampled
    for p, s, o in zip(PROMPTS, samplings, outs, strict=True):
        with torch.no_grad():
            logits = engine.hf(input_ids=torch.tensor([p + o.token_ids], device=engine.device)).logits[0].float()
        x = logits / (s.temperature if s.temperature > 0 else 1.0)  # greedy: no temperature
        if s.top_k > 0:
            x = x.masked_fill(x < torch.topk(x, s.top_k, dim=-1).values[:, -1:], float("-inf"))
        lp = torch.log_softmax(x, dim=-1)
        want = [lp[len(p) - 1 + j, t].item() for j, t in enumerate(o.token_ids)]
        assert o.logprobs == pytest.approx(want, abs=1e-4)


def test_mixed_greedy_and_sampled_batch(engine: HfEngine) -> None:
    greedy = [Sampling(max_tokens=9), Sampling(max_tokens=5)]
    greedy_only = tokens(engine, PROMPTS[:2], greedy)
    sampled_alone = [tokens(engine, [p], [sampled(11 + i)])[0] for i, p in enumerate(PROMPTS[2:])]
    mixed = tokens(engine, PROMPTS, greedy + [sampled(11), sampled(12)])
    assert mixed[:2] == greedy_only
    assert mixed[2:] == sampled_alone
    assert [len(t) for t in mixed] == [9, 5, 10, 10]  # each row its own max_tokens


def test_top_k_one_and_tiny_top_p_are_greedy(engine: HfEngine) -> None:
    greedy = tokens(engine, PROMPTS, [Sampling(max_tokens=8)] * len(PROMPTS))
    assert tokens(engine, PROMPTS, [sampled(3, max_tokens=8, top_k=1)] * len(PROMPTS)) == greedy
    assert tokens(engine, PROMPTS, [sampled(3, max_tokens=8, top_p=1e-6)] * len(PROMPTS)) == greedy


def test_stop_tokens_and_max_tokens(engine: HfEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    p = PROMPTS[0]
    free = engine.generate([GenItem(p, Sampling(max_tokens=12))])[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    # Stop at the first occurrence of the 4th greedy token, which stays in the output.
    stop = free.token_ids[3]
    cut = free.token_ids.index(stop) + 1
    o = engine.generate([GenItem(p, Sampling(max_tokens=12, stop_token_ids=(stop,)))])[0]
    assert (o.token_ids, o.finish_reason) == (free.token_ids[:cut], "stop")
    short = engine.generate([GenItem(p, Sampling(max_tokens=3))])[0]
    assert (short.token_ids, short.finish_reason) == (free.token_ids[:3], "length")
    # The model's eos ends a row the same way, and a stopped row does not end its neighbours.
    monkeypatch.setattr(engine, "eos_ids", {stop})
    other = engine.generate([GenItem(PROMPTS[1], Sampling(max_tokens=12))])[0]
    both = engine.generate([GenItem(p, Sampling(max_tokens=12)), GenItem(PROMPTS[1], Sampling(max_tokens=12))])
    assert (both[0].token_ids, both[0].finish_reason) == (free.token_ids[:cut], "stop")
    assert (both[1].token_ids, both[1].finish_reason) == (other.token_ids, other.finish_reason)
    assert len(both[1].token_ids) > len(both[0].token_ids)
    # min_tokens: no stop token before it (the row goes on past where it stopped), greedy otherwise unchanged.
    held = engine.generate([GenItem(p, Sampling(max_tokens=12, stop_token_ids=(stop,), min_tokens=cut + 1))])[0]
    assert held.token_ids[: cut - 1] == free.token_ids[: cut - 1]
    assert stop not in held.token_ids[:cut] and len(held.token_ids) > cut


def test_the_batch_shares_one_forward_pass_per_step(engine: HfEngine) -> None:
    calls = []
    hook = engine.hf.register_forward_hook(lambda mod, args, out: calls.append(1))
    try:
        outs = engine.generate([GenItem(PROMPTS[i % 4], sampled(100 + i, max_tokens=6)) for i in range(8)])
    finally:
        hook.remove()
    assert len(outs) == 8 and all(len(o.token_ids) <= 6 for o in outs)
    # One prefill, then one step per further token of the longest row: 6 calls, not 8 x 6.
    assert len(calls) == max(len(o.token_ids) for o in outs) <= 6


def test_large_calls_split_into_capped_batches(engine: HfEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    items = [GenItem(PROMPTS[i % 4], sampled(200 + i, max_tokens=4)) for i in range(7)]
    whole = engine.generate(items)
    monkeypatch.setattr(hf_engine, "MAX_BATCH_ROWS", 3)
    calls = []
    hook = engine.hf.register_forward_hook(lambda mod, args, out: calls.append(1))
    try:
        split = engine.generate(items)
    finally:
        hook.remove()
    assert [o.token_ids for o in split] == [o.token_ids for o in whole]  # results in request order
    assert 3 <= len(calls) <= 3 * 4


def test_refusals(engine: HfEngine) -> None:
    with pytest.raises(EngineError, match="text-only"):
        engine.generate([GenItem([1, 2], Sampling(max_tokens=2), images=[object()])])
    with pytest.raises(EngineError, match="stop strings"):
        engine.generate([GenItem([1, 2], Sampling(max_tokens=2, stop=("x",)))])
    with pytest.raises(EngineInputError, match="empty prompt"):
        engine.generate([GenItem([1, 2], Sampling(max_tokens=2)), GenItem([], Sampling(max_tokens=2))])
