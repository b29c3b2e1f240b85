"""Every object the operator renders validates against the Kubernetes 1.32 schemas and carries
what the issue asks for (GPUs, probes, shm, security, owner references, suspended learner)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from rmsft_operator import render

from rmsft.jobspec import load_job, parse_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["configs/job.yaml", "configs/job-3v1.yaml", "configs/job-kind-cpu.yaml"]


def _by_kind(path: str) -> dict[str, dict]:
    job = load_job(ROOT / path)
    return {o["kind"]: o for o in render.render_all(job, "team-a", "0000-uid")}


@pytest.mark.parametrize("path", EXAMPLES)
def test_rendered_objects_validate_against_kubernetes_1_32(path: str) -> None:
    objs = render.render_all(load_job(ROOT / path), "team-a", "0000-uid")
    assert [o["kind"] for o in objs] == ["Secret", "ConfigMap", "Service", "NetworkPolicy",
                                         "StatefulSet", "Job"]
    for obj in objs:
        kubernetes_validate.validate(obj, "1.32", strict=True)
        ref = obj["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("RolloutMatchingJob", "0000-uid", True)


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
    assert two["command"][:4] == ["python", "-m", "torch.distributed.run", "--standalone"]
    assert two["command"][4:] == ["--nproc-per-node", "2", "-m", "rmsft.cli"]
    assert two["args"][0] == "train"
    # One GPU, or none: the image's entrypoint (`rmsft`) runs `train` as a single process.
    for path in ("configs/job-3v1.yaml", "configs/job-kind-cpu.yaml"):
        one = learner(path)
        assert "command" not in one and one["args"][0] == "train"


def test_cpu_job_requests_no_gpus() -> None:
    objs = _by_kind("configs/job-kind-cpu.yaml")
    for kind in ("StatefulSet", "Job"):
        res = objs[kind]["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert "nvidia.com/gpu" not in res.get("limits", {}) and "nvidia.com/gpu" not in res.get("requests", {})


def test_network_policy_admits_only_learner_to_grpc_and_monitoring_to_metrics() -> None:
    np = _by_kind("configs/job.yaml")["NetworkPolicy"]["spec"]
    assert np["podSelector"]["matchLabels"] == render.selector("qwen3vl-det", "rollout")
    grpc, metrics = np["ingress"]
    assert grpc["from"] == [{"podSelector": {"matchLabels": render.selector("qwen3vl-det", "learner")}}]
    assert grpc["ports"] == [{"protocol": "TCP", "port": 50051}]
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"}
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9090}]
    # the learner pod's labels really match the gRPC rule
    learner_labels = _by_kind("configs/job.yaml")["Job"]["spec"]["template"]["metadata"]["labels"]
    assert render.selector("qwen3vl-det", "learner").items() <= learner_labels.items()


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
