"""The trainer's side of the stream: consumer-group reader, redistribution across data-parallel ranks, micro-batch
packing (the entry codec and the Redis connection are :mod:`rljob_wire`)."""
