"""A tiny, download-free Qwen2-style model with the CoordExp vocabulary, for tests and `rmsft local`.

The tokenizer is a byte-level BPE trained on generated detection-style strings, plus the chat
special tokens and the 1000 `<|coord_k|>` tokens; the model is a random-weight Qwen2 with
head_dim 64 (vLLM's CPU attention rejects 16). Same seed, same bytes on disk.

`coord_tokens=False` builds a "stock" model instead: the same tokenizer (same BPE merges, same ids)
without the coord tokens, as a real Qwen checkpoint comes, for `rmsft prepare-model` to convert.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rmsft.prepare_model import COORD_TOKENS

CHAT_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CLASS_NAMES = [
    "person",
    "car",
    "dog",
    "cat",
    "bicycle",
    "traffic light",
    "chair",
    "bottle",
    "cup",
    "bird",
    "horse",
    "truck",
    "boat",
    "bench",
    "umbrella",
    "red apple",
]
MARKER_FILE = "rmsft_tiny_model.json"


def _corpus(rng: random.Random, n: int = 400) -> list[str]:
    """Strings shaped like prompts and CoordExp answers, so BPE learns useful merges."""
    lines = []
    for _ in range(n):
        objs = []
        for i in range(rng.randint(1, 4)):
            name = rng.choice(CLASS_NAMES)
            if rng.random() < 0.8:
                geom = '"bbox_2d": [' + ", ".join(f'"<|coord_{rng.randrange(1000)}|>"' for _ in range(4)) + "]"
            else:
                geom = '"poly": [' + ", ".join(f'"<|coord_{rng.randrange(1000)}|>"' for _ in range(6)) + "]"
            objs.append(f'"object_{i + 1}": {{"desc": "{name}", {geom}}}')
        lines.append("{" + ", ".join(objs) + "}")
        lines.append(
            "Detect every object in the image and answer in JSON. The image shows "
            + ", ".join(rng.sample(CLASS_NAMES, 3))
            + "."
        )
    return lines


def build_tokenizer(
    seed: int = 0,
    special_tokens: list[str] = CHAT_SPECIAL_TOKENS,
    chat_template: str = CHAT_TEMPLATE,
    coord_tokens: bool = True,
):
    """Byte-level BPE tokenizer wrapped as a `PreTrainedTokenizerFast` with a chat template; with
    `coord_tokens=False` the same tokenizer without the `<|coord_k|>` tokens (a stock vocabulary)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(rng), trainer=trainer)
    # Coord tokens are ordinary added tokens (not "special"): decode must keep them. They come after
    # the trained vocabulary, so a stock build differs only by their absence (every other id is equal).
    if coord_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in COORD_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=special_tokens[1:],
    )
    fast.chat_template = chat_template
    return fast


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    max_position_embeddings: int = 8192,
    coord_tokens: bool = True,
) -> Path:
    """Write tokenizer + random Qwen2 weights to `out_dir` and return it. Idempotent per (seed, sizes, coord_tokens).
    `coord_tokens=False`: a stock model whose tokenizer has no `<|coord_k|>` tokens."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    marker = out / MARKER_FILE
    params = {
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "max_position_embeddings": max_position_embeddings,
    } | ({} if coord_tokens else {"coord_tokens": False})  # default builds keep their old marker (no rebuild)
    if marker.exists() and json.loads(marker.read_text()) == params:
        return out
    out.mkdir(parents=True, exist_ok=True)
    # Another build's marker goes first: a build that stops half way must not pass for the earlier one.
    marker.unlink(missing_ok=True)

    tokenizer = build_tokenizer(seed, coord_tokens=coord_tokens)
    head_dim = 64
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        # Wider than the usual 0.02 so greedy decoding has clear winners: transformers and
        # vLLM must agree token for token despite float rounding differences.
        initializer_range=0.08,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    marker.write_text(json.dumps(params))
    return out
