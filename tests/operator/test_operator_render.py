"""Every object the operator renders validates against the Kubernetes 1.32 schemas and carries
what the issue asks for (GPUs, probes, shm, security, owner references, suspended learner)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from rmsft_operator import render

from rmsft.jobspec import load_job, parse_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["configs/job.yaml", "configs/job-3v1.yaml", "configs/job-kind-cpu.yaml", "configs/job-grpo-6v2.yaml"]


def _by_kind(path: str) -> dict[str, dict]:
    job = load_job(ROOT / path)
    return {render.child_key(o): o for o in render.render_all(job, "team-a", "0000-uid")}


@pytest.mark.parametrize("path", EXAMPLES)
def test_rendered_objects_validate_against_kubernetes_1_32(path: str) -> None:
    objs = render.render_all(load_job(ROOT / path), "team-a", "0000-uid")
    assert [render.child_key(o) for o in objs] == [
        "Secret",
        "ConfigMap",
        "Service",
        "NetworkPolicy",
        "PoolDisruptionBudget",
        "StatefulSet",
        "LearnerDisruptionBudget",
        "LearnerNetworkPolicy",
        "Job",
    ]
    for obj in objs:
        kubernetes_validate.validate(obj, "1.32", strict=True)
        ref = obj["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("RolloutMatchingJob", "0000-uid", True)


def _selects(budget: dict, pod_template: dict) -> bool:
    return budget["spec"]["selector"]["matchLabels"].items() <= pod_template["metadata"]["labels"].items()


def test_disruption_budgets_cover_the_pool_and_the_learner_by_default_and_go_when_asked() -> None:
    """Issue 41: a drain evicts one rollout server at a time (maxUnavailable 1 over the StatefulSet's pods) and not
    the running learner (minAvailable 1: a Job's pods take only an integer minAvailable); a pod not Ready never
    holds a drain up. Each budget selects its own pods and no other's."""
    kids = _by_kind("configs/job.yaml")
    pool, learner = kids["PoolDisruptionBudget"], kids["LearnerDisruptionBudget"]
    rollout_pods, learner_pods = kids["StatefulSet"]["spec"]["template"], kids["Job"]["spec"]["template"]
    assert pool["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pool["spec"]
    assert learner["spec"]["minAvailable"] == 1 and "maxUnavailable" not in learner["spec"]
    assert _selects(pool, rollout_pods) and not _selects(pool, learner_pods)
    assert _selects(learner, learner_pods) and not _selects(learner, rollout_pods)
    assert {pool["spec"]["unhealthyPodEvictionPolicy"], learner["spec"]["unhealthyPodEvictionPolicy"]} == {
        "AlwaysAllow"
    }
    doc = yaml.safe_load((ROOT / "configs/job.yaml").read_text())
    doc["spec"]["rollout"]["disruptionBudget"] = False
    doc["spec"]["learner"]["disruptionBudget"] = False
    kinds = [o["kind"] for o in render.render_all(parse_job(doc), "team-a", "0000-uid")]
    assert "PodDisruptionBudget" not in kinds and "StatefulSet" in kinds


def test_a_grpo_job_renders_the_same_children_with_processed_log_probs() -> None:
    # spec.trainer picks the learner inside `rmsft train`; the pool differs only in what its log-probs are.
    grpo, rm = _by_kind("configs/job-grpo-6v2.yaml"), _by_kind("configs/job.yaml")
    assert grpo["StatefulSet"]["spec"]["replicas"] == 6
    assert (
        grpo["Job"]["spec"]["template"]["spec"]["containers"][0]["args"]
        == rm["Job"]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert grpo["Job"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    serve = yaml.safe_load(grpo["ConfigMap"]["data"]["serve.yaml"])
    assert serve["logprobs_mode"] == "processed" and serve["gpu_memory_utilization"] == 0.6
    assert serve["max_model_len"] == 8192 and serve["enable_lora"] is False
    assert yaml.safe_load(rm["ConfigMap"]["data"]["serve.yaml"])["logprobs_mode"] == "raw"
    assert yaml.safe_load(grpo["ConfigMap"]["data"]["job.yaml"])["spec"]["trainer"] == "grpo"


def test_reference_job_gpu_layout_and_pod_settings() -> None:
    objs = _by_kind("configs/job.yaml")
    sts, job = objs["StatefulSet"], objs["Job"]
    assert sts["spec"]["replicas"] == 6
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["args"] == ["serve", "--config", "/etc/rmsft/serve.yaml"]
    assert c["readinessProbe"]["grpc"]["port"] == 50051
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9090}
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert job["spec"]["suspend"] is True
    learner = job["spec"]["template"]["spec"]["containers"][0]
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == "2"
    # The learner follows the ConfigMap's live server list (mounted at /etc/rmsft): no list frozen
    # into its env at creation.
    assert learner["args"] == ["train", "--config", "/etc/rmsft/job.yaml", "--servers-file", "/etc/rmsft/servers"]
    env = {e["name"] for e in learner["env"]}
    assert "RMSFT_ROLLOUT_SERVERS" not in env and "RMSFT_LEARNER_GPUS" not in env
    servers = objs["ConfigMap"]["data"]["servers"].splitlines()
    assert servers[5] == "qwen3vl-det-rollout-5.qwen3vl-det-rollout.team-a.svc:50051"
    assert {"name": "config", "mountPath": "/etc/rmsft", "readOnly": True} in learner["volumeMounts"]
    token_env = next(e for e in learner["env"] if e["name"] == "RMSFT_AUTH_TOKEN")
    assert token_env["valueFrom"]["secretKeyRef"]["name"] == "qwen3vl-det-token"


def test_tensor_parallel_sets_gpus_per_pod() -> None:
    doc = yaml.safe_load((ROOT / "configs/job.yaml").read_text())
    doc["spec"]["rollout"].update(replicas=3, tensorParallelSize=2)
    sts = render.render_statefulset(parse_job(doc), "ns", "u")
    assert sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_learner_runs_one_rank_per_gpu() -> None:
    def learner(path: str) -> dict:
        return _by_kind(path)["Job"]["spec"]["template"]["spec"]["containers"][0]

    two = learner("configs/job.yaml")  # learner.gpus: 2
    # Issue 60: torchrun under `rmsft torchrun` (the container exits with its ranks' verdict, not torchrun's 1),
    # under tini (PID 1), its agent waiting the pod's grace period but a margin for the ranks to save after SIGTERM.
    assert two["command"][:5] == ["tini", "--", "rmsft", "torchrun", "--standalone"]
    assert two["command"][5:] == ["--nproc-per-node", "2", "-m", "rmsft_cli"]
    assert two["args"][0] == "train"
    grace = _by_kind("configs/job.yaml")["Job"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(grace - render.SHUTDOWN_MARGIN_S)} in two["env"]
    # NCCL's watchdog: a collective past the ranks' timeout aborts the communicator, then ends the rank.
    assert {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"} in two["env"]
    doc = yaml.safe_load((ROOT / "configs/job-kind-cpu.yaml").read_text())
    doc["spec"]["learner"]["ranksPerPod"] = 2
    cpu_ranks = render.render_job(parse_job(doc), "ns", "u")["spec"]["template"]["spec"]["containers"][0]
    assert cpu_ranks["command"][:4] == ["tini", "--", "rmsft", "torchrun"]  # ranks on gloo: no NCCL to set
    assert all(e["name"] != "TORCH_NCCL_ASYNC_ERROR_HANDLING" for e in cpu_ranks["env"])
    # One GPU, or none: the image's entrypoint (`rmsft`) runs `train` as a single process.
    for path in ("configs/job-3v1.yaml", "configs/job-kind-cpu.yaml"):
        one = learner(path)
        assert "command" not in one and one["args"][0] == "train"
        assert all(e["name"] != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" for e in one["env"])


def _several(path: str = "configs/job-kind-cpu.yaml", **learner: object) -> dict:
    """A job of `path` with its learner on pods: learner.nodes 2 by default, a checkpoint claim, weights over grpc."""
    doc = yaml.safe_load((ROOT / path).read_text())
    doc["spec"]["learner"].update({"nodes": 2, "checkpointClaim": "ck", **learner})
    doc["spec"]["sync"]["transport"] = "grpc"
    return doc


def test_a_learner_on_several_pods_is_an_indexed_job_whose_pods_meet_at_pod_0() -> None:
    """Issue 45, learner.nodes 2 on the CPU with 2 ranks per pod: an Indexed Job of 2 pods (hostnames
    <job>-learner-<index> under the headless Service), torchrun in each with a static rendezvous on pod 0's stable
    name and the pod's completion index as its node rank (read from the annotation the Job controller sets), one pod
    per node, and a lost pod failing the Job at once (any exit but 0, or a disruption): its peers cannot go on. The
    objects validate against the 1.32 schemas."""
    objs = render.render_all(parse_job(_several(ranksPerPod=2)), "team-a", "0000-uid")
    for obj in objs:
        kubernetes_validate.validate(obj, "1.32", strict=True)
    kids = {render.child_key(o): o for o in objs}
    assert list(kids)[-2:] == ["LearnerService", "Job"]  # the names resolve before the pods look them up
    job, svc = kids["Job"], kids["LearnerService"]
    assert (job["spec"]["completionMode"], job["spec"]["completions"], job["spec"]["parallelism"]) == ("Indexed", 2, 2)
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "tiny-cpu-learner"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == render.selector("tiny-cpu", "learner")
    c = pod["containers"][0]
    # The static rendezvous waits as long as the start clock (spec.rollout.startupTimeout, 30 min by default), not
    # torch's 600 s (issue 60).
    assert c["command"] == [
        "tini",
        "--",
        "rmsft",
        "torchrun",
        "--nnodes",
        "2",
        "--node-rank",
        "$(RMSFT_NODE_RANK)",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "tiny-cpu-learner-0.tiny-cpu-learner.team-a.svc",
        "--master-port",
        "29500",
        "--rdzv-conf",
        "timeout=1800",
        "-m",
        "rmsft_cli",
    ]
    rank = next(e for e in c["env"] if e["name"] == "RMSFT_NODE_RANK")
    assert (
        rank["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"} in c["ports"]
    assert svc["spec"]["ports"][0]["port"] == 29500
    apart = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert apart == [
        {
            "labelSelector": {"matchLabels": render.selector("tiny-cpu", "learner")},
            "topologyKey": "kubernetes.io/hostname",
        }
    ]
    assert kids["LearnerDisruptionBudget"]["spec"]["minAvailable"] == 2  # evicting either pod stops both
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert [r["action"] for r in rules] == ["FailJob", "FailJob"]
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert rules[1]["onExitCodes"] == {"operator": "NotIn", "values": [0]}  # any container, the preflight's too
    # spread: false lets the pods share a node (a one-node cluster); nothing else changes
    shared = render.render_job(parse_job(_several(spread=False)), "team-a", "0000-uid")
    assert "affinity" not in shared["spec"]["template"]["spec"]
    assert shared["spec"]["template"]["spec"]["containers"][0]["command"][9] == "1"  # --nproc-per-node: 1 on CPU


def test_scheduling_pass_throughs_reach_every_rollout_and_learner_pod_and_never_replace_rmsfts_keys() -> None:
    """Issue 45, item 3: spec.scheduling's scheduler, pod labels and annotations on both pod templates (a secondary
    network's annotation, a cost-centre label), beside rmsft's own selectors and scrape annotations; the learner's
    pods of a learner.nodes 2 job held to one domain of learnerTopologyKey as well as one pod per node."""
    doc = _several()
    doc["spec"]["scheduling"] = {
        "schedulerName": "volcano",
        "podLabels": {"team": "vision", "example.com/cost": "a1"},
        "podAnnotations": {"k8s.v1.cni.cncf.io/networks": "roce-net"},
        "learnerTopologyKey": "example.com/network-block",
    }
    objs = render.render_all(parse_job(doc), "team-a", "0000-uid")
    for obj in objs:
        kubernetes_validate.validate(obj, "1.32", strict=True)
    kids = {render.child_key(o): o for o in objs}
    for kind, role in (("StatefulSet", "rollout"), ("Job", "learner")):
        template = kids[kind]["spec"]["template"]
        assert template["spec"]["schedulerName"] == "volcano"
        assert template["metadata"]["labels"] == {
            "team": "vision",
            "example.com/cost": "a1",
            **render.labels("tiny-cpu", role),
        }
        assert template["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "roce-net"
        assert template["metadata"]["annotations"]["prometheus.io/scrape"] in ("true", "false")
    for kind in ("StatefulSet", "Job", "Service", "ConfigMap"):  # the owners keep only rmsft's labels
        assert "team" not in kids[kind]["metadata"]["labels"]
    affinity = kids["Job"]["spec"]["template"]["spec"]["affinity"]
    mine = {"matchLabels": render.selector("tiny-cpu", "learner")}
    assert affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {"labelSelector": mine, "topologyKey": "example.com/network-block"}
    ]
    assert affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {"labelSelector": mine, "topologyKey": "kubernetes.io/hostname"}
    ]
    plain = _by_kind("configs/job-kind-cpu.yaml")["Job"]["spec"]["template"]
    assert "schedulerName" not in plain["spec"] and "team" not in plain["metadata"]["labels"]


def test_one_learner_pod_keeps_its_retry_rules_and_cpu_ranks_use_torchrun_standalone() -> None:
    """learner.nodes 1 (the default): no Service, a plain Job, disruptions not counted; ranksPerPod 2 on the CPU runs
    two gloo ranks in the one pod (torchrun --standalone), as learner.gpus 2 does on GPUs."""
    one = _by_kind("configs/job-kind-cpu.yaml")
    assert "LearnerService" not in one and "completionMode" not in one["Job"]["spec"]
    assert one["Job"]["spec"]["podFailurePolicy"]["rules"][0]["action"] == "Ignore"
    doc = yaml.safe_load((ROOT / "configs/job-kind-cpu.yaml").read_text())
    doc["spec"]["learner"]["ranksPerPod"] = 2
    c = render.render_job(parse_job(doc), "ns", "u")["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == [
        "tini",
        "--",
        "rmsft",
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "rmsft_cli",
    ]


def test_cpu_job_requests_no_gpus() -> None:
    objs = _by_kind("configs/job-kind-cpu.yaml")
    for kind in ("StatefulSet", "Job"):
        res = objs[kind]["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert "nvidia.com/gpu" not in res.get("limits", {}) and "nvidia.com/gpu" not in res.get("requests", {})


def test_network_policy_admits_only_learner_and_peers_to_grpc_and_monitoring_to_metrics() -> None:
    np = _by_kind("configs/job.yaml")["NetworkPolicy"]["spec"]
    assert np["podSelector"]["matchLabels"] == render.selector("qwen3vl-det", "rollout")
    grpc, metrics = np["ingress"]
    # the learner, and the job's other rollout pods (an update is relayed server to server)
    assert grpc["from"] == [
        {"podSelector": {"matchLabels": render.selector("qwen3vl-det", "learner")}},
        {"podSelector": {"matchLabels": render.selector("qwen3vl-det", "rollout")}},
    ]
    assert grpc["ports"] == [{"protocol": "TCP", "port": 50051}]
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9090}]
    # the learner pod's labels really match the gRPC rule
    learner_labels = _by_kind("configs/job.yaml")["Job"]["spec"]["template"]["metadata"]["labels"]
    assert render.selector("qwen3vl-det", "learner").items() <= learner_labels.items()


@pytest.mark.parametrize(("accelerator", "backend"), [("nvidia", "nccl"), ("none", "rmsft_gloo")])
def test_an_nccl_job_starts_servers_that_join_groups_and_opens_the_group_ports_to_its_own_pods(
    accelerator: str, backend: str
) -> None:
    """transport nccl: every server is started with the weight-transfer backend (NCCL on GPUs, the gloo stand-in on
    CPUs), and the NetworkPolicy lets the job's learner and rollout pods reach the rollout pods on any port (the
    group's rank-to-rank connections); a grpc job's servers join no group."""
    path = "configs/job.yaml" if accelerator == "nvidia" else "configs/job-kind-cpu.yaml"
    job = load_job(ROOT / path)
    manifest = job.to_manifest()
    manifest["spec"]["sync"].update(transport="nccl", mode="full")
    nccl = parse_job(manifest)
    objs = {render.child_key(o): o for o in render.render_all(nccl, "team-a", "0000-uid")}
    assert yaml.safe_load(objs["ConfigMap"]["data"]["serve.yaml"])["weight_transfer"] == backend
    name = nccl.metadata.name
    group = [r for r in objs["NetworkPolicy"]["spec"]["ingress"] if "ports" not in r]
    assert group == [
        {
            "from": [
                {"podSelector": {"matchLabels": render.selector(name, "learner")}},
                {"podSelector": {"matchLabels": render.selector(name, "rollout")}},
            ]
        }
    ]
    plain = _by_kind(path)
    assert yaml.safe_load(plain["ConfigMap"]["data"]["serve.yaml"]).get("weight_transfer") is None
    assert all("ports" in r for r in plain["NetworkPolicy"]["spec"]["ingress"])


def test_configmap_carries_the_defaulted_manifest_for_the_learner() -> None:
    cm = _by_kind("configs/job-3v1.yaml")["ConfigMap"]
    manifest = yaml.safe_load(cm["data"]["job.yaml"])
    # what the learner reads back is a valid job equal to what the operator validated
    assert parse_job(manifest).to_manifest() == manifest
    assert manifest["spec"]["training"]["buffer"] == {"enabled": True, "m_steps": 2}
    assert manifest["spec"]["sync"]["mode"] == "adapter"
    assert cm["metadata"]["annotations"][render.SPEC_HASH_ANNOTATION] == render.spec_hash(manifest["spec"])


def test_spec_hash_ignores_replicas_only() -> None:
    spec = load_job(ROOT / "configs/job.yaml").to_manifest()["spec"]
    scaled = yaml.safe_load(yaml.safe_dump(spec))
    scaled["rollout"]["replicas"] = 1
    assert render.spec_hash(spec) == render.spec_hash(scaled)
    scaled["rollout"]["maxModelLen"] = 4096
    assert render.spec_hash(spec) != render.spec_hash(scaled)


@pytest.mark.parametrize("path", EXAMPLES)
def test_serve_config_is_accepted_by_rmsft_serve(path: str, tmp_path: Path) -> None:
    """The rendered serve.yaml goes through `rmsft serve`'s own config parser unchanged."""
    from rollout_svc.config import parse_config

    cm = _by_kind(path)["ConfigMap"]
    serve = yaml.safe_load(cm["data"]["serve.yaml"])
    job = load_job(ROOT / path)
    assert serve["model"] == job.spec.model.path
    serve["model"] = str(tmp_path)  # the parser checks that the folder exists
    cfg_file = tmp_path / "serve.yaml"
    cfg_file.write_text(yaml.safe_dump(serve))
    cfg = parse_config(["--config", str(cfg_file)])
    assert cfg.port == job.spec.rollout.port
    assert cfg.tensor_parallel_size == job.spec.rollout.tensor_parallel_size
    assert cfg.enable_lora == job.spec.rollout.enable_lora
    on_gpus = job.spec.placement.accelerator == "nvidia"
    assert cfg.gpu_memory_utilization == (job.spec.rollout.gpu_memory_utilization if on_gpus else None)
    assert cfg.kv_cache_bytes == (job.spec.rollout.kv_cache_bytes or 0)


@pytest.mark.parametrize("path", EXAMPLES)
def test_pods_mount_no_service_account_token(path: str) -> None:
    for kind in ("StatefulSet", "Job"):
        assert _by_kind(path)[kind]["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("path", EXAMPLES)
def test_log_level_reaches_both_pods(path: str) -> None:
    job = load_job(ROOT / path)
    for kind in ("StatefulSet", "Job"):
        env = _by_kind(path)[kind]["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "RMSFT_LOG_LEVEL", "value": job.spec.monitoring.log_level} in env


def _learner_pod(doc: dict) -> dict:
    return render.render_job(parse_job(doc), "ns", "u")["spec"]["template"]["spec"]


def test_checkpoint_dir_is_writable_without_a_claim() -> None:
    # configs/job-3v1.yaml has no checkpointClaim: its learner failed at step 100 writing to a
    # /checkpoints the non-root user could not create.
    doc = yaml.safe_load((ROOT / "configs/job-3v1.yaml").read_text())
    assert "checkpointClaim" not in doc["spec"].get("learner", {})
    pod = _learner_pod(doc)
    ckpt = parse_job(doc).spec.training.checkpoint.dir
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == ckpt)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume == {"name": "checkpoints", "emptyDir": {}}
    assert not mount.get("readOnly")
    assert pod["securityContext"]["fsGroup"] == render.UID  # the emptyDir is group-writable for uid 1000

    doc["spec"].setdefault("learner", {})["checkpointClaim"] = "ckpt-pvc"
    pod = _learner_pod(doc)
    volume = next(v for v in pod["volumes"] if v["name"] == "checkpoints")
    assert volume["persistentVolumeClaim"] == {"claimName": "ckpt-pvc"}

    doc["spec"]["learner"].pop("checkpointClaim")
    doc["spec"]["training"]["checkpoint"] = {"dir": "/tmp/ckpt"}  # already on a writable mount
    pod = _learner_pod(doc)
    assert not any(v["name"] == "checkpoints" for v in pod["volumes"])
    mounts = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
    assert len(mounts) == len(set(mounts))


def _pods(doc: dict) -> dict[str, dict]:
    """role -> pod template (spec and labels) of the StatefulSet and the learner Job."""
    objs = {o["kind"]: o for o in render.render_all(parse_job(doc), "team-a", "0000-uid", token="t")}
    return {"rollout": objs["StatefulSet"]["spec"]["template"], "learner": objs["Job"]["spec"]["template"]}


def _reference(transport: str | None) -> dict:
    doc = yaml.safe_load((ROOT / "configs/job.yaml").read_text())
    if transport is None:
        doc["spec"]["sync"].pop("transport", None)
    else:
        doc["spec"]["sync"]["transport"] = transport
    return doc


def test_shm_shares_one_node_memory_directory_between_learner_and_servers() -> None:
    job = parse_job(_reference("shm"))
    assert job.spec.sync.cluster_transport == "shm"
    host_path = "/dev/shm/rmsft/team-a.qwen3vl-det"
    assert render.shared_weights_host_path("team-a", "qwen3vl-det") == host_path
    for role, template in _pods(_reference("shm")).items():
        pod, c = template["spec"], template["spec"]["containers"][0]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[render.SHARED_WEIGHTS_VOLUME] == {
            "name": render.SHARED_WEIGHTS_VOLUME,
            "hostPath": {"path": host_path, "type": "DirectoryOrCreate"},
        }
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory", role  # the pod's own /dev/shm stays
        assert {"name": render.SHARED_WEIGHTS_VOLUME, "mountPath": render.SHARED_WEIGHTS_MOUNT} in c["volumeMounts"]
        assert {"name": "RMSFT_SHARED_WEIGHTS_DIR", "value": "/rmsft-shared"} in c["env"], role
        # Every pod of the job on the node of the first one placed: the term matches both roles'
        # labels (the learner follows the servers, a server follows the others or the learner).
        (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), role
        assert term["labelSelector"]["matchLabels"] == {render.JOB_LABEL: "qwen3vl-det"}
        assert pod["securityContext"]["runAsNonRoot"] is True and "runAsUser" not in c.get("securityContext", {})
        if role == "rollout":  # the servers only read the learner's files
            assert [i["name"] for i in pod["initContainers"]] == [render.PREFLIGHT_CONTAINER]
            continue
        # The kubelet makes the directory root's: in the learner's pod (the writer) a root init
        # container with CHOWN/FOWNER only hands it to the non-root user before the learner starts
        # (after the model preflight, which fails faster).
        preflight, init = pod["initContainers"]
        assert preflight["name"] == render.PREFLIGHT_CONTAINER
        assert init["volumeMounts"] == [{"name": render.SHARED_WEIGHTS_VOLUME, "mountPath": "/rmsft-shared"}]
        assert f"chown {render.UID}:{render.UID} /rmsft-shared" in init["command"][-1]
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
        assert init["securityContext"]["allowPrivilegeEscalation"] is False
        assert init["image"] == c["image"]
    # The shm pods still pass the Kubernetes schemas.
    for obj in render.render_all(job, "team-a", "0000-uid"):
        kubernetes_validate.validate(obj, "1.32", strict=True)


def test_shm_cleanup_runs_the_operators_image_unprivileged_on_the_jobs_own_folder() -> None:
    """Issue 41, least privilege: the Job that empties a deleted shm job's folder runs the operator's image (the
    chart's RMSFT_OPERATOR_IMAGE), as the learner's non-root user (the owner of the folder), with no capability, a
    read-only image and the RuntimeDefault seccomp profile, and mounts the job's own folder only, never the node's
    whole /dev/shm/rmsft; without an operator image it runs the job's own, under the same security context."""
    job = parse_job(_reference("shm"))
    cleanup = render.render_shm_cleanup(job, "team-a", "node-1", "registry.example/ops/rmsft:9.9", "Always")
    kubernetes_validate.validate(cleanup, "1.32", strict=True)
    pod = cleanup["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert (c["image"], c["imagePullPolicy"]) == ("registry.example/ops/rmsft:9.9", "Always")
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": render.UID,
        "runAsGroup": render.UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
    }
    assert "initContainers" not in pod and pod["nodeName"] == "node-1" and pod["automountServiceAccountToken"] is False
    (volume,) = pod["volumes"]
    assert volume["hostPath"] == {"path": "/dev/shm/rmsft/team-a.qwen3vl-det", "type": "Directory"}
    assert c["volumeMounts"] == [{"name": volume["name"], "mountPath": render.SHM_CLEANUP_MOUNT}]
    assert c["command"] == ["find", render.SHM_CLEANUP_MOUNT, "-mindepth", "1", "-delete"]
    fallback = render.render_shm_cleanup(job, "team-a", "node-1")["spec"]["template"]["spec"]
    assert (fallback["containers"][0]["image"], fallback["containers"][0]["imagePullPolicy"]) == (
        job.spec.image.ref,
        job.spec.image.pull_policy,
    )
    assert fallback["securityContext"] == pod["securityContext"]
    assert fallback["containers"][0]["securityContext"] == c["securityContext"]


def test_shm_cleanup_command_empties_the_folder_as_its_owner_and_touches_nothing_else() -> None:
    """The rendered command, run on a copy of the node's layout (as the learner's UID when this runs as root, as the
    kubelet would run it): everything the learner left in its folder goes (files, a folder of files), the folder
    stays (its root-owned parent is not writable by that user, and is not mounted), another job's folder beside it
    is untouched."""
    import os
    import shutil
    import tempfile

    cleanup = render.render_shm_cleanup(parse_job(_reference("shm")), "team-a", "node-1", "img:1")
    (c,) = cleanup["spec"]["template"]["spec"]["containers"]
    as_root = os.geteuid() == 0
    root = Path(tempfile.mkdtemp(prefix="rmsft-shm-"))  # stands for the node's /dev/shm/rmsft (root's, 0755)
    try:
        root.chmod(0o755)
        folders = {name: root / name for name in ("team-a.qwen3vl-det", "team-a.other")}
        for folder in folders.values():
            (folder / "sub").mkdir(parents=True)
            (folder / "update-v7.safetensors").write_bytes(b"x" * 64)
            (folder / ".partial").write_bytes(b"y")
            (folder / "sub" / "f").write_bytes(b"z")
            if as_root:  # the shared-weights-owner init container's chown and chmod, then the learner's files
                for path in [folder, *folder.rglob("*")]:
                    os.chown(path, render.UID, render.UID)
                folder.chmod(0o770)
        mine = folders["team-a.qwen3vl-det"]
        command = [str(mine) if a == render.SHM_CLEANUP_MOUNT else a for a in c["command"]]
        ids = {"user": render.UID, "group": render.UID, "extra_groups": []} if as_root else {}
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60, **ids)
        assert proc.returncode == 0, proc.stderr
        assert mine.is_dir() and list(mine.iterdir()) == []
        other = folders["team-a.other"]
        assert sorted(p.name for p in other.rglob("*")) == [".partial", "f", "sub", "update-v7.safetensors"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _tls_job(transport: str = "grpc") -> dict:
    doc = _reference(transport)
    doc["spec"]["rollout"]["tls"] = {"secretName": "qwen-rollout-tls"}
    return doc


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_rollout_tls_mounts_the_secret_and_probes_a_plaintext_health_port(transport: str, tmp_path: Path) -> None:
    """spec.rollout.tls: the kubernetes.io/tls Secret mounted read-only (mode 0440, the pods' fsGroup reads it) in the
    rollout and learner containers only, by key (issue 62: never the whole Secret; the private key only in the
    servers, which use it; the learner gets what it trusts, ca.crt when there is one and tls.crt); serve.yaml names
    its tls.crt and tls.key (and `rmsft serve`'s own parser
    takes it); the server gets RMSFT_HEALTH_PORT and the kubelet's gRPC probes go there (they cannot speak TLS); the
    learner gets the Secret's folder (what it trusts) and reaches the servers by names the documented SAN covers;
    the NetworkPolicy opens the health port to no pod. With either transport (shm only moves the bytes)."""
    from fnmatch import fnmatch

    from rollout_svc.config import parse_config

    job = parse_job(_tls_job(transport))
    objs = {render.child_key(o): o for o in render.render_all(job, "team-a", "0000-uid", token="t")}
    for obj in objs.values():
        kubernetes_validate.validate(obj, "1.32", strict=True)
    volumes = {
        "rollout": {
            "name": render.TLS_VOLUME,
            "secret": {
                "secretName": "qwen-rollout-tls",
                "defaultMode": 0o440,
                "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
            },
        },
        "learner": {
            "name": render.TLS_VOLUME,
            "projected": {
                "defaultMode": 0o440,
                "sources": [
                    {
                        "secret": {
                            "name": "qwen-rollout-tls",
                            "items": [{"key": "ca.crt", "path": "ca.crt"}],
                            "optional": True,
                        }
                    },
                    {"secret": {"name": "qwen-rollout-tls", "items": [{"key": "tls.crt", "path": "tls.crt"}]}},
                ],
            },
        },
    }
    mount = {"name": render.TLS_VOLUME, "mountPath": "/etc/rmsft-tls", "readOnly": True}
    pods = {
        "rollout": objs["StatefulSet"]["spec"]["template"]["spec"],
        "learner": objs["Job"]["spec"]["template"]["spec"],
    }
    for role, pod in pods.items():
        assert volumes[role] in pod["volumes"], role
        assert [v for v in pod["volumes"] if v["name"] == render.TLS_VOLUME] == [volumes[role]], role
    assert "tls.key" not in yaml.safe_dump(pods["learner"]["volumes"])  # the private key stays with the servers
    for role, pod in pods.items():
        (c,) = pod["containers"]
        assert mount in c["volumeMounts"], role
        for init in pod["initContainers"]:  # the preflight and the shared-weights owner read no certificate
            assert render.TLS_VOLUME not in {m["name"] for m in init["volumeMounts"]}, (role, init["name"])
        assert pod["securityContext"]["fsGroup"] == render.UID
    rollout = pods["rollout"]["containers"][0]
    env = {e["name"]: e.get("value") for e in rollout["env"]}
    assert env["RMSFT_HEALTH_PORT"] == "50052" and "RMSFT_ROLLOUT_TLS_DIR" not in env
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert rollout[probe]["grpc"] == {"port": 50052}, probe
    assert {"name": "health", "containerPort": 50052, "protocol": "TCP"} in rollout["ports"]
    learner_env = {e["name"]: e.get("value") for e in pods["learner"]["containers"][0]["env"]}
    assert learner_env["RMSFT_ROLLOUT_TLS_DIR"] == "/etc/rmsft-tls" and "RMSFT_HEALTH_PORT" not in learner_env

    serve = yaml.safe_load(objs["ConfigMap"]["data"]["serve.yaml"])
    assert (serve["tls_cert"], serve["tls_key"]) == ("/etc/rmsft-tls/tls.crt", "/etc/rmsft-tls/tls.key")
    serve["model"] = str(tmp_path)
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(serve))
    cfg = parse_config(["--config", str(tmp_path / "serve.yaml")])
    assert (cfg.tls_cert, cfg.tls_key) == ("/etc/rmsft-tls/tls.crt", "/etc/rmsft-tls/tls.key")
    # The names the learner and the relays dial are what docs/operator.md tells the certificate to cover.
    servers = objs["ConfigMap"]["data"]["servers"].split()
    hosts = [a.rsplit(":", 1)[0] for a in servers]
    assert hosts and all(fnmatch(h, "*.qwen3vl-det-rollout.team-a.svc") for h in hosts)
    # A certificate wildcard stands for one label only: each name has one before that suffix.
    assert all("." not in h.removesuffix(".qwen3vl-det-rollout.team-a.svc") for h in hosts)
    # Only the learner and the job's pods reach the gRPC port; nobody is let in on the health port.
    opened = {p["port"] for rule in objs["NetworkPolicy"]["spec"]["ingress"] for p in rule["ports"]}
    assert 50052 not in opened and 50051 in opened


def test_without_tls_nothing_of_it_is_rendered() -> None:
    """No spec.rollout.tls: no Secret volume, no health port, the probes on the gRPC port, serve.yaml without TLS."""
    objs = {render.child_key(o): o for o in render.render_all(parse_job(_reference("grpc")), "team-a", "u", token="t")}
    for kind in ("StatefulSet", "Job"):
        pod = objs[kind]["spec"]["template"]["spec"]
        assert render.TLS_VOLUME not in {v["name"] for v in pod["volumes"]}
        names = {e["name"] for e in pod["containers"][0]["env"]}
        assert not names & {"RMSFT_HEALTH_PORT", "RMSFT_ROLLOUT_TLS_DIR"}
    rollout = objs["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    assert {rollout[p]["grpc"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {50051}
    assert not {"tls_cert", "tls_key"} & set(yaml.safe_load(objs["ConfigMap"]["data"]["serve.yaml"]))


def _without_shared_weights(template: dict) -> dict:
    pod = copy.deepcopy(template["spec"])
    del pod["affinity"]
    pod["initContainers"] = pod["initContainers"][:1]  # the learner's owner container goes; the preflight stays
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != render.SHARED_WEIGHTS_VOLUME]
    c = pod["containers"][0]
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != render.SHARED_WEIGHTS_VOLUME]
    c["env"] = [e for e in c["env"] if e["name"] != render.SHARED_WEIGHTS_ENV]
    return pod


def test_grpc_renders_what_it_always_did_and_shm_only_adds_the_shared_directory() -> None:
    def objects(doc: dict) -> list[dict]:
        objs = render.render_all(parse_job(doc), "team-a", "0000-uid", token="t")
        for o in objs:  # the ConfigMap carries the manifest itself, transport included
            if o["kind"] == "ConfigMap":
                o["data"].pop("job.yaml")
                o["metadata"].pop("annotations")
        return objs

    # auto is grpc in a cluster: a job that never names the transport renders as before it existed.
    grpc = objects(_reference("grpc"))
    assert objects(_reference(None)) == grpc == objects(_reference("auto"))
    for kind in ("StatefulSet", "Job"):
        pod = next(o for o in grpc if o["kind"] == kind)["spec"]["template"]["spec"]
        assert "affinity" not in pod
        assert [i["name"] for i in pod["initContainers"]] == [render.PREFLIGHT_CONTAINER]
        assert not any("hostPath" in v for v in pod["volumes"])
        assert not any(e["name"] == render.SHARED_WEIGHTS_ENV for e in pod["containers"][0]["env"])
    # shm = grpc plus the volume, mount, env, init container and affinity; nothing else moves.
    shm, by_kind = _pods(_reference("shm")), {o["kind"]: o for o in grpc}
    assert _without_shared_weights(shm["rollout"]) == by_kind["StatefulSet"]["spec"]["template"]["spec"]
    assert _without_shared_weights(shm["learner"]) == by_kind["Job"]["spec"]["template"]["spec"]
    shm_objs = {o["kind"]: o for o in objects(_reference("shm"))}
    for kind in ("Secret", "ConfigMap", "Service", "NetworkPolicy"):
        assert shm_objs[kind] == by_kind[kind], kind  # same Service/NetworkPolicy: gRPC still carries the header


@pytest.mark.parametrize(
    "transport,local,cluster", [("auto", "shm", "grpc"), ("grpc", "grpc", "grpc"), ("shm", "shm", "shm")]
)
def test_effective_transport(transport: str, local: str, cluster: str) -> None:
    sync = parse_job(_reference(transport)).spec.sync
    assert (sync.local_transport, sync.cluster_transport) == (local, cluster)


def test_shared_weights_env_is_the_one_learner_and_servers_read() -> None:
    # render keeps its own copy: the operator image imports no part of the weight-sync data path.
    from rmsft.weight_wire import SHARED_DIR_ENV

    assert render.SHARED_WEIGHTS_ENV == SHARED_DIR_ENV == "RMSFT_SHARED_WEIGHTS_DIR"


def test_a_colocate_job_renders_only_the_learner_job() -> None:
    """spec.rollout.mode colocate: the engine lives in the learner's ranks, so no pool, no Service, no
    NetworkPolicy for it, and the learner follows no servers file."""
    objs = render.render_all(load_job(ROOT / "configs/job-kind-cpu-colocate.yaml"), "team-a", "0000-uid")
    assert [o["kind"] for o in objs] == [
        "Secret",
        "ConfigMap",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Job",
    ]  # the learner's budget and its NetworkPolicy
    for obj in objs:
        kubernetes_validate.validate(obj, "1.32", strict=True)
    job = objs[-1]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == ["train", "--config", f"{render.CONFIG_DIR}/{render.CONFIG_KEY}"]
    doc = yaml.safe_load(objs[1]["data"][render.CONFIG_KEY])
    assert doc["spec"]["rollout"]["mode"] == "colocate" and doc["spec"]["rollout"]["replicas"] == 0


def test_a_gpu_colocate_job_gives_the_learner_all_its_gpus() -> None:
    doc = yaml.safe_load((ROOT / "configs/job.yaml").read_text())
    doc["spec"]["rollout"] = {
        "mode": "colocate",
        "maxModelLen": 8192,
        "colocate": {"tensorParallelSize": 2, "gpuMemoryUtilization": 0.4},
    }
    doc["spec"]["learner"]["gpus"] = 4
    doc["spec"]["sync"] = {"mode": "full"}
    kids = {o["kind"]: o for o in render.render_all(parse_job(doc), "team-a", "0000-uid")}
    assert set(kids) == {"Secret", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy", "Job"}
    pod = kids["Job"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert pod["containers"][0]["command"][-2:] == ["-m", "rmsft_cli"]  # torchrun: one rank per GPU


@pytest.mark.parametrize("path", ["configs/job.yaml", "configs/job-kind-cpu-colocate.yaml"])
def test_every_pod_checks_the_model_before_its_container_loads_it(path: str) -> None:
    job = load_job(ROOT / path)
    pods = {kind: o["spec"]["template"]["spec"] for kind, o in _by_kind(path).items() if kind in ("StatefulSet", "Job")}
    assert set(pods) == ({"Job"} if job.spec.rollout.colocated else {"StatefulSet", "Job"})
    for kind, pod in pods.items():
        init, main = pod["initContainers"][0], pod["containers"][0]
        assert init["name"] == render.PREFLIGHT_CONTAINER, kind  # first: before anything else of the pod runs
        assert init["args"] == ["preflight", "/etc/rmsft/job.yaml"]
        assert (init["image"], init["imagePullPolicy"]) == (main["image"], main["imagePullPolicy"])
        # No GPU: none requested, and the NVIDIA runtime hands it none.
        assert init["resources"]["requests"] == init["resources"]["limits"] == render.PREFLIGHT_RESOURCES
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in init["env"]
        # It reads what the main container reads: the manifest and the model, at the same paths.
        assert {"name": "config", "mountPath": "/etc/rmsft", "readOnly": True} in init["volumeMounts"]
        model = [m for m in main["volumeMounts"] if m["name"] == "model"]
        assert [m for m in init["volumeMounts"] if m["name"] == "model"] == model
        assert bool(model) == (job.spec.model.volume is not None), kind
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert init["securityContext"]["allowPrivilegeEscalation"] is False
    if "StatefulSet" in pods:
        assert "nvidia.com/gpu" in pods["StatefulSet"]["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize("fmt,code", [("coordexp", 2), ("qwen_json", 0)])
def test_the_preflight_container_refuses_a_stock_checkpoint_for_coordexp(
    tokenizer_folders: dict[str, Path], tmp_path: Path, fmt: str, code: int
) -> None:
    """What the init container runs, on the manifest the ConfigMap mounts: a stock checkpoint with coordexp
    exits 2 with both fixes, with qwen_json it passes."""
    doc = yaml.safe_load((ROOT / "configs/job-kind-cpu.yaml").read_text())
    stock = tokenizer_folders["stock"]
    doc["spec"]["model"]["path"] = str(stock)
    doc["spec"]["training"]["format"] = fmt
    objs = {o["kind"]: o for o in render.render_all(parse_job(doc), "team-a", "0000-uid", token="t")}
    (tmp_path / "job.yaml").write_text(objs["ConfigMap"]["data"]["job.yaml"])
    init = objs["StatefulSet"]["spec"]["template"]["spec"]["initContainers"][0]
    args = [a.replace("/etc/rmsft", str(tmp_path)) for a in init["args"]]
    proc = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == code, proc.stderr
    if code:
        said = proc.stderr.strip()
        assert said.startswith("rmsft preflight:") and "\n" not in said, said  # one line, no traceback
        assert f"rmsft prepare-model {stock} DST" in said and "spec.training.format: qwen_json" in said, said
    else:
        assert "qwen_json needs nothing more" in proc.stdout


def test_a_disruption_is_not_a_failure_and_a_refused_configuration_is_final() -> None:
    """Issue 41: an evicted, drained or preempted learner is retried without counting against backoffLimit (its
    retry resumes from the save it made on SIGTERM); `rmsft train` refusing its configuration (exit 2) fails the job
    at once; by default a learner crash is retried."""
    job = load_job(ROOT / "configs/job.yaml")
    spec = render.render_job(job, "ns", "uid-1")["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1]["action"] == "FailJob" and rules[1]["onExitCodes"]["values"] == [render.CONFIG_EXIT_CODE]
    names = [c["name"] for c in spec["template"]["spec"]["containers"]]
    assert rules[1]["onExitCodes"]["containerName"] in names and spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["backoffLimit"] == job.spec.learner.backoff_limit == 1  # as configs/job.yaml sets it
    assert load_job(ROOT / "configs/job-kind-cpu.yaml").spec.learner.backoff_limit == 2  # the default
    refused = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "train", "--config", str(ROOT / "README.md"), "--servers", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == render.CONFIG_EXIT_CODE, refused.stderr[-2000:]


def _containers(pod_spec: dict) -> list[dict]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


@pytest.mark.parametrize(
    "path", ["configs/job.yaml", "configs/job-kind-cpu.yaml", "configs/job-kind-cpu-colocate.yaml"]
)
def test_every_container_runs_on_a_read_only_image_and_the_learner_has_time_to_save(path: str) -> None:
    """Issue 41: readOnlyRootFilesystem on every rmsft container (the rollout server, the learner, their model
    preflight, the shared-weights owner and the shm cleanup), what they write going to mounted volumes; and the
    learner pod's grace period (spec.learner.terminationGracePeriod, 10 minutes by default, not Kubernetes' 30 s)
    covers the step in progress and the checkpoint `rmsft train` saves on SIGTERM."""
    job = load_job(ROOT / path)
    kids = {render.child_key(o): o for o in render.render_all(job, "team-a", "0000-uid")}
    pods = [kids[k]["spec"]["template"]["spec"] for k in ("StatefulSet", "Job") if k in kids]
    pods.append(render.render_shm_cleanup(job, "team-a", "node-1")["spec"]["template"]["spec"])
    containers = [c for pod in pods for c in _containers(pod)]
    assert len(containers) >= 2
    assert {c["name"]: c["securityContext"].get("readOnlyRootFilesystem") for c in containers} == {
        c["name"]: True for c in containers
    }
    for pod in pods:  # what they write has a place: /tmp is a volume in every pod that runs rmsft
        mounted = {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        assert "/tmp" in mounted or pod["containers"][0]["name"] == "remove", mounted
    learner = kids["Job"]["spec"]["template"]["spec"]
    assert learner["terminationGracePeriodSeconds"] == 600
    doc = yaml.safe_load((ROOT / path).read_text())
    doc["spec"].setdefault("learner", {})["terminationGracePeriod"] = "90s"
    assert (
        render.render_job(parse_job(doc), "team-a", "0000-uid")["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"
        ]
        == 90
    )


@pytest.mark.parametrize("transport", ["grpc", "nccl"])
def test_the_learner_pods_get_a_networkpolicy_of_their_own(transport: str) -> None:
    """Issue 62: before, nothing guarded the learner pods: torchrun's rendezvous store and the weight group's store
    were open to every pod of the cluster. Now: any port from the job's own learner pods (rendezvous, collectives);
    with transport nccl, from the job's own rollout pods (the weight-transfer group); /metrics from anywhere (the
    operator's progress); nothing else."""
    spec = yaml.safe_load((ROOT / "configs/job-kind-cpu.yaml").read_text())["spec"]
    spec = {
        **spec,
        "sync": {**(spec.get("sync") or {}), "transport": transport},
        "learner": {**spec["learner"], "nodes": 2, "spread": False, "checkpointClaim": "ck"},
    }
    job = parse_job(
        {
            "apiVersion": "rmsft.io/v1alpha1",
            "kind": "RolloutMatchingJob",
            "metadata": {"name": "demo", "namespace": "team-a"},
            "spec": spec,
        }
    )
    objs = {render.child_key(o): o for o in render.render_all(job, "team-a", "0000-uid", token="t")}
    policy = objs["LearnerNetworkPolicy"]
    kubernetes_validate.validate(policy, "1.32", strict=True)
    learners, rollouts = render.selector("demo", "learner"), render.selector("demo", "rollout")
    assert policy["metadata"]["name"] == "demo-learner" and policy["spec"]["podSelector"] == {"matchLabels": learners}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert learners.items() <= objs["Job"]["spec"]["template"]["metadata"]["labels"].items()  # it guards the pods
    rules = policy["spec"]["ingress"]
    assert rules[0] == {"from": [{"podSelector": {"matchLabels": learners}}]}  # rendezvous (29500) and ranks
    assert rules[-1] == {"ports": [{"protocol": "TCP", "port": job.spec.learner.metrics_port}]}
    group = [{"from": [{"podSelector": {"matchLabels": rollouts}}]}] if transport == "nccl" else []
    assert rules[1:-1] == group
    # No rule lets any other pod reach a port but /metrics: every `from` names this job's own pods.
    for rule in rules:
        for peer in rule.get("from", []):
            assert set(peer) == {"podSelector"} and peer["podSelector"]["matchLabels"]["rmsft.io/job"] == "demo"
