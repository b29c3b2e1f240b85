"""Issue 60: what `rmsft train` exits with is what the learner Job's podFailurePolicy reads (rmsft.exit_codes): 2 only
for a refused configuration, 75 for a failure a retry may not meet again, 143 for a stop on SIGTERM; several ranks'
codes become one verdict (`rmsft torchrun`); the SIGTERM handler works from `rmsft train`'s first line; torchrun's
agent reads the shutdown timeout the operator sets. The 2-rank runs are tests/learner/test_torchrun_exits.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from rmsft.exit_codes import CONFIG_EXIT, RETRY_EXIT, STOPPED_EXIT, exit_code_for, read_rank_exits, verdict


def test_refusals_exit_2_and_transient_failures_exit_retryable() -> None:
    from learner.data.records import DataError
    from learner.rollouts.pool import NoServerAvailableError
    from learner.sync.client import WeightSyncError
    from learner.train.checkpoint_owner import CheckpointFolderBusyError, CheckpointLineageError
    from learner.train.policy import ModelLoadError
    from learner.train.ranks import RankFailedError
    from rmsft.jobspec import JobSpecError
    from rmsft.model_check import ModelCheckError
    from rmsft.requirements import MissingRequirementError

    refused = [
        JobSpecError("spec"),
        DataError("records"),
        ModelCheckError("no coord tokens"),
        CheckpointLineageError("another job's"),
        ModelLoadError("no config.json"),
        MissingRequirementError("no deepspeed"),
        ValueError("prompts_per_step < ranks"),
        RankFailedError("rank 0 refused", exit_code=CONFIG_EXIT),
    ]
    assert [exit_code_for(e) for e in refused] == [CONFIG_EXIT] * len(refused)
    # A CUDA error, EIO on the claim, the rendezvous, servers gone, a busy folder, another rank's transient error.
    transient = [
        RuntimeError("CUDA error: an illegal memory access"),
        OSError(5, "Input/output error"),
        NoServerAvailableError("rollout servers not ready after 300s"),
        WeightSyncError("cut off"),
        CheckpointFolderBusyError("held by pod-1"),
        RankFailedError("rank 1 failed"),
    ]
    assert [exit_code_for(e) for e in transient] == [RETRY_EXIT] * len(transient)
    # A refusal whose cause is the storage failing (EIO reading the model folder on a claim) is retried; a missing
    # file is not.
    for cause, expected in (
        (OSError(5, "Input/output error"), RETRY_EXIT),
        (FileNotFoundError(2, "No such file or directory"), CONFIG_EXIT),
    ):
        try:
            raise ModelLoadError("cannot load model from /models/x") from cause
        except ModelLoadError as exc:
            assert exit_code_for(exc) == expected


@pytest.mark.parametrize(
    ("codes", "launcher", "expected"),
    [
        ({0: 0, 1: 0}, 0, 0),
        ({0: 143, 1: 143}, 1, STOPPED_EXIT),  # torchrun's own 1 after a SIGTERM is not the last word
        ({0: 75, 1: 2}, 1, CONFIG_EXIT),  # a refusal anywhere is the job's
        ({0: 143, 1: 75}, 1, RETRY_EXIT),  # the survivor torchrun SIGTERMed stopped; the failure is the cause
        ({1: 75}, 1, RETRY_EXIT),  # rank 0 killed before it could say
        ({}, 1, 1),  # no rank said: torchrun's code (retryable)
        ({}, -9, 137),  # torchrun itself killed
    ],
)
def test_the_verdict_of_several_ranks(codes: dict[int, int], launcher: int, expected: int) -> None:
    assert verdict(codes, launcher) == expected


def test_ranks_record_their_exit_where_the_wrapper_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rmsft.exit_codes import EXIT_DIR_ENV, record_rank_exit

    monkeypatch.setenv(EXIT_DIR_ENV, str(tmp_path))
    for rank, code in ((0, 143), (1, 75)):
        monkeypatch.setenv("RANK", str(rank))
        record_rank_exit(code)
    (tmp_path / "rank-2.tmp").write_text("2")  # half written: not a verdict
    assert read_rank_exits(tmp_path) == {0: 143, 1: 75}


def test_sigterm_before_the_first_step_leaves_the_setup_and_after_it_stops_at_a_step() -> None:
    from rmsft_cli.app import Interrupted, StopOnSignal, _after_signal

    stop = StopOnSignal()
    with pytest.raises(Interrupted, match=r"stopped \(SIGTERM\) before the first step"):
        stop._handle(signal.SIGTERM, None)  # loading the model: nothing to save

    class Loop:
        history = ["step 1"]
        asked: list[str] = []

        def request_stop(self, why: str) -> None:
            self.asked.append(why)

    stop.loop = Loop()
    stop._handle(signal.SIGTERM, None)
    assert stop.loop.asked == ["SIGTERM"]
    # After the signal, a peer's closed connection is the stop's consequence; a refusal stays a refusal.
    assert _after_signal(stop, RuntimeError("Connection closed by peer")) == STOPPED_EXIT
    assert _after_signal(stop, ValueError("bad spec")) == CONFIG_EXIT
    assert _after_signal(StopOnSignal(), RuntimeError("CUDA error")) == RETRY_EXIT


def test_torchrun_reads_the_shutdown_timeout_the_operator_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """render.py sets TORCH_ELASTIC_SHUTDOWN_TIMEOUT from the grace period: torch's own launcher must read that name
    (its default, 30 s, SIGKILLs the ranks mid-save)."""
    from rmsft_operator import render
    from torch.distributed.run import config_from_args, parse_args

    monkeypatch.setenv(render.SHUTDOWN_TIMEOUT_ENV, "590")
    config, _, _ = config_from_args(parse_args(["--standalone", "--nproc-per-node", "2", "-m", "rmsft_cli"]))
    assert config.shutdown_timeout == 590 == render.torchrun_shutdown_seconds(600)
    monkeypatch.delenv(render.SHUTDOWN_TIMEOUT_ENV)
    config, _, _ = config_from_args(parse_args(["--standalone", "--nproc-per-node", "2", "-m", "rmsft_cli"]))
    assert config.shutdown_timeout == 30  # what every learner of several ranks got before


def test_the_rendezvous_timeout_flag_reaches_torchs_static_rendezvous() -> None:
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(
        [
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--nproc-per-node",
            "1",
            "--master-addr",
            "pod-0",
            "--master-port",
            "29500",
            "--rdzv-conf",
            "timeout=1800",
            "-m",
            "rmsft_cli",
        ]
    )
    config, _, _ = config_from_args(args)
    assert config.rdzv_backend == "static" and int(config.rdzv_configs["timeout"]) == 1800
