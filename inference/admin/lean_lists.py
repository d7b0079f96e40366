"""What the long lists (workers, nodes) pay per row or per related object, made cheap with the same output.

At 1,000 workers on 100 nodes (Zen 5, bench/sim/page_timing.py) a worker list page spent, besides its
query: a template render of the action checkbox widget for each of its 100 rows, and for the deployment and
node filters every Deployment and Node row loaded whole (a node's last heartbeat blob decoded, 100 of them)
to show their names.
"""
from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin import helpers
from django.db.models import Model
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _


class NamedRelatedFilter(admin.RelatedFieldListFilter):
    """A filter by a related model whose objects are shown by their `name` (Node, Deployment): the choices
    read (pk, name) only, in the related admin's ordering, instead of every column of every row."""

    def field_choices(self, field: Any, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[Any, str]]:
        """(pk, name) of every related object, ordered as the related admin orders them (else by name)."""
        ordering = self.field_admin_ordering(field, request, model_admin) or ("name",)
        rows = field.remote_field.model._default_manager.order_by(*ordering).values_list("pk", "name")
        return [(pk, str(name)) for pk, name in rows]


class LeanActionCheckbox:
    """A ModelAdmin mixin: each row's action checkbox written directly, as CheckboxInput renders it
    (ModelAdmin.action_checkbox), instead of through the widget's template (100 renders a page)."""

    def action_checkbox(self, obj: Model) -> SafeString:
        """The row's checkbox for the list's actions."""
        label = format_html(_("Select this object for an action - {}"), str(obj))
        return format_html('<input type="checkbox" name="{}" value="{}" class="action-select" aria-label="{}">',
                           helpers.ACTION_CHECKBOX_NAME, str(obj.pk), label)  # fmt: skip
