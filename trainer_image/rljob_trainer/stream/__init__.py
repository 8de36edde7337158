"""The trainer's stream layer: wire codec, Redis connection, consumer-group reader, micro-batch packing."""
