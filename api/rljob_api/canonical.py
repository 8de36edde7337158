"""Canonical JSON (sorted keys, no spaces) and its sha256: what every content hash of rljob covers."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional


def canonical_json(value: Any) -> str:
    """``value`` (JSON-serialisable) as JSON with sorted keys and no spaces: equal values give equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def canonical_hash(value: Any, digits: Optional[int] = None) -> str:
    """Hex sha256 of :func:`canonical_json` of ``value``; its first ``digits`` hex digits when given (16 fit a label
    value)."""
    digest = hashlib.sha256(canonical_json(value).encode()).hexdigest()
    return digest if digits is None else digest[:digits]
