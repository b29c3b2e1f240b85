"""`rmsft.model_check`: whether a model folder fits training.format, from its tokenizer files alone; the same
verdict as the learner's own check when it loads the tokenizer, in a fraction of the time and without torch."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rmsft.model_check import ModelCheckError, check_model, tokenizer_tokens
from rmsft.prepare_model import COORD_TOKENS

ROOT = Path(__file__).resolve().parent.parent


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_coordexp_tokenizer_fits_both_formats(tokenizer_folders: dict[str, Path]) -> None:
    folder = tokenizer_folders["coordexp"]
    assert "1000 coordinate tokens" in check_model(folder, "coordexp")
    assert "qwen_json needs nothing more" in check_model(folder, "qwen_json")


def test_a_stock_tokenizer_fits_qwen_json_only_and_the_message_names_both_fixes(
    tokenizer_folders: dict[str, Path],
) -> None:
    folder = tokenizer_folders["stock"]
    assert "qwen_json" in check_model(folder, "qwen_json")
    with pytest.raises(ModelCheckError) as err:
        check_model(folder, "coordexp")
    said = str(err.value)
    assert "none of the 1000 coordinate tokens" in said and "(spec.model.path)" in said
    assert f"rmsft prepare-model {folder} DST" in said and "set spec.model.path to DST" in said
    assert "spec.training.format: qwen_json" in said


@pytest.mark.parametrize("name", ["coordexp", "stock"])
def test_the_verdict_is_the_learners(tokenizer_folders: dict[str, Path], name: str) -> None:
    """The learner's VocabView (loaded through transformers) refuses exactly the tokenizers the check refuses."""
    from transformers import AutoTokenizer

    from learner.core.vocab import VocabView

    folder = tokenizer_folders[name]
    tok = AutoTokenizer.from_pretrained(folder)
    tokens = tokenizer_tokens(folder)
    assert all(tokens[t] == tok.convert_tokens_to_ids(t) for t in COORD_TOKENS if t in tokens)
    if name == "coordexp":
        check_model(folder, "coordexp")
        assert len(VocabView.from_hf_tokenizer(tok, coord_tokens=True).coord_token_ids) == 1000
    else:
        with pytest.raises(ModelCheckError):
            check_model(folder, "coordexp")
        with pytest.raises(ValueError, match="prepare-model"):
            VocabView.from_hf_tokenizer(tok, coord_tokens=True)


@pytest.mark.parametrize("layout", ["added_tokens.json", "tokenizer_config.json"])
def test_the_slow_tokenizer_files_count_too(tokenizer_folders: dict[str, Path], tmp_path: Path, layout: str) -> None:
    """Checkpoints list added tokens in tokenizer_config.json (added_tokens_decoder) or added_tokens.json,
    with the base vocabulary in vocab.json; a folder without tokenizer.json is read from those."""
    coord = tokenizer_tokens(tokenizer_folders["coordexp"])
    folder = _copy(tokenizer_folders["stock"], tmp_path / "m")
    base = tokenizer_tokens(folder)
    (folder / "tokenizer.json").unlink()
    (folder / "vocab.json").write_text(json.dumps(base))
    with pytest.raises(ModelCheckError, match="none of the 1000"):
        check_model(folder, "coordexp")
    added = {t: coord[t] for t in COORD_TOKENS}
    if layout == "added_tokens.json":
        (folder / "added_tokens.json").write_text(json.dumps(added))
    else:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["added_tokens_decoder"] = {str(i): {"content": t, "special": False} for t, i in added.items()}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert "1000 coordinate tokens" in check_model(folder, "coordexp")


def _with_tokens(src: Path, dst: Path, keep: int) -> Path:
    folder = _copy(src, dst)
    data = json.loads((folder / "tokenizer.json").read_text())
    drop = set(COORD_TOKENS[keep:])
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in drop]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_some_coord_tokens_are_not_enough(tokenizer_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _with_tokens(tokenizer_folders["coordexp"], tmp_path / "half", 500)
    with pytest.raises(
        ModelCheckError,
        match=r"has 500 of the 1000 coordinate tokens .*no <\|coord_500\|>.*"
        r"start from the stock checkpoint",
    ):
        check_model(folder, "coordexp")


def test_coord_tokens_past_the_embedding_rows_are_refused(tokenizer_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(tokenizer_folders["coordexp"], tmp_path / "rows")
    rows = max(tokenizer_tokens(folder)[t] for t in COORD_TOKENS)  # one row short of the last coord token
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "text_config": {"vocab_size": rows}}))
    with pytest.raises(ModelCheckError, match=f"only {rows} embedding rows"):
        check_model(folder, "coordexp")


def test_what_is_no_model_folder_is_named(tokenizer_folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ModelCheckError, match=f"model folder {tmp_path / 'nope'} does not exist"):
        check_model(tmp_path / "nope", "qwen_json")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelCheckError, match="is a file, not a model folder"):
        check_model(tmp_path / "file", "qwen_json")
    with pytest.raises(ModelCheckError, match="it has no config.json"):
        check_model(tmp_path, "qwen_json")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    with pytest.raises(ModelCheckError, match="has no tokenizer"):
        check_model(bare, "qwen_json")
    broken = _copy(tokenizer_folders["coordexp"], tmp_path / "broken")
    (broken / "tokenizer.json").write_text('{"added_tokens": [')
    with pytest.raises(ModelCheckError, match="tokenizer.json cannot be read as JSON"):
        check_model(broken, "coordexp")


def test_the_check_needs_neither_torch_nor_transformers() -> None:
    code = (
        "import sys; import rmsft.model_check as m; "
        "print(sorted(k for k in ('torch', 'transformers', 'tokenizers') if k in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_rmsft_local_refuses_before_any_server_starts(tokenizer_folders: dict[str, Path], tmp_path: Path) -> None:
    from rich.console import Console

    from learner.local import run_local

    doc = yaml.safe_load((ROOT / "configs/local-tiny.yaml").read_text())
    doc["metadata"].pop("annotations", None)  # nothing to build: the stock folder is the model
    doc["spec"]["model"]["path"] = str(tokenizer_folders["stock"])
    doc["spec"]["training"]["data"]["path"] = str(tmp_path / "absent.jsonl")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ModelCheckError, match="rmsft prepare-model"):
        run_local(tmp_path / "job.yaml", work_dir=tmp_path / "work", console=Console(file=io.StringIO()))
    assert not (tmp_path / "work").exists()  # no server log: nothing was started
