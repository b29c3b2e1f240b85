"""Extra learner memory of one FULL weight sync of a LoRA model: the streaming export against the
previous one, which built a merged copy of every LoRA-targeted weight before sending anything.

    python benchmarks/full_export_memory.py [--hidden 1024] [--layers 16] [--dtype bfloat16]

Builds a random Qwen2 (tokenizer-free, `--hidden`, `--layers`, intermediate 2.75 x hidden) with a
LoRA adapter on every linear layer, and syncs it with the real `WeightSyncClient` to a sink server
in another process (a gRPC `UpdateWeights` that checks the stream with the real wire reader,
digest included, and discards the bytes). Each variant runs in a fresh learner process: one
warm-up sync, then the measured one. Two figures per variant:

- peak RSS: the kernel's high-water mark of the learner process (VmHWM, reset through
  /proc/self/clear_refs right before the sync) minus its RSS at that moment. Everything the sync
  costs on a CPU learner: tensors, encoder frames, gRPC buffers, malloc slack.
- peak tensors: the most bytes of tensor storage created by the export and alive at once,
  counted by a torch dispatch mode around the export (tests/learner/alloc_tracker.py), peft's
  merge/unmerge temporaries included; on a GPU learner this is what lands on the device.

"old" runs the previous export verbatim (`_old_full_named_tensors` below, a list of every tensor
with all merged copies, then encoded) through the same client; "new" is the current code.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests/learner"))

MIB = 1 << 20

SINK = r"""
import sys
from concurrent import futures
import grpc
from rmsft_protos import rollout_pb2, rollout_pb2_grpc
from rmsft.weight_wire import FRESH, StreamReader, set_version, version_of

class Sink(rollout_pb2_grpc.RolloutServiceServicer):
    version = FRESH
    def UpdateWeights(self, request_iterator, context):
        reader = StreamReader()
        for chunk in request_iterator:
            reader.feed(chunk)
        if not reader.finished:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no trailer")
        Sink.version = version_of(reader.header)
        return set_version(rollout_pb2.UpdateReply(tensors_applied=len(reader.tensors),
                                                   bytes_received=reader.received_bytes), Sink.version)
    def GetStatus(self, request, context):
        return set_version(rollout_pb2.StatusReply(model="sink", ready=True, backend="sink"), Sink.version)

server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.max_receive_message_length", 64 << 20)])
rollout_pb2_grpc.add_RolloutServiceServicer_to_server(Sink(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
"""


def _old_full_named_tensors(model: Any, dtype: Any = None) -> list[tuple[str, Any]]:
    """The FULL export before streaming (learner/sync/weights.py up to this change), verbatim in
    what it allocates: a merged clone of every LoRA-targeted base weight, then the list."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    from learner.sync.weights import active_adapter, hf_name

    def merged_base_weights() -> dict[str, torch.Tensor]:
        out = {}
        for mod_name, module in model.named_modules():
            if not isinstance(module, BaseTunerLayer) or not hasattr(module, "base_layer"):
                continue
            base = module.get_base_layer()
            saved = {n: p.detach().clone() for n, p in base.named_parameters(recurse=False)}
            module.merge()
            try:
                for n, p in base.named_parameters(recurse=False):
                    out[f"{mod_name}.base_layer.{n}"] = p.detach().clone()
            finally:
                module.unmerge()
                for n, p in base.named_parameters(recurse=False):
                    p.data.copy_(saved[n])
        return out

    with torch.no_grad():
        adapter = active_adapter(model)
        merged = merged_base_weights()
        items = []
        for key, t in model.state_dict(keep_vars=False).items():
            name = hf_name(key, adapter)
            if name is None:
                continue
            t = merged.get(key, t).detach()
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            items.append((name, t))
    seen, out = set(), []
    for name, t in items:  # tied duplicates dropped, as before
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    return out


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) * 1024


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024


def _settle() -> None:
    gc.collect()
    with contextlib.suppress(OSError):  # free heap back to the OS, so the baseline is what is live
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from alloc_tracker import AllocationTracker
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import learner.sync.client as sync_client
    from learner.rollouts.pool import ServerPool
    from learner.sync.weights import full_export
    from rmsft.weight_wire import TensorSpec, dtype_name

    torch.manual_seed(0)
    hidden = args.hidden
    cfg = Qwen2Config(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=int(2.75 * hidden),
        num_hidden_layers=args.layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 512),
        head_dim=64,
        tie_word_embeddings=True,
    )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(
        Qwen2ForCausalLM(cfg), LoraConfig(r=16, lora_alpha=32, target_modules=targets, init_lora_weights=False)
    )
    dtype = getattr(torch, args.dtype) if args.dtype else None
    bases = [m.get_base_layer().weight for m in model.modules() if isinstance(m, BaseTunerLayer)]
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    trackers = [AllocationTracker()]  # a fresh one for the measured sync

    if args.child == "old":

        def plan(self, mode: str):  # the sync client before streaming: the whole merged list first
            with trackers[0]:
                tensors = _old_full_named_tensors(self.model, self.dtype)
            return [(n, TensorSpec(dtype_name(t.dtype), tuple(t.shape))) for n, t in tensors], tensors, ""

        sync_client.WeightSyncClient._plan = plan
    else:

        class Tracked:
            def __init__(self, export) -> None:
                self.export, self.specs = export, export.specs

            def __iter__(self):
                with trackers[0]:  # entered on gRPC's request thread, where the export runs
                    yield from self.export

        sync_client.full_export = lambda *a, **k: Tracked(full_export(*a, **k))

    with ServerPool([args.sink]) as pool:
        client = sync_client.WeightSyncClient(pool, model, mode="full", dtype=dtype)
        client.sync(1)  # warm-up: channel, threads, first-use allocations
        trackers[0] = tracker = AllocationTracker()
        _settle()
        base_rss = _rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        t0 = time.perf_counter()
        report = client.sync(2)
        seconds = time.perf_counter() - t0
        peak_rss = _hwm() - base_rss
    _settle()
    return {
        "variant": args.child,
        "model_mib": sum(nbytes(p) for p in model.parameters()) / MIB,
        "lora_weights_mib": sum(nbytes(w) for w in bases) / MIB,
        "largest_mib": max(nbytes(w) for w in bases) / MIB,
        "stream_mib": report.tensor_bytes / MIB,
        "seconds": seconds,
        "peak_rss_mib": peak_rss / MIB,
        "peak_tensors_mib": tracker.peak / MIB,
        "left_after_mib": tracker.live_bytes() / MIB,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", default="", help="serving dtype to cast to (e.g. bfloat16); default: as trained")
    ap.add_argument("--child", choices=["old", "new"], help=argparse.SUPPRESS)
    ap.add_argument("--sink", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT_JSON " + json.dumps(child(args)), flush=True)
        return

    sink = subprocess.Popen(
        [sys.executable, "-c", SINK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        address = f"127.0.0.1:{int(sink.stdout.readline())}"
        rows = []
        for variant in ("old", "new"):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                variant,
                "--sink",
                address,
                "--hidden",
                str(args.hidden),
                "--layers",
                str(args.layers),
                "--dtype",
                args.dtype,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT_JSON ")), None)
            if out.returncode != 0 or line is None:
                raise SystemExit(f"{variant} run failed:\n{out.stderr[-4000:]}")
            rows.append(json.loads(line.removeprefix("RESULT_JSON ")))
    finally:
        sink.stdin.close()
        sink.wait(timeout=30)
    r = rows[0]
    print(
        f"model {r['model_mib']:.0f} MiB ({args.layers} layers, hidden {args.hidden}), LoRA-targeted weights "
        f"{r['lora_weights_mib']:.0f} MiB, largest {r['largest_mib']:.1f} MiB, stream {r['stream_mib']:.0f} MiB "
        f"({args.dtype or 'as trained'})"
    )
    print(f"{'variant':8} {'peak RSS MiB':>13} {'peak tensors MiB':>17} {'left after MiB':>15} {'sync s':>7}")
    for r in rows:
        print(
            f"{r['variant']:8} {r['peak_rss_mib']:13.1f} {r['peak_tensors_mib']:17.1f} {r['left_after_mib']:15.1f} "
            f"{r['seconds']:7.2f}"
        )
    old, new = rows
    print(
        f"RESULT old_rss_mib={old['peak_rss_mib']:.1f} new_rss_mib={new['peak_rss_mib']:.1f} "
        f"old_tensors_mib={old['peak_tensors_mib']:.1f} new_tensors_mib={new['peak_tensors_mib']:.1f} "
        f"largest_mib={new['largest_mib']:.1f} old_s={old['seconds']:.2f} new_s={new['seconds']:.2f}"
    )


if __name__ == "__main__":
    main()
