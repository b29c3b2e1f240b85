"""The README's cluster path, run as a user runs it: the CPU image built from the Dockerfile, the chart
installed with helm, jobs applied with kubectl, on real pods (tests/cluster/conftest.py brings the
cluster up). Faults are done to real pods: a one-server job's server deleted mid-run, the operator
deleted mid-run, the learner evicted mid-run and resumed from the checkpoint it saved on SIGTERM, on a
PersistentVolume; then the same job with no fault trains the same 40 steps to the printed digit. The tests
run in file order and share the cluster; the last one uninstalls everything and checks that nothing is left
behind."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import yaml
from cluster import OPERATOR_NS, ROOT, Cluster
from rmsft_operator.failures import CRASH_LOOP_RESTARTS
from rmsft_operator.progress import completion_index

DASHBOARDS = ROOT / "charts/rmsft/dashboards"
NAMESPACES: list[str] = []  # every namespace a test made (the uninstall test checks them all)
JOBS: list[tuple[str, str]] = []  # (namespace, name) of every job a test applied, deleted since or not
CLAIM_DIRS: list[str] = []  # the node folders behind the tests' PersistentVolumes (removed by the uninstall test)
FAULT_STEPS = 40  # enough steps left after the server restart (the learner waits meanwhile) for the scrape and eviction
FAULT_NS = "rmsft-faults"
FAULTED: dict[int, tuple[str, ...]] = {}  # the faulted run's step lines (test 1), for its uninterrupted twin (test 2)
STEP_LINE = re.compile(r"step (\d+) v\d+ loss (\S+) \(ce (\S+) coord (\S+)\) f1 (\S+) rows (\d+)")
# Two runs of one job are compared on the losses to 1e-4, not bit for bit. CI's cluster tier saw two runs of this
# job differ from step 1 (10.074578 vs 10.074569) and by 2.4e-5 at step 40. The cause found: the learner's first
# CPU forward sometimes computed the rotary cos inexactly on one thread's share of the row (docs/development.md,
# "The CPU learner's first forward"; `warm_cpu_math_kernels` now prevents it, and tests/learner/test_first_forward.py
# checks it). Bit-for-bit is not asked back: the pair below runs on different thread counts anyway, and a race is
# not shown gone by one passing run. Consecutive steps' losses differ by about 0.1 here, so a step trained on other
# records is far outside 1e-4. Rollout F1 and rows are counts: equal.
LOSS_TOLERANCE = 1e-4


def manifest(config: str, name: str, **training: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / config).read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["training"].update(training)
    return doc


def namespace(cluster: Cluster, name: str) -> str:
    cluster.kubectl("create", "namespace", name, check=False)
    NAMESPACES.append(name)
    return name


def apply_job(cluster: Cluster, doc: dict[str, Any], ns: str) -> str:
    """kubectl apply of a job manifest; the job is remembered for the uninstall test. Returns its name."""
    cluster.apply(doc, ns)
    JOBS.append((ns, doc["metadata"]["name"]))
    return doc["metadata"]["name"]


def learner_pod(cluster: Cluster, ns: str, job: str, running: bool = True) -> dict[str, Any] | None:
    pods = [
        p
        for p in cluster.pods(ns, f"rmsft.io/job={job},app.kubernetes.io/component=learner")
        if not p["metadata"].get("deletionTimestamp")
    ]
    if running:
        pods = [p for p in pods if p["status"].get("phase") == "Running"]
    return max(pods, key=lambda p: p["metadata"]["creationTimestamp"]) if pods else None


def scrape(cluster: Cluster, ns: str, pod: str, url: str, why: dict[str, str] | None = None) -> dict[str, float]:
    """GET a /metrics page from inside `pod` (every image has python): {series: value} of samples
    without labels and the sum over labels of the others. A GET that failed: {}, and the end of its error in
    `why[url]`."""
    code = (
        "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
    )
    proc = cluster.kubectl("-n", ns, "exec", pod, "--", "python", "-c", code, url, check=False, timeout=60)
    if why is not None and proc.returncode != 0:
        why[url] = f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"
    out: dict[str, float] = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def dashboard_metrics(name: str) -> set[str]:
    doc = json.loads((DASHBOARDS / name).read_text())
    found: set[str] = set()

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                found.update(re.findall(r"\b(rmsft_[a-z0-9_]+|vllm:[a-z0-9_:]+)", t.get("expr", "")))
            walk(p.get("panels", []))

    walk(doc.get("panels", []))
    return found


def base_name(series: str) -> str:
    return re.sub(r"_(bucket|count|sum|total|created)$", "", series)


def step_lines(log: str) -> dict[int, tuple[str, ...]]:
    """{step: (loss, ce, coord, f1, rows)} as the learner printed them (the weight version is left out: a restart
    re-syncs, which numbers a new version)."""
    return {int(m.group(1)): m.groups()[1:] for m in STEP_LINE.finditer(log)}


def same_step(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Two step lines agree: loss, ce and coord within LOSS_TOLERANCE, rollout F1 and rows exactly."""
    return a[3:] == b[3:] and all(abs(float(x) - float(y)) <= LOSS_TOLERANCE for x, y in zip(a[:3], b[:3], strict=True))


def fault_job(name: str, checkpoint_dir: str) -> dict[str, Any]:
    """The faulted job of test 1 and its uninterrupted twin of test 2: configs/job-kind-cpu.yaml, longer, one
    server (the default) over shm, a checkpoint every 5 steps, and a learner of two ranks in its one pod (ranksPerPod
    2: `rmsft torchrun`, gloo), as a real learner of several GPUs starts (issue 60): a SIGTERM must reach both
    ranks, which agree on the step to stop after."""
    doc = manifest(
        "configs/job-kind-cpu.yaml", name, steps=FAULT_STEPS, checkpoint={"dir": checkpoint_dir, "every": 5, "keep": 2}
    )
    doc["spec"]["rollout"]["replicas"] = 1
    doc["spec"]["sync"]["transport"] = "shm"
    doc["spec"]["monitoring"] = {"enabled": True}  # the servers' /metrics (the learner always has one)
    doc["spec"]["learner"]["ranksPerPod"] = 2
    return doc


SIGNAL_RANKS = (Path(__file__).parent / "signal_ranks.py").read_text()


def signal_ranks(cluster: Cluster, ns: str, pod: str, **options: Any) -> float | None:
    """Run signal_ranks.py in `pod` with these key=value options (sig, rank, step, url, pending: its docstring):
    the learner step it waited for, or None without step=. In the pod, so that the signal lands at the learner's
    step however fast the steps are; a failure (a timeout, no such rank) fails the test with its words."""
    argv = [f"{k}={v}" for k, v in options.items()]
    out = cluster.kubectl("-n", ns, "exec", pod, "--", "python", "-c", SIGNAL_RANKS, *argv, timeout=480).stdout
    lines = out.splitlines()
    assert lines and lines[0].split(), (options, out)  # the pids signalled
    return float(lines[1].split()[1]) if "step" in options else None


def wait_recreated(cluster: Cluster, ns: str, pod: dict[str, Any]) -> dict[str, Any]:
    """The pod of that name again, once its controller made a new one (another uid)."""
    name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
    return cluster.wait(
        lambda: (p := cluster.get("pod", name, "-n", ns)) and p["metadata"]["uid"] != uid and p,
        300,
        f"{name} recreated",
        namespace=ns,
    )


def claim_on_node(cluster: Cluster, ns: str, name: str) -> None:
    """A PersistentVolumeClaim bound to a fresh folder on the node (a local volume), writable by the learner's user."""
    host_dir = f"/tmp/rmsft-cluster-pv-{ns}-{name}"
    CLAIM_DIRS.append(host_dir)
    cluster.backend.node_rmtree(host_dir)
    cluster.backend.node_mkdir(host_dir, uid=1000)
    cluster.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"{ns}-{name}"},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": "manual",
                    "persistentVolumeReclaimPolicy": "Delete",
                    "hostPath": {"path": host_dir, "type": "Directory"},
                    "claimRef": {"namespace": ns, "name": name},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": name, "namespace": ns},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": "manual",
                    "volumeName": f"{ns}-{name}",
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        ]
    )


# ---------------------------------------------------------------------------------------------------


def test_one_server_job_survives_its_deleted_server_the_operator_and_an_evicted_learner(cluster: Cluster) -> None:
    """configs/job-kind-cpu.yaml over shm with one server (the default), longer, its checkpoints on a
    PersistentVolume (a local volume on the node), backoffLimit 1, its learner two ranks under torchrun in one pod.
    Four faults in turn on one job (issue 40: one job, not one per fault; issue 41 (a) and (b); issue 60): its only
    rollout pod and the operator pod deleted mid-run (the learner waits for the recreated server, re-syncs it and
    goes on); then the learner pod evicted through the Eviction API (SIGTERM: both ranks finish the step they agree
    on, rank 0 saves it, both exit 143 within the grace period, torchrun's shutdown timeout set from it; the Job's
    podFailurePolicy does not count the disruption, and the retry resumes from that save as a new run); then rank 1
    of the resumed learner killed (SIGKILL, as the OOM killer ends one rank): the pod fails, the Job counts it (its
    one retry: the eviction used none) and the third pod resumes from the newest periodic checkpoint, redoing the
    steps after it with the same figures. The job completes with status.step equal to its steps. On the way: each
    component's logs and /metrics as the docs say. Each fault lands at a step the test picks, whatever the machine's
    speed: the learner held (rank 1 stopped by signal_ranks.py inside the pod, rank 0 waiting for it) across a fault
    made from outside, or rank 1 killed from inside at that step. Deleting the job empties the node's
    /dev/shm/rmsft/<ns>.<job> directory (its cleanup Job, least privilege, leaves the directory itself). (The
    cluster's default transport, grpc, is what the vision-language and GRPO jobs below run; two servers failing over
    is tests/learner/test_e2e_local.py's.)"""
    ns = namespace(cluster, FAULT_NS)
    job = "text-faults"
    claim_on_node(cluster, ns, "checkpoints")
    doc = fault_job(job, "/checkpoints")
    # No learner budget: it would refuse the eviction (docs/operator.md); backoffLimit 1: the one counted retry is
    # the killed rank's, so the eviction's retry must be the podFailurePolicy's uncounted one (its disruption rule).
    doc["spec"]["learner"].update(checkpointClaim="checkpoints", backoffLimit=1, disruptionBudget=False)
    apply_job(cluster, doc, ns)
    first = cluster.wait(lambda: learner_pod(cluster, ns, job), 420, "the learner pod running", namespace=ns)
    learner = first["metadata"]["name"]
    # The first learner's whole log, kept past its pod (an evicted pod is deleted): streamed until it exits.
    first_log = cluster.follow_logs(ns, learner)
    # Each fault lands while the learner is held (signal_ranks.py: rank 1 stopped, rank 0 waiting for it in the
    # step's collective, its /metrics answering): on a fast machine the whole job is shorter than a scrape and an
    # exec from outside, and a fault that landed after the last step would test nothing.
    held = signal_ranks(cluster, ns, learner, sig="STOP", rank=1, step=3)
    assert held is not None and 3 <= held < FAULT_STEPS - 10, held
    shm_dir = f"/dev/shm/rmsft/{ns}.{job}"
    assert cluster.backend.node_exists(shm_dir)

    # 1. The only rollout pod and the operator pod deleted; the learner let go once the server's pod is recreated,
    # before it is Ready: it finds no server up and waits for it.
    old = cluster.get("pod", f"{job}-rollout-0", "-n", ns)
    cluster.kubectl("-n", ns, "delete", "pod", f"{job}-rollout-0", "--wait=false")
    op_pods = cluster.pods(OPERATOR_NS, "app.kubernetes.io/name=rmsft")
    cluster.kubectl("-n", OPERATOR_NS, "delete", "pod", op_pods[0]["metadata"]["name"], "--wait=false")
    wait_recreated(cluster, ns, old)
    signal_ranks(cluster, ns, learner, sig="CONT", rank=1)
    # Held again two steps on (trained on the recreated server's rollouts) while it is checked, every component's
    # /metrics is scraped and the learner evicted.
    held = signal_ranks(cluster, ns, learner, sig="STOP", rank=1, step=int(held) + 2)
    assert held is not None and held < FAULT_STEPS - 8, held

    def recreated_and_ready() -> dict[str, Any] | None:
        pod = cluster.get("pod", f"{job}-rollout-0", "-n", ns)
        if not pod or pod["metadata"]["uid"] == old["metadata"]["uid"]:
            return None
        ready = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}.get("Ready") == "True"
        return pod if ready else None

    cluster.wait(recreated_and_ready, 300, "the recreated rollout-0 pod Ready", namespace=ns)

    # The new server is fenced until the learner re-syncs it, then generates the learner's rollouts.
    def resynced_and_working() -> dict[str, float] | None:
        m = scrape(cluster, ns, f"{job}-rollout-0", "http://127.0.0.1:9090/metrics")
        return (
            m if m.get("rmsft_rollout_weight_version", 0) > 0 and m.get("rmsft_rollout_prompts_total", 0) > 0 else None
        )

    rollout_metrics = cluster.wait(resynced_and_working, 300, "rollout-0 re-synced and serving", namespace=ns)
    server_log = cluster.logs(ns, f"{job}-rollout-0", "--tail=400")
    assert re.search(r"weights v[1-9]\d* of run [\w.-]+ applied \(", server_log), server_log[-3000:]

    # /metrics of every component, scraped from another pod through the network (the operator
    # through the chart's metrics Service), and the names the dashboards query.
    probe = f"{job}-rollout-0"
    learner_ip = first["status"]["podIP"]
    rollout_ip = cluster.get("pod", f"{job}-rollout-0", "-n", ns)["status"]["podIP"]

    urls = {
        "operator": f"http://rmsft-metrics.{OPERATOR_NS}.svc:8080/metrics",
        "learner": f"http://{learner_ip}:9090/metrics",
        "rollout": f"http://{rollout_ip}:9090/metrics",
    }
    got: dict[str, dict[str, float]] = {}
    why: dict[str, str] = {}

    def scraped() -> dict[str, dict[str, float]] | None:
        # again until every component answered (one that did is kept): on a loaded machine one GET can take past 10 s
        for c in set(urls) - set(got):
            m = scrape(cluster, ns, probe, urls[c], why)
            if any(k.startswith(f"rmsft_{c}_") for k in m):
                got[c] = m
        return got if len(got) == len(urls) else None

    try:
        remote = cluster.wait(scraped, 180, "every component's /metrics scraped through the network", namespace=ns)
    except AssertionError as e:
        missing = {c: why.get(urls[c], "answered, without its rmsft_ series") for c in set(urls) - set(got)}
        learners = [(p["metadata"]["name"], p["status"].get("podIP")) for p in cluster.pods(ns, f"rmsft.io/job={job}")]
        raise AssertionError(f"not scraped: {missing}; the job's pods (name, IP) {learners}\n{e}") from None
    for component, got in remote.items():
        assert any(k.startswith(f"rmsft_{component}_") for k in got), (component, sorted(got)[:20])
    seen = {base_name(k) for got in remote.values() for k in got} | {base_name(k) for k in rollout_metrics}
    for board, must in (
        ("operator.json", {"rmsft_operator_"}),
        ("rollout.json", {"rmsft_rollout_", "vllm:"}),
        ("training.json", {"rmsft_learner_"}),
        ("weight-sync.json", {"rmsft_learner_weight_sync"}),
    ):
        queried = {base_name(q) for q in dashboard_metrics(board)}
        shown = queried & seen
        assert shown, f"{board}: none of {sorted(queried)} is exported by a running component"
        for prefix in must:
            assert any(q.startswith(prefix) for q in shown), (board, prefix, sorted(shown))

    # 2. The learner evicted (what a drain or the cluster autoscaler does), mid-step (held).
    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": first["metadata"]["name"], "namespace": ns},
    }
    cluster.kubectl(
        "create",
        "--raw",
        f"/api/v1/namespaces/{ns}/pods/{first['metadata']['name']}/eviction",
        "-f",
        "-",
        input=json.dumps(eviction),
    )
    # torchrun's agent passes the SIGTERM on to its ranks; once it waits at the stopped rank 1, the learner goes on.
    signal_ranks(cluster, ns, learner, sig="CONT", rank=1, pending="TERM")
    log = first_log.wait(timeout=600)
    before = step_lines(log)
    # Logs as docs/operator.md describes them: it waited for its only server, which came back and was re-synced.
    assert re.search(r"no rollout server is up for .* waiting up to \d+s for one to come back", log), log[-3000:]
    assert re.search(r"rollout server\(s\) .+ back after \d+s; going on", log), log[-3000:]
    # torchrun's agent signals its ranks in turn: rank 0 stops for the SIGTERM or because rank 1 was asked first;
    # either way after the step both agreed on, rank 0 writing its checkpoint, and both ranks exit 143.
    stopped = re.search(
        r"stopped \((?:SIGTERM|another rank was asked to stop)\) after step (\d+): "
        r"checkpoint /checkpoints/step-(\d+) written",
        log,
    )
    assert stopped and stopped.group(1) == stopped.group(2), log[-3000:]
    saved = int(stopped.group(1))
    # Where the test held it: the step whose stop it had not yet agreed on, or one of the next two.
    assert held <= saved <= held + 2, (held, saved)
    assert re.search(rf"stopped \(.+\) after step {saved}: its checkpoint written by rank 0", log), log[-3000:]
    assert re.search(r"ranks 2, device cpu", log), log[-3000:]  # one pod, two ranks under torchrun

    # 3. Rank 1 of the resumed learner killed mid-run, after the resumed run's first periodic checkpoint.
    second = cluster.wait(
        lambda: (p := learner_pod(cluster, ns, job)) and p["metadata"]["uid"] != first["metadata"]["uid"] and p,
        420,
        "the resumed learner pod running",
        namespace=ns,
    )
    second_log = cluster.follow_logs(ns, second["metadata"]["name"])
    periodic = (saved // 5 + 1) * 5  # checkpoint.every 5
    assert periodic + 2 <= FAULT_STEPS, f"the eviction came too late (after step {saved}) to leave steps to kill in"
    signal_ranks(cluster, ns, second["metadata"]["name"], sig="KILL", rank=1, step=periodic + 1)
    log = second_log.wait(timeout=600)
    # A new run (issue 27): its weight versions are (its run id, number), never taken for the evicted one's.
    resumed = re.search(
        r"resumed from step (\d+) \(weight version (\d+) of run ([\w.-]+)\); this run is ([\w.-]+)", log
    )
    assert resumed, log[-3000:]
    assert int(resumed.group(1)) == saved, (saved, log[-3000:])  # the save made on SIGTERM, not an older one
    dead, live = resumed.group(3), resumed.group(4)
    assert dead != live and f"learner run {live}" in log and f"of run {live} synced" in log, log[-3000:]
    assert not re.search(rf"step {saved} v\d+ loss ", log), log[-3000:]  # it went on from there, nothing redone
    middle = step_lines(log)
    assert min(middle) == saved + 1 and max(middle) > periodic, (saved, periodic, sorted(middle))

    status = cluster.wait_phase(ns, job, {"Complete"}, timeout=900)
    assert status.get("step") == FAULT_STEPS, status  # the STEP column: the last step, across the restarts too
    learner_job = cluster.get("job", f"{job}-learner", "-n", ns)
    assert learner_job["status"].get("failed") == 1, learner_job["status"]  # the kill counted, the eviction not
    third = learner_pod(cluster, ns, job, running=False)
    assert third is not None and third["metadata"]["uid"] not in (first["metadata"]["uid"], second["metadata"]["uid"])
    log = cluster.logs(ns, third["metadata"]["name"])
    assert re.search(rf"step {FAULT_STEPS} v\d+ loss ", log), log[-3000:]
    assert re.search(rf"training done: {FAULT_STEPS} steps, .* weight version \d+\b", log), log[-3000:]
    again = re.search(r"resumed from step (\d+) ", log)
    assert again and periodic <= int(again.group(1)) <= max(middle), (periodic, sorted(middle), log[-3000:])
    redone = int(again.group(1))
    after = step_lines(log)
    assert sorted(before) == list(range(1, saved + 1)), (saved, sorted(before))
    assert sorted(after) == list(range(redone + 1, FAULT_STEPS + 1)), (redone, sorted(after))
    # The steps the killed run had done past its checkpoint, done again from it: the same figures.
    twice = {s: (middle[s], after[s]) for s in middle if s in after and not same_step(middle[s], after[s])}
    assert not twice, f"(loss, ce, coord, f1, rows) before the kill vs redone, by step: {twice}"
    after = {s: v for s, v in middle.items() if s <= redone} | after
    FAULTED.update(before | after)
    operator_log = cluster.logs(OPERATOR_NS, "deploy/rmsft", "--tail=400")
    assert f"{ns}/{job}" in operator_log and "Complete" in operator_log, operator_log[-3000:]

    # What a learner killed in the middle of an update leaves (a folder, so both backends can make it as the
    # learner's user): the cleanup Job, as that user on this folder only, removes it.
    cluster.backend.node_mkdir(f"{shm_dir}/left-over", uid=1000)
    assert cluster.backend.node_holds_anything(shm_dir)
    cluster.kubectl("-n", ns, "delete", "rmj", job, "--wait=true", timeout=300)
    cluster.wait(
        lambda: not cluster.backend.node_holds_anything(shm_dir),
        120,
        f"{shm_dir} emptied on the node after the job was deleted",
        namespace=ns,
    )


def test_the_faulted_run_trained_what_an_uninterrupted_run_trains(cluster: Cluster) -> None:
    """Issue 41 (b): the run above, its only server deleted mid-run, its learner evicted and resumed, then one of its
    ranks killed and the learner resumed again, against
    the same job run with no fault (its checkpoints in the pod, every 5 steps as above): every one of the 40 steps
    has the same loss, CE and coordinate parts within 1e-4 (LOSS_TOLERANCE) and the same rollout F1 and row
    count. The rollouts are sampled with seeds that are a function of the step, the retried request after the
    server restart is the same request, and the resumed run restores the optimizer and the data order, so nothing
    may differ beyond that."""
    assert sorted(FAULTED) == list(range(1, FAULT_STEPS + 1)), "the faulted run above did not finish"
    job = "text-straight"
    apply_job(cluster, fault_job(job, "/tmp/checkpoints"), FAULT_NS)
    cluster.wait_phase(FAULT_NS, job, {"Complete"}, timeout=900)
    straight = step_lines(cluster.logs(FAULT_NS, f"job/{job}-learner"))
    assert sorted(straight) == list(range(1, FAULT_STEPS + 1)), sorted(straight)
    differ = {s: (FAULTED[s], straight[s]) for s in straight if not same_step(FAULTED[s], straight[s])}
    assert not differ, f"(loss, ce, coord, f1, rows) faulted vs uninterrupted, by step: {differ}"
    cluster.kubectl("-n", FAULT_NS, "delete", "rmj", job, "--wait=true", timeout=300)


def _runs_to_complete(cluster: Cluster, config: str) -> tuple[str, str, str]:
    """Apply a shipped job and wait for it to complete all its steps: (namespace, name, learner log)."""
    doc = yaml.safe_load((ROOT / config).read_text())
    ns = namespace(cluster, f"rmsft-{Path(config).stem.removeprefix('job-kind-cpu-')}")
    apply_job(cluster, doc, ns)
    name = doc["metadata"]["name"]
    status = cluster.wait_phase(ns, name, {"Complete"}, timeout=900)
    steps = doc["spec"]["training"]["steps"]
    assert status.get("step") == steps, status
    log = cluster.logs(ns, f"job/{name}-learner")
    assert re.search(rf"training done: {steps} steps", log), log[-3000:]
    return ns, name, log


def test_the_vision_language_job_runs_to_complete(cluster: Cluster) -> None:
    """The vision-language job (tiny Qwen3-VL and its images baked into the image), as shipped; its pool is
    released when it ends."""
    ns, name, _ = _runs_to_complete(cluster, "configs/job-kind-cpu-vl.yaml")
    assert cluster.get("statefulset", f"{name}-rollout", "-n", ns)["spec"]["replicas"] == 0


def test_the_colocate_job_runs_to_complete_in_its_learner_pod(cluster: Cluster) -> None:
    """The colocate job, as shipped: the engine in the learner's pod, no pool."""
    ns, _, log = _runs_to_complete(cluster, "configs/job-kind-cpu-colocate.yaml")
    assert "rollout engine in-process" in log, log[-3000:]
    pods = cluster.get("pods", "-n", ns, "-l", "app.kubernetes.io/name=rmsft")["items"]
    assert {p["metadata"]["labels"].get("app.kubernetes.io/component") for p in pods} == {"learner"}


def operator_resync_passes(cluster: Cluster) -> float:
    """Resync passes the operator finished (rmsft_operator_reconciles_total, trigger resync), read in its pod."""
    code = (
        "import sys, urllib.request; "
        "sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:8080/metrics', timeout=10).read().decode())"
    )
    proc = cluster.kubectl("-n", OPERATOR_NS, "exec", "deploy/rmsft", "--", "python", "-c", code, timeout=60)
    return sum(
        float(m.group(1))
        for m in re.finditer(
            r'^rmsft_operator_reconciles_total\{[^}]*trigger="resync[^}]*\}\s+(\S+)', proc.stdout, re.M
        )
    )


def test_the_grpo_job_completes_and_deleting_its_learner_job_runs_nothing_again(cluster: Cluster) -> None:
    """The GRPO job as shipped runs to Complete; then issue 41, final is final: its learner Job deleted (by hand,
    or by a TTL), the operator neither recreates it nor scales the pool up, and the status stays Complete, over
    two resync passes of every job (counted by the operator's own metric, not slept for)."""
    ns, name, _ = _runs_to_complete(cluster, "configs/job-kind-cpu-grpo.yaml")
    assert cluster.get("statefulset", f"{name}-rollout", "-n", ns)["spec"]["replicas"] == 0
    before = cluster.job(ns, name)["status"]
    cluster.kubectl("-n", ns, "delete", "job", f"{name}-learner", "--wait=true", timeout=120)
    jobs = len(cluster.get("rmj", "-A")["items"])
    passes = operator_resync_passes(cluster)
    cluster.wait(
        lambda: operator_resync_passes(cluster) >= passes + 2 * jobs,
        120,
        f"two more resync passes of each of {jobs} jobs",
        namespace=ns,
    )
    assert cluster.get("job", f"{name}-learner", "-n", ns) is None, "the learner Job was recreated"
    assert cluster.get("statefulset", f"{name}-rollout", "-n", ns)["spec"]["replicas"] == 0
    after = cluster.job(ns, name)["status"]
    assert after["phase"] == "Complete" and after.get("step") == before.get("step"), after
    cluster.wait(
        lambda: not cluster.pods(ns, f"rmsft.io/job={name}"),
        60,
        "no pod of the finished job (its learner pod goes with the Job; nothing comes back)",
        namespace=ns,
    )


def test_a_learner_whose_image_cannot_be_had_fails_at_once_in_the_kubelets_words(cluster: Cluster) -> None:
    """Issue 41: a colocate job (the learner is the job's only pod) whose image tag is not on the node, with pull
    policy Never. Before, it waited for its start deadline and then said "pod ... is still starting"; now it is
    Failed (ImageUnavailable) as soon as the kubelet says ErrImageNeverPull, far inside the deadline, with the
    kubelet's words, and the learner Job suspended (its waiting pod removed)."""
    ns = namespace(cluster, "rmsft-no-image")
    job = "no-image"
    doc = yaml.safe_load((ROOT / "configs/job-kind-cpu-colocate.yaml").read_text())
    doc["metadata"]["name"] = job
    doc["spec"]["image"]["tag"] = "no-such-tag"
    doc["spec"]["rollout"]["startupTimeout"] = "10m"
    t0 = time.monotonic()
    apply_job(cluster, doc, ns)
    status = cluster.wait_phase(ns, job, {"Failed"}, timeout=240)
    took = time.monotonic() - t0
    assert next(c for c in status["conditions"] if c["type"] == "Failed")["reason"] == "ImageUnavailable", status
    assert re.search(
        rf"learner pod {job}-learner-\S+: container \S+ cannot get image \S*rmsft:no-such-tag: "
        r"ErrImageNeverPull: .*not present with pull policy of Never",
        status["message"],
    ), status
    assert took < 180, took  # the start deadline is 10 minutes
    cluster.wait(
        lambda: cluster.get("job", f"{job}-learner", "-n", ns)["spec"].get("suspend") is True,
        60,
        "the learner Job suspended",
        namespace=ns,
    )


def test_a_job_named_like_a_statefulset_it_does_not_own_leaves_it_untouched(cluster: Cluster) -> None:
    """Issue 41, no adoption: a StatefulSet named as the job's pool already exists, made by someone else. The
    operator does not scale, patch or own it; the job stays Pending saying why (NameConflict) and creates
    nothing."""
    ns = namespace(cluster, "rmsft-squatter")
    job = "squatter"
    theirs = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": f"{job}-rollout", "labels": {"made-by": "someone-else"}},
        "spec": {
            "replicas": 0,
            "serviceName": "none",
            "selector": {"matchLabels": {"app": "theirs"}},
            "template": {
                "metadata": {"labels": {"app": "theirs"}},
                "spec": {"containers": [{"name": "c", "image": "rmsft:cpu", "imagePullPolicy": "Never"}]},
            },
        },
    }
    cluster.apply(theirs, ns)
    before = cluster.get("statefulset", f"{job}-rollout", "-n", ns)
    apply_job(cluster, manifest("configs/job-kind-cpu.yaml", job), ns)

    def conflict() -> dict[str, Any] | None:
        status = cluster.job(ns, job).get("status") or {}
        conds = {c["type"]: c for c in status.get("conditions") or []}
        return status if (conds.get("RolloutReady") or {}).get("reason") == "NameConflict" else None

    status = cluster.wait(conflict, 120, f"{job} Pending with NameConflict", namespace=ns)
    assert status["phase"] == "Pending" and f"StatefulSet {job}-rollout" in status["message"], status
    after = cluster.get("statefulset", f"{job}-rollout", "-n", ns)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], after["metadata"]
    assert not after["metadata"].get("ownerReferences") and after["spec"]["replicas"] == 0, after
    assert cluster.get("job", f"{job}-learner", "-n", ns) is None  # nothing of the job was created
    events = cluster.get("events", "-n", ns, "--field-selector", f"involvedObject.name={job},type=Warning")
    assert any(e["reason"] == "NameConflict" for e in events["items"]), events


def test_a_job_whose_model_path_does_not_exist_fails_and_frees_its_pool(cluster: Cluster) -> None:
    """The pods' model preflight (an init container, before any rollout container starts) refuses the folder:
    the job is Failed with the preflight's own words well within its startup timeout (not Pending in
    Init:CrashLoopBackOff for ever), its pool at 0 replicas, a Warning event."""
    ns = namespace(cluster, "rmsft-bad-model")
    job = "bad-model"
    doc = manifest("configs/job-kind-cpu.yaml", job)
    doc["spec"]["model"]["path"] = "/models/does-not-exist"
    doc["spec"]["rollout"]["startupTimeout"] = "5m"
    apply_job(cluster, doc, ns)
    status = cluster.wait_phase(ns, job, {"Failed"}, timeout=300)
    assert "model folder /models/does-not-exist does not exist" in status["message"], status
    assert next(c for c in status["conditions"] if c["type"] == "Failed")["reason"] == "ModelPreflightFailed", status
    cluster.wait(
        lambda: cluster.get("statefulset", f"{job}-rollout", "-n", ns)["spec"]["replicas"] == 0,
        60,
        "the pool scaled to 0",
        namespace=ns,
    )
    events = cluster.get("events", "-n", ns, "--field-selector", f"involvedObject.name={job},type=Warning")
    assert any("/models/does-not-exist" in e["message"] for e in events["items"]), events


def test_a_two_rank_learner_that_refuses_its_configuration_fails_at_once(cluster: Cluster) -> None:
    """Issue 60: a refusal under torchrun is the job's refusal, not torchrun's 1. A learner of two ranks in one pod
    whose configuration only the learner can refuse (a global batch of 1 prompt for 2 ranks: the spec alone does not
    know the ranks' count is wrong for it) exits 2 on both ranks; `rmsft torchrun` exits 2 with them, the Job's
    podFailurePolicy fails the job at once (LearnerFailed) although backoffLimit would allow two retries: one pod,
    one attempt, the pool scaled to 0, the refusal in the pod's log."""
    ns = namespace(cluster, "rmsft-refused")
    job = "refused-2r"
    doc = manifest("configs/job-kind-cpu.yaml", job, prompts_per_step=1)
    doc["spec"]["rollout"]["replicas"] = 1
    doc["spec"]["learner"].update(ranksPerPod=2, backoffLimit=2)
    apply_job(cluster, doc, ns)
    status = cluster.wait_phase(ns, job, {"Failed"}, timeout=600)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "LearnerFailed" and "exit code 2" in status["message"], status
    learner_job = cluster.get("job", f"{job}-learner", "-n", ns)
    assert learner_job["status"].get("failed") == 1, learner_job["status"]
    pods = cluster.pods(ns, f"rmsft.io/job={job},app.kubernetes.io/component=learner")
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]  # no retry
    log = cluster.logs(ns, pods[0]["metadata"]["name"])
    refusal = "spec.training.prompts_per_step (1) is the global batch and must be >= the number of learner ranks (2)"
    assert refusal in log, log[-3000:]
    cluster.wait(
        lambda: cluster.get("statefulset", f"{job}-rollout", "-n", ns)["spec"]["replicas"] == 0,
        60,
        "the pool scaled to 0",
        namespace=ns,
    )
    cluster.kubectl("-n", ns, "delete", "rmj", job, "--wait=true", timeout=300)


def test_a_stock_checkpoint_with_the_coordexp_format_is_refused_before_any_server_starts(cluster: Cluster) -> None:
    """configs/job-kind-cpu-stock.yaml as shipped: a stock tiny checkpoint (no coordinate tokens in its tokenizer,
    baked into the image) with the coordexp format. The model preflight (an init container) refuses it: the job
    is Failed with reason ModelPreflightFailed and the fix in its message, no rollout (or learner) container ever
    started (the kubelet's events and every pod status seen on the way), the pool at 0 replicas, a Warning event."""
    doc = yaml.safe_load((ROOT / "configs/job-kind-cpu-stock.yaml").read_text())
    job, model = doc["metadata"]["name"], doc["spec"]["model"]["path"]
    assert doc["spec"]["training"]["format"] == "coordexp", doc["spec"]["training"]  # what a stock model cannot fit
    ns = namespace(cluster, "rmsft-stock")
    apply_job(cluster, doc, ns)
    seen: dict[str, list[dict[str, Any]]] = {}  # every status of every pod of the job seen until it failed

    def failed() -> dict[str, Any] | None:
        for pod in cluster.pods(ns, f"rmsft.io/job={job}"):
            seen.setdefault(pod["metadata"]["name"], []).append(pod)
        status = cluster.job(ns, job).get("status") or {}
        if status.get("phase") in ("Running", "Complete", "Invalid"):
            raise AssertionError(f"job {ns}/{job} went {status['phase']}: {status}\n{cluster.diagnostics(ns)}")
        return status if status.get("phase") == "Failed" else None

    status = cluster.wait(failed, 300, f"job {ns}/{job} Failed", interval=1.0, namespace=ns)
    assert next(c for c in status["conditions"] if c["type"] == "Failed")["reason"] == "ModelPreflightFailed", status
    message = status["message"]
    for words in (
        f"the model in {model}",
        "coordinate tokens",
        f"rmsft prepare-model {model}",
        "spec.training.format: qwen_json",
    ):
        assert words in message, (words, message)
    cluster.wait(
        lambda: cluster.get("statefulset", f"{job}-rollout", "-n", ns)["spec"]["replicas"] == 0,
        60,
        "the pool scaled to 0",
        namespace=ns,
    )
    learner = cluster.get("job", f"{job}-learner", "-n", ns)
    assert learner["spec"]["suspend"] is True, learner["spec"]  # the learner never got to start either

    # No container of the job ever started: the pods were seen only Pending, their containers waiting
    # (PodInitializing) and never restarted; the kubelet started the preflight init container and nothing else.
    rollout_pods = {name for name in seen if name.startswith(f"{job}-rollout-")}
    assert rollout_pods, seen.keys()
    for name, statuses in seen.items():
        for pod in statuses:
            assert pod["status"].get("phase") == "Pending", (name, pod["status"])
            for cs in pod["status"].get("containerStatuses") or []:
                assert set(cs.get("state") or {}) <= {"waiting"} and not cs.get("lastState"), (name, cs)
                assert cs.get("restartCount", 0) == 0 and not cs.get("started"), (name, cs)
    events = cluster.get("events", "-n", ns, "--field-selector", "involvedObject.kind=Pod")["items"]
    started = {
        (e["involvedObject"]["name"], e["involvedObject"].get("fieldPath", ""))
        for e in events
        if e["reason"] == "Started" and e["involvedObject"]["name"].startswith(f"{job}-")
    }
    assert any(pod in rollout_pods and path.startswith("spec.initContainers{") for pod, path in started), events
    assert not [s for s in started if not s[1].startswith("spec.initContainers{")], started
    warnings = cluster.get("events", "-n", ns, "--field-selector", f"involvedObject.name={job},type=Warning")
    assert any(f"rmsft prepare-model {model}" in e["message"] for e in warnings["items"]), warnings


def test_a_rollout_server_that_crash_loops_fails_the_job_within_its_startup_timeout(cluster: Cluster) -> None:
    """A server that exits at every start for another reason than an invalid configuration: its /dev/shm
    (spec.rollout.shmSize, a memory emptyDir of that size) cannot stage a FULL weight sync of the model. The
    kubelet restarts it with back-off; the operator's crash-loop rule fails the job with the server's own
    message well before spec.rollout.startupTimeout, the pool at 0 replicas, a Warning event."""
    ns = namespace(cluster, "rmsft-crash-loop")
    job = "crash-loop"
    doc = manifest("configs/job-kind-cpu.yaml", job)
    deadline_s = 300
    doc["spec"]["rollout"].update(replicas=1, shmSize="1Mi", startupTimeout=f"{deadline_s}s")
    doc["spec"]["sync"]["transport"] = "grpc"  # the server stages FULL updates in its own /dev/shm
    t0 = time.monotonic()
    apply_job(cluster, doc, ns)
    status = cluster.wait_phase(ns, job, {"Failed"}, timeout=deadline_s + 60)
    took = time.monotonic() - t0
    assert next(c for c in status["conditions"] if c["type"] == "Failed")["reason"] == "RolloutCrashLoop", status
    said = re.search(
        rf"rollout pod {job}-rollout-0 restarted (\d+) times without becoming Ready \(last exit code "
        r"(\d+)\): (rmsft serve: staging dir /dev/shm has .*)",
        status["message"],
    )
    assert said, status["message"]
    assert int(said.group(1)) >= CRASH_LOOP_RESTARTS and int(said.group(2)) != 0, status["message"]
    assert "raise spec.rollout.shmSize" in said.group(3), status["message"]  # the server's words, with the fix
    assert took < deadline_s, (took, status)
    cluster.wait(
        lambda: cluster.get("statefulset", f"{job}-rollout", "-n", ns)["spec"]["replicas"] == 0,
        60,
        "the pool scaled to 0",
        namespace=ns,
    )
    events = cluster.get("events", "-n", ns, "--field-selector", f"involvedObject.name={job},type=Warning")
    assert any(said.group(3)[:80] in e["message"] for e in events["items"]), events


def test_a_learner_on_two_pods_survives_a_lost_pod_and_trains_what_one_pod_of_two_ranks_trains(
    cluster: Cluster,
) -> None:
    """Issue 45: configs/job-kind-cpu.yaml with learner.nodes 2 (one gloo rank per pod, both pods on this one node:
    spread false; checkpoints every 4 steps on a claim both mount; weights over grpc): the two pods find each other by
    pod 0's DNS name (torchrun's static rendezvous, the node rank from the Indexed Job's completion index). Learner pod
    1 deleted mid-run (the learner held at step 5 by signal_ranks.py, so whatever the machine's speed): every rank
    stops at the same step boundary with a checkpoint (the stop is agreed), the Job's attempt fails at once
    (podFailurePolicy), an event names the pod, the operator starts attempt 2, which resumes from that checkpoint and
    completes. Then the same job on one pod of two ranks (ranksPerPod 2), never stopped:
    every one of the steps has the same loss and parts within 1e-4 (issue 45 asks 1e-5; two runs of one job on one
    machine differed by 1.4e-5 at step 1 before the first-forward fix: LOSS_TOLERANCE), and the same rollout F1
    and rows. Both train under DeepSpeed ZeRO-2 (its CPU accelerator over gloo): optimizer state and gradients
    partitioned across the pods.

    The one-pod job moves its weights with transport nccl (the CPU backend: one gloo weight-transfer group of the
    learner's rank 0 and the server's engine worker, driven over gRPC), and its only server is deleted mid-run: the
    restarted server is re-synced over gRPC and joins the group the learner then builds again. Its losses equal the
    grpc job's: every update reached the server whole, over either path."""
    ns = namespace(cluster, "rmsft-nodes")
    claim_on_node(cluster, ns, "checkpoints")
    steps = 12

    def job_doc(job: str, checkpoint_dir: str, **learner: Any) -> dict[str, Any]:
        doc = manifest("configs/job-kind-cpu.yaml", job, steps=steps, checkpoint={"dir": checkpoint_dir, "every": 4})
        doc["spec"]["rollout"]["replicas"] = 1
        doc["spec"]["sync"]["transport"] = "grpc"
        doc["spec"]["training"]["deepspeed_stage"] = 2
        doc["spec"]["learner"].update(learner)
        return doc

    def learner_pods(job: str) -> list[dict[str, Any]]:
        return sorted(cluster.pods(ns, f"rmsft.io/job={job},app.kubernetes.io/component=learner"), key=completion_index)

    def rank0_log(job: str) -> str:
        log = cluster.logs(ns, learner_pods(job)[0]["metadata"]["name"])
        assert re.search(r"ranks 2, device cpu, DeepSpeed ZeRO-2", log), log[-3000:]  # one world of two ranks
        return log

    # Two pods, pod 1 lost mid-run.
    job = "pods-2x1"
    apply_job(
        cluster, job_doc(job, "/checkpoints", nodes=2, spread=False, checkpointClaim="checkpoints", backoffLimit=1), ns
    )
    pods = cluster.wait(
        lambda: (
            (live := [p for p in learner_pods(job) if p["status"].get("phase") == "Running"])
            and len(live) == 2
            and live
        ),
        420,
        "both learner pods running",
        namespace=ns,
    )
    assert [p["spec"].get("hostname") for p in pods] == [f"{job}-learner-0", f"{job}-learner-1"]
    pod0, lost = pods[0]["metadata"]["name"], pods[1]["metadata"]["name"]
    first_log = cluster.follow_logs(ns, pod0)
    # Pod 1 deleted while the learner is held at step 5 (its rank stopped, rank 0 waiting for it): its SIGTERM waits
    # at the stopped rank, which goes on once it is there, so the stop lands mid-run however fast the steps are.
    held = signal_ranks(
        cluster, ns, lost, sig="STOP", rank=1, step=5, url=f"http://{pods[0]['status']['podIP']}:9090/metrics"
    )
    assert held is not None and 5 <= held < steps, held
    cluster.kubectl("-n", ns, "delete", "pod", lost, "--wait=false")
    signal_ranks(cluster, ns, lost, sig="CONT", rank=1, pending="TERM")
    log = first_log.wait(timeout=600)
    stopped = re.search(
        r"stopped \((?:SIGTERM|another rank was asked to stop)\) after step (\d+): "
        r"checkpoint /checkpoints/step-(\d+) written",
        log,
    )
    assert stopped and stopped.group(1) == stopped.group(2), log[-3000:]
    saved = int(stopped.group(1))
    before = step_lines(log)
    assert sorted(before) == list(range(1, saved + 1)), (saved, sorted(before))
    status = cluster.wait_phase(ns, job, {"Complete"}, timeout=900)
    assert status.get("step") == steps and status.get("learnerAttempt") == 2, status
    events = json.loads(
        cluster.kubectl("-n", ns, "get", "events", "--field-selector", "reason=LearnerRestarted", "-o", "json").stdout
    )["items"]
    assert any("attempt 1 of 2 failed" in e["message"] and f"{job}-learner-" in e["message"] for e in events), [
        e["message"] for e in events
    ]
    log = rank0_log(job)
    resumed = re.search(r"resumed from step (\d+) ", log)
    assert resumed and int(resumed.group(1)) == saved, log[-3000:]
    after = step_lines(log)
    assert sorted(after) == list(range(saved + 1, steps + 1)), sorted(after)
    faulted = before | after
    cluster.kubectl("-n", ns, "delete", "rmj", job, "--wait=true", timeout=300)

    # One pod of two ranks, never stopped; weights over transport nccl, the server deleted mid-run.
    job = "pod-1x2"
    doc = job_doc(job, "/tmp/checkpoints", ranksPerPod=2)
    doc["spec"]["sync"]["transport"] = "nccl"
    apply_job(cluster, doc, ns)
    pod0 = cluster.wait(
        lambda: (p := learner_pods(job)) and p[0]["status"].get("phase") == "Running" and p[0]["metadata"]["name"],
        420,
        "the learner pod running",
        namespace=ns,
    )
    # The learner held at step 2 (rank 1 stopped, rank 0 waiting for it) while its server is deleted and recreated
    # (deleted with the learner running, the server could outlive the run), then let go: its next call finds the
    # server gone.
    server = cluster.get("pod", f"{job}-rollout-0", "-n", ns)
    assert server is not None, cluster.diagnostics(ns)
    held = signal_ranks(cluster, ns, pod0, sig="STOP", rank=1, step=2)
    assert held is not None and 2 <= held < steps, held  # mid-run
    cluster.kubectl("-n", ns, "delete", "pod", f"{job}-rollout-0", "--wait=false")
    wait_recreated(cluster, ns, server)
    signal_ranks(cluster, ns, pod0, sig="CONT", rank=1)
    status = cluster.wait_phase(ns, job, {"Complete"}, timeout=900)
    assert status.get("step") == steps, status
    log = rank0_log(job)
    straight = step_lines(log)
    assert sorted(straight) == list(range(1, steps + 1)), sorted(straight)
    groups = re.findall(r"weight-transfer group (\w+) \(rmsft_gloo\): the learner and 1 server", log)
    assert len(groups) == 2 and groups[0] != groups[1], log[-3000:]  # built at the start, again after the restart
    cluster.kubectl("-n", ns, "delete", "rmj", job, "--wait=true", timeout=300)
    # Within LOSS_TOLERANCE: torchrun gives each of two ranks in one pod one OpenMP thread and a pod of one rank all
    # its cores, so their sums differ (a CI run read 10.074573 vs 10.074567 at step 1, before any update).
    differ = {s: (faulted[s], straight[s]) for s in range(1, steps + 1) if not same_step(faulted[s], straight[s])}
    assert not differ, f"(loss, ce, coord, f1, rows) two pods, one lost, vs one pod of two ranks, by step: {differ}"


def test_deleting_the_jobs_and_uninstalling_leaves_nothing(cluster: Cluster) -> None:
    """Every job is deleted (those the tests before left and one applied here, whose children are seen to exist
    first, so the check never runs on nothing), then `helm uninstall`: no pod or child with the rmsft labels in
    any namespace, nothing in the /dev/shm/rmsft/<ns>.<job> directory of any job a test applied."""
    ns = namespace(cluster, "rmsft-uninstall")
    doc = yaml.safe_load((ROOT / "configs/job-kind-cpu-stock.yaml").read_text())  # fails at once: cheap
    job = apply_job(cluster, doc, ns)
    children = "pods,statefulsets,jobs,services,configmaps,secrets,networkpolicies"
    kinds = {"StatefulSet", "Job", "ConfigMap", "Secret", "Service", "NetworkPolicy"}
    cluster.wait(
        lambda: kinds <= {o["kind"] for o in cluster.get(children, "-n", ns, "-l", f"rmsft.io/job={job}")["items"]},
        120,
        f"{job}'s children",
        namespace=ns,
    )
    on_cluster = [(j["metadata"]["namespace"], j["metadata"]["name"]) for j in cluster.get("rmj", "-A")["items"]]
    assert (ns, job) in on_cluster, on_cluster
    for job_ns in sorted({n for n, _ in on_cluster}):
        cluster.kubectl("-n", job_ns, "delete", "rmj", "--all", "--wait=true", timeout=300)
    cluster.helm("uninstall", "rmsft", "--namespace", OPERATOR_NS, "--wait", "--timeout", "5m")
    applied = sorted(set(JOBS) | set(on_cluster))

    def nothing_left() -> bool:
        left = cluster.get(children, "-A", "-l", "app.kubernetes.io/name=rmsft")
        if left is None or left["items"]:
            return False
        # The directories stay, empty (docs/operator.md: the cleanup cannot remove them, by design).
        return not any(cluster.backend.node_holds_anything(f"/dev/shm/rmsft/{n}.{j}") for n, j in applied)

    cluster.wait(nothing_left, 180, "no pods, children or anything in /dev/shm/rmsft directories left")
    assert cluster.get("rmj", "-A")["items"] == []
    for name in NAMESPACES:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
    cluster.kubectl("delete", "pv", "--all", "--wait=false", check=False)
    for host_dir in CLAIM_DIRS:  # hostPath volumes have no deleter: the checkpoints the tests wrote go here
        cluster.backend.node_rmtree(host_dir)
