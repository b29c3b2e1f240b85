"""HF transformers engine (explicit `--backend hf`): for debugging and for machines without vLLM.

`generate` runs its own batched decode loop instead of `model.generate`: prompts are left-padded
into batches of at most `MAX_BATCH_ROWS` rows, the model runs once per step over the whole batch with
a KV cache, and every live row picks one token per step. `generate` cannot do this for sampling: it
has one global RNG (`torch.manual_seed`), so a row's tokens would depend on its batch neighbours.
Here each row samples with its own `torch.Generator` seeded from `Sampling.seed` (fresh randomness
when unseeded), on its own probability row only, so a seeded request gives the same tokens alone, in
any batch and at any position in it (up to float differences left padding can make in the logits,
which only matter at a near-exact tie), and a retry on another server of the same kind reproduces it.

Per row: temperature (0 = greedy argmax, so greedy and sampled rows share a batch), top_k (0 = off),
top_p, repetition_penalty (1.0 = off; HF's rule over the row's own prompt + output tokens), max_tokens,
stop_token_ids plus the model's eos ids, none of them sampled before min_tokens (the stop token is kept in the
output, finish_reason "stop"; reaching max_tokens is "length"). Finished rows are fed pad tokens until the
whole batch is done.

With `Sampling.logprobs`, each output carries the log-probability of every returned token under the
model's raw distribution: log_softmax of the unmodified logits, before repetition penalty,
temperature, top-k and top-p (vLLM's default `logprobs_mode="raw_logprobs"`); with `--logprobs-mode
processed`, under the distribution the token was sampled from: after the penalty, temperature, top-k
and top-p (vLLM's `processed_logprobs`; a greedy row's: after the penalty alone).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from rmsft.model_folder import is_vision_language
from rollout_engine.config import ServeConfig
from rollout_engine.engine import (
    EngineDead,
    EngineError,
    EngineInputError,
    GenItem,
    GenOutput,
    Sampling,
    chat_prompt_ids,
)

if TYPE_CHECKING:
    import torch

# Rows per forward pass; more prompts run as further batches (bounds KV-cache and logits memory).
MAX_BATCH_ROWS = 64


class HfEngine:
    backend = "hf"
    lora_enabled = False
    max_lora_rank = 0

    def __init__(self, cfg: ServeConfig):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if is_vision_language(cfg.model):
            raise EngineError(
                f"--backend hf serves text models only; {cfg.model} is a vision-language model: "
                "serve it with --backend vllm (spec.rollout.engine: vllm)"
            )
        self.vision = None
        self.model = cfg.model
        self.tensor_parallel_size = 1
        self.max_model_len = cfg.max_model_len
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
            # transformers types PreTrainedModel.to as an unbound wrapper (it wants the model as its first argument)
            self.hf = AutoModelForCausalLM.from_pretrained(cfg.model).to(self.device).eval()  # type: ignore[arg-type]
        except Exception as e:
            raise EngineError(f"transformers failed to load {cfg.model}: {type(e).__name__}: {e}") from e
        self.vocab_size = self.hf.config.get_text_config().vocab_size
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = set(self._as_list(self.hf.generation_config.eos_token_id))
        self.processed_logprobs = cfg.logprobs_mode == "processed"

    @classmethod
    def around(cls, model, tokenizer, *, max_model_len: int, logprobs_mode: str = "raw", name: str = "") -> HfEngine:
        """An engine that decodes with an already loaded model (the learner's own, in colocate mode): no copy,
        so it always generates with the model's current weights."""
        self = cls.__new__(cls)
        self.vision = None
        self.model = name or getattr(model.config, "_name_or_path", "model")
        self.tensor_parallel_size = 1
        self.max_model_len = max_model_len
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.hf = model
        self.vocab_size = model.config.get_text_config().vocab_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        gen = getattr(model, "generation_config", None)
        self.eos_ids = set(self._as_list(gen.eos_token_id if gen is not None else tokenizer.eos_token_id))
        self.processed_logprobs = logprobs_mode == "processed"
        return self

    @staticmethod
    def _as_list(x) -> list[int]:
        return [] if x is None else [x] if isinstance(x, int) else list(x)

    def generate(self, items: list[GenItem]) -> list[GenOutput]:
        if any(it.images for it in items):
            raise EngineError("the hf backend serves text-only models; send token ids or messages")
        if any(it.sampling.stop for it in items):
            raise EngineError("the hf backend does not support stop strings; use stop_token_ids")
        if any(not it.prompt_token_ids for it in items):
            # A fully padded row has no position to read logits from (vLLM refuses empty prompts too).
            raise EngineInputError("the hf backend cannot generate from an empty prompt")
        out: list[GenOutput | None] = [None] * len(items)
        # Batching by similar prompt length only saves padding: a row's result does not depend on its batch.
        order = sorted(range(len(items)), key=lambda i: len(items[i].prompt_token_ids))
        for start in range(0, len(order), MAX_BATCH_ROWS):
            idx = order[start : start + MAX_BATCH_ROWS]
            for i, o in zip(idx, self._decode([items[i] for i in idx]), strict=True):
                out[i] = o
        return out  # type: ignore[return-value]

    def _decode(self, items: list[GenItem]) -> list[GenOutput]:
        """One left-padded batch, decoded step by step with a KV cache until every row has finished."""
        import torch

        dev = self.device
        n = len(items)
        width = max(len(it.prompt_token_ids) for it in items)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for r, it in enumerate(items):
            k = len(it.prompt_token_ids)
            ids[r, width - k :] = torch.tensor(it.prompt_token_ids, dtype=torch.long)
            mask[r, width - k :] = 1
        ids, mask = ids.to(dev), mask.to(dev)

        gens = []
        for it in items:
            g = torch.Generator(device=dev)
            if it.sampling.seed is None:
                g.seed()  # fresh randomness, as vLLM gives an unseeded request
            else:
                g.manual_seed(it.sampling.seed)
            gens.append(g)
        want_lp = [it.sampling.logprobs for it in items]
        stops = [self.eos_ids | set(it.sampling.stop_token_ids) for it in items]
        toks: list[list[int]] = [[] for _ in items]
        lps: list[list[float]] = [[] for _ in items]
        reasons: list[str | None] = ["length" if it.sampling.max_tokens <= 0 else None for it in items]

        # Tokens already in each row's prompt + output, kept only when some row penalizes repetition
        # (HF's input_ids would include the left padding; this is the row's own tokens only).
        seen = None
        if any(it.sampling.repetition_penalty != 1.0 for it in items):
            seen = torch.zeros((n, self.hf.config.get_text_config().vocab_size), dtype=torch.bool, device=dev)
            seen[mask.bool().nonzero(as_tuple=True)[0], ids[mask.bool()]] = True

        cache = None
        step_ids = ids
        with torch.no_grad():
            while any(r is None for r in reasons):
                # Positions count real tokens only, so a left-padded row sees the positions it would alone.
                pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
                res = self.hf(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                cache = res.past_key_values
                logits = res.logits[:, -1, :].float()
                live = [r for r in range(n) if reasons[r] is None]
                picked = [
                    self._pick(
                        logits[r],
                        items[r].sampling,
                        gens[r],
                        None if seen is None else seen[r],
                        want_lp[r],
                        self.processed_logprobs,
                        stops[r] if len(toks[r]) < items[r].sampling.min_tokens else (),
                    )
                    for r in live
                ]
                # One device->host copy per step rather than one per row.
                chosen = torch.stack([t for t, _ in picked]).tolist()
                chosen_lp = torch.stack([lp for _, lp in picked]).tolist() if any(want_lp) else [0.0] * len(live)
                nxt = torch.full((n, 1), self.pad_id, dtype=torch.long)
                for r, t, lp in zip(live, chosen, chosen_lp, strict=True):
                    toks[r].append(t)
                    lps[r].append(lp)
                    nxt[r, 0] = t
                    if t in stops[r]:
                        reasons[r] = "stop"
                    elif len(toks[r]) >= items[r].sampling.max_tokens:
                        reasons[r] = "length"
                if seen is not None:
                    seen[torch.tensor(live, device=dev), torch.tensor(chosen, device=dev)] = True
                if all(r is not None for r in reasons):
                    break  # no forward pass for tokens nobody will read
                step_ids = nxt.to(dev)
                # Finished rows keep a 1 too: their pad tokens are never read, and one mask update serves all rows.
                mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=1)

        return [
            GenOutput(list(it.prompt_token_ids), toks[r], reasons[r] or "length", lps[r] if want_lp[r] else None)
            for r, it in enumerate(items)
        ]

    @staticmethod
    def _pick(
        raw: torch.Tensor,
        s: Sampling,
        g: torch.Generator,
        seen: torch.Tensor | None,
        want_lp: bool,
        processed: bool = False,
        blocked: Collection[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token of one row (and its log-prob, raw or `processed`, or 0 when not asked), from that row's
        logits alone; `blocked` tokens (the stop tokens before min_tokens) cannot be picked."""
        import torch

        x = raw
        if blocked:
            x = x.index_fill(0, torch.tensor(sorted(blocked), device=x.device), float("-inf"))
        if s.repetition_penalty != 1.0 and seen is not None:
            # HF's rule: a seen token gets less likely whatever its logit's sign (divide if > 0, else multiply).
            x = torch.where(seen, torch.where(x > 0, x / s.repetition_penalty, x * s.repetition_penalty), x)
        if s.temperature < 1e-5:  # vLLM's greedy cutoff (a tinier temperature overflows float32)
            tok = torch.argmax(x)
        else:
            x = x / s.temperature
            if 0 < s.top_k < x.shape[-1]:
                kth = torch.topk(x, s.top_k).values[-1]
                x = x.masked_fill(x < kth, float("-inf"))
            if s.top_p < 1.0:
                srt, order = torch.sort(x, descending=True)
                p = torch.softmax(srt, dim=-1)
                # Keep the smallest prefix reaching top_p: a token goes when the ones above it already do.
                drop = (torch.cumsum(p, dim=-1) - p) >= s.top_p
                drop[0] = False
                x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
            tok = torch.multinomial(torch.softmax(x, dim=-1), 1, generator=g)[0]
        lp = torch.log_softmax(x if processed else raw, dim=-1)[tok] if want_lp else raw.new_zeros(())
        return tok, lp

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def apply_full(self, index_path: str | None) -> None:
        import torch

        from rollout_engine.staged_file import iter_staged_tensors

        if index_path is None:
            raise EngineError("the hf backend cannot roll back to the checkpoint")
        params = dict(self.hf.named_parameters())
        params.update(dict(self.hf.named_buffers()))
        with torch.no_grad():
            for name, t in iter_staged_tensors(index_path):
                if name in params:
                    params[name].copy_(t)

    def join_weight_group(self, init_info: dict) -> None:
        """Transport nccl's CPU stand-in, in this process (the hf backend has one worker)."""
        from rmsft.weight_wire.transfer import open_group

        self._group = None
        try:
            self._group = open_group(
                init_info["master_address"],
                init_info["master_port"],
                init_info["rank_offset"],
                init_info["world_size"],
                init_info["timeout_s"],
            )
            self._bucket_bytes = int(init_info.get("bucket_bytes", 0))
        except Exception as e:
            raise EngineError(f"joining the learner's weight-transfer group failed: {e}") from e

    def receive_weights(self, update_info: dict) -> None:
        """Every tensor arrives before any is loaded (`receive_whole`): an update the learner called off, or one
        whose group broke, leaves the model as it was (EngineError: nothing applied)."""
        import torch

        from rmsft.weight_wire.transfer import GroupAborted, receive_whole

        if getattr(self, "_group", None) is None:
            raise EngineError("this engine is in no weight-transfer group")
        params = dict(self.hf.named_parameters())
        params.update(dict(self.hf.named_buffers()))
        try:
            tensors = receive_whole(
                self._group,
                update_info["names"],
                update_info["dtype_names"],
                update_info["shapes"],
                getattr(self, "_bucket_bytes", 0),
            )
        except GroupAborted as e:
            self._group = None  # broken: the learner builds a new group, which this engine joins again
            raise EngineError(str(e)) from e
        try:
            with torch.no_grad():
                for name, t in tensors:
                    if name in params:
                        params[name].copy_(t)
        except Exception as e:  # some tensors are in, the rest not
            raise EngineDead(
                f"loading the weights received over the weight-transfer group failed: {e}; the "
                "weights are partly replaced"
            ) from e

    def apply_adapter(self, adapter_dir: str, adapter_id: int, name: str) -> None:
        raise EngineError("the hf backend does not serve LoRA adapters")

    def clear_adapter(self) -> None:
        pass  # never holds an adapter (apply_adapter refuses)

    def reset_prefix_cache(self) -> None:
        pass  # no prefix cache: every generate runs the whole prompt

    def close(self) -> None:
        pass  # nothing outside the process: the model goes with the object
