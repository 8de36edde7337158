"""rljob_trainer: what runs in trainer and rollout pods (stream, loss, training loop, rollout workers)."""
