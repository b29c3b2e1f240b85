"""learner.train.policy options: attention kernels keep packed rows isolated, bf16 precision, gradient
checkpointing, and clear refusals for what cannot train here. All on the tiny model, on the CPU."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from learner.core.losses import LossWeights, loss_sums
from learner.core.packing import PackedRow, pack
from learner.core.targets import IGNORE_INDEX, Segment
from learner.train.policy import ModelLoadError, Policy, load_policy, policy_autocast
from rmsft.jobspec import TrainingConfig

LENGTHS = (23, 31, 17)  # >= 3 segments of different lengths in one row
HERE = Path(__file__).resolve().parent
HAS_FA2 = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def cfg(**kw) -> TrainingConfig:
    return TrainingConfig(data={"path": "unused.jsonl"}, **kw)


def segments(policy: Policy, lengths=LENGTHS, seed: int = 0) -> list[Segment]:
    """Random segments: a 6-token prompt, then targets with two coordinate tokens each."""
    rng = random.Random(seed)
    coord_ids = policy.vocab.coord_token_ids
    out = []
    for n in lengths:
        ids = [rng.randrange(1000) for _ in range(n)]
        cpos = (n - 5, n - 2)
        bins = tuple(rng.randrange(len(coord_ids)) for _ in cpos)
        for p, b in zip(cpos, bins, strict=True):
            ids[p] = coord_ids[b]
        labels = [IGNORE_INDEX] * 6 + ids[6:]
        out.append(Segment(tuple(ids), tuple(labels), cpos, bins, 6, 0))
    return out


def next_token_logprobs(model, row: PackedRow, device: str = "cpu") -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position of the row, in fp32, on the CPU."""
    row = row.to(device)
    logits = model(**row.model_inputs()).logits[0].float()
    return logits[:-1].log_softmax(-1).gather(-1, row.input_ids[0, 1:, None])[:, 0].cpu()


def assert_isolated(model, segs: list[Segment], atol: float, device: str = "cpu") -> None:
    row = pack(segs)
    with torch.no_grad():
        packed = next_token_logprobs(model, row, device)
        # The same tokens with positions running on: a mask that ignored the restarts would match this.
        unrestarted = PackedRow(
            row.input_ids,
            torch.arange(row.length)[None],
            row.labels,
            row.coord_positions,
            row.coord_bins,
            row.segments,
            row.fill,
        )
        leaky = next_token_logprobs(model, unrestarted, device)
        for info, seg in zip(row.segments, segs, strict=True):
            alone = next_token_logprobs(model, pack([seg]), device)
            got = packed[info.offset : info.offset + info.length - 1]
            torch.testing.assert_close(got, alone, atol=atol, rtol=0)
            if info.offset:  # not vacuous: attending across segments changes later segments
                assert (leaky[info.offset : info.offset + info.length - 1] - alone).abs().max() > 1e-2


def use_uncompiled_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers compiles FlexAttention and its block mask (~10-25 s per shape on 2 CPU cores);
    the uncompiled reference computes the same attention from the same block mask."""
    import transformers.integrations.flex_attention as flex_integration
    import transformers.masking_utils as masking_utils
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def eager_flex(query, key, value, training=False, **kwargs):
        return flex_attention(query, key, value, **kwargs)

    def eager_block_mask(*args, _compile=False, **kwargs):
        return create_block_mask(*args, _compile=False, **kwargs)

    monkeypatch.setattr(flex_integration, "compile_friendly_flex_attention", eager_flex)
    monkeypatch.setattr(masking_utils, "create_block_mask", eager_block_mask)


def perturb_adapters(model, seed: int) -> None:
    """LoRA B starts at zero (so A's gradient is zero); give every adapter weight a value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def grads_of_step(policy: Policy, row: PackedRow, device: str = "cpu") -> dict[str, torch.Tensor]:
    policy.model.zero_grad(set_to_none=True)
    with policy_autocast(policy, device):
        out = loss_sums(policy.model(**row.model_inputs()).logits, row, policy.vocab.coord_token_ids).finish()
    out.loss.backward()
    return {n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------- attention implementations


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex_attention", "flash_attention_2"])
def test_packed_rows_stay_isolated(impl: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device, atol, kw = "cpu", 1e-5, {}
    if impl == "flash_attention_2":
        if not HAS_FA2:
            pytest.skip("flash_attention_2 needs CUDA and the flash_attn package; this machine lacks one")
        # FA2 computes in bf16: a logit near 16 has an ulp of 0.06, and varlen vs dense kernels round apart.
        device, atol, kw = "cuda", 1e-1, {"precision": "bf16"}
    if impl == "flex_attention":
        # Forward only: FlexAttention has no CPU backward, so load_policy refuses it for a CPU run
        # (test_flex_attention_refused_for_a_cpu_run); a CUDA run uses the same mask construction checked here.
        kw = {"device": "cuda"}
        use_uncompiled_flex(monkeypatch)
    policy = load_policy(tiny_model_dir, cfg(attn_implementation=impl, **kw))
    base = policy.model.get_base_model()
    assert base.config._attn_implementation == impl
    policy.model.to(device)
    segs = segments(policy)
    with policy_autocast(policy, device):
        assert_isolated(policy.model, segs, atol, device)


@pytest.mark.slow
@pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="torch.compile on the CPU needs a C++ compiler"
)
def test_compiled_flex_attention_isolates_packed_rows(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The real path: transformers' compiled FlexAttention kernel and compiled block mask (forward only,
    on the CPU; equal segment lengths keep it to two compiled shapes). 12-30 s, mostly compiling.

    In a process of its own, with an inductor cache of its own and without the environment vLLM's CPU platform sets
    (TORCHINDUCTOR_*, VLLM_*, LD_PRELOAD). In a whole `make test` (CI, twice, and here once) inductor's C++ for the
    block mask failed to compile (`'at::vec' has not been declared`: vectorised code, compiled in C++-wrapper mode
    with no vector-ISA flag and the precompiled header under /tmp/torchinductor_root); run alone it compiles, and
    after an in-process vLLM engine in the same process too. Not pinned down: state another test left in pytest's
    process (vLLM patches inductor and sets its environment where an engine starts), or that inductor cache, which
    the suite's processes and rollout servers share. This process has neither. A GPU run compiles Triton kernels,
    not these; what the test checks is the mask."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "VLLM_")) and k != "LD_PRELOAD"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_model_options as t; "
        f"t.check_compiled_flex({str(tiny_model_dir)!r})"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "packed rows isolated" in proc.stdout, proc.stderr[-4000:]


def check_compiled_flex(model_dir: str) -> None:
    """`test_compiled_flex_attention_isolates_packed_rows`'s body, run in its own process."""
    policy = load_policy(Path(model_dir), cfg(attn_implementation="flex_attention", device="cuda"))
    assert_isolated(policy.model, segments(policy, lengths=(16, 16, 16)), atol=1e-5)
    print("packed rows isolated")


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_flex_attention_refused_for_a_cpu_run(device: str, tiny_model_dir: Path) -> None:
    if device == "auto" and torch.cuda.is_available():
        pytest.skip("auto resolves to CUDA here")
    with pytest.raises(ModelLoadError, match=r"spec\.training\.attn_implementation: flex_attention.*backward.*CPU"):
        load_policy(tiny_model_dir, cfg(attn_implementation="flex_attention", device=device))


def test_flash_attention_2_without_cuda_is_a_clear_error(tiny_model_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible")
    with pytest.raises(ModelLoadError, match=r"spec\.training\.attn_implementation: flash_attention_2 needs a CUDA"):
        load_policy(tiny_model_dir, cfg(attn_implementation="flash_attention_2"))
    with pytest.raises(ModelLoadError, match=r"spec\.training\.device 'cpu' resolves to cpu"):
        load_policy(tiny_model_dir, cfg(attn_implementation="flash_attention_2", device="cpu"))


def test_flash_attention_2_prerequisites_named(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA (faked) the missing package is named; with both (faked) fp32 weights are refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    if real_find_spec("flash_attn") is None:
        with pytest.raises(ModelLoadError, match="needs the flash_attn package") as err:
            load_policy(tiny_model_dir, cfg(attn_implementation="flash_attention_2", device="cuda"))
        assert "CUDA" not in str(err.value)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a)
    )
    for dtype in ("auto", "float32"):  # the tiny checkpoint is float32
        with pytest.raises(ModelLoadError, match=r"bf16/fp16 only.*spec\.training\.precision: bf16"):
            load_policy(tiny_model_dir, cfg(attn_implementation="flash_attention_2", device="cuda"), dtype=dtype)


# ---------------------------------------------------------------- precision


@pytest.mark.parametrize("mode", ["lora", "dora", "full"])
def test_bf16_dtypes(mode: str, tiny_model_dir: Path) -> None:
    kw = {"finetune": "full"} if mode == "full" else {"lora": {"use_dora": mode == "dora"}}
    policy = load_policy(tiny_model_dir, cfg(precision="bf16", **kw))
    assert policy.autocast_dtype is torch.bfloat16
    params = list(policy.model.named_parameters())
    trainable = {n: p.dtype for n, p in params if p.requires_grad}
    frozen = {n: p.dtype for n, p in params if not p.requires_grad}
    assert trainable and set(trainable.values()) == {torch.float32}
    if mode == "full":
        assert not frozen
    else:
        assert frozen and set(frozen.values()) == {torch.bfloat16}
        if mode == "dora":
            assert any("lora_magnitude_vector" in n for n in trainable)


def test_fp32_precision_keeps_weights_as_loaded(tiny_model_dir: Path) -> None:
    policy = load_policy(tiny_model_dir, cfg())
    assert policy.autocast_dtype is None
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
    assert isinstance(policy_autocast(policy, "cpu"), nullcontext)
    bf16_base = load_policy(tiny_model_dir, cfg(), dtype="bfloat16")  # spec.model.dtype still applies under fp32
    assert any(p.dtype == torch.bfloat16 for p in bf16_base.model.parameters())


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_bf16_step_on_cpu_and_packed_equals_unpacked(mode: str, tiny_model_dir: Path) -> None:
    kw = {"finetune": "full"} if mode == "full" else {}
    torch.manual_seed(0)
    policy = load_policy(tiny_model_dir, cfg(precision="bf16", **kw))
    perturb_adapters(policy.model, seed=1)
    coord_ids = policy.vocab.coord_token_ids
    segs = segments(policy)

    def loss_of(rows: list[PackedRow]) -> torch.Tensor:
        with policy_autocast(policy, "cpu"):
            sums = [loss_sums(policy.model(**r.model_inputs()).logits, r, coord_ids) for r in rows]
        total = sums[0]
        for s in sums[1:]:
            total = total + s
        return total.finish(LossWeights()).loss

    with policy_autocast(policy, "cpu"):
        logits = policy.model(**pack(segs).model_inputs()).logits
    assert logits.dtype == torch.bfloat16  # the matmuls ran in bf16
    packed = loss_of([pack(segs)])
    assert packed.dtype == torch.float32 and torch.isfinite(packed)
    packed.backward()
    grads = [p.grad for p in policy.model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    with torch.no_grad():
        unpacked = loss_of([pack([s]) for s in segs])
    assert float(packed.detach()) == pytest.approx(float(unpacked), rel=2e-2)
    # and bf16 stays close to the fp32 loss of the same weights (seen: ~2e-4 relative)
    torch.manual_seed(0)
    ref = load_policy(tiny_model_dir, cfg(**kw))
    perturb_adapters(ref.model, seed=1)
    with torch.no_grad():
        fp32 = loss_sums(ref.model(**pack(segs).model_inputs()).logits, pack(segs), coord_ids).finish().loss
    assert float(packed.detach()) == pytest.approx(float(fp32), rel=2e-2)


# ---------------------------------------------------------------- gradient checkpointing


@pytest.mark.parametrize("mode", ["lora", "dora", "full"])
def test_gradient_checkpointing_gives_the_same_gradients(mode: str, tiny_model_dir: Path) -> None:
    kw = {"finetune": "full"} if mode == "full" else {"lora": {"use_dora": mode == "dora"}}
    grads = []
    for on in (False, True):
        torch.manual_seed(0)  # same adapter init in both
        policy = load_policy(tiny_model_dir, cfg(gradient_checkpointing=on, **kw))
        hf = policy.model.get_base_model() if policy.is_peft else policy.model
        assert hf.is_gradient_checkpointing is on
        perturb_adapters(policy.model, seed=1)
        calls: list[int] = []
        hook = hf.model.layers[0].self_attn.register_forward_hook(lambda *_, c=calls: c.append(1))
        grads.append(grads_of_step(policy, pack(segments(policy))))
        hook.remove()
        assert len(calls) == (2 if on else 1)  # checkpointing recomputes the layer during backward
    off, on_ = grads
    assert off.keys() == on_.keys() and off
    assert any(float(g.abs().max()) > 0 for g in off.values())
    for name in off:
        torch.testing.assert_close(on_[name], off[name], atol=1e-5, rtol=1e-5, msg=name)


def test_gradient_checkpointing_with_bf16_and_frozen_embeddings(tiny_model_dir: Path) -> None:
    """LoRA freezes the embeddings: the checkpointed layers must still pass gradients to the adapters of
    every layer, under autocast (the recompute runs in bf16 like the forward did). The coordinate rows, which
    train beside the adapter by default (training.lora.coord_rows), stay frozen here: the case is a whole frozen
    embedding (qwen_json, or coord_rows false)."""
    torch.manual_seed(0)
    policy = load_policy(tiny_model_dir, cfg(gradient_checkpointing=True, precision="bf16", lora={"coord_rows": False}))
    perturb_adapters(policy.model, seed=1)
    assert not policy.model.get_input_embeddings().weight.requires_grad
    grads = grads_of_step(policy, pack(segments(policy)))
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n, g in grads.items() if float(g.abs().max()) > 0}
    assert layers == set(range(policy.model.get_base_model().config.num_hidden_layers))
