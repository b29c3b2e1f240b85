"""`rmsft prepare-model`: a stock checkpoint (no <|coord_k|> tokens) becomes CoordExp-ready, and nothing
else about the model changes; the stock tiny models it is tested on (`coord_tokens=False`)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rmsft.prepare_model import COORD_TOKENS, MARKER_FILE, ORDER_SCALE, PrepareModelError, coord_rows, prepare_model
from rmsft_dev.tiny_model import build_tiny_model
from rmsft_dev.tiny_vl import build_tiny_vl_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def stock_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("stock-text"), coord_tokens=False)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def stock_vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from rmsft.vl_processor import register

    register()
    return request.param, build_tiny_vl_model(
        tmp_path_factory.mktemp(f"stock-{request.param}"), arch=request.param, coord_tokens=False
    )


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _embedding_key(tensors: dict[str, torch.Tensor]) -> str:
    (key,) = [k for k in tensors if k.endswith("embed_tokens.weight")]
    return key


# ---------------------------------------------------------------- stock tiny models


def test_stock_tiny_model_is_the_coordexp_one_without_coord_tokens(
    tmp_path: Path, stock_text: Path, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    stock, coord = AutoTokenizer.from_pretrained(stock_text), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert not set(COORD_TOKENS) & set(stock.get_vocab())
    assert {t: i for t, i in coord.get_vocab().items() if t not in set(COORD_TOKENS)} == stock.get_vocab()
    assert stock.chat_template == coord.chat_template and stock.eos_token == coord.eos_token
    cfg_stock, cfg_coord = (json.loads((d / "config.json").read_text()) for d in (stock_text, tiny_model_dir))
    assert cfg_stock.pop("vocab_size") == len(stock) and cfg_coord.pop("vocab_size") == len(coord)
    assert cfg_stock == cfg_coord
    # The markers keep the two apart: each build over the other rebuilds, none is mistaken for the other.
    folder = tmp_path / "m"
    build_tiny_model(folder, coord_tokens=False)
    assert "<|coord_0|>" not in AutoTokenizer.from_pretrained(folder).get_vocab()
    build_tiny_model(folder)
    assert "<|coord_0|>" in AutoTokenizer.from_pretrained(folder).get_vocab()
    build_tiny_model(folder, coord_tokens=False)
    assert "<|coord_0|>" not in AutoTokenizer.from_pretrained(folder).get_vocab()
    # A default build's marker is what it was before the option existed (old folders are not rebuilt).
    assert json.loads((tiny_model_dir / "rmsft_tiny_model.json").read_text()).get("coord_tokens") is None


def test_stock_vl_marker_and_rebuild(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = tmp_path / "vl"
    build_tiny_vl_model(folder, arch="qwen2_5_vl", coord_tokens=False)
    assert "<|coord_5|>" not in AutoTokenizer.from_pretrained(folder).get_vocab()
    build_tiny_vl_model(folder, arch="qwen2_5_vl")
    tok = AutoTokenizer.from_pretrained(folder)
    assert "<|coord_5|>" in tok.get_vocab()
    assert json.loads((folder / "config.json").read_text())["text_config"]["vocab_size"] == len(tok)


def test_cli_builds_a_stock_model(tmp_path: Path) -> None:
    out = tmp_path / "stock"
    res = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "dev", "tiny-model", str(out), "--stock"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "stock" in res.stderr
    assert "<|coord_0|>" not in (out / "tokenizer.json").read_text()


# ---------------------------------------------------------------- the ordered initialisation


def test_coord_rows_are_the_mean_plus_an_ordered_half_circle() -> None:
    g = torch.Generator().manual_seed(3)
    old = torch.randn(300, 32, generator=g) * 0.5 + 1.0
    rows = coord_rows(old)
    mean = old.mean(0)
    radius = (old - mean).pow(2).sum(1).mean().sqrt()
    assert rows.shape == (1000, 32)
    # Each row sits at ORDER_SCALE x the old rows' spread from their mean.
    dist = (rows - mean).norm(dim=1)
    torch.testing.assert_close(dist, torch.full((1000,), float(ORDER_SCALE * radius)), rtol=1e-4, atol=1e-5)
    # Distance from bin 0 grows with the bin index: neighbours start close, far bins apart.
    from_first = (rows - rows[0]).norm(dim=1)
    assert bool((from_first[1:] > from_first[:-1]).all())
    assert float((rows[1] - rows[0]).norm()) < 0.01 * float((rows[999] - rows[0]).norm())
    assert torch.equal(coord_rows(old), rows)  # deterministic: the same bytes on every run


# ---------------------------------------------------------------- vision-language models


def _vl_inputs(processor, text: str, n_images: int):
    from PIL import Image

    images = [Image.new("RGB", (96 + 32 * i, 64), (40 * i, 180, 90)) for i in range(n_images)]
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return processor(text=[rendered], images=images or None, return_tensors="pt")


def test_prepare_vl_model(tmp_path: Path, stock_vl: tuple[str, Path]) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from learner.core.vocab import VocabView
    from learner.train.policy import load_processor

    arch, src = stock_vl
    src_files = _digests(src)
    dst = tmp_path / "prepared"
    summary = prepare_model(src, dst)
    assert summary.changed and summary.tokens_added == 1000 and summary.tied and summary.vision_language
    assert (summary.old_vocab, summary.new_vocab, summary.old_rows, summary.new_rows) == (1200, 2200, 1200, 2200)
    assert _digests(src) == src_files  # SRC untouched

    # The tokenizer: the 1000 tokens as ordinary added tokens after the old vocabulary, exactly the ids
    # the CoordExp build of the same tiny model has; rmsft's vocabulary view accepts it.
    tok = AutoTokenizer.from_pretrained(dst)
    vocab = VocabView.from_hf_tokenizer(tok)
    assert list(vocab.coord_token_ids) == list(range(1200, 2200))
    assert not any(tok.added_tokens_decoder[i].special for i in vocab.coord_token_ids)
    text = '{"object_1": {"desc": "person", "bbox_2d": ["<|coord_7|>", "<|coord_993|>"]}}'
    ids = tok.encode(text, add_special_tokens=False)
    assert 1207 in ids and 2193 in ids and tok.decode(ids) == text
    coord_build = AutoTokenizer.from_pretrained(build_tiny_vl_model(tmp_path / "coord", arch=arch))
    assert tok.get_vocab() == coord_build.get_vocab()

    # Config: vocabulary sizes agree (nested text_config), nothing else changed.
    cfg_src, cfg_dst = (json.loads((d / "config.json").read_text()) for d in (src, dst))
    assert cfg_dst["text_config"].pop("vocab_size") == 2200 and cfg_src["text_config"].pop("vocab_size") == 1200
    for cfg in (cfg_src, cfg_dst):
        for section in (cfg, cfg["text_config"], cfg["vision_config"]):
            section.pop("dtype", None)
    assert cfg_src == cfg_dst
    # Every other file of SRC is there as it was (processor config, generation config, chat template);
    # the tiny builder's marker is not (the folder is no tiny build).
    dst_files = _digests(dst)
    for name in ("processor_config.json", "generation_config.json", "chat_template.jinja"):
        assert dst_files[name] == src_files[name], name
    assert "rmsft_tiny_vl_model.json" not in dst_files and MARKER_FILE in dst_files

    # Weights: old rows bit for bit, new rows as documented, every other tensor unchanged.
    before, after = _safetensors(src), _safetensors(dst)
    key = _embedding_key(before)
    assert set(before) == set(after)
    assert torch.equal(after[key][:1200], before[key])
    assert torch.equal(after[key][1200:], coord_rows(before[key]))
    assert all(torch.equal(before[k], after[k]) for k in before if k != key)

    # The processor loads from DST and renders prompts as SRC's does (same ids: no coord token in them).
    p_src, p_dst = load_processor(src), load_processor(dst)
    m_src = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    m_dst = AutoModelForImageTextToText.from_pretrained(dst, dtype=torch.float32).eval()
    assert m_dst.get_output_embeddings().weight.data_ptr() == m_dst.get_input_embeddings().weight.data_ptr()
    for n_images, prompt in (
        (0, "Detect every shape."),
        (1, "Detect every shape in the image."),
        (2, "What is there?"),
    ):
        enc_src, enc_dst = _vl_inputs(p_src, prompt, n_images), _vl_inputs(p_dst, prompt, n_images)
        assert torch.equal(enc_src["input_ids"], enc_dst["input_ids"])
        with torch.no_grad():
            out_src = m_src(**enc_src, output_hidden_states=True)
            out_dst = m_dst(**enc_dst, output_hidden_states=True)
        # Same hidden states; the old tokens' logits equal up to matmul blocking; the new tokens'
        # logits never beat the best old one (their rows sit near the mean).
        assert torch.equal(out_src.hidden_states[-1], out_dst.hidden_states[-1])
        torch.testing.assert_close(out_dst.logits[..., :1200], out_src.logits, rtol=1e-5, atol=1e-5)
        assert bool((out_dst.logits[..., 1200:].max(-1).values < out_src.logits.max(-1).values).all())
        # Greedy answers: equal with the new tokens masked, and also without the mask.
        eos = p_src.tokenizer.eos_token_id
        kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        with torch.no_grad():
            want = m_src.generate(**enc_src, **kw)
            masked = m_dst.generate(**enc_dst, suppress_tokens=list(range(1200, 2200)), **kw)
            plain = m_dst.generate(**enc_dst, **kw)
        assert torch.equal(want, masked) and torch.equal(want, plain)

    # Idempotent: a second run changes nothing and says so; DST itself needs nothing.
    again = prepare_model(src, dst)
    assert not again.changed and "already holds" in again.reason and again.tokens_added == 1000
    assert _digests(dst) == dst_files
    twice = prepare_model(dst, tmp_path / "twice")
    assert not twice.changed and "nothing to do" in twice.reason and not (tmp_path / "twice").exists()


# ---------------------------------------------------------------- text models, tied and untied


def _untied_copy(src: Path, dst: Path) -> Path:
    """The stock text model with an output head of its own (random rows), as untied checkpoints come."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(src, dst)
    (dst / "rmsft_tiny_model.json").unlink()
    config = AutoConfig.from_pretrained(src)
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_pretrained(src, config=config, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=g) * 0.08)
    model.save_pretrained(dst)
    return dst


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_prepare_text_model(tmp_path: Path, stock_text: Path, tied: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.core.vocab import VocabView
    from learner.train.policy import prompt_ids

    src = stock_text if tied else _untied_copy(stock_text, tmp_path / "untied")
    dst = tmp_path / "prepared"
    summary = prepare_model(src, dst)
    assert summary.changed and summary.tied is tied and not summary.vision_language
    assert json.loads((dst / "config.json").read_text())["vocab_size"] == 2200
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"] is tied
    VocabView.from_hf_tokenizer(AutoTokenizer.from_pretrained(dst))

    before, after = _safetensors(src), _safetensors(dst)
    key = _embedding_key(before)
    assert torch.equal(after[key][:1200], before[key])
    assert torch.equal(after[key][1200:], coord_rows(before[key]))
    if tied:
        assert "lm_head.weight" not in after
    else:  # the head's new rows come from the head's own rows, not from the input embeddings
        assert torch.equal(after["lm_head.weight"][:1200], before["lm_head.weight"])
        assert torch.equal(after["lm_head.weight"][1200:], coord_rows(before["lm_head.weight"]))

    tok = AutoTokenizer.from_pretrained(src)
    m_src = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    m_dst = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    for text in ("Detect every object in the image and answer in JSON.", "Find the cars."):
        ids = torch.tensor([prompt_ids(tok, [{"role": "user", "content": text}])])
        with torch.no_grad():
            a, b = m_src(ids).logits, m_dst(ids).logits
            torch.testing.assert_close(b[..., :1200], a, rtol=1e-5, atol=1e-5)
            kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
            want = m_src.generate(ids, **kw)
            assert torch.equal(m_dst.generate(ids, suppress_tokens=list(range(1200, 2200)), **kw), want)
            assert torch.equal(m_dst.generate(ids, **kw), want)


def test_prepare_keeps_a_bf16_checkpoint_bf16(tmp_path: Path, stock_text: Path) -> None:
    import shutil

    from transformers import AutoModelForCausalLM

    src = tmp_path / "bf16"
    shutil.copytree(stock_text, src)
    AutoModelForCausalLM.from_pretrained(stock_text, dtype=torch.bfloat16).save_pretrained(src)
    summary = prepare_model(src, tmp_path / "out")
    assert summary.dtype == "bfloat16"
    before, after = _safetensors(src), _safetensors(tmp_path / "out")
    key = _embedding_key(before)
    assert after[key].dtype == torch.bfloat16 and torch.equal(after[key][:1200], before[key])
    assert torch.equal(after[key][1200:], coord_rows(before[key]).to(torch.bfloat16))


# ---------------------------------------------------------------- refusals


def test_refusals(tmp_path: Path, stock_text: Path) -> None:
    import shutil

    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PrepareModelError, match="no config.json"):
        prepare_model(empty, tmp_path / "a")
    with pytest.raises(PrepareModelError, match="no such folder"):
        prepare_model(tmp_path / "missing", tmp_path / "a")
    (empty / "config.json").write_text('{"hello": 1}')
    with pytest.raises(PrepareModelError, match="not a transformers model config"):
        prepare_model(empty, tmp_path / "a")

    # Some coord tokens but not all: refused, naming how many.
    partial = tmp_path / "partial"
    shutil.copytree(stock_text, partial)
    tok = AutoTokenizer.from_pretrained(partial)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in COORD_TOKENS[:10]])
    tok.save_pretrained(partial)
    with pytest.raises(PrepareModelError, match="10 of the 1000 coord tokens"):
        prepare_model(partial, tmp_path / "a")

    # A non-empty DST is refused before any work; --overwrite replaces it whole.
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(PrepareModelError, match="not empty.*--overwrite"):
        prepare_model(stock_text, busy)
    assert (busy / "notes.txt").read_text() == "mine"
    assert prepare_model(stock_text, busy, overwrite=True).changed
    assert not (busy / "notes.txt").exists() and (busy / "model.safetensors").exists()
    with pytest.raises(PrepareModelError, match="not SRC itself"):
        prepare_model(stock_text, stock_text, overwrite=True)
    # No temporary folder is left beside DST.
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_refuses_a_non_empty_dst(tmp_path: Path, stock_text: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    res = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "prepare-model", str(stock_text), str(busy)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr
    assert "not empty" in res.stderr and "--overwrite" in res.stderr and "Traceback" not in res.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "prepare-model", str(stock_text), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert "tokens added: 1000" in ok.stderr and "1200 -> 2200" in ok.stderr


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_the_prepared_model_as_transformers_does(tmp_path: Path, stock_text: Path) -> None:
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.train.policy import prompt_ids

    dst = tmp_path / "prepared"
    prepare_model(stock_text, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    ids = [
        prompt_ids(tok, [{"role": "user", "content": t}])
        for t in ("Detect every object in the image and answer in JSON.", "Find the cars.", "Where is the umbrella?")
    ]
    (tmp_path / "prompts.json").write_text(json.dumps({"ids": ids, "max_tokens": 16}))
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "vllm_greedy.py"),
        str(dst),
        str(tmp_path / "prompts.json"),
        str(tmp_path / "out.json"),
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=600
    )
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads((tmp_path / "out.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(stock_text, dtype=torch.float32).eval()  # the stock model
    eos = tok.eos_token_id
    with torch.no_grad():
        for prompt, out in zip(ids, got, strict=True):
            want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=eos)
            assert out == want[0, len(prompt) :].tolist()
