"""Which API an endpoint URL speaks, judged by its path, and the URLs derived from it."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit, urlunsplit

#: The wire formats load_test can drive: our JSON API, OpenAI completions, OpenAI chat.
ApiKind = Literal["generate", "completions", "chat"]


def endpoint_kind(url: str) -> ApiKind:
    """Classify an endpoint URL by its path; raises ``ValueError`` when unsupported.

    ``.../generate`` and ``.../api/generate`` are our JSON API, ``.../v1/completions`` and
    ``.../v1/chat/completions`` the OpenAI one.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"invalid endpoint {url!r}: expected an http:// or https:// URL")
    path = parts.path.rstrip("/")
    if path.endswith("/v1/chat/completions"):
        return "chat"
    if path.endswith("/v1/completions"):
        return "completions"
    if path.endswith("/generate"):
        return "generate"
    raise ValueError(
        f"invalid endpoint {url!r}: the path must end in /generate, /api/generate, "
        "/v1/completions or /v1/chat/completions"
    )


def models_url(endpoint: str) -> str:
    """The OpenAI ``/v1/models`` URL next to an OpenAI endpoint (same host and path prefix)."""
    parts = urlsplit(endpoint)
    path = parts.path.rstrip("/")
    base = path[: path.rfind("/v1/")] if "/v1/" in path else ""
    return urlunsplit((parts.scheme, parts.netloc, base + "/v1/models", "", ""))
