"""The kubelet the envtest control plane does not have, played by the test: Nodes registered as a
kubelet would register them, pod status written through the `status` subresource, and deletions
finished (grace period 0) where a kubelet would finish them. Mixed into `ControlPlane`, whose
`ok`/`request` it uses."""

from __future__ import annotations

import datetime as dt
import urllib.parse
import uuid
from typing import Any


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeKubelet:
    _pod_ips = 0  # fake pod IPs handed out so far

    def create_node(
        self,
        name: str,
        gpus: int = 8,
        cpu: str = "96",
        memory: str = "1024Gi",
        pods: int = 110,
        labels: dict[str, str] | None = None,
        taints: list[dict] | None = None,
    ) -> dict:
        """A Node as a kubelet would register it: capacity/allocatable incl. `nvidia.com/gpu`, and
        a Ready condition set through the status subresource, and only `taints` as taints. No
        heartbeats are needed: the node lifecycle controller is off (see _start_controller_manager)."""
        resources = {"cpu": cpu, "memory": memory, "pods": str(pods), "ephemeral-storage": "1Ti"}
        if gpus:
            resources["nvidia.com/gpu"] = str(gpus)
        node_labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **(labels or {}),
        }
        self.ok(
            "POST",
            "/api/v1/nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": node_labels},
                "spec": {"taints": taints or []},
            },
        )
        now = _now()
        conditions = [
            {
                "type": t,
                "status": "False",
                "reason": f"Kubelet{r}",
                "message": "fake kubelet",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for t, r in (
                ("MemoryPressure", "HasSufficientMemory"),
                ("DiskPressure", "HasNoDiskPressure"),
                ("PIDPressure", "HasSufficientPID"),
            )
        ]
        conditions.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "fake kubelet",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
        )
        status = {
            "capacity": resources,
            "allocatable": resources,
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "v1.32.13",
                "kubeProxyVersion": "",
                "containerRuntimeVersion": "fake://1",
                "kernelVersion": "",
                "osImage": "fake",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }
        self.ok("PATCH", f"/api/v1/nodes/{name}/status", {"status": status})
        # The TaintNodesByCondition admission plugin gives every new Node the
        # node.kubernetes.io/not-ready:NoSchedule taint; the node lifecycle controller would lift it
        # once the node is Ready. It is off here, so the fake kubelet lifts it (keeping `taints`).
        return self.ok("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": taints or None}})

    def set_pod_phase(
        self,
        namespace: str,
        name: str,
        phase: str,
        ready: bool | None = None,
        container_state: dict[str, Any] | None = None,
        exit_code: int | None = None,
    ) -> dict:
        """Acts as the kubelet for one pod: writes its status through the `status` subresource.

        phase Running (Ready unless ready=False), Succeeded (exit 0) or Failed (exit 1, or
        `exit_code`); `container_state` overrides each container's `state` (e.g.
        {"waiting": {"reason": "CrashLoopBackOff"}})."""
        if phase not in ("Pending", "Running", "Succeeded", "Failed"):
            raise ValueError(f"phase {phase!r}")
        pod = self.ok("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        now = _now()
        old = pod.get("status") or {}
        started = old.get("startTime") or now
        if ready is None:
            ready = phase == "Running"
        if container_state is None:
            if phase == "Running":
                container_state = {"running": {"startedAt": started}}
            elif phase in ("Succeeded", "Failed"):
                code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
                container_state = {
                    "terminated": {
                        "exitCode": code,
                        "reason": "Completed" if code == 0 else "Error",
                        "startedAt": started,
                        "finishedAt": now,
                    }
                }
            else:
                container_state = {"waiting": {"reason": "ContainerCreating"}}
        running = "running" in container_state
        statuses = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": f"fake://{c['image']}",
                "containerID": f"fake://{uuid.uuid5(uuid.NAMESPACE_URL, pod['metadata']['uid'] + c['name'])}",
                "ready": bool(ready and running),
                "started": running,
                "restartCount": 0,
                "state": container_state,
            }
            for c in pod["spec"]["containers"]
        ]
        ip = old.get("podIP") or self._next_pod_ip()
        cond_ready = "True" if ready and running else "False"
        conditions = [
            {"type": t, "status": s, "lastTransitionTime": now, "lastProbeTime": None}
            for t, s in (
                ("PodReadyToStartContainers", "True"),
                ("Initialized", "True"),
                ("Ready", cond_ready),
                ("ContainersReady", cond_ready),
                ("PodScheduled", "True"),
            )
        ]
        if phase in ("Succeeded", "Failed"):
            for c in conditions:
                if c["type"] in ("Ready", "ContainersReady"):
                    c["status"], c["reason"] = "False", "PodCompleted"
        status = {
            "phase": phase,
            "conditions": conditions,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": started,
            "containerStatuses": statuses,
            "qosClass": old.get("qosClass", "BestEffort"),
        }
        return self.ok("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": status})

    def _next_pod_ip(self) -> str:
        self._pod_ips += 1
        n = self._pod_ips
        return f"10.244.{n // 250}.{n % 250 + 1}"

    def delete_pod(self, namespace: str, name: str) -> int:
        """Deletes a pod at once (grace period 0): with no kubelet, a pod bound to a node and
        deleted with a grace period would stay Terminating forever. Returns the HTTP status."""
        status, _ = self.request(
            "DELETE",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0},
        )
        return status

    def reap_terminating_pods(self, namespace: str) -> list[str]:
        """What a kubelet does for pods its controllers deleted with a grace period (StatefulSet
        scale-down, Job cleanup, GC): finishes the deletion. Returns the names it deleted."""
        pods = self.ok("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]
        done = []
        for p in pods:
            if p["metadata"].get("deletionTimestamp"):
                self.delete_pod(namespace, p["metadata"]["name"])
                done.append(p["metadata"]["name"])
        return done

    def pods(self, namespace: str, selector: str | None = None) -> list[dict]:
        q = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        return self.ok("GET", f"/api/v1/namespaces/{namespace}/pods{q}")["items"]
