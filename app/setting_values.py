"""Settings given as text (a flag, an ``MMSERVE_*`` environment variable) turned into their values, before
``app.settings.Settings`` validates them: lists as comma-separated text or JSON, as vLLM's flags accept;
and, once validated, the media limits completed with their defaults."""

from __future__ import annotations

import json
from typing import Any


def media_domains(value: Any) -> Any:
    """``a.com,b.org`` or a JSON list; names are compared lower-case, without a trailing dot."""
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else text.split(",")
    if isinstance(value, list):
        return [str(v).strip().lower().rstrip(".") for v in value if str(v).strip()]
    return value


def api_keys(value: Any) -> Any:
    """A comma-separated list (the environment variable), a list (the repeated flag), or one key."""
    if isinstance(value, str):
        value = value.split(",")
    if isinstance(value, list | tuple):
        keys = [str(key).strip() for key in value]
        if any(not key for key in keys):
            raise ValueError("an API key must not be empty")
        return list(dict.fromkeys(keys))
    return value


def mm_limits(value: Any) -> Any:
    """``image=4`` (also ``image=4,video=0``) or JSON ``{"image": 4}``, as vLLM accepts."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("{"):
        return json.loads(text)
    limits: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        modality, sep, count = part.partition("=")
        if not sep:
            raise ValueError(f"expected modality=N, got {part!r}")
        limits[modality.strip()] = count.strip()
    return limits


def complete_mm_limits(limits: dict[str, int], defaults: dict[str, int]) -> dict[str, int]:
    """``--limit-mm-per-prompt``'s counts over the ``defaults``, for the modalities served only."""
    unknown = sorted(set(limits) - set(defaults))
    if unknown:
        raise ValueError(f"unsupported modalities {unknown}; mmserve serves {sorted(defaults)}")
    if any(count < 0 for count in limits.values()):
        raise ValueError("limits must be >= 0")
    return {**defaults, **limits}
