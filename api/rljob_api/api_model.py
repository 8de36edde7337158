"""The base of every API model and the rule that keeps fields added later out of the resolved config at their
default (re-exported by :mod:`rljob_api.spec`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


def omitted_at_default(default: Any, *also: Any) -> Any:
    """``exclude_if`` of a field added after 0.2: the field is left out of a dump (the resolved config JSON, the hashes
    of the config and of each role) while it holds ``default`` (or one of ``also``, values that mean the same, e.g. an
    unset and an empty override), so that a job which does not set it resolves to the bytes, and the hashes, it
    resolved to before the field existed, and an older trainer or rollout image still reads its config (the models
    reject unknown fields)."""
    defaults = (default, *also)
    return lambda value: any(value == d for d in defaults)


class ApiModel(BaseModel):
    """Base of every API model: camelCase aliases, unknown fields rejected, validated on assignment."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True
    )
