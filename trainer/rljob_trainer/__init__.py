"""rljob_trainer: what runs in trainer pods (``torchrun -m rljob_trainer.train``): the stream reader, the loss, the
training loop, checkpoints and weight publication. The wire it shares with the rollout is :mod:`rljob_wire`."""
