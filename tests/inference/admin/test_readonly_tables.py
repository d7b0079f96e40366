"""The read-only tables of the deployment and node pages (live workers, recent events) show exactly the rows
Django's own tabular inline showed, without a form per row; the long lists' lean parts (action checkbox,
related filters, CPU overlaps) give what Django's and the controller's own code give."""
from __future__ import annotations

import random
import re
from datetime import time
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.admin.options import ModelAdmin
from django.forms.models import BaseInlineFormSet
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.actions import scale as scale_actions
from inference.admin.deployment_inlines import (
    DeploymentWorkerInline,
    RecentEventsFormSet,
    ScaleEventInline,
    ScalingRuleInline,
)
from inference.admin.lean_lists import NamedRelatedFilter
from inference.admin.readonly_tables import TableFormSet
from inference.admin.workers import FirstLiveWorkersFormSet, WorkerInline
from inference.controller.pinning import PINNED_STATUSES, cpu_overlaps, live_cpu_overlaps
from inference.models import Deployment, ScaleEvent, ScalingRule, Worker
from nodes.models import Node
from tests.support.control_plane import make_deployment, make_node, make_worker

pytestmark = pytest.mark.django_db

STOCK_TEMPLATE = "admin/edit_inline/tabular.html"


class StockWorkers(FirstLiveWorkersFormSet):
    """The same rows as Django's formset: a form per row."""

    initial_form_count = BaseInlineFormSet.initial_form_count
    total_form_count = BaseInlineFormSet.total_form_count


class StockEvents(RecentEventsFormSet):
    """The same rows as Django's formset: a form per row."""

    initial_form_count = BaseInlineFormSet.initial_form_count
    total_form_count = BaseInlineFormSet.total_form_count


def _group(page: str, prefix: str) -> str:
    """The inline's rows, normalised: hidden inputs (the stock forms' ids) and whitespace dropped; ages
    ("12s ago") may differ by the time between two renders."""
    start = page.index(f'id="{prefix}-group"')
    body = page[page.index("<tbody>", start):page.index("</tbody>", start)]
    body = re.sub(r'<input type="hidden"[^>]*>', "", body)
    body = re.sub(r"\d+s ago", "Ns ago", body)
    return re.sub(r"\s+", "", body)


@pytest.fixture
def deployment() -> Deployment:
    """A deployment with live, starting and stopped workers on two nodes, and events by a rule and by hand
    (one refused)."""
    dep = make_deployment(name="chat")
    nodes = [make_node(name="n-a", last_heartbeat=timezone.now()), make_node(name="n-b")]
    for k in range(7):
        make_worker(dep, nodes[k % 2], role="decode" if k % 3 else "prefill", last_seen=timezone.now(),
                    status="starting" if k == 4 else "running", last_error="boom\nline two" if k == 1 else "")
    make_worker(dep, nodes[0], status="stopped")
    rule = ScalingRule.objects.create(deployment=dep, name="hot", kind="threshold", role="decode", threshold=0.7,
                                      last_triggered_at=timezone.now())  # fmt: skip
    ScalingRule.objects.create(deployment=dep, name="night <b>", kind="schedule", role="decode", enabled=False,
                               start_time=time(22), end_time=time(6), target_replicas=2)  # fmt: skip
    scale_actions.scale_deployment(dep, "decode", 3, source="manual", reason="seed <b>bold</b>\nsecond line")
    ScaleEvent.objects.create(deployment=dep, role="decode", from_replicas=3, to_replicas=4, source="rule", rule=rule,
                              reason="load high", time_to_run_s=12.5)  # fmt: skip
    ScaleEvent.objects.create(deployment=dep, role="prefill", from_replicas=1, to_replicas=2, source="manual",
                              refused=True, reason="no node")  # fmt: skip
    return dep


class StockRules(TableFormSet):
    """The same rows as Django's formset: a form per row."""

    initial_form_count = BaseInlineFormSet.initial_form_count
    total_form_count = BaseInlineFormSet.total_form_count


@pytest.mark.parametrize(("inline", "stock", "prefix"), [
    (DeploymentWorkerInline, StockWorkers, "workers"), (ScaleEventInline, StockEvents, "scale_events"),
    (ScalingRuleInline, StockRules, "rules"),
])  # fmt: skip
def test_deployment_tables_show_what_the_tabular_inline_showed(
    client_root: Client, deployment: Deployment, monkeypatch: pytest.MonkeyPatch, inline: Any, stock: Any,
    prefix: str,
) -> None:
    url = reverse("admin:inference_deployment_change", args=[deployment.pk])
    page = client_root.get(url).content.decode()
    assert f'name="{prefix}-TOTAL_FORMS" value="0"' in page and f'name="{prefix}-0-id"' not in page  # no forms
    monkeypatch.setattr(inline, "template", STOCK_TEMPLATE)
    monkeypatch.setattr(inline, "formset", stock)
    before = client_root.get(url).content.decode()
    assert f'name="{prefix}-0-id"' in before  # Django's inline: a form per row
    assert _group(page, prefix) == _group(before, prefix)
    rows = _group(page, prefix).count("<trclass=")
    assert rows == {"workers": 7, "scale_events": 3, "rules": 2}[prefix]  # the stopped worker is not listed


def test_node_page_workers_table(client_root: Client, deployment: Deployment, monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node.objects.get(name="n-a")
    url = reverse("admin:nodes_node_change", args=[node.pk])
    page = client_root.get(url).content.decode()
    assert f'<a href="/admin/inference/deployment/{deployment.pk}/change/">chat</a>' in page
    monkeypatch.setattr(WorkerInline, "template", STOCK_TEMPLATE)
    monkeypatch.setattr(WorkerInline, "formset", StockWorkers)
    assert _group(page, "workers") == _group(client_root.get(url).content.decode(), "workers")


def test_deployment_page_saves_with_its_tables(client_root: Client, deployment: Deployment) -> None:
    """The tables bind nothing on a submitted page: the management forms of 0 forms validate."""
    url = reverse("admin:inference_deployment_change", args=[deployment.pk])
    page = client_root.get(url)
    form = page.context["adminform"].form
    data = {k: v for k, v in form.initial.items() if v is not None and k not in ("created_at", "updated_at")}
    data.update({f"initial-{r}_replicas": deployment.replicas(r) for r in ("prefill", "decode", "both")})
    data["batch_size"] = 9
    for formset in page.context["inline_admin_formsets"]:
        management = formset.formset.management_form
        data.update({management.add_prefix(k): v for k, v in management.initial.items()})
        if formset.formset.prefix == "routers":
            data["routers-TOTAL_FORMS"] = data["routers-INITIAL_FORMS"] = 0
    saved = client_root.post(url, data)
    assert saved.status_code == 302, saved.context["adminform"].form.errors if saved.context else ""
    assert Deployment.objects.get(pk=deployment.pk).batch_size == 9
    assert Worker.objects.filter(deployment=deployment).count() == 8  # nothing of the tables touched


def test_action_checkbox_is_the_widget_s(deployment: Deployment) -> None:
    worker_admin = admin.site._registry[Worker]
    worker = Worker.objects.select_related("deployment", "node").first()
    assert worker_admin.action_checkbox(worker) == ModelAdmin.action_checkbox(worker_admin, worker)


def test_worker_list_filters_name_every_node_and_deployment(client_root: Client, deployment: Deployment) -> None:
    field = Worker._meta.get_field("node")
    request = client_root.get(reverse("admin:inference_worker_changelist")).wsgi_request
    lean = NamedRelatedFilter(field, request, {}, Worker, admin.site._registry[Worker], "node")
    stock = admin.RelatedFieldListFilter(field, request, {}, Worker, admin.site._registry[Worker], "node")
    assert lean.lookup_choices == stock.lookup_choices and [name for _, name in lean.lookup_choices] == ["n-a", "n-b"]
    other = make_deployment(name="batch")  # a filter of one choice is not shown
    page = client_root.get(reverse("admin:inference_worker_changelist")).content.decode()
    assert f'deployment__id__exact={other.pk}">batch</a>' in page
    assert f'node__id__exact={Node.objects.get(name="n-b").pk}">n-b</a>' in page


def test_live_overlaps_are_those_of_every_pinned_worker() -> None:
    """The lean reading finds what cpu_overlaps finds over the workers' rows, on random pinnings."""
    rng = random.Random(7)
    dep = make_deployment()
    nodes = [make_node(allow_cpu_oversubscription=bool(k % 2)) for k in range(3)]
    for k in range(40):
        cpus = rng.sample(range(12), rng.randint(0, 3))
        status = rng.choice(["running", "running", "starting", "unhealthy", "stopped", "failed"])
        make_worker(dep, nodes[k % 3], cpu_ids=[str(c) if k % 5 == 0 else c for c in cpus], status=status)
    every = Worker.objects.filter(status__in=PINNED_STATUSES).select_related("node")
    expected = sorted(cpu_overlaps(every), key=lambda o: (o.node_name, o.first, o.second))
    found = sorted(live_cpu_overlaps(), key=lambda o: (o.node_name, o.first, o.second))
    assert found == expected and len(found) > 5
