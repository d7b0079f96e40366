"""The admin home's dashboard as a template tag: admin.site.index renders Django's stock index view, so
the dashboard's reads come in through `{% console_dashboard as dashboard %}` in templates/admin/index.html
rather than through a replaced AdminSite.
"""
from __future__ import annotations

from typing import Any

from django import template
from django.utils import timezone

from inference.selectors import dashboard

register = template.Library()


@register.simple_tag
def console_dashboard() -> dict[str, Any]:
    """Deployments with their roles' state and SLO state, node counts by status, recent scale events."""
    now = timezone.now()
    return {
        "now": now,
        "deployments": dashboard.deployment_states(now),
        "nodes": dashboard.node_counts(),
        "events": dashboard.recent_events(),
        "fresh_for_s": int(dashboard.FRESH_FOR.total_seconds()),
    }


@register.filter
def ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds ("–" for None): the console shows every latency in ms."""
    if seconds is None:
        return "–"
    return f"{seconds * 1000:.0f} ms"


@register.filter
def ratio(value: float | None) -> str:
    """A 0..1 ratio with two decimals ("–" for None), as the scaling rules' thresholds are written."""
    return "–" if value is None else f"{value:.2f}"
