"""The inference app's admin, one module per page; importing this package registers every ModelAdmin.

- `deployments`: served models and deployments (rules, events and workers inline, scale actions, charts);
- `deployment_inlines`: what the deployment page shows inside it;
- `nodes`: nodes (status, resources, drain / activate / offline); `workers`: the live worker list, restart;
- `scaling`: scaling rules, overrides, scale events; `samples`: metric samples (read-only);
- `display`: badges, ages, health and resource summaries shared by the pages;
- `api_keys`: generation API keys (secret shown once, limits, revoke, usage chart and CSV).
The admin home is the operator's dashboard (templates/admin/index.html, reads in
inference.selectors.dashboard), and "View site" leads there: the platform has no other site to view (`/`
answers 404).
State changes go through inference.actions, reads through inference.selectors.
"""
from django.contrib import admin
from django.urls import reverse_lazy

from inference.admin import api_keys, deployments, nodes, samples, scaling, workers

admin.site.site_url = reverse_lazy("admin:index")  # type: ignore[assignment]

__all__ = ["api_keys", "deployments", "nodes", "samples", "scaling", "workers"]
