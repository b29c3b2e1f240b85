"""Prometheus metrics of the learner. Dashboards may only query names defined here,
in rollout_engine/metrics.py or in rmsft_operator/metrics.py (tests/test_dashboards.py checks)."""

from prometheus_client import Counter, Gauge, Histogram

PHASES = (
    "rollout",
    "generate",
    "parse",
    "match",
    "targets",
    "pack",
    "forward",
    "backward",
    "optimizer",
    "sync",
    "reward",
    "reference",
)
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

PHASE_SECONDS = Histogram(
    "rmsft_learner_phase_seconds",
    "Duration of one phase of a training step",
    ["phase"],
    buckets=_PHASE_BUCKETS,
)
STEP_SECONDS = Histogram("rmsft_learner_step_seconds", "Duration of one optimizer step", buckets=_PHASE_BUCKETS)
GLOBAL_STEP = Gauge("rmsft_learner_global_step", "Optimizer steps done")
WEIGHT_VERSION = Gauge("rmsft_learner_weight_version", "Weight version the learner holds (its number)")
# The learner run those versions belong to: one series, value 1, labelled with the run id (new after every
# restart). Compare with the servers' rmsft_rollout_weight_run_info to see which learner each one serves.
RUN_INFO = Gauge("rmsft_learner_run_info", "This learner run's id (1 per run_id; new after every restart)", ["run_id"])
PACKING_FILL = Gauge("rmsft_learner_packing_fill_ratio", "Filled fraction of the last packed row")
PACKER_PENDING = Gauge("rmsft_learner_packer_pending_segments", "Segments waiting in the packer's carry buffer")
OBJECTS = Counter("rmsft_learner_objects_total", "Matching outcomes", ["outcome"])  # matched|fp|fn
DROPPED_OBJECTS = Counter("rmsft_learner_dropped_objects_total", "Rollout objects dropped by the parser")
TRUNCATED_ROLLOUTS = Counter("rmsft_learner_truncated_rollouts_total", "Rollouts without a closed JSON object")
LOSS = Gauge("rmsft_learner_loss", "Last step's loss by part", ["part"])
# Every figure an objective reports of a step (its StepFigures.scalars, named as in TensorBoard, e.g. train/f1,
# grpo/reward_mean): a new objective's figures reach /metrics with no metric of their own.
OBJECTIVE_FIGURE = Gauge(
    "rmsft_learner_objective_figure", "Last step's figures of the objective, by TensorBoard name", ["name"]
)
TRAINED_TOKENS = Counter("rmsft_learner_trained_tokens_total", "Tokens in packed training rows")
ROLLOUT_REQUESTS = Counter("rmsft_learner_rollout_requests_total", "Prompts sent to rollout servers")
ROLLOUT_RETRIES = Counter("rmsft_learner_rollout_retries_total", "Chunks retried on another server", ["reason"])
# The reasons of learner/rollouts/client.py's retries (a gRPC status, lower case, that is not the request's own
# fault; a reply that breaks the contract; a reply from weights older than the call's), each exported at 0 from
# the start: a labelled series exists only from its first .labels() call, and a dashboard must tell "no retry"
# (0) from "no data". A status not listed (e.g. "internal") gets its series from its first retry.
ROLLOUT_RETRY_REASONS = (
    "unavailable",
    "deadline_exceeded",
    "resource_exhausted",
    "failed_precondition",
    "aborted",
    "cancelled",
    "bad_reply",
    "stale_version",
)
for _reason in ROLLOUT_RETRY_REASONS:
    ROLLOUT_RETRIES.labels(reason=_reason)
WEIGHT_SYNC_BYTES = Counter("rmsft_learner_weight_sync_bytes_total", "Bytes streamed to servers", ["mode"])
SERVERS_READY = Gauge("rmsft_learner_servers_ready", "Rollout servers healthy and on the current version")
# Held-out evaluation (training.eval), set after each one; the operator copies them into
# status.evaluation once EVAL_STEP is >= 1 (0, the initial value, means none yet).
EVAL_STEP = Gauge("rmsft_learner_eval_step", "Optimizer step of the last held-out evaluation (0 = none yet)")
# Label-aware (a prediction counts only with its ground truth's label, normalized) unless named otherwise.
EVAL_F1 = Gauge(
    "rmsft_learner_eval_f1", "Held-out label-aware F1 at IoU training.eval.iou (0.5 by default), last evaluation"
)
EVAL_F1_GEOMETRY = Gauge(
    "rmsft_learner_eval_f1_geometry", "Held-out F1 at IoU training.eval.iou, labels not compared, last evaluation"
)
EVAL_MAP = Gauge("rmsft_learner_eval_map", "Held-out label-aware COCO bbox mAP@[.50:.95], last evaluation")
EVAL_MAP50 = Gauge("rmsft_learner_eval_map50", "Held-out label-aware COCO bbox mAP@.50, last evaluation")
EVAL_MAP_AGNOSTIC = Gauge(
    "rmsft_learner_eval_map_agnostic", "Held-out class-agnostic COCO bbox mAP@[.50:.95], last evaluation"
)
EVAL_TRUNCATION = Gauge(
    "rmsft_learner_eval_truncation_ratio",
    "Share of the last evaluation's held-out answers cut by max_tokens before they closed",
)
EVAL_DUPLICATES = Gauge(
    "rmsft_learner_eval_duplicate_ratio",
    "Share of the last evaluation's predicted objects repeating an earlier one of their answer",
)
EVAL_PREDICTED_PER_GT = Gauge(
    "rmsft_learner_eval_predicted_per_gt_ratio",
    "Predicted objects per ground-truth object in the last held-out evaluation",
)

# GRPO (spec.trainer: grpo), set after each step.
REWARD = Gauge("rmsft_learner_reward", "Last GRPO step's reward over its completions", ["stat"])  # mean|std|group_std
REWARD_PART = Gauge(
    "rmsft_learner_reward_part", "Last GRPO step's mean of each reward of the sum, unweighted", ["reward"]
)
ZERO_STD_GROUPS = Gauge(
    "rmsft_learner_grpo_zero_std_groups_ratio",
    "Share of the last step's groups whose rewards were all equal (no learning signal)",
)
CLIP_FRACTION = Gauge("rmsft_learner_grpo_clip_fraction_ratio", "Completion tokens whose importance ratio was clipped")
GRPO_KL = Gauge("rmsft_learner_grpo_kl", "k3 estimate of the KL to the reference policy, per completion token")
MISMATCH_KL = Gauge(
    "rmsft_learner_grpo_mismatch_kl",
    "k3 estimate of KL(servers' sampling policy || learner's policy), per completion token",
)
CORRECTED_FRACTION = Gauge(
    "rmsft_learner_grpo_corrected_tokens_ratio",
    "Completion tokens whose importance weight the mismatch correction truncated or masked",
)
SPANNING_ROLLOUTS = Counter(
    "rmsft_learner_spanning_rollouts_total",
    "Rollouts whose tokens span weight versions (a sync applied while they generated)",
)
DROPPED_GROUPS = Counter(
    "rmsft_learner_grpo_dropped_groups_total",
    "GRPO groups with all-equal rewards left out of the loss (dynamic_sampling)",
)
RESAMPLED_GROUPS = Counter(
    "rmsft_learner_grpo_resampled_groups_total",
    "GRPO groups sampled again because their rewards were all equal (dynamic_sampling resample)",
)
OVERLONG_ANSWERS = Counter(
    "rmsft_learner_grpo_overlong_answers_total",
    "GRPO answers cut at max_tokens that the overlong rule masked or penalised",
    ["action"],
)
COMPLETION_LENGTH = Gauge("rmsft_learner_completion_length_tokens", "Mean completion length of the last GRPO step")


# Rollouts generated ahead (spec.training.rollout.max_staleness, learner/train/overlap.py); rank 0.
ROLLOUT_WAIT_SECONDS = Counter(
    "rmsft_learner_rollout_wait_seconds_total",
    "Learner time waiting on the pool: a step's rollouts, or the batch ahead before a sync",
)
POOL_IDLE_SECONDS = Counter(
    "rmsft_learner_pool_idle_seconds_total",
    "Time the pool had no learner Generate call in flight (between the first and last call)",
)
ROLLOUT_STALENESS = Histogram(
    "rmsft_learner_rollout_staleness_versions",
    "Weight versions between the one that generated a consumed rollout and the learner's",
    buckets=(0, 1, 2, 3, 4),
)
STALE_ROLLOUTS_DROPPED = Counter(
    "rmsft_learner_stale_rollouts_dropped_total",
    "Rollouts generated ahead but dropped (older than max_staleness) and regenerated",
)


def set_run(run_id: str) -> None:
    """Export this learner run's id as the only `rmsft_learner_run_info` series."""
    RUN_INFO.clear()
    RUN_INFO.labels(run_id=run_id).set(1)


def counter_total(counter: Counter) -> float:
    """A counter's value summed over its labels (in this process)."""
    return sum(s.value for mf in counter.collect() for s in mf.samples if s.name.endswith("_total"))
