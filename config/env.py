"""Environment parsing helpers used by settings: every setting comes from the environment, once."""
from __future__ import annotations

import os

from django.core.exceptions import ImproperlyConfigured


def env_str(name: str, default: str | None = None) -> str | None:
    """The variable's value, or `default` when it is unset or empty."""
    value = os.environ.get(name, "")
    return value if value != "" else default


def env_bool(name: str, default: bool) -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off; anything else fails at startup."""
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return default
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean (use 1/0, true/false)")


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    """An integer variable; a malformed or too small value fails at startup, naming the variable."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    try:
        number = int(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={value!r} is not an integer") from exc
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number} must be >= {minimum}")
    return number


def env_float(name: str, default: float) -> float:
    """A float variable; a malformed value fails at startup, naming the variable."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    try:
        return float(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={value!r} is not a number") from exc


def env_list(name: str) -> list[str]:
    """A comma-separated list variable, blanks dropped."""
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]
