"""The memory plan (rmsft/memory_plan/): parameter counts against real transformers models, the sharding and
phase arithmetic, refusals that name the knob, and `rmsft plan`'s exit codes."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rmsft.jobspec import JobSpecError, parse_job
from rmsft.memory_plan import (
    PRESETS,
    RUNTIME_BYTES,
    ZERO_REDUCE_BUCKET,
    GiB,
    MemoryPlanError,
    ModelShapeError,
    check_memory_plan,
    default_gpu_memory,
    parse_bytes,
    plan_memory,
    preset_for,
    shape_from_config,
    shape_from_folder,
    trainable_params,
)
from rmsft.memory_plan.arithmetic import activation_bytes

ROOT = Path(__file__).resolve().parent.parent
JOB = yaml.safe_load((ROOT / "configs" / "job.yaml").read_text())

# ---------------------------------------------------------------- tiny configs, built as transformers builds them


def _qwen2_text(tied: bool) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )


def _vl(arch: str, tied: bool, deepstack: list[int]) -> Any:
    text = dict(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=tied,
    )
    vision = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=96,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=128,
    )
    if arch == "qwen3_vl":
        from transformers import Qwen3VLConfig

        vision.update(deepstack_visual_indexes=deepstack, num_position_embeddings=256)
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied)
    from transformers import Qwen2_5_VLConfig

    vision.update(window_size=64, fullatt_block_indexes=[1], hidden_act="silu")
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied)


def _model(config: Any, device: str = "meta") -> Any:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device(device):
        return cls.from_config(config)


def _vision_split(model: Any) -> tuple[int, int]:
    """(tower, aligner) numel by the learner's own rule (learner/train/policy.py)."""
    from learner.train.policy import _vision_parts

    tower, aligner = _vision_parts(model)
    return sum(p.numel() for p in tower), sum(p.numel() for p in aligner)


CASES = [
    ("qwen2", lambda: _qwen2_text(False)),
    ("qwen2 tied", lambda: _qwen2_text(True)),
    ("qwen2.5-vl", lambda: _vl("qwen2_5_vl", True, [])),
    ("qwen2.5-vl untied", lambda: _vl("qwen2_5_vl", False, [])),
    ("qwen3-vl", lambda: _vl("qwen3_vl", True, [])),
    ("qwen3-vl deepstack", lambda: _vl("qwen3_vl", False, [0, 1])),
]


@pytest.mark.parametrize(("name", "make"), CASES, ids=[c[0] for c in CASES])
def test_counts_from_config_equal_the_models_numel(name: str, make: Any) -> None:
    config = make()
    model = _model(config)
    shape = shape_from_config(config.to_dict())
    assert shape.total_params == sum(p.numel() for p in model.parameters()), name
    if hasattr(config, "vision_config"):
        assert (shape.vision_tower_params, shape.aligner_params) == _vision_split(model)
    assert shape.tied == config.to_dict().get("tie_word_embeddings", False)
    assert shape.lm_head_params == (0 if shape.tied else shape.vocab * shape.hidden)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_equal_the_real_architectures(preset: str) -> None:
    """Each preset (the stock checkpoint's config.json values) built by transformers on the meta device."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    cfg = PRESETS[preset]
    config_cls = Qwen2_5_VLConfig if cfg["model_type"] == "qwen2_5_vl" else Qwen3VLConfig
    model = _model(config_cls(**{k: v for k, v in cfg.items() if k != "model_type"}))
    shape = shape_from_config(cfg)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert (shape.vision_tower_params, shape.aligner_params) == _vision_split(model)
    # Hugging Face's model cards: Qwen2.5-VL-7B-Instruct 8.29B, Qwen3-VL-8B-Instruct 8.77B parameters.
    expected = {"Qwen2.5-VL-7B": 8_292_166_656, "Qwen3-VL-8B": 8_767_123_696}
    if preset in expected:
        assert shape.total_params == expected[preset]


def test_safetensors_headers_give_exact_counts(tmp_path: Path) -> None:
    config = _vl("qwen3_vl", True, [1])
    model = _model(config, device="cpu")
    model.save_pretrained(tmp_path, safe_serialization=True)
    shape = shape_from_folder(tmp_path)
    assert shape.exact and "safetensors headers (exact)" in shape.source
    assert shape.total_params == sum(p.numel() for p in model.parameters())  # the tied head is not stored twice
    assert (shape.vision_tower_params, shape.aligner_params) == _vision_split(model)
    assert shape.checkpoint_dtype == "F32"


@pytest.mark.parametrize("dora", [False, True])
def test_lora_params_equal_peft(dora: bool) -> None:
    from peft import LoraConfig, get_peft_model

    from learner.train.policy import _language_model_targets

    config = _vl("qwen2_5_vl", True, [])
    targets = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    model = get_peft_model(
        _model(config, device="cpu"),
        LoraConfig(r=4, lora_alpha=8, target_modules=_language_model_targets(targets), use_dora=dora),
    )
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape_from_config(config.to_dict()).lora_params(4, targets, dora) == trained


def _job(**changes: Any) -> Any:
    """configs/job.yaml with `a.b.c=value` changes under spec."""
    doc = copy.deepcopy(JOB)
    for dotted, value in changes.items():
        node = doc["spec"]
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return parse_job(doc)


SHAPE_7B = shape_from_config(PRESETS["Qwen2.5-VL-7B"], "preset")


def test_the_chunked_loss_holds_one_chunk_of_logits_not_the_rows() -> None:
    """training.loss.logits chunked (the default) counts logits_chunk positions' logits, full the whole row's: at
    configs/job.yaml's 16384-token row and Qwen3-VL-2B's vocabulary the difference is (16384 - 1024) rows."""
    shape = shape_from_config(PRESETS["Qwen3-VL-2B"], "preset")
    full = activation_bytes(_job(**{"training.loss": {"logits": "full"}}).spec, shape)
    chunked = activation_bytes(_job().spec, shape)
    small = activation_bytes(_job(**{"training.loss": {"logits_chunk": 256}}).spec, shape)
    per_row = shape.vocab * (2 * 2 + 8)  # bf16 logits and grad, fp32 copy and softmax grad
    assert full - chunked == (16384 - 1024) * per_row
    assert chunked - small == (1024 - 256) * per_row
    assert full - chunked > 10 * 2**30  # the plan's activations drop by over 10 GiB


def test_full_finetuning_trains_what_freeze_leaves() -> None:
    job = _job(**{"training.finetune": "full"})
    total, vision = SHAPE_7B.total_params, SHAPE_7B.vision_tower_params + SHAPE_7B.aligner_params
    assert trainable_params(job.spec, SHAPE_7B) == total - vision  # tower and aligner frozen by default
    job = _job(**{"training.finetune": "full", "training.freeze": {"vision_tower": False, "embeddings": True}})
    assert trainable_params(job.spec, SHAPE_7B) == total - SHAPE_7B.aligner_params - SHAPE_7B.embed_params


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_shard_optimizer_then_gradients_then_weights(stage: int) -> None:
    job = _job(
        **{
            "training.finetune": "full",
            "training.precision": "bf16",
            "training.deepspeed_stage": stage,
            "rollout.replicas": 4,
            "learner.gpus": 4,
            "sync.transport": "shm",
        }
    )
    plan = plan_memory(job, shape=SHAPE_7B)
    learner = plan.plans["server"].devices[1]
    assert learner.role == "learner GPU" and learner.count == 4
    step = learner.phases["step"]
    n, t = SHAPE_7B.total_params, trainable_params(job.spec, SHAPE_7B)
    # bf16 + full: every weight fp32 (the master), trained ones with fp32 grads and two fp32 moments
    assert step["training weights"] == (4 * n // 4 if stage == 3 else 4 * n)
    expected_grads = 4 * t // 4 + min(ZERO_REDUCE_BUCKET, t) * 4 if stage >= 2 else 4 * t
    assert step["gradients"] == expected_grads
    expected_opt = (8 * t + 4 * t) // 4 if stage >= 1 else 8 * t  # DeepSpeed's fp32 master copy, sharded
    assert step["optimizer state"] == expected_opt
    assert ("sync" in learner.phases) == (stage == 3)
    if stage == 3:
        assert learner.phases["sync"]["training weights"] == 4 * n  # a sync gathers the whole model


def test_a_learner_on_several_pods_shards_over_every_pods_gpus() -> None:
    """Issue 45: learner.nodes 2 x 4 GPUs is a world of 8: ZeRO-3 keeps an eighth of the weights, optimizer state and
    gradients per GPU, as 8 GPUs in one pod would; the layout says where they are."""
    common = {
        "training.finetune": "full",
        "training.precision": "bf16",
        "training.deepspeed_stage": 3,
        "rollout.replicas": 4,
        "sync.transport": "grpc",
    }
    pods = plan_memory(_job(**common, **{"learner.gpus": 4, "learner.nodes": 2}), shape=SHAPE_7B).plans["server"]
    one = plan_memory(_job(**common, **{"learner.gpus": 8, "placement.gpusPerNode": 16}), shape=SHAPE_7B).plans[
        "server"
    ]
    assert pods.devices[1].count == 8 and pods.devices[1].phases["step"] == one.devices[1].phases["step"]
    assert pods.devices[1].phases["step"]["training weights"] == 4 * SHAPE_7B.total_params // 8
    assert "2 learner pods x 4 GPU(s)" in pods.layout, pods.layout


def _colocate(**changes: Any) -> Any:
    base = {
        "rollout.mode": "colocate",
        "rollout.replicas": None,
        "learner.gpus": 8,
        "sync.transport": "auto",
        "training.gradient_checkpointing": True,
        "training.packing_length": 8192,
    }
    return _job(**{**base, **changes})


def test_colocate_peak_is_the_sum_awake_and_the_max_asleep_with_offload() -> None:
    awake = plan_memory(_colocate(), shape=SHAPE_7B).plans["colocate"].devices[0]
    awake_offload = (
        plan_memory(_colocate(**{"rollout.colocate": {"offloadModel": True, "offloadOptimizer": True}}), shape=SHAPE_7B)
        .plans["colocate"]
        .devices[0]
    )
    asleep = plan_memory(_colocate(**{"rollout.colocate": {"sleepLevel": 1}}), shape=SHAPE_7B).plans["colocate"]
    asleep_offload = plan_memory(
        _colocate(**{"rollout.colocate": {"sleepLevel": 1, "offloadModel": True, "offloadOptimizer": True}}),
        shape=SHAPE_7B,
    ).plans["colocate"]
    share = int(0.45 * 80 * GiB)
    train = awake.phases["train"]
    # Awake, the engine's weights and KV cache stay through training: the peak is training plus the share.
    assert (
        train["engine weights"]
        + train["KV cache"]
        + train["CUDA graphs, vLLM runtime"]
        + awake.phases["generate"]["engine activations"]
        == share
    )
    assert awake.peak_phase == "train"
    lines = plan_memory(_colocate(), shape=SHAPE_7B).lines()  # what the learner logs at start
    assert lines[0].startswith("memory plan of qwen3vl-det: model 8.29B parameters (preset)")
    assert any(line.startswith("colocate (the job's mode)") for line in lines)
    assert any(line.startswith("server (for comparison)") for line in lines)
    # Offloading shrinks the generate phase, not the peak, while the engine is awake.
    assert awake_offload.total("generate") < awake.total("generate")
    assert awake_offload.peak == awake.peak
    assert awake_offload.phases["generate"]["training weights"] == 0
    assert "optimizer state" not in awake_offload.phases["generate"]
    # Asleep, training gets the GPU to itself; offload then makes the peak the larger phase, not the sum.
    d = asleep_offload.devices[0]
    assert "engine weights" not in d.phases["train"] and "KV cache" not in d.phases["train"]
    assert d.peak == max(d.total(p) for p in d.phases) < awake.peak
    assert d.total("generate") < asleep.devices[0].total("generate")
    training_state = train["training weights"] + train["optimizer state"]
    engine_weights = awake.phases["generate"]["engine weights"]
    assert d.host_bytes == training_state + engine_weights  # offloaded state + level 1's weights in host memory
    assert asleep_offload.host_total == 8 * d.host_bytes


def test_a_colocate_job_that_cannot_fit_is_refused_naming_the_knob() -> None:
    # 7B full fine-tuning, ZeRO-2 over 8 GPUs, the engine asleep while training: generation holds the fp32
    # weights, the optimizer shard and a 0.55 engine share at once.
    job = _colocate(
        **{
            "training.finetune": "full",
            "training.precision": "bf16",
            "training.deepspeed_stage": 2,
            "rollout.colocate": {"sleepLevel": 1, "gpuMemoryUtilization": 0.55},
            "learner.resources": {},
        }
    )
    with pytest.raises(MemoryPlanError) as info:
        check_memory_plan(job, model_config="Qwen2.5-VL-7B")
    err = info.value
    assert isinstance(err, JobSpecError) and isinstance(err, ValueError)
    text = str(err)
    assert "does not fit (colocate mode): a GPU needs" in text and "generate phase" in text
    for knob in (
        "lower spec.rollout.colocate.gpuMemoryUtilization to 0.45",
        "set spec.rollout.colocate.offloadOptimizer: true",
        "set spec.rollout.colocate.offloadModel: true",
    ):
        assert knob in text, text
    # ZeRO-3 would fit too, but the spec refuses it with a sleeping engine: the advice never names a refused job.
    assert "deepspeed_stage: 3" not in text, text
    fixed = _colocate(
        **{
            "training.finetune": "full",
            "training.precision": "bf16",
            "training.deepspeed_stage": 2,
            "rollout.colocate": {"sleepLevel": 1, "gpuMemoryUtilization": 0.55, "offloadOptimizer": True},
            "learner.resources": {},
        }
    )
    assert check_memory_plan(fixed, model_config="Qwen2.5-VL-7B").fits  # what the advice names is enough
    # The learner pod's memory limit bounds what may be offloaded: 8 ranks' optimizer shards and sleeping
    # engine weights do not fit 64 GiB of host memory.
    colocate = {"sleepLevel": 1, "gpuMemoryUtilization": 0.55, "offloadOptimizer": True}
    limited = _colocate(
        **{
            "training.finetune": "full",
            "training.precision": "bf16",
            "training.deepspeed_stage": 2,
            "rollout.colocate": colocate,
            "learner.resources": {"limits": {"memory": "64Gi"}},
        }
    )
    with pytest.raises(MemoryPlanError, match="spec.learner.resources.limits.memory"):
        check_memory_plan(limited, model_config="Qwen2.5-VL-7B")


def test_lowering_the_engine_share_is_advised_with_the_value_that_fits() -> None:
    job = _colocate(**{"rollout.colocate": {"gpuMemoryUtilization": 0.9}})
    plan = plan_memory(job, shape=SHAPE_7B)
    assert not plan.fits
    advice = " ".join(plan.advice)
    assert "lower spec.rollout.colocate.gpuMemoryUtilization to " in advice
    value = float(advice.split("gpuMemoryUtilization to ")[1].split(",")[0].split(" ")[0].rstrip("."))
    fixed = _colocate(**{"rollout.colocate": {"gpuMemoryUtilization": value}})
    assert plan_memory(fixed, shape=SHAPE_7B).fits
    too_far = _colocate(**{"rollout.colocate": {"gpuMemoryUtilization": round(value + 0.05, 2)}})
    assert not plan_memory(too_far, shape=SHAPE_7B).fits  # the largest share that fits


def test_a_kv_cache_smaller_than_one_sequence_is_refused() -> None:
    job = _job(
        **{"rollout.gpuMemoryUtilization": 0.1, "rollout.maxModelLen": 32768, "training.gradient_checkpointing": True}
    )
    plan = plan_memory(job, shape=SHAPE_7B)
    assert not plan.fits
    assert any("maxModelLen" in p for p in plan.own.devices[0].problems)
    assert "raise spec.rollout.gpuMemoryUtilization to" in " ".join(plan.advice)


def test_tp_splits_the_engine_weights() -> None:
    one = plan_memory(_colocate(), shape=SHAPE_7B).own.devices[0].phases["generate"]["engine weights"]
    four = plan_memory(_colocate(**{"rollout.colocate": {"tensorParallelSize": 4}}), shape=SHAPE_7B)
    assert four.own.devices[0].phases["generate"]["engine weights"] == one // 4
    assert one == SHAPE_7B.total_params * 2  # bf16 serving dtype


def test_gpu_memory_and_presets_from_the_spec() -> None:
    job = _job()
    assert default_gpu_memory(job.spec) == 80 * GiB  # NVIDIA-H100-80GB-HBM3
    assert default_gpu_memory(_job(**{"placement.nodeSelector": {}}).spec) == 80 * GiB
    assert (
        default_gpu_memory(_job(**{"placement.nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200-141GB"}}).spec)
        == 141 * GiB
    )
    assert preset_for("/models/Qwen3-VL-2B-Instruct") == "Qwen3-VL-2B"
    assert preset_for("/models/qwen2.5-vl-7b-instruct/") == "Qwen2.5-VL-7B"
    assert preset_for("/models/Qwen3-VL-235B-A22B") is None
    assert parse_bytes("80GiB") == parse_bytes("80Gi") == 80 * GiB
    assert parse_bytes("96G") == 96 * 10**9 and parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match="not a memory size"):
        parse_bytes("eighty")
    with pytest.raises(ModelShapeError, match="--model-config"):
        plan_memory(_job(**{"model.path": "/nowhere/custom-model"}))


def test_cpu_jobs_are_shown_in_host_memory_and_refused_only_over_a_limit() -> None:
    doc = yaml.safe_load((ROOT / "configs" / "local-tiny-vl.yaml").read_text())
    shape = SHAPE_7B  # a large model on CPUs: shown, not refused, without a memory limit
    plan = plan_memory(parse_job(doc), shape=shape)
    assert plan.fits and all(d.capacity is None for p in plan.plans.values() for d in p.devices)
    assert plan.own.devices[1].role == "learner process"
    assert "CUDA context, NCCL" not in plan.own.devices[1].phases["train"]
    doc["spec"]["learner"]["resources"] = {"limits": {"memory": "8Gi"}}
    plan = plan_memory(parse_job(doc), shape=shape)
    assert not plan.fits and "learner process needs" in plan.message()


def test_runtime_reserve_is_counted_once_per_training_gpu() -> None:
    plan = plan_memory(_colocate(), shape=SHAPE_7B)
    assert plan.own.devices[0].phases["train"]["CUDA context, NCCL"] == RUNTIME_BYTES
    rollout = plan_memory(_job(), shape=SHAPE_7B).plans["server"].devices[0]
    assert "CUDA context, NCCL" not in rollout.phases["generate"]  # inside vLLM's own share


# ---------------------------------------------------------------- the CLI


def _rmsft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rmsft_cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"},
    )


def test_cli_plan_exit_codes_and_output(tmp_path: Path) -> None:
    fits = tmp_path / "fits.yaml"
    doc = copy.deepcopy(JOB)
    doc["spec"]["training"]["gradient_checkpointing"] = True
    fits.write_text(yaml.safe_dump(doc))
    res = _rmsft("plan", str(fits))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "server mode (the job)" in out and "colocate mode (for comparison" in out
    for row in ("training weights", "optimizer state", "activations", "KV cache", "engine weights"):
        assert row in out
    assert "preset Qwen3-VL-2B" in out and "assumptions:" in out

    # configs/job.yaml's learner GPU needs 13.7 GiB (the chunked loss: 39.8 with the whole row's logits)
    res = _rmsft("plan", str(ROOT / "configs" / "job.yaml"), "--gpu-memory", "12GiB")
    assert res.returncode == 2
    err = " ".join(res.stderr.split())
    assert "does not fit (server mode)" in err and "spec.training." in err
    assert "Traceback" not in res.stderr

    res = _rmsft("plan", str(fits), "--gpu-memory", "lots")
    assert res.returncode == 2 and "not a memory size" in res.stderr and "Traceback" not in res.stderr
    res = _rmsft("plan", str(fits), "--model-config", "Llama-1T")
    assert res.returncode == 2 and "preset" in res.stderr
    res = _rmsft("plan", str(fits), "--model-config", "Qwen2.5-VL-7B", "--gpu-memory", "141GiB")
    assert res.returncode == 0 and "preset Qwen2.5-VL-7B" in res.stdout


def test_a_sync_wakes_a_sleeping_engines_weights_and_moe_is_refused() -> None:
    job = _colocate(
        **{
            "training.finetune": "full",
            "training.precision": "bf16",
            "training.deepspeed_stage": 2,
            "rollout.colocate": {"sleepLevel": 2},
        }
    )
    d = plan_memory(job, shape=SHAPE_7B).own.devices[0]
    assert "engine weights" not in d.phases["train"]
    assert d.phases["sync"]["engine weights"] == d.phases["generate"]["engine weights"] > 0
    assert d.host_bytes == 0  # level 2 discards the engine's weights; the learner restores them
    moe = {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "vocab_size": 100,
        "num_experts": 8,
    }
    with pytest.raises(ModelShapeError, match="mixture-of-experts"):
        shape_from_config(moe)


# ---------------------------------------------------------------- the advice is a job the validator accepts


def _advice_cases() -> list[tuple[str, Any, int]]:
    """Jobs that do not fit, over the knobs' whole range: colocate at ZeRO 1-3 (where offloading the optimizer
    is refused at stage 3), server jobs whose rollout GPUs are short (where a larger TP would need more GPUs
    than the node has), full and LoRA fine-tuning, fp32."""
    cases = []
    for stage in (1, 2, 3):
        for finetune in ("full", "lora"):
            for share, sleep in ((0.45, 0), (0.55, 1), (0.9, 1)):
                if stage == 3 and sleep:  # refused by the spec (a sleeping engine under ZeRO-3 is unproven)
                    continue
                job = _colocate(
                    **{
                        "training.finetune": finetune,
                        "training.precision": "bf16",
                        "training.deepspeed_stage": stage,
                        "learner.resources": {},
                        "rollout.colocate": {"sleepLevel": sleep, "gpuMemoryUtilization": share},
                    }
                )
                cases += [(f"colocate z{stage} {finetune} {share}/{sleep}", job, gib) for gib in (48, 64, 80)]
    # shm: the one-node budget binds (over grpc a larger TP may take GPUs on another node, and is sound advice).
    for replicas in (4, 7):
        job = _job(
            **{
                "rollout.replicas": replicas,
                "learner.gpus": 8 - replicas,
                "sync.transport": "shm",
                "rollout.gpuMemoryUtilization": 0.2,
            }
        )
        cases += [(f"server {replicas}+{8 - replicas} u0.2", job, gib) for gib in (64, 80)]
    job = _job(
        **{
            "training.finetune": "full",
            "training.precision": "fp32",
            "training.deepspeed_stage": 1,
            "rollout.replicas": 4,
            "learner.gpus": 4,
            "sync.transport": "shm",
        }
    )
    cases += [("server full fp32", job, gib) for gib in (40, 80)]
    return cases


def test_every_piece_of_advice_is_a_job_the_validator_accepts_and_that_fits() -> None:
    from rmsft.jobspec import JobSpec
    from rmsft.memory_plan import advised_knobs, changed

    checked: list[str] = []
    for name, job, gib in _advice_cases():
        plan = plan_memory(job, shape=SHAPE_7B, gpu_memory=gib * GiB)
        if plan.fits:  # some corners of the sweep fit as they are: no advice to check
            continue
        singles, pair = advised_knobs(job.spec, SHAPE_7B, gib * GiB)
        text = " ".join(plan.advice)
        for chosen in [(k,) for k in singles] + ([pair] if pair else []):
            label = f"{name} at {gib} GiB: {' + '.join(k[0] for k in chosen)}"
            assert all(k[0] in text for k in chosen), label  # the structured advice is what the text says
            s = changed(job.spec, *chosen)
            try:  # through the validator, as the user would apply it (a manifest, not the object)
                fixed = JobSpec.model_validate(s.model_dump(by_alias=True))
            except Exception as exc:  # reported with the advice that made it
                pytest.fail(f"{label}: refused by the validator: {exc}")
            c = fixed.rollout.colocate
            assert not (fixed.rollout.colocated and c.offload_optimizer and fixed.training.deepspeed_stage == 3), (
                f"{label}: offloadOptimizer under ZeRO-3 (the learner refuses it at start)"
            )
            doc = job.to_manifest()
            doc["spec"] = fixed.model_dump(by_alias=True)
            assert plan_memory(parse_job(doc), shape=SHAPE_7B, gpu_memory=gib * GiB).fits, label
            checked.append(label)
    # The sweep reaches the knobs that needed the filter, and still finds advice for them.
    assert len(checked) >= 40
    joined = "\n".join(checked)
    assert "offloadOptimizer" in joined and "deepspeed_stage: 3" in joined and "tensorParallelSize" not in joined


def test_advice_never_offloads_the_optimizer_under_zero3_nor_outgrows_the_node() -> None:
    # Offloading the optimizer is advice under ZeRO 1 and 2, never under ZeRO-3 (DeepSpeed moves ZeRO-3's
    # optimizer state only for its own FusedAdam): neither alone at stage 3 nor paired with going to stage 3.
    def job(stage: int, share: float) -> Any:
        return _colocate(
            **{
                "training.finetune": "full",
                "training.precision": "bf16",
                "training.deepspeed_stage": stage,
                "learner.resources": {},
                # a sleeping engine under ZeRO-3 is refused by the spec: awake there
                "rollout.colocate": {"sleepLevel": 0 if stage == 3 else 1, "gpuMemoryUtilization": share},
            }
        )

    offload = "set spec.rollout.colocate.offloadOptimizer: true"
    assert offload in " ".join(plan_memory(job(2, 0.55), shape=SHAPE_7B).advice)
    for stage in (1, 2, 3):
        plan = plan_memory(job(stage, 0.9), shape=SHAPE_7B, gpu_memory=64 * GiB)
        assert not plan.fits and plan.advice, stage
        assert "offloadOptimizer" not in " ".join(plan.advice), (stage, plan.advice)
    # 7 servers at TP 1 and 1 learner fill the node: over shm (one node) TP 2 would need 15 GPUs, the node has 8;
    # over grpc the pool may span nodes, and TP 2 is advice.
    for transport, tp_advised in (("shm", False), ("grpc", True)):
        job = _job(
            **{
                "rollout.replicas": 7,
                "learner.gpus": 1,
                "sync.transport": transport,
                "rollout.gpuMemoryUtilization": 0.2,
            }
        )
        plan = plan_memory(job, shape=SHAPE_7B, gpu_memory=80 * GiB)
        assert plan.advice and ("raise spec.rollout.tensorParallelSize to 2" in " ".join(plan.advice)) == tp_advised
        assert "raise spec.rollout.gpuMemoryUtilization to" in " ".join(plan.advice)


@pytest.mark.parametrize(
    "value,expected",
    [(None, "refuse"), ("", "refuse"), ("refuse", "refuse"), ("warn", "warn"), ("off", "off"), (" WARN ", "warn")],
)
def test_memory_plan_setting_takes_its_documented_values(value: str | None, expected: str) -> None:
    from rmsft.memory_plan import MEMORY_PLAN_ENV, memory_plan_setting

    assert memory_plan_setting({} if value is None else {MEMORY_PLAN_ENV: value}) == expected


@pytest.mark.parametrize("value", ["wran", "0", "false", "no", "refused"])
def test_memory_plan_setting_refuses_anything_else_naming_the_values(value: str) -> None:
    from rmsft.memory_plan import MEMORY_PLAN_ENV, MemoryPlanSettingError, memory_plan_setting

    with pytest.raises(MemoryPlanSettingError) as info:
        memory_plan_setting({MEMORY_PLAN_ENV: value})
    text = str(info.value)
    assert MEMORY_PLAN_ENV in text and repr(value) in text
    assert all(v in text for v in ("refuse", "warn", "off"))
