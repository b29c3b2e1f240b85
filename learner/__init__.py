"""rmsft learner: rollouts -> parse -> match -> targets -> packed training -> weight sync."""
