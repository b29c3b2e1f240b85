"""The RolloutMatchingJob manifest as a pydantic model.

One manifest drives the cluster (`kubectl apply`), the laptop (`rmsft local job.yaml`) and the
learner (`rmsft train --config job.yaml`), so this package is the single place that says what a
valid job is. The Kubernetes-facing sections use camelCase keys (Kubernetes convention); the
`training` section is the learner's own config and uses snake_case keys. Unknown keys are errors.

Torch-free on purpose: the operator image imports this package.

One module per idea, each importing only those above it in this list:
- base.py: the API's names, the Kubernetes patterns, `JobSpecError` and the two key conventions.
- model.py: spec.model (the weights, their volume, image processing).
- pods.py: what the operator deploys around the engines: image, placement, resources, the learner pod, monitoring.
- rollout.py: spec.rollout (the server pool or the colocated engine) and its startup deadline.
- sync.py: spec.sync (how new weights reach the engines).
- recipe.py: spec.training.recipe and the matching, target and loss settings whose defaults follow its generation.
- grpo.py: spec.training.grpo.
- objectives.py: the registry of training objectives (spec.trainer's names, each class's import path).
- training.py: spec.training, the learner's own config.
- job.py: `JobSpec` and the rules that span its sections (mirrored by the CRD's CEL rules).
- manifest.py: the whole manifest (`RolloutMatchingJob`) and reading one (`parse_job`, `load_job`).
This package re-exports what the rest of the project imports.
"""

from rmsft.jobspec.base import (
    API_GROUP,
    API_VERSION,
    DURATION_PATTERN,
    KIND,
    PLURAL,
    QUANTITY_PATTERN,
    JobSpecError,
    duration_seconds,
)
from rmsft.jobspec.grpo import GrpoTrainingConfig, RewardEntry
from rmsft.jobspec.job import (
    COLOCATE_SLEEP_ZERO3,
    COLOCATE_STALENESS,
    LOGITS_FUSED_CPU,
    LOGITS_FUSED_ZERO3,
    JobSpec,
    colocate_errors,
    cross_field_errors,
    grpo_errors,
)
from rmsft.jobspec.manifest import (
    PATH_FIELDS,
    ObjectMeta,
    RolloutMatchingJob,
    absolute_paths,
    apply_overrides,
    load_job,
    parse_job,
    parse_spec,
    resolve_paths,
    write_effective_job,
)
from rmsft.jobspec.model import ModelSpec, ModelVolume, VisionSpec
from rmsft.jobspec.pods import ImageSpec, LearnerSpec, MonitoringSpec, PlacementSpec, ResourceSpec, Toleration
from rmsft.jobspec.recipe import (
    GENERATION_DEFAULTS,
    RECIPE_EXPLORERS_STALENESS,
    RECIPE_SECOND_ONLY,
    DuplicateControl,
    ExplorerConfig,
    LossConfig,
    MatchingConfig,
    RecipeConfig,
    TargetsConfig,
)
from rmsft.jobspec.rollout import (
    COLOCATE_REPLICAS,
    DEFAULT_STARTUP_TIMEOUT,
    TLS_COLOCATE,
    TLS_HEALTH_PORT,
    ColocateSpec,
    RolloutSpec,
    RolloutTLSSpec,
)
from rmsft.jobspec.sync import SyncSpec, SyncTransport
from rmsft.jobspec.training import (
    REPORT_TO_TWICE,
    TRACKERS,
    BufferConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ExportConfig,
    FormatOptions,
    FreezeConfig,
    LoraConfig,
    MlflowConfig,
    RolloutDecoding,
    TrainingConfig,
    WandbConfig,
)

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "COLOCATE_REPLICAS",
    "COLOCATE_SLEEP_ZERO3",
    "COLOCATE_STALENESS",
    "DEFAULT_STARTUP_TIMEOUT",
    "DURATION_PATTERN",
    "GENERATION_DEFAULTS",
    "KIND",
    "LOGITS_FUSED_CPU",
    "LOGITS_FUSED_ZERO3",
    "PATH_FIELDS",
    "PLURAL",
    "QUANTITY_PATTERN",
    "RECIPE_EXPLORERS_STALENESS",
    "RECIPE_SECOND_ONLY",
    "REPORT_TO_TWICE",
    "TRACKERS",
    "MlflowConfig",
    "WandbConfig",
    "BufferConfig",
    "CheckpointConfig",
    "ColocateSpec",
    "DataConfig",
    "DuplicateControl",
    "EvalConfig",
    "ExplorerConfig",
    "ExportConfig",
    "FormatOptions",
    "FreezeConfig",
    "GrpoTrainingConfig",
    "ImageSpec",
    "JobSpec",
    "JobSpecError",
    "LearnerSpec",
    "LoraConfig",
    "LossConfig",
    "MatchingConfig",
    "ModelSpec",
    "ModelVolume",
    "MonitoringSpec",
    "ObjectMeta",
    "PlacementSpec",
    "RecipeConfig",
    "ResourceSpec",
    "RewardEntry",
    "RolloutDecoding",
    "RolloutMatchingJob",
    "RolloutSpec",
    "RolloutTLSSpec",
    "TLS_COLOCATE",
    "TLS_HEALTH_PORT",
    "SyncSpec",
    "SyncTransport",
    "TargetsConfig",
    "Toleration",
    "TrainingConfig",
    "VisionSpec",
    "colocate_errors",
    "absolute_paths",
    "apply_overrides",
    "cross_field_errors",
    "duration_seconds",
    "grpo_errors",
    "load_job",
    "parse_job",
    "parse_spec",
    "resolve_paths",
    "write_effective_job",
]
