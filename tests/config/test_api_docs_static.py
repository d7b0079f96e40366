"""The API docs page (/api/docs/) needs nothing but our own static files (drf-spectacular-sidecar).

The browser test (tests/browser/test_api_docs.py) renders it from a real router offline; here, without
a browser: every asset the page links is a /static/ URL that the staticfiles finders resolve (what
config/asgi.py's static handler serves), and `collectstatic` copies them to STATIC_ROOT for a web
server in front.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from django.contrib.staticfiles import finders
from django.core.management import call_command
from django.test import Client

SWAGGER_UI = ("swagger-ui-bundle.js", "swagger-ui-standalone-preset.js", "swagger-ui.css", "favicon-32x32.png")


def _assets(html: str) -> list[str]:
    """Every src/href of a page."""
    return re.findall(r'(?:src|href)="([^"]+)"', html)


def test_api_docs_link_only_our_static_files(settings: Any) -> None:
    response = Client().get("/api/docs/")
    assert response.status_code == 200
    assets = _assets(response.content.decode())
    prefix = f"/{settings.STATIC_URL.strip('/')}/drf_spectacular_sidecar/swagger-ui-dist/"
    assert sorted(assets) == sorted(prefix + name for name in SWAGGER_UI)
    for url in assets:
        assert finders.find(url.removeprefix(f"/{settings.STATIC_URL.strip('/')}/")), url


def test_collectstatic_copies_swagger_ui(settings: Any, tmp_path: Path) -> None:
    settings.STATIC_ROOT = tmp_path / "static"
    call_command("collectstatic", interactive=False, verbosity=0)
    folder = settings.STATIC_ROOT / "drf_spectacular_sidecar" / "swagger-ui-dist"
    for name in SWAGGER_UI:
        assert (folder / name).stat().st_size > 0, name
    assert "SwaggerUIBundle" in (folder / "swagger-ui-bundle.js").read_text(errors="replace")
