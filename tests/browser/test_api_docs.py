"""The API docs page (/api/docs/) in a real browser, offline: Swagger UI from the project's own static files.

The page is served by a real router process (`python -m inference.launch_router`: gunicorn + uvicorn
running config.asgi, which serves static files itself, as `make up` does), not by a test server.
Chromium must render the schema's operations, with every request it made going to 127.0.0.1: no
CDN, no web font, nothing that a machine without internet would wait for.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Request, expect

from tests.browser.conftest import CHROMIUM, SKIP_REASON, BrowserSession
from tests.support.processes import start_router

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason=SKIP_REASON),
    pytest.mark.timeout(180),
]

# Nothing listens there: the docs page needs no worker, only a router that starts.
NO_WORKER = "http://127.0.0.1:1"
SIDECAR_STATIC = "/static/drf_spectacular_sidecar/swagger-ui-dist/"


@pytest.fixture(scope="module")
def router_url(log_dir: Path) -> Iterator[str]:
    """A real router process, whose ASGI app serves the admin, the REST API, its docs and static files."""
    proc, url = start_router([NO_WORKER], [NO_WORKER], log_dir)
    try:
        yield url
    finally:
        proc.stop()


def test_api_docs_render_operations_offline(browser: BrowserSession, router_url: str) -> None:
    page = browser.page
    requests: list[Request] = []
    page.on("request", lambda request: requests.append(request))
    # A request leaving 127.0.0.1 is refused at once (as it would be with no internet), and recorded above.
    page.context.route(
        lambda url: urlsplit(url).hostname != "127.0.0.1", lambda route: route.abort("internetdisconnected")
    )

    with browser.step("api-docs"):
        response = page.goto(router_url + "/api/docs/")
        assert response is not None and response.status == 200
        # Swagger UI drew the schema: the deployments list operation, its path and its tag section.
        operation = page.locator("#operations-deployments-deployments_list")
        expect(operation).to_be_visible()
        expect(operation.locator(".opblock-summary-method")).to_have_text("GET")
        expect(operation.locator(".opblock-summary-path")).to_have_attribute("data-path", "/api/deployments/")
        expect(page.locator("#operations-deployments-deployments_scale_create")).to_be_visible()
        expect(page.locator(".info .title")).to_contain_text("Disaggregated inference platform API")

    with browser.step("api-docs-operation-open"):
        operation.locator(".opblock-summary").click()
        # Expanded from the schema: the list's pagination parameters.
        expect(operation.locator("tr[data-param-name='limit']")).to_be_visible()
        expect(operation.locator("tr[data-param-name='offset']")).to_be_visible()

    hosts = {urlsplit(r.url).hostname for r in requests if not r.url.startswith("data:")}
    assert hosts == {"127.0.0.1"}, sorted(r.url for r in requests)
    # Swagger UI's own files came from the router's static files (drf-spectacular-sidecar), answered 200.
    assets = {urlsplit(r.url).path.removeprefix(SIDECAR_STATIC): r for r in requests
              if urlsplit(r.url).path.startswith(SIDECAR_STATIC)}
    assert {"swagger-ui-bundle.js", "swagger-ui-standalone-preset.js", "swagger-ui.css"} <= set(assets)
    for name, request in assets.items():
        answer = request.response()
        assert answer is not None and answer.status == 200, name
