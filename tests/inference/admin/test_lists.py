"""Admin polish (issue 10, item 6) against the real admin: the RDMA reason keeps the module name,
stopped workers are hidden by default and pruned after WORKER_RETENTION_HOURS, long health JSON is
cut with the whole text on hover, CPU pinning overlaps are warned about, and the list stylesheet is
on the pages whose tables overflowed."""
from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.actions.workers import prune_stopped_workers
from inference.admin.display import cpu_ranges, short_reason
from inference.kv_transfer.rdma_detect import pyverbs_import_reason, rdma_available
from inference.models import Worker
from inference.tasks import prune_workers
from nodes.resources import detect_rdma
from tests.support.control_plane import make_deployment, make_node, make_worker

pytestmark = pytest.mark.django_db


def page(client: Client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200
    return html.unescape(response.content.decode())


def worker_rows(text: str) -> set[int]:
    """Ids of the workers listed (their change links)."""
    return {int(m) for m in re.findall(r"/admin/inference/worker/(\d+)/change/", text)}


# ------------------------------------------------------------------------------------------ RDMA
def test_pyverbs_reason_names_the_missing_module() -> None:
    missing = ModuleNotFoundError("No module named 'pyverbs'", name="pyverbs")
    assert pyverbs_import_reason(missing) == "pyverbs is not installed (No module named 'pyverbs')"
    dependency = ModuleNotFoundError("No module named 'pyverbs_deps'", name="pyverbs_deps")
    assert "missing module pyverbs_deps" in pyverbs_import_reason(dependency)
    abi = ImportError("libibverbs.so.1: cannot open shared object file")
    assert pyverbs_import_reason(abi) == "pyverbs not importable (libibverbs.so.1: cannot open shared object file)"


def test_short_reason_keeps_the_headline_whole() -> None:
    assert short_reason("pyverbs is not installed (No module named 'pyverbs')") == "pyverbs is not installed"
    long = "ibv_get_device_list failed: " + "x" * 80
    cut = short_reason(long)
    assert len(cut) <= 48 and cut.endswith("…")


def test_node_list_shows_the_reason_this_host_gives(client_root: Client) -> None:
    """The real detection on this host, registered as the agent does, read back from the list."""
    ok, _, _ = rdma_available()
    if ok:
        pytest.skip("RDMA is usable on this host: no reason to show")
    devices, note = detect_rdma()
    node = make_node(name="here", rdma_devices=devices, rdma_note=note)
    text = page(client_root, reverse("admin:nodes_node_changelist"))
    assert f'<span title="{note}">no ({short_reason(note)})</span>' in text
    assert not short_reason(note).endswith("named"), node.rdma_note  # the old cut lost the module name


def test_node_list_rdma_cell_for_a_missing_pyverbs(client_root: Client) -> None:
    note = pyverbs_import_reason(ModuleNotFoundError("No module named 'pyverbs'", name="pyverbs"))
    make_node(name="cpu-9", rdma_note=note)
    text = page(client_root, reverse("admin:nodes_node_changelist"))
    assert "no (pyverbs is not installed)" in text
    assert "No module named 'pyverbs'" in text  # the whole reason, in the hover title


# ------------------------------------------------------------------------------- stopped workers
@pytest.fixture
def workers() -> dict[str, Worker]:
    dep = make_deployment(name="chat")
    node = make_node(name="n1")
    return {
        "running": make_worker(dep, node, role="decode"),
        "failed": make_worker(dep, node, status="failed", last_error="crashed"),
        "stopped": make_worker(dep, node, status="stopped", pid=None),
    }


def test_stopped_workers_are_hidden_by_default(client_root: Client, workers: dict[str, Worker]) -> None:
    url = reverse("admin:inference_worker_changelist")
    default = page(client_root, url)
    assert worker_rows(default) == {workers["running"].pk, workers["failed"].pk}
    assert "Not stopped" in default  # the default choice of the state filter, named
    assert worker_rows(page(client_root, url + "?state=all")) == {w.pk for w in workers.values()}
    assert worker_rows(page(client_root, url + "?state=stopped")) == {workers["stopped"].pk}
    assert worker_rows(page(client_root, url + "?state=active")) == {workers["running"].pk}
    # Asking for stopped ones through the status filter shows them, not an empty list.
    assert worker_rows(page(client_root, url + "?status__exact=stopped")) == {workers["stopped"].pk}


def test_prune_deletes_only_old_final_workers(workers: dict[str, Worker], settings) -> None:
    settings.WORKER_RETENTION_HOURS = 24
    old = timezone.now() - timedelta(hours=25)
    dep, node = workers["running"].deployment, workers["running"].node
    old_stopped = make_worker(dep, node, status="stopped")
    old_failed = make_worker(dep, node, status="failed")
    old_running = make_worker(dep, node, status="running")
    # updated_at is auto_now: set it past the retention with an UPDATE, as time passing would.
    Worker.objects.filter(pk__in=[old_stopped.pk, old_failed.pk, old_running.pk]).update(updated_at=old)
    assert prune_workers() == 2  # the Celery task beat runs hourly
    left = set(Worker.objects.values_list("pk", flat=True))
    assert left == {workers["running"].pk, workers["failed"].pk, workers["stopped"].pk, old_running.pk}
    assert prune_stopped_workers() == 0
    # A shorter retention takes the recent ones too, never the live ones.
    assert prune_stopped_workers(timedelta(0), now=timezone.now() + timedelta(seconds=1)) == 2
    assert set(Worker.objects.values_list("pk", flat=True)) == {workers["running"].pk, old_running.pk}


# ----------------------------------------------------------------------------- compact columns
def test_long_health_is_cut_with_the_whole_json_on_hover(client_root: Client) -> None:
    dep, node = make_deployment(), make_node()
    health = {"status": "healthy", "queue_depth": 3, "running": 1, "kv_usage": 0.5, "cpu_utilization": 0.2,
              "padding": "p" * 3000}
    worker = make_worker(dep, node, last_health=health)
    raw = client_root.get(reverse("admin:inference_worker_changelist")).content.decode()
    match = re.search(r'<span class="cell-clip" title="([^"]*)">healthy · queue 3 · running 1 · KV 50% · CPU 20%',
                      raw)
    assert match, raw
    title = html.unescape(match.group(1))
    text = html.unescape(raw)
    assert title.startswith('{"cpu_utilization": 0.2') and title.endswith("…") and len(title) == 1501
    assert f">127.0.0.1:{worker.port}</a>" in text  # the URL without its scheme
    assert "admin_lists.css" in text


def test_cpu_ranges() -> None:
    assert cpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert cpu_ranges([]) == "–" and cpu_ranges(None) == "–"
    assert cpu_ranges([3]) == "3"


def test_overlapping_pinning_is_warned(client_root: Client) -> None:
    dep = make_deployment(name="chat")
    node = make_node(name="n1")
    other_node = make_node(name="n2")
    first = make_worker(dep, node, role="decode", cpu_ids=[1])
    second = make_worker(dep, node, role="decode", cpu_ids=[1, 2])
    apart = make_worker(dep, node, role="prefill", cpu_ids=[3, 4])
    elsewhere = make_worker(dep, other_node, role="prefill", cpu_ids=[1])  # CPU 1 of another host
    make_worker(dep, node, status="stopped", cpu_ids=[3])  # no process: no overlap
    expected = f"CPU pinning overlaps: node n1: workers {first.pk} and {second.pk} are both pinned to CPU 1."
    text = page(client_root, reverse("admin:inference_worker_changelist"))
    assert expected in text
    assert text.count("CPU pinning overlaps") == 1
    assert '<span class="cpu-overlap"' in text and "⚠ 1-2" in text and "⚠ 1<" in text
    assert "⚠ 3-4" not in text and f">{apart.pk}</a>" in text and f">{elsewhere.pk}</a>" in text
    assert expected in page(client_root, reverse("admin:nodes_node_changelist"))
    Worker.objects.filter(pk=second.pk).update(cpu_ids=[2])
    assert "CPU pinning overlaps" not in page(client_root, reverse("admin:inference_worker_changelist"))


def test_deployment_page_loads_the_list_stylesheet(client_root: Client) -> None:
    dep = make_deployment(name="chat")
    text = page(client_root, reverse("admin:inference_deployment_change", args=[dep.pk]))
    assert "inference/admin_lists.css" in text
    css = client_root.get("/static/inference/admin_lists.css")
    assert css.status_code in (200, 404)  # served by runserver/whitenoise only; the finder below is what counts
    from django.contrib.staticfiles import finders

    found = finders.find("inference/admin_lists.css")
    assert found and "#rules-group fieldset.module" in open(found).read()
