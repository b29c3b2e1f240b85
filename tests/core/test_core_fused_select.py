"""training.loss.logits fused | auto (learner/core/fused.py), what the CPU can prove: which mode a learner takes,
the refusals that say to use chunked (admission, the learner's start, the first forward), the head weight the
kernel is handed, and which loss terms go to the kernel. The kernel's values against the chunked path's are
tests/gpu/test_fused_loss_gpu.py (CUDA)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from learner.core import fused as fused_mod
from learner.core.fused import FusedLogitsError, _weight_source, check_logits_mode, resolve_logits_mode
from learner.core.grpo import completion_logprobs, grpo_segment
from learner.core.head import RowHead, row_outputs
from learner.core.losses import compute_loss
from learner.core.packing import pack
from learner.core.targets import IGNORE_INDEX, Segment
from rmsft.exit_codes import CONFIG_EXIT, exit_code_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def cuda_and_liger(monkeypatch: pytest.MonkeyPatch):
    """A learner that looks like the GPU image's: CUDA present, liger-kernel importable (a stand-in module)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    stub = types.ModuleType(fused_mod.LIGER_MODULE)
    stub.liger_fused_linear_cross_entropy = lambda *a, **k: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fused_mod.LIGER_MODULE, stub)


def _row(tiny_vocab) -> object:
    ids = list(range(5, 45))
    cpos = (34, 37)
    for p, b in zip(cpos, (17, 900), strict=True):
        ids[p] = tiny_vocab.coord_token_ids[b]
    labels = [IGNORE_INDEX] * 20 + ids[20:]
    return pack([Segment(tuple(ids), tuple(labels), cpos, (17, 900), prompt_len=20, prefix_len=0)])


def test_auto_takes_chunked_on_the_cpu_and_fused_is_refused_there_saying_use_chunked(tiny_model, tiny_vocab):
    assert resolve_logits_mode("auto", "cpu") == "chunked"
    assert resolve_logits_mode("chunked", "cuda") == "chunked" and resolve_logits_mode("full", "cpu") == "full"
    with pytest.raises(FusedLogitsError, match=r"CUDA.*runs on cpu.*set spec.training.loss.logits: chunked") as err:
        resolve_logits_mode("fused", "cpu")
    assert exit_code_for(err.value) == CONFIG_EXIT  # a refused configuration, not a retry
    row = _row(tiny_vocab)
    out = row_outputs(tiny_model, tiny_model, row.model_inputs(), "auto", 8)
    assert isinstance(out, RowHead) and not out.fused  # the chunked path
    with pytest.raises(FusedLogitsError, match="loss.logits: chunked"):
        row_outputs(tiny_model, tiny_model, row.model_inputs(), "fused", 8)


def test_the_learners_start_refuses_fused_it_cannot_run(tiny_model):
    """make_updater (the step's setup, before any step) checks the mode: no traceback from inside a forward."""
    from learner.train.ranks import Ranks
    from learner.train.updater import make_updater
    from rmsft.jobspec import TrainingConfig

    cfg = TrainingConfig.model_validate({"data": {"path": "x.jsonl"}, "loss": {"logits": "fused"}})
    with pytest.raises(FusedLogitsError, match="chunked"):
        make_updater(tiny_model, Ranks.single(), cfg, device=torch.device("cpu"))
    auto = cfg.model_copy(update={"loss": cfg.loss.model_copy(update={"logits": "auto"})})
    make_updater(tiny_model, Ranks.single(), auto, device=torch.device("cpu"))  # auto: chunked, no refusal


def test_without_liger_kernel_auto_is_chunked_and_fused_names_the_package(monkeypatch, tiny_model):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, fused_mod.LIGER_MODULE, None)  # importing it raises ModuleNotFoundError
    head = tiny_model.get_output_embeddings()
    assert resolve_logits_mode("auto", "cuda", head) == "chunked"
    with pytest.raises(FusedLogitsError, match=r"liger-kernel package cannot be imported.*loss.logits: chunked"):
        resolve_logits_mode("fused", "cuda", head)


def test_with_cuda_and_liger_auto_takes_fused_unless_the_head_or_zero3_rules_it_out(cuda_and_liger, tiny_model):
    head = tiny_model.get_output_embeddings()
    assert resolve_logits_mode("auto", "cuda", head) == "fused"
    assert resolve_logits_mode("fused", "cuda", head) == "fused"
    check_logits_mode("fused", "cuda", tiny_model, 0)
    assert resolve_logits_mode("auto", "cuda", head, deepspeed_stage=3) == "chunked"
    with pytest.raises(FusedLogitsError, match="deepspeed_stage 3"):
        check_logits_mode("fused", "cuda", tiny_model, 3)
    partitioned = torch.nn.Linear(8, 16, bias=False)
    partitioned.weight.ds_id = 3  # type: ignore[attr-defined]  # what ZeRO-3 marks its parameters with
    biased = torch.nn.Linear(8, 16)

    class LoraHead(torch.nn.Linear):  # anything computing more than weight @ h
        pass

    for bad, why in ((partitioned, "partitioned"), (biased, "bias"), (LoraHead(8, 16, bias=False), "LoraHead")):
        assert resolve_logits_mode("auto", "cuda", bad) == "chunked"
        with pytest.raises(FusedLogitsError, match=why):
            resolve_logits_mode("fused", "cuda", bad)


def test_the_kernel_gets_the_weight_the_heads_forward_uses_with_lora_coordinate_rows(tiny_model_dir):
    """finetune: lora trains the coordinate rows as peft's trainable token rows on the tied head: the weight handed
    to the kernel is the merged one (the rows' deltas), and under disable_adapter (GRPO's reference policy) the
    base one, each equal to what the head's own forward multiplies by."""
    from learner.train.policy import load_policy
    from rmsft.jobspec import TrainingConfig

    cfg = TrainingConfig.model_validate({"data": {"path": "x.jsonl"}, "finetune": "lora"})
    model = load_policy(tiny_model_dir, cfg).model
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "trainable_tokens_delta" in n:
                p.add_(0.5)  # rows that differ from their base
    head = model.get_output_embeddings()
    x = torch.randn(5, head.in_features if hasattr(head, "in_features") else model.config.hidden_size)
    with torch.no_grad():
        source = _weight_source(head)
        assert callable(source)
        trained = source()
        assert torch.allclose(head(x), x @ trained.T, atol=1e-5)
        with model.disable_adapter():
            base_source = _weight_source(head)
            assert callable(base_source)
            assert torch.allclose(head(x), x @ base_source().T, atol=1e-5)
            assert not torch.allclose(base_source(), trained)


def test_a_fused_head_sends_ce_and_logprobs_to_the_kernel_and_the_rest_to_the_chunks(
    monkeypatch, tiny_model, tiny_vocab
):
    """With the kernel standing in (the same CE from the head's logits), a fused RowHead computes the CE term in one
    kernel call over every labelled position, the coordinate terms chunk by chunk, and the same loss; GRPO's
    log-probs use the kernel at temperature 1 and the chunks at another."""
    calls: list[int] = []

    def kernel(hidden, head, labels):
        calls.append(int(labels.numel()))
        return F.cross_entropy(head(hidden).float(), labels, reduction="none")

    monkeypatch.setattr(fused_mod, "fused_token_ce", kernel)
    row = _row(tiny_vocab)
    chunked = row_outputs(tiny_model, tiny_model, row.model_inputs(), "chunked", 8)
    fused = RowHead(chunked.hidden, chunked.head, 8, fused=True)
    want = compute_loss(chunked, row, tiny_vocab.coord_token_ids)
    assert calls == []
    got = compute_loss(fused, row, tiny_vocab.coord_token_ids)
    assert calls == [len(row.ce_positions)]
    assert torch.allclose(got.loss, want.loss, rtol=1e-6)
    g = grpo_segment(list(range(5, 15)), list(range(20, 31)), [-1.0] * 11, 0.5)
    grow = pack([g])
    gsrc = row_outputs(tiny_model, tiny_model, grow.model_inputs(), "chunked", 4)
    calls.clear()
    lp = completion_logprobs(RowHead(gsrc.hidden, gsrc.head, 4, fused=True), grow, 1.0)
    assert calls == [11] and torch.allclose(lp, completion_logprobs(gsrc, grow, 1.0), atol=1e-6)
    calls.clear()
    completion_logprobs(RowHead(gsrc.hidden, gsrc.head, 4, fused=True), grow, 0.7)
    assert calls == []  # the kernel has no temperature: chunked


def _job_doc(**changes) -> dict:
    doc = yaml.safe_load((ROOT / "configs" / "job.yaml").read_text())
    for dotted, value in changes.items():
        node = doc["spec"]
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return doc


def test_admission_refuses_fused_on_a_cpu_job_and_under_zero3_saying_use_chunked():
    from rmsft.jobspec import JobSpecError, parse_job
    from rmsft.requirements import learner_needs

    cpu = {"placement.accelerator": "none", "learner.gpus": 0}
    with pytest.raises(JobSpecError, match=r"loss.logits 'fused' needs spec.placement.accelerator 'nvidia'.*chunked"):
        parse_job(_job_doc(**cpu, **{"training.loss.logits": "fused"}))
    with pytest.raises(JobSpecError, match=r"loss.logits 'fused' cannot run under .*deepspeed_stage 3.*chunked"):
        parse_job(_job_doc(**{"training.loss.logits": "fused", "training.deepspeed_stage": 3}))
    assert parse_job(_job_doc(**cpu)).spec.training.loss.logits == "auto"  # the default: chunked on a CPU
    job = parse_job(_job_doc(**{"training.loss.logits": "fused"}))
    assert learner_needs(job)["liger-kernel"] == "spec.training.loss.logits: fused"  # checked at `rmsft train`
    assert "liger-kernel" not in learner_needs(parse_job(_job_doc()))  # auto needs nothing extra
