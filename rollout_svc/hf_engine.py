"""HF transformers engine (explicit `--backend hf`): batched `generate`, for debugging and for
machines without vLLM. Greedy requests run as one left-padded batch; seeded sampling runs one
prompt at a time because `generate` has no per-row seed."""

from __future__ import annotations

from rmsft.model_folder import is_vision_language
from rollout_svc.config import ServeConfig
from rollout_svc.engine import EngineError, GenItem, GenOutput


class HfEngine:
    backend = "hf"
    lora_enabled = False
    max_lora_rank = 0

    def __init__(self, cfg: ServeConfig):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if is_vision_language(cfg.model):
            raise EngineError(f"--backend hf serves text models only; {cfg.model} is a vision-language model: "
                              "serve it with --backend vllm (spec.rollout.engine: vllm)")
        self.vision = None
        self.model = cfg.model
        self.tensor_parallel_size = 1
        self.max_model_len = cfg.max_model_len
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
            self.hf = AutoModelForCausalLM.from_pretrained(cfg.model).to(self.device).eval()
        except Exception as e:
            raise EngineError(f"transformers failed to load {cfg.model}: {type(e).__name__}: {e}") from e
        self.vocab_size = self.hf.config.get_text_config().vocab_size
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = set(self._as_list(self.hf.generation_config.eos_token_id))

    @staticmethod
    def _as_list(x) -> list[int]:
        return [] if x is None else [x] if isinstance(x, int) else list(x)

    def _run(self, items: list[GenItem]) -> list[GenOutput]:
        import torch

        s = items[0].sampling
        width = max(len(it.prompt_token_ids) for it in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, it in enumerate(items):
            n = len(it.prompt_token_ids)
            ids[i, width - n :] = torch.tensor(it.prompt_token_ids)
            mask[i, width - n :] = 1
        eos = sorted(self.eos_ids | set(s.stop_token_ids))
        kwargs = dict(max_new_tokens=s.max_tokens, eos_token_id=eos or None, pad_token_id=self.pad_id)
        if s.temperature > 0:
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p,
                          top_k=s.top_k if s.top_k > 0 else None)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if s.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = s.repetition_penalty
        if s.seed is not None:
            torch.manual_seed(s.seed)
        with torch.no_grad():
            out = self.hf.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs)
        res = []
        for i, it in enumerate(items):
            toks = out[i, width:].tolist()
            reason = "length"
            for j, t in enumerate(toks):
                if t in eos:
                    toks, reason = toks[: j + 1], "stop"
                    break
            res.append(GenOutput(list(it.prompt_token_ids), toks, reason))
        return res

    def generate(self, items: list[GenItem]) -> list[GenOutput]:
        if any(it.images for it in items):
            raise EngineError("the hf backend serves text-only models; send token ids or messages")
        if any(it.sampling.stop for it in items):
            raise EngineError("the hf backend does not support stop strings; use stop_token_ids")
        out: list[GenOutput | None] = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for i, it in enumerate(items):
            s = it.sampling
            key = (s.max_tokens, s.repetition_penalty, s.stop_token_ids) if s.temperature == 0 else ("one", i)
            groups.setdefault(key, []).append(i)
        for idx in groups.values():
            for i, o in zip(idx, self._run([items[i] for i in idx]), strict=True):
                out[i] = o
        return out  # type: ignore[return-value]

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def apply_full(self, index_path: str | None) -> None:
        import torch

        from rollout_svc.staging import iter_staged_tensors

        if index_path is None:
            raise EngineError("the hf backend cannot roll back to the checkpoint")
        params = dict(self.hf.named_parameters())
        params.update(dict(self.hf.named_buffers()))
        with torch.no_grad():
            for name, t in iter_staged_tensors(index_path):
                if name in params:
                    params[name].copy_(t)

    def apply_adapter(self, adapter_dir: str, adapter_id: int, name: str) -> None:
        raise EngineError("the hf backend does not serve LoRA adapters")

    def clear_adapter(self) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        pass

    def close(self) -> None:
        pass
