"""`rmsft export` / `export_trained`: a learner checkpoint (or the live model) as a Hugging Face folder.

The policy is built the way the learner builds it (`load_policy` with a job's TrainingConfig: LoRA, DoRA,
full fine-tuning; text and both Qwen-VL families), its trained tensors perturbed (random non-zero LoRA B,
so the merge matters), checkpointed by the learner's own Checkpointer, exported, and the export loaded
back: transformers' greedy tokens equal the learner's (HF generate on the in-memory peft model), the
adapter alone loads with peft on the base and gives the same logits, and vLLM serves the merged export
with the learner's greedy tokens (vllm-marked tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from trainer_fixtures import make_job

from learner.core.packing import Packer
from learner.train.checkpointer import Checkpointer, TrainState
from learner.train.export import EXPORT_INFO_FILE, RUN_FILE, ExportError, export_checkpoint, export_trained
from learner.train.policy import Policy, load_policy, prompt_ids
from learner.train.ranks import Ranks
from learner.train.updater import PlainUpdater
from rmsft.jobspec import JobSpecError

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
TEXT_PROMPTS = [
    "Detect every object in the image and answer in JSON.",
    "The image shows a person, a dog and a red apple.",
    "Find the cars.",
    "Where is the umbrella?",
]
# (text, number of images)
VL_PROMPTS = [("Detect every shape in the image.", 1), ("What is there?", 0), ("Detect every shape.", 2)]
MAX_TOKENS = 16


@dataclass
class Trained:
    model_dir: Path
    job: Any
    policy: Policy
    ckpt: Path  # the step-<n> folder


def _perturb(model: Any, seed: int) -> None:
    """What training would do, but larger and at once: random non-zero LoRA B (a fresh LoRA layer is the
    identity, so without this a merge would change nothing), DoRA magnitudes scaled, full weights moved."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=g)
            if "lora_B" in name:
                p.copy_(noise * 0.05)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * noise)
            elif "lora_A" not in name:  # full fine-tuning
                p.add_(noise * 0.02)


def _train(
    model_dir: Path,
    tmp: Path,
    *,
    finetune: str = "lora",
    dora: bool = False,
    seed: int = 0,
    run_json: bool = True,
    **training: Any,
) -> Trained:
    job = make_job(
        model_dir,
        tmp / "data.jsonl",
        tmp / "ckpt",
        finetune=finetune,
        lora={"r": 8, "alpha": 16, "target_modules": TARGETS, "use_dora": dora},
        **training,
    )
    cfg = job.spec.training
    policy = load_policy(model_dir, cfg, job.spec.model.dtype, job.spec.model.vision)
    _perturb(policy.model, seed)
    ranks = Ranks.single()
    step = PlainUpdater(
        policy.model,
        ranks,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        device=torch.device("cpu"),
    )
    packer = Packer(cfg.packing_length, cfg.packing_buffer)
    ckpt = Checkpointer(cfg, ranks, policy.model, step, packer, TrainState(step=5, version=5)).save()
    assert ckpt is not None
    if run_json:  # what the learner writes beside its checkpoints
        (ckpt.parent / RUN_FILE).write_text(json.dumps({"job": job.to_manifest(), "started": "now"}))
    policy.model.eval()
    return Trained(model_dir, job, policy, ckpt)


# ---------------------------------------------------------------- prompts and greedy decoding


def _png_paths(folder: Path) -> list[Path]:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (size, colour) in enumerate([((200, 120), (30, 160, 40)), ((64, 200), (180, 20, 40))]):
        g = torch.Generator().manual_seed(i)
        noise = (torch.rand(size[1], size[0], 3, generator=g) * 60).int()
        pixels = (torch.tensor(colour).int() + noise).clamp(0, 255).to(torch.uint8).numpy()
        path = folder / f"img{i}.png"
        Image.fromarray(pixels).save(path)
        out.append(path)
    return out


def _vl_cases(processor: Any, images: list[Path]) -> list[tuple[str, list[Path]]]:
    cases = []
    for text, n in VL_PROMPTS:
        content = [{"type": "image"}] * n + [{"type": "text", "text": text}]
        rendered = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        cases.append((rendered, images[:n]))
    return cases


def _inputs(policy: Policy, images: list[Path]) -> list[dict[str, torch.Tensor]]:
    """The prompts as model inputs: chat prompts for a text model, prompts with 0-2 images for a VL one."""
    if not policy.is_vision_language:
        return [
            {"input_ids": torch.tensor([prompt_ids(policy.tokenizer, [{"role": "user", "content": t}])])}
            for t in TEXT_PROMPTS
        ]
    from PIL import Image

    out = []
    for rendered, paths in _vl_cases(policy.processor, images):
        pil = [Image.open(p).convert("RGB") for p in paths]
        out.append(dict(policy.processor(text=[rendered], images=pil or None, return_tensors="pt")))
    return out


def _greedy(model: Any, inputs: list[dict[str, torch.Tensor]], eos: int) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for enc in inputs:
            n = enc["input_ids"].shape[1]
            y = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            outs.append(y[0, n:].tolist())
    return outs


def _logits(model: Any, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(**enc).logits for enc in inputs]


def _load_hf(out: Path, vision_language: bool) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
    return cls.from_pretrained(out, dtype=torch.float32).eval()


def _state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- merged / full exports


@pytest.mark.parametrize(
    "finetune,dora", [("lora", False), ("lora", True), ("full", False)], ids=["lora", "dora", "full"]
)
def test_text_export_gives_the_learner_greedy_tokens(
    tmp_path: Path, tiny_model_dir: Path, finetune: str, dora: bool
) -> None:
    _check_merged_export(tmp_path, _train(tiny_model_dir, tmp_path, finetune=finetune, dora=dora))


@pytest.mark.parametrize(
    "finetune,dora", [("lora", False), ("lora", True), ("full", False)], ids=["lora", "dora", "full"]
)
def test_vl_export_gives_the_learner_greedy_tokens(
    tmp_path: Path, tiny_vl_model_dir: Path, finetune: str, dora: bool
) -> None:
    _check_merged_export(tmp_path, _train(tiny_vl_model_dir, tmp_path, finetune=finetune, dora=dora))


def _check_merged_export(tmp_path: Path, t: Trained) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from learner.core.vocab import VocabView
    from learner.train.policy import load_processor

    policy, vl = t.policy, t.policy.is_vision_language
    eos = policy.tokenizer.eos_token_id
    images = _png_paths(tmp_path / "images")
    inputs = _inputs(policy, images)
    want = _greedy(policy.model, inputs, eos)
    assert sum(len(w) for w in want) >= 2 * MAX_TOKENS  # not a vacuous pass (lone end-of-turn answers)
    base = _load_hf(t.model_dir, vl)
    assert _greedy(base, inputs, eos) != want  # the training (perturbation) changed the answers

    out = tmp_path / "out"
    result = export_checkpoint(t.ckpt, out)  # the job from run.json beside the checkpoint
    assert result.mode == ("full" if t.job.spec.training.finetune == "full" else "merged")
    assert result.dtype == "float32" and result.info["step"] == 5
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        EXPORT_INFO_FILE,
    } <= set(result.files)
    assert not any(f.startswith("adapter") for f in result.files)
    assert ("processor_config.json" in result.files) == vl
    loaded = _load_hf(out, vl)
    assert _greedy(loaded, inputs, eos) == want
    for a, b in zip(_logits(loaded, inputs), _logits(policy.model, inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # Checkpoint names, as save_pretrained writes them (Qwen2.5-VL's differ from its state-dict names), and
    # the config as the base's (nothing of training leaks into it).
    with safe_open(out / "model.safetensors", "pt") as f, safe_open(t.model_dir / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())
    cfg_out, cfg_base = (json.loads((d / "config.json").read_text()) for d in (out, t.model_dir))
    for cfg in (cfg_out, cfg_base):
        for section in (cfg, cfg.get("text_config") or {}, cfg.get("vision_config") or {}):
            section.pop("dtype", None)
    assert cfg_out == cfg_base
    VocabView.from_hf_tokenizer(AutoTokenizer.from_pretrained(out))
    if vl:  # the exported processor renders the prompts the learner's did
        processor = load_processor(out)
        assert [c[0] for c in _vl_cases(processor, images)] == [c[0] for c in _vl_cases(policy.processor, images)]

    # The live model at the end of a run: the same weights, and the model is left exactly as it was.
    before = _state(policy.model)
    live = export_trained(policy.model, policy, tmp_path / "live", base_model_dir=t.model_dir)
    assert (live / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    after = policy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _greedy(policy.model, inputs, eos) == want


def test_sharded_export_loads(tmp_path: Path, tiny_model_dir: Path) -> None:
    t = _train(tiny_model_dir, tmp_path)
    inputs = _inputs(t.policy, [])
    eos = t.policy.tokenizer.eos_token_id
    out = export_trained(t.policy.model, t.policy, tmp_path / "one", base_model_dir=tiny_model_dir)
    # Small shards: several files and an index, which transformers follows.
    small = export_trained(
        t.policy.model, t.policy, tmp_path / "small", base_model_dir=tiny_model_dir, max_shard_bytes=1 << 20
    )
    assert not (small / "model.safetensors").exists()
    shards = sorted(p.name for p in small.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (small / "model.safetensors.index.json").exists()
    assert _greedy(_load_hf(small, False), inputs, eos) == _greedy(_load_hf(out, False), inputs, eos)


# ---------------------------------------------------------------- adapter exports


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_adapter_export_loads_with_peft(tmp_path: Path, tiny_model_dir: Path, dora: bool) -> None:
    _check_adapter_export(tmp_path, _train(tiny_model_dir, tmp_path, dora=dora))


def test_vl_adapter_export_loads_with_peft(tmp_path: Path, tiny_qwen3_vl_dir: Path) -> None:
    _check_adapter_export(tmp_path, _train(tiny_qwen3_vl_dir, tmp_path))


def _check_adapter_export(tmp_path: Path, t: Trained) -> None:
    from peft import PeftModel

    out = tmp_path / "adapter"
    result = export_checkpoint(t.ckpt, out, adapter_only=True)
    assert result.mode == "adapter"
    assert set(result.files) == {"adapter_config.json", "adapter_model.safetensors", EXPORT_INFO_FILE}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["use_dora"] == t.job.spec.training.lora.use_dora and config["inference_mode"] is True
    assert Path(config["base_model_name_or_path"]) == t.model_dir.resolve()
    inputs = _inputs(t.policy, _png_paths(tmp_path / "images"))
    loaded = PeftModel.from_pretrained(_load_hf(t.model_dir, t.policy.is_vision_language), out).eval()
    for a, b in zip(_logits(loaded, inputs), _logits(t.policy.model, inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # The live path writes the same adapter.
    live = export_trained(t.policy.model, t.policy, tmp_path / "live", adapter_only=True)
    assert (live / "adapter_model.safetensors").read_bytes() == (out / "adapter_model.safetensors").read_bytes()


# ---------------------------------------------------------------- dtype


def test_export_keeps_the_base_dtype(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A bf16 base exports in bf16 (trained fp32 tensors cast once, as written) unless told otherwise."""
    import shutil

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base = tmp_path / "bf16-base"
    shutil.copytree(tiny_model_dir, base)
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(base)
    t = _train(base, tmp_path, precision="bf16")
    out = export_checkpoint(t.ckpt, tmp_path / "auto").path
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 - safe_open is no dict == {"BF16"}
    live = export_trained(t.policy.model, t.policy, tmp_path / "live", base_model_dir=base)
    assert (live / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    wide = export_checkpoint(t.ckpt, tmp_path / "f32", dtype="float32").path
    assert json.loads((wide / "config.json").read_text())["dtype"] == "float32"
    with safe_open(wide / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 - safe_open is no dict == {"F32"}
    _load_hf(out, False)
    with pytest.raises(ExportError, match="dtype must be one of"):
        export_checkpoint(t.ckpt, tmp_path / "bad", dtype="int8")


# ---------------------------------------------------------------- refusals and failures


def test_export_refusals(tmp_path: Path, tiny_model_dir: Path) -> None:
    full = _train(tiny_model_dir, tmp_path / "full", finetune="full")
    with pytest.raises(ExportError, match="--adapter needs a LoRA/DoRA run"):
        export_checkpoint(full.ckpt, tmp_path / "a", adapter_only=True)
    with pytest.raises(ExportError, match="fully fine-tuned"):
        export_trained(full.policy.model, full.policy, tmp_path / "a", adapter_only=True)

    lora = _train(tiny_model_dir, tmp_path / "lora", run_json=False)
    # No --config and no run.json: say what to pass.
    with pytest.raises(ExportError, match="--config JOB.yaml"):
        export_checkpoint(lora.ckpt, tmp_path / "a")
    # A job that builds another model than the checkpoint's: refused, naming the likely cause.
    other = tmp_path / "other.yaml"
    doc = lora.job.to_manifest()
    doc["spec"]["training"]["lora"]["target_modules"] = ["q_proj", "gate_proj"]
    other.write_text(yaml.safe_dump(doc))
    with pytest.raises(ExportError, match="does not match the model"):
        export_checkpoint(lora.ckpt, tmp_path / "a", config=other)
    doc["spec"]["training"]["lora"].update(target_modules=TARGETS, r=4)
    other.write_text(yaml.safe_dump(doc))
    with pytest.raises(ExportError, match="does not fit"):
        export_checkpoint(lora.ckpt, tmp_path / "a", config=other)
    # A bad run.json is a job spec error naming the file.
    (lora.ckpt.parent / RUN_FILE).write_text(json.dumps({"job": {"kind": "RolloutMatchingJob"}}))
    with pytest.raises(JobSpecError, match=RUN_FILE):
        export_checkpoint(lora.ckpt, tmp_path / "a")
    with pytest.raises(ExportError, match="no learner checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "a")

    # The checkpoint dir itself: its newest checkpoint. A non-empty OUT needs --overwrite.
    (lora.ckpt.parent / RUN_FILE).write_text(json.dumps({"job": lora.job.to_manifest()}))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty.*--overwrite"):
        export_checkpoint(lora.ckpt.parent, busy)
    assert export_checkpoint(lora.ckpt.parent, busy, overwrite=True).info["step"] == 5
    assert not (busy / "mine.txt").exists() and (busy / "model.safetensors").exists()
    # An export never replaces what it is made from (the checkpoints, the base model).
    with pytest.raises(ExportError, match="would replace the checkpoint"):
        export_checkpoint(lora.ckpt, lora.ckpt.parent, overwrite=True)
    assert (lora.ckpt / "state.pt").exists()
    with pytest.raises(ExportError, match="would replace the base model"):
        export_trained(lora.policy.model, lora.policy, tmp_path / "base", base_model_dir=tmp_path / "base")


def test_failed_live_export_leaves_nothing_behind(tmp_path: Path, tiny_model_dir: Path) -> None:
    t = _train(tiny_model_dir, tmp_path)
    # A path that cannot be written: one clear error.
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ExportError, match="cannot write the output folder"):
        export_trained(t.policy.model, t.policy, blocker / "out")

    class Broken:
        def save_pretrained(self, path: Any) -> None:
            raise OSError(28, "No space left on device")

    target = tmp_path / "exports" / "final"
    export_trained(t.policy.model, t.policy, target)  # a previous export
    first = (target / "model.safetensors").read_bytes()
    with pytest.raises(ExportError, match="No space left on device"):
        export_trained(t.policy.model, Broken(), target)
    # The previous export is intact and no temporary folder is left beside it.
    assert (target / "model.safetensors").read_bytes() == first
    assert sorted(p.name for p in target.parent.iterdir()) == ["final"]
    with pytest.raises(ExportError, match="not empty"):
        export_trained(t.policy.model, t.policy, target, overwrite=False)


def test_cli_export_without_a_job_says_to_pass_config(tmp_path: Path) -> None:
    step = tmp_path / "ckpt" / "step-3"
    step.mkdir(parents=True)
    torch.save({"step": 3, "model": {}}, step / "state.pt")
    res = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "export", str(step), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr
    assert "--config" in res.stderr and "run.json" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()


def test_cli_export(tmp_path: Path, tiny_model_dir: Path) -> None:
    t = _train(tiny_model_dir, tmp_path)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(t.job.to_manifest()))
    (t.ckpt.parent / RUN_FILE).unlink()
    res = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "export", str(t.ckpt), str(tmp_path / "out"), "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "merged" in res.stderr and "step 5" in res.stderr
    eos = t.policy.tokenizer.eos_token_id
    inputs = _inputs(t.policy, [])
    assert _greedy(_load_hf(tmp_path / "out", False), inputs, eos) == _greedy(t.policy.model, inputs, eos)


# ---------------------------------------------------------------- vLLM serves the export


def _vllm_greedy(model_dir: Path, prompts: dict[str, Any], tmp: Path) -> list[list[int]]:
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    script = ROOT / "tests" / "vllm_greedy.py"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, str(script), str(model_dir), str(tmp / "prompts.json"), str(tmp / "out.json")]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


def _cut_at_eos(tokens: list[list[int]], eos: int) -> list[list[int]]:
    return [t[: t.index(eos) + 1] if eos in t else t for t in tokens]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_the_text_export_with_the_learner_greedy_tokens(tmp_path: Path, tiny_model_dir: Path) -> None:
    t = _train(tiny_model_dir, tmp_path, dora=True)
    out = export_checkpoint(t.ckpt, tmp_path / "out").path
    inputs = _inputs(t.policy, [])
    eos = t.policy.tokenizer.eos_token_id
    want = _greedy(t.policy.model, inputs, eos)
    got = _vllm_greedy(
        out, {"ids": [enc["input_ids"][0].tolist() for enc in inputs], "max_tokens": MAX_TOKENS}, tmp_path
    )
    assert _cut_at_eos(got, eos) == _cut_at_eos(want, eos)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_the_vl_export_with_the_learner_greedy_tokens(tmp_path: Path, tiny_vl_model_dir: Path) -> None:
    """With images, through vLLM's Transformers backend (what the CPU can run; ../shared/ENV.md)."""
    t = _train(tiny_vl_model_dir, tmp_path)
    out = export_checkpoint(t.ckpt, tmp_path / "out").path
    images = _png_paths(tmp_path / "images")
    eos = t.policy.tokenizer.eos_token_id
    want = _greedy(t.policy.model, _inputs(t.policy, images), eos)
    cases = _vl_cases(t.policy.processor, images)
    prompts = {
        "texts": [c[0] for c in cases],
        "images": [[str(p) for p in c[1]] for c in cases],
        "max_tokens": MAX_TOKENS,
        "llm": {"model_impl": "transformers", "limit_mm_per_prompt": {"image": 2}},
    }
    got = _vllm_greedy(out, prompts, tmp_path)
    assert _cut_at_eos(got, eos) == _cut_at_eos(want, eos)
