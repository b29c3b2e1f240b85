"""Host memory per learner rank of a checkpoint load under DeepSpeed ZeRO-2 with `finetune: full`: each rank
reading only its own part (`rank-<r>.pt`, learner/train/checkpointer.py) against the one-file checkpoint of
earlier releases (every rank's partition gathered into one `state.pt` that every rank loaded whole).

    python benchmarks/checkpoint_partitions.py [--hidden 512] [--layers 8] [--vocab 32000] [--ranks 2]

Builds a random Qwen2 (tokenizer-free; intermediate 2.75 x hidden, embeddings tied) in fp32, every parameter
trainable, and trains one step under the real `ZeroUpdater` (ZeRO-2) on `--ranks` torchrun ranks (gloo, CPU).
Then the real `Checkpointer.save` writes the partitioned checkpoint, and the same state is written in the one-file
layout (`_write_one_file`: what the previous `Checkpointer.save` wrote, rank 0 gathering every rank's part).
Each load runs in fresh torchrun ranks that build the same model and engine, then:

- "partitioned": the real `Checkpointer.resume` (state.pt memory-mapped for the weights, the rank's own part);
- "one-file": the previous load verbatim (`_load_one_file`: `torch.load` of the whole file onto the CPU, every
  rank's partition handed to DeepSpeed).

Per rank: the load's peak RSS above the RSS before it (VmHWM, reset through /proc/self/clear_refs right before the
load), and after the load the anonymous and file-backed RSS (RssAnon, RssFile: memory-mapped checkpoint pages are
file-backed, which the kernel can drop). Both loads then train one more step on the same input: the losses must be
equal (the same state was loaded), and the peak RSS through that step over the same baseline is printed too (a
memory-mapped part's pages are read when the step first uses them, so the load's peak alone would flatter it).
Prints one RESULT line.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20


def _status() -> dict[str, int]:
    """/proc/self/status memory lines, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _cfg(ckpt_dir: Path) -> Any:
    import yaml

    from rmsft.jobspec import parse_job

    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text()))
    t = doc["spec"]["training"]
    t.update(finetune="full", deepspeed_stage=2, lr=1e-3)
    t["checkpoint"] = {"dir": str(ckpt_dir), "every": 0, "keep": 2}
    return parse_job(doc).spec.training


def _build(args: argparse.Namespace, ckpt_dir: Path) -> tuple[Any, ...]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from learner.core.packing import Packer
    from learner.train.checkpointer import Checkpointer, TrainState
    from learner.train.ranks import Ranks
    from learner.train.updater import ZeroUpdater

    ranks = Ranks.from_env()
    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    cfg = _cfg(ckpt_dir)
    updater = ZeroUpdater(
        model,
        ranks,
        stage=2,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        device=torch.device("cpu"),
    )
    packer = Packer(cfg.packing_length, cfg.packing_buffer)
    ckpt = Checkpointer(cfg, ranks, model, updater, packer, TrainState(run_id="bench"))
    return ranks, model, updater, ckpt


def _step(updater: Any, args: argparse.Namespace, seed: int) -> float:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab, (1, 64), generator=g)
    updater.begin()
    loss = updater.forward(input_ids=ids, labels=ids).loss
    updater.backward(loss)
    updater.finish(1, 1e-3)
    return float(loss.detach())


def _write_one_file(ckpt: Any, folder: Path) -> None:
    """The previous Checkpointer.save's file: rank 0 gathers every rank's state (ZeRO partition included)."""
    import torch

    rank_states = ckpt.ranks.gather_to_main(ckpt._rank_state())
    model_state = ckpt.gathered_trainable_state()
    if ckpt.ranks.is_main:
        state = {**ckpt.checkpoint(model_state), "rank_states": rank_states}
        state.pop("layout")
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, folder / "state.pt")


def _load_one_file(ckpt: Any, updater: Any, model: Any, folder: Path) -> None:
    """The previous Checkpointer.resume's load, verbatim in what it holds in memory."""
    import torch

    from learner.train.checkpoint_files import set_rng_state

    state = torch.load(folder / "state.pt", weights_only=False, map_location="cpu")
    model.load_state_dict(state["model"], strict=False)
    rank_states = state["rank_states"]
    updater.engine.optimizer.load_state_dict(
        [s["zero_optimizer"] for s in rank_states], load_optimizer_states=True, load_from_fp32_weights=True
    )
    mine = rank_states[ckpt.ranks.rank]
    set_rng_state(mine["rng"])
    ckpt.packer.restore(mine["packer"])
    del state, rank_states, mine


def child(args: argparse.Namespace) -> None:
    """One torchrun rank: `--mode save`, `partitioned` or `one-file`."""
    work = Path(args.work)
    ranks, model, updater, ckpt = _build(args, work / "partitioned")
    if args.mode == "save":
        _step(updater, args, seed=1)
        ckpt.state.step = 1
        ckpt.save()
        _write_one_file(ckpt, work / "one-file" / "step-1")
        ranks.barrier()
        return
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    before = _status()
    t0 = time.perf_counter()
    if args.mode == "partitioned":
        assert ckpt.resume(), "no checkpoint to resume"
    else:
        _load_one_file(ckpt, updater, model, work / "one-file" / "step-1")
    seconds = time.perf_counter() - t0
    gc.collect()
    after = _status()
    loss = _step(updater, args, seed=2)
    stepped = _status()
    mine = {
        "rank": ranks.rank,
        "load_peak_mib": (after["VmHWM"] - before["VmRSS"]) / MIB,
        "step_peak_mib": (stepped["VmHWM"] - before["VmRSS"]) / MIB,
        "rss_before_mib": before["VmRSS"] / MIB,
        "anon_added_mib": (after["RssAnon"] - before["RssAnon"]) / MIB,
        "file_added_mib": (after["RssFile"] - before["RssFile"]) / MIB,
        "load_s": seconds,
        "next_loss": loss,
    }
    every = ranks.gather_to_main(mine)
    if ranks.is_main:
        print("RESULT_JSON " + json.dumps(every), flush=True)
    ranks.barrier()


def _torchrun(args: argparse.Namespace, mode: str) -> list[dict[str, Any]] | None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.ranks),
        __file__,
        "--child",
        "--mode",
        mode,
        "--work",
        args.work,
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--vocab",
        str(args.vocab),
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed ({out.returncode}):\n{out.stderr[-6000:]}")
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT_JSON ")), None)
    return json.loads(line.removeprefix("RESULT_JSON ")) if line else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--work", default="")
    p.add_argument("--mode", default="")
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    if args.child:
        child(args)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rmsft-ckpt-bench-") as work:
        args.work = work
        _torchrun(args, "save")
        folder = Path(work) / "partitioned" / "step-1"
        sizes = {f.name: f.stat().st_size / MIB for f in sorted(folder.glob("*.pt"))}
        one_file = (Path(work) / "one-file" / "step-1" / "state.pt").stat().st_size / MIB
        print(
            "files (MiB): partitioned "
            + ", ".join(f"{k} {v:.0f}" for k, v in sizes.items())
            + f"; one-file state.pt {one_file:.0f}"
        )
        res = {mode: _torchrun(args, mode) for mode in ("one-file", "partitioned")}
    for mode, ranks in res.items():
        assert ranks is not None
        for r in ranks:
            print(
                f"{mode:11s} rank {r['rank']}: load peak +{r['load_peak_mib']:.0f} MiB over {r['rss_before_mib']:.0f}"
                f" MiB; after: anon +{r['anon_added_mib']:.0f} MiB, file-backed +{r['file_added_mib']:.0f} MiB;"
                f" {r['load_s']:.2f} s; peak through the next step +{r['step_peak_mib']:.0f} MiB, its loss"
                f" {r['next_loss']:.6f}"
            )
    old, new = res["one-file"], res["partitioned"]
    assert old is not None and new is not None
    same = all(a["next_loss"] == b["next_loss"] for a, b in zip(old, new, strict=True))
    print(
        f"RESULT ranks={args.ranks} hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
        f"one_file_mib={one_file:.0f} own_part_mib={max(v for k, v in sizes.items() if k.startswith('rank-')):.0f} "
        f"one_file_load_peak_mib={max(r['load_peak_mib'] for r in old):.0f} "
        f"partitioned_load_peak_mib={max(r['load_peak_mib'] for r in new):.0f} "
        f"one_file_step_peak_mib={max(r['step_peak_mib'] for r in old):.0f} "
        f"partitioned_step_peak_mib={max(r['step_peak_mib'] for r in new):.0f} "
        f"one_file_anon_mib={max(r['anon_added_mib'] for r in old):.0f} "
        f"partitioned_anon_mib={max(r['anon_added_mib'] for r in new):.0f} same_next_loss={same}"
    )


if __name__ == "__main__":
    main()
