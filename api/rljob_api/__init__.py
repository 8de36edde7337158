"""rljob_api: the one config model and every shared constant of rljob (pydantic only, no torch, no kopf)."""

from rljob_api.config import JobConfig, RedisConnection, RedisKeys, resolve
from rljob_api.spec import RLTrainingJobSpec
from rljob_api.validation import SpecProblem, check_spec, data_parallel_size

__all__ = [
    "JobConfig",
    "RedisConnection",
    "RedisKeys",
    "RLTrainingJobSpec",
    "SpecProblem",
    "check_spec",
    "resolve",
    "data_parallel_size",
]
