"""Rank 0's server home, wired: the ordered pool, the weight-sync client on it (what the job's spec.sync asks),
the rollout interface over both (`learner.rollouts.server_home.ServerRollouts`, which is given its weight
sender rather than building it: the rollout room sits below the sync room), and the prefetcher of rollouts
generated ahead (learner/train/overlap.py) in front of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from learner.rollouts.pool import ServerPool, ServersFile
from learner.rollouts.server_home import ServerRollouts
from learner.sync.client import WeightSyncClient
from learner.sync.weights import checkpoint_name_map
from learner.train.config import sync_transport
from learner.train.overlap import RolloutsAhead
from rmsft.jobspec import RolloutMatchingJob
from rmsft.jobspec.rollout import TLS_DIR_ENV  # the Secret's folder the operator names; unset: plaintext
from rmsft.weight_wire import shared_dir_from_env


def tls_roots_from_env() -> bytes | None:
    """The PEM roots the learner trusts the rollout servers with: the Secret's ca.crt (an issuer's CA, e.g.
    cert-manager's), else its tls.crt (a self-signed certificate is its own root); None without TLS. The host name
    gRPC checks is each server's address, the name its certificate must cover."""
    folder = os.environ.get(TLS_DIR_ENV, "").strip()
    if not folder:
        return None
    for name in ("ca.crt", "tls.crt"):
        path = Path(folder) / name
        if path.is_file() and path.stat().st_size:
            return path.read_bytes()
    raise ValueError(
        f"{TLS_DIR_ENV}={folder}: neither ca.crt nor tls.crt is there; spec.rollout.tls.secretName must "
        "name a Secret of type kubernetes.io/tls"
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def server_pool(
    job: RolloutMatchingJob, addresses: Sequence[str] | ServersFile, *, run_id: str | None, auth_token: str | None
) -> ServerPool:
    """The learner's channels to the servers: the job's token, TLS when the operator mounted spec.rollout.tls's
    Secret (tls_roots_from_env), and a restart of every server (the only one, most often) waited out for
    spec.rollout.recoveryTimeout."""
    followed = addresses if isinstance(addresses, ServersFile) else list(addresses)
    return ServerPool(
        followed,
        auth_token=auth_token,
        run_id=run_id,
        root_certificates=tls_roots_from_env(),
        recovery_s=job.spec.rollout.recovery_timeout_seconds,
    )


def build_server_rollouts(
    job: RolloutMatchingJob,
    addresses: Sequence[str] | ServersFile,
    model: Any,
    *,
    run_id: str,
    auth_token: str | None,
    checkpoint_dir: str | Path,
    vision_language: bool,
    zero3: bool,
    fence_resync: Callable[[Callable], Callable] | None = None,
) -> ServerRollouts:
    """The pool of `addresses` (a fixed list, or the servers file the operator keeps current), the weight
    sender of `model` on it, and the rollout interface over both."""
    pool = server_pool(job, addresses, run_id=run_id, auth_token=auth_token)
    sync, cfg = job.spec.sync, job.spec.training
    sync_client = WeightSyncClient(
        pool,
        model,
        mode=sync.mode,
        fallback_to_full=sync.fallback_to_full,
        frame_bytes=sync.frame_bytes,
        timeout_s=sync.timeout_seconds,
        # FULL weights go out in the serving dtype (spec.model.dtype; auto = the checkpoint's)
        dtype=job.spec.model.dtype,
        checkpoint_dir=checkpoint_dir,
        # Vision-language: checkpoint names (what vLLM reloads), and only what training can
        # change (a frozen vision tower is never resent).
        name_map=checkpoint_name_map(model) if vision_language else None,
        changed_only=vision_language,
        transport=sync_transport(sync, shared_dir_from_env()),
        shared_dir=shared_dir_from_env(),
        # The servers' backend (rmsft.serve_options): NCCL when they and this learner run on GPUs.
        group_backend=sync.group_backend("nvidia" if job.spec.placement.accelerator == "nvidia" and _cuda() else "none")
        or "rmsft_gloo",
        group_timeout_s=sync.group_timeout_seconds,
        group_bucket_bytes=sync.bucket_megabytes << 20,
        keep_generating=job.spec.training.rollout.inflight,
    )
    if zero3:
        sync_client.export_blocked = (
            "ZeRO-3 partitions the weights across learner ranks; the next step's collective sync brings the server up"
        )
    return ServerRollouts(
        pool,
        sync_client,
        timeout_s=cfg.rollout.request_timeout_s,
        generate_batch_size=cfg.rollout.generate_batch_size or 0,
        fence_resync=fence_resync,
    )


def server_rollouts_ahead(
    job: RolloutMatchingJob,
    addresses: Sequence[str] | ServersFile,
    model: Any,
    *,
    run_id: str,
    auth_token: str | None,
    checkpoint_dir: str | Path,
    vision_language: bool,
) -> tuple[ServerRollouts, RolloutsAhead]:
    """Rank 0's rollout source in server mode and its prefetcher: every E-step's rollouts go through the prefetcher
    (max_staleness 0: generated inline, as always); the servers' re-syncs are fenced by it (none while weights
    move), and closing it ends a call still running ahead before waiting for it."""
    cfg = job.spec.training
    source: ServerRollouts | None = None

    def generate(reqs: Any, sampling: Any, v: Any) -> Any:
        assert source is not None, "set below, before the prefetcher is given any work"
        return source.generate(reqs, sampling, weight_version=v)

    ahead = RolloutsAhead(generate, cfg.rollout.max_staleness)
    source = build_server_rollouts(
        job,
        addresses,
        model,
        run_id=run_id,
        auth_token=auth_token,
        checkpoint_dir=checkpoint_dir,
        vision_language=vision_language,
        zero3=cfg.deepspeed_stage == 3,
        fence_resync=ahead.fenced_resync,
    )
    ahead.abort = source.abort
    return source, ahead
