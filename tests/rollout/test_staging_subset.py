"""What a rollout server accepts as a weight stream: FULL updates carrying a subset of the checkpoint
(what training can change), and LoRA adapters named as the model class names its modules (Qwen2.5-VL:
`model.language_model.layers.*` for the checkpoint's `model.layers.*`). No engine, no server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rmsft.weight_wire import ADAPTER, FULL, StreamReader, TensorSpec, WireError, iter_weight_chunks
from rollout_engine.staged_file import iter_staged_tensors
from rollout_svc.staging import Stager, adapter_expectation, full_expectation

# A Qwen2.5-VL-like checkpoint: language model under model.*, vision tower under visual.*, tied head.
TABLE = {
    "model.embed_tokens.weight": TensorSpec("F32", (16, 8)),
    "model.layers.0.self_attn.q_proj.weight": TensorSpec("F32", (8, 8)),
    "model.layers.0.self_attn.q_proj.bias": TensorSpec("F32", (8,)),
    "model.layers.0.mlp.down_proj.weight": TensorSpec("F32", (8, 12)),
    "model.norm.weight": TensorSpec("F32", (8,)),
    "visual.blocks.0.attn.qkv.weight": TensorSpec("F32", (24, 8)),
    "visual.merger.mlp.0.weight": TensorSpec("F32", (8, 32)),
}
LM = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias", "model.norm.weight")


def _tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(spec.shape, generator=g)


def _stream(names, table=TABLE, *, version: int = 1):
    specs = full_expectation(dict(table), True)[0]  # lm_head.weight shaped as the embedding
    tensors = [(n, _tensor(specs[n], k)) for k, n in enumerate(names)]
    return tensors, list(iter_weight_chunks(tensors, number=version, mode=FULL, frame_bytes=64))


def _read(chunks, table, optional, require_all) -> StreamReader:
    reader = StreamReader(expected=table, optional=optional, require_all=require_all)
    for chunk in chunks:
        reader.feed(chunk)
    assert reader.finished
    return reader


def _accept(names, tied: bool = False, required=frozenset(), table=TABLE) -> list[str]:
    _, chunks = _stream(names, table)
    reader = _read(chunks, *full_expectation(dict(table), tied, required))
    return [t.name for t in reader.tensors]


def _refuse(names, tied: bool = False, required=frozenset(), table=TABLE) -> WireError:
    _, chunks = _stream(names, table)
    with pytest.raises(WireError) as err:
        _read(chunks, *full_expectation(dict(table), tied, required))
    return err.value


# ---------------------------------------------------------------- FULL


def test_a_subset_is_accepted_when_nothing_is_required() -> None:
    assert _accept(LM) == list(LM)  # no visual.* tensor: a frozen tower is not resent
    assert _accept(["model.norm.weight"]) == ["model.norm.weight"]
    assert _accept(list(TABLE)) == list(TABLE)  # the whole checkpoint still goes


def test_full_expectation_keeps_the_table_and_marks_only_required_names_mandatory() -> None:
    table, optional, require_all = full_expectation(dict(TABLE), False, {"model.norm.weight"})
    assert table == TABLE and require_all is True
    assert optional == set(TABLE) - {"model.norm.weight"}


def test_the_subset_must_hold_every_required_name() -> None:
    required = set(LM)
    assert _accept([*LM, "model.embed_tokens.weight"], required=required)  # more than required is fine
    # One required tensor left out, the count still in range: refused at the trailer, naming it.
    err = _refuse([*LM[:2], "model.embed_tokens.weight"], required=required)
    assert err.reason == "count"
    assert "model.norm.weight" in str(err) and "earlier" in str(err)


def test_too_few_tensors_for_the_required_names_are_refused_from_the_header() -> None:
    err = _refuse(LM[:2], required=set(LM))
    assert err.reason == "count"
    assert "announces 2 tensors but needs 3 to 7" in str(err)
    assert "earlier FULL update" in str(err)


def test_names_outside_the_checkpoint_are_still_refused() -> None:
    err = _refuse(["model.norm.weight", "lm_head.weight"])  # untied: the checkpoint has no lm_head
    assert err.reason == "name" and "lm_head.weight" in str(err)


@pytest.mark.parametrize("emb", ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight"])
def test_the_tied_head_is_optional_for_either_embedding_name(emb: str) -> None:
    table = {emb: TensorSpec("F32", (16, 8)), "model.norm.weight": TensorSpec("F32", (8,))}
    full, optional, _ = full_expectation(dict(table), True, {emb})
    assert full["lm_head.weight"] == table[emb] and "lm_head.weight" in optional and emb not in optional
    assert _accept([emb], tied=True, required={emb}, table=table) == [emb]
    assert _accept([emb, "lm_head.weight"], tied=True, required={emb}, table=table) == [emb, "lm_head.weight"]
    assert _accept(["lm_head.weight"], tied=True, table=table) == ["lm_head.weight"]
    err = _refuse(["lm_head.weight", "model.norm.weight"], tied=True, required={emb}, table=table)
    assert err.reason == "count" and emb in str(err)  # the head does not stand in for the embedding


def test_an_untied_or_headed_table_is_left_alone() -> None:
    table = {"model.embed_tokens.weight": TensorSpec("F32", (16, 8)), "lm_head.weight": TensorSpec("F32", (16, 8))}
    full, optional, _ = full_expectation(dict(table), True, {"lm_head.weight"})
    assert full == table and optional == {"model.embed_tokens.weight"}  # the checkpoint's own head: required
    assert full_expectation({"model.embed_tokens.weight": table["model.embed_tokens.weight"]}, False)[0] == {
        "model.embed_tokens.weight": table["model.embed_tokens.weight"]
    }


def test_the_stager_stages_a_subset(tmp_path: Path) -> None:
    tensors, chunks = _stream(LM)
    staged = Stager(str(tmp_path), max_frame_bytes=1 << 20).stage(
        iter(chunks), lambda header: full_expectation(dict(TABLE), True, {"model.norm.weight"})
    )
    try:
        got = dict(iter_staged_tensors(staged.index_path))
        assert list(got) == list(LM)
        for name, t in tensors:
            assert torch.equal(got[name], t)
    finally:
        staged.cleanup()
    assert list(tmp_path.iterdir()) == []


def test_a_header_announcing_more_bytes_than_the_model_holds_is_refused_before_staging(tmp_path: Path) -> None:
    """Issue 41: the staging space was reserved (posix_fallocate) for whatever size a header announced, so one
    header could fill /dev/shm; now an announcement beyond every tensor the update may carry is refused first."""
    _, chunks = _stream(LM)
    header = chunks[0].header
    most = sum(8 * spec.nbytes // 4 for spec in full_expectation(dict(TABLE), True)[0].values())  # F32 at 8 bytes
    assert header.total_bytes < most  # a subset: honest
    header.total_bytes = 1 << 50  # a PiB for a checkpoint of a few kB (no disk could take it without the check)
    with pytest.raises(WireError, match=rf"announces {1 << 50} bytes, more than the {most} bytes") as err:
        Stager(str(tmp_path), max_frame_bytes=1 << 20).stage(
            iter(chunks), lambda h: full_expectation(dict(TABLE), True)
        )
    assert err.value.reason == "count"
    assert list(tmp_path.iterdir()) == []  # no staging file was made, no space taken


# ---------------------------------------------------------------- ADAPTER

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}


def test_adapter_names_of_the_language_model_layout_are_accepted_for_a_vl_checkpoint() -> None:
    out = adapter_expectation(TABLE, CONFIG)
    for stem in ("model.layers.0.self_attn.q_proj", "model.language_model.layers.0.self_attn.q_proj"):
        for prefix in ("base_model.model.", ""):
            assert out[f"{prefix}{stem}.lora_A.weight"] == TensorSpec("*", (4, 8))
            assert out[f"{prefix}{stem}.lora_B.weight"] == TensorSpec("*", (8, 4))
    assert out["base_model.model.model.language_model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 12)
    assert out["base_model.model.model.language_model.layers.0.mlp.down_proj.lora_B.weight"].shape == (8, 4)
    # Only 2-D weights get adapters, and only model.layers.* gets the alias.
    assert not any(".bias." in n or "norm" in n for n in out)
    assert not any("language_model.visual" in n or "language_model.embed" in n for n in out)

    # A PEFT stream of the model class's names passes the reader.
    a = torch.zeros(4, 8, dtype=torch.float32)
    b = torch.zeros(8, 4, dtype=torch.bfloat16)  # any float dtype
    stem = "base_model.model.model.language_model.layers.0.self_attn.q_proj"
    chunks = iter_weight_chunks(
        [(f"{stem}.lora_A.weight", a), (f"{stem}.lora_B.weight", b)],
        number=2,
        mode=ADAPTER,
        adapter_config_json=json.dumps(CONFIG),
    )
    reader = _read(chunks, out, set(), False)
    assert [t.name for t in reader.tensors] == [f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"]


def test_a_text_checkpoint_gets_no_language_model_alias() -> None:
    text = {n: s for n, s in TABLE.items() if not n.startswith("visual.")}
    out = adapter_expectation(text, CONFIG)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in out
    assert not any("language_model" in n for n in out)
    stem = "base_model.model.model.language_model.layers.0.self_attn.q_proj"
    chunks = iter_weight_chunks(
        [(f"{stem}.lora_A.weight", torch.zeros(4, 8))], number=2, mode=ADAPTER, adapter_config_json=json.dumps(CONFIG)
    )
    with pytest.raises(WireError) as err:
        _read(chunks, out, set(), False)
    assert err.value.reason == "name"


def test_a_qwen3_vl_checkpoint_keeps_its_own_names() -> None:
    table = {
        "model.language_model.layers.0.self_attn.q_proj.weight": TensorSpec("BF16", (8, 8)),
        "model.visual.blocks.0.attn.qkv.weight": TensorSpec("BF16", (24, 8)),
    }
    out = adapter_expectation(table, CONFIG)
    assert "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight" in out
    assert not any("language_model.language_model" in n for n in out)


def test_a_killed_servers_staging_files_are_removed_by_the_next_server(tmp_path) -> None:
    """Issue 41: a server killed mid-update (SIGKILL, an OOM kill) leaves its staging file in /dev/shm, memory that
    nothing freed. The next server's Stager removes the files of servers that are gone (the pid in the name),
    never a live server's, nor names it does not make."""
    import os
    import subprocess
    import sys

    from rollout_svc.staging import Stager

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            f"rmsft-stage-{gone.pid}-3-0123abcd.bin": False,
            f"rmsft-stage-{gone.pid}-3-0123abcd.json": False,
            f"rmsft-stage-{live.pid}-4-89abcdef.bin": True,
            f"rmsft-stage-{os.getpid()}-5-00000000.bin": True,
            "rmsft-stage-3-2f81ce71.bin": True,
            "other.bin": True,
        }
        for n in names:
            (tmp_path / n).write_bytes(b"x")
        stager = Stager(str(tmp_path), max_frame_bytes=1 << 20)
        assert {p.name for p in tmp_path.iterdir()} == {n for n, stays in names.items() if stays}
        assert sorted(os.path.basename(p) for p in stager.removed_at_start) == sorted(
            n for n, stays in names.items() if not stays
        )
    finally:
        live.kill()
        live.wait()
