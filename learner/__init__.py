"""rmsft learner: rollouts -> parse -> match -> targets -> packed training -> weight sync.

One subpackage per idea; each may import only the ones listed under it (tests/test_imports.py checks, with
every import counted, the lazy ones inside functions too):

    core/        the algorithm, pure (codec, parse, match, targets, packing, losses, grpo)   nothing
    tracking/    Prometheus metrics, TensorBoard, run.json                                  -
    rollouts/    where rollouts come from: the interface and the server home (pool,         tracking
                 servers file, requests and completions, the client)
    sync/        the weights the servers load, the weight-sync client                       rollouts, tracking
    data/        records, images, datasets, data order, vision segments, the E-step glue    core, rollouts
    rewards/     GRPO rewards: interface, built-ins, resolution and scoring                 core, data
    evaluation/  held-out evaluation, COCO mAP, pictures of answers                         core, data, rollouts
    rollouts/colocate/  the other home: the rollout engine inside the learner's ranks       core, rollouts, sync,
                                                                                            tracking, rollout_engine
    train/       the training loop and its objectives, updaters, ranks, policy, checkpoints, export,   all of the above
                 the server home's wiring, the offload context
    local.py, checkpoint_eval.py, gpu_assignment.py: `rmsft local` / `rmsft eval`, on top     everything

Every subpackage but core may also import the base (`rmsft` and `rmsft_protos`); only the modules on top
import `rmsft_dev` and `rollout_svc` (to start servers), and only rollouts/colocate/ imports `rollout_engine`
(the engines the servers run too).
"""
