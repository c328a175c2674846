"""Canonical JSON: the one byte form that digests, signatures and `why` texts are computed over."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> str:
    """Serialise with sorted keys, no spaces and real unicode, so equal values give equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_bytes(value: Any) -> bytes:
    """UTF-8 bytes of `canonical_json(value)`."""
    return canonical_json(value).encode("utf-8")


def argument_digest(arguments: Any) -> str:
    """sha256 (hex) of the canonical JSON of a call's arguments."""
    return text_digest(canonical_json(arguments))


def text_digest(text: str) -> str:
    """sha256 (hex) of a text's UTF-8 bytes (of canonical JSON: the digest of its value)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
