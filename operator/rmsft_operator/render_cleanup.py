"""The cleanup Job of an shm job's shared-weights folder on its node, pure: made when the job is deleted, since the
kubelet never removes a hostPath directory and the operator cannot reach a node's files."""

from __future__ import annotations

from typing import Any

from rmsft.jobspec import RolloutMatchingJob
from rmsft_operator.render_meta import SHARED_WEIGHTS_VOLUME, UID, labels
from rmsft_operator.render_pods import container_security, pod_common, shared_weights_host_path

SHM_CLEANUP_MOUNT = "/shared-weights"  # the job's own folder, in the cleanup container


def render_shm_cleanup(
    job: RolloutMatchingJob, namespace: str, node: str, image: str = "", pull_policy: str = "IfNotPresent"
) -> dict[str, Any]:
    """A Job that empties the job's shared-weights directory (/dev/shm/rmsft/<ns>.<job>) on `node`,
    created when an shm job is deleted: nothing else can, since the kubelet never removes a hostPath
    directory and the operator cannot reach a node's files. No owner reference (its owner is going
    away); `ttlSecondsAfterFinished: 0` has Kubernetes delete it, and its pod, once it has run.

    `image`: the operator's own (RMSFT_OPERATOR_IMAGE, which the chart sets); empty, for an operator
    run outside the chart, the job's own image, which grants nothing more: the learner pod already
    ran that image on that folder, and the privilege below comes from the pod's security context,
    whatever the image.

    Least privilege: the learner's non-root user (UID: the folder is the learner's, chowned to it with
    mode 0770 by the shared-weights-owner init container), no capability, a read-only image, and only
    the job's own folder mounted (never the node's whole /dev/shm/rmsft, where the other jobs' folders
    are). It removes everything inside the folder and leaves the folder itself, empty: removing it
    would need write access on its root-owned parent, that is root (or DAC_OVERRIDE) with the parent
    mounted, which is what this Job must not have. An empty directory in tmpfs holds no pages (an
    inode's worth of kernel memory); it goes with the node's next reboot, and a job created again
    under the same name and namespace reuses it."""
    if not image:
        image, pull_policy = job.spec.image.ref, job.spec.image.pull_policy
    volume = {
        "name": SHARED_WEIGHTS_VOLUME,
        "hostPath": {
            # Directory, not DirectoryOrCreate: a folder that is not there has nothing to remove, and
            # creating it would leave a root-owned one behind (the pod then never starts; the deadline
            # below ends the Job and the TTL deletes it).
            "path": shared_weights_host_path(namespace, job.metadata.name),
            "type": "Directory",
        },
    }
    container = {
        "name": "remove",
        "image": image,
        "imagePullPolicy": pull_policy,
        # Everything in the folder, not the folder (the mount point itself cannot go anyway). The
        # learner's files and subfolders are its user's: the folder's write bit is all it takes.
        "command": ["find", SHM_CLEANUP_MOUNT, "-mindepth", "1", "-delete"],
        "securityContext": container_security(),
        "volumeMounts": [{"name": SHARED_WEIGHTS_VOLUME, "mountPath": SHM_CLEANUP_MOUNT}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
    }
    # No fsGroup: it would add nothing (a hostPath volume is never chowned to it) and the user's own
    # group is the folder's group already.
    security = {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "seccompProfile": {"type": "RuntimeDefault"}}
    pod = {
        **pod_common(job),
        "securityContext": security,
        "restartPolicy": "Never",
        "nodeName": node,
        "containers": [container],
        "volumes": [volume],
    }
    pod.pop("nodeSelector", None)  # nodeName places it; the job's selector chose that node already
    meta = {
        "name": f"{job.metadata.name}-shm-cleanup",
        "namespace": namespace,
        "labels": labels(job.metadata.name, "shm-cleanup"),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 2,
            "ttlSecondsAfterFinished": 0,
            "activeDeadlineSeconds": 300,
            "template": {"metadata": {"labels": labels(job.metadata.name, "shm-cleanup")}, "spec": pod},
        },
    }
