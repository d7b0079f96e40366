"""Admin page of generation API keys: create (the secret shown once), limits, revoke, usage chart and CSV.

Adding a key answers with a page that shows its secret, rendered into that response only (never put
in a message, the session or a log): once the operator leaves it, only the prefix is left. The usage
page draws requests and tokens per minute as server-side SVG bars (no script needed) and links the
CSV export of every usage row.
"""
from __future__ import annotations

import csv
from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html

from inference.actions import api_keys as key_actions
from inference.admin.usage_chart import bar_chart
from inference.models import ApiKey
from inference.selectors import api_keys as key_selectors

USAGE_WINDOWS = {"60": "1 hour", "360": "6 hours", "1440": "24 hours", "10080": "7 days"}


class ApiKeyForm(forms.ModelForm):
    """The add and change form (the secret and its hash are never fields)."""

    class Meta:
        model = ApiKey
        fields = ["name", "owner", "deployments", "priority", "requests_per_minute", "tokens_per_minute",
                  "max_concurrent", "expires_at"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """API keys: list with state and limits, add (secret shown once), revoke, usage page."""

    form = ApiKeyForm
    list_display = ["name", "prefix_shown", "owner", "priority", "limits", "state", "created_at", "usage_link"]
    list_filter = ["priority", "revoked_at"]
    search_fields = ["name", "prefix", "owner__username"]
    filter_horizontal = ["deployments"]
    actions = ["revoke_selected"]
    readonly_fields = ["prefix", "revoked_at", "created_at"]

    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        """The form's fields, plus prefix and state on an existing key."""
        fields = list(ApiKeyForm.Meta.fields)
        return fields if obj is None else ["prefix", *fields, "revoked_at", "created_at"]

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        """A new key is owned by whoever creates it unless they pick someone else."""
        return {"owner": request.user.pk, **super().get_changeform_initial_data(request)}

    @admin.display(description="key", ordering="prefix")
    def prefix_shown(self, key: ApiKey) -> str:
        """The key's recognisable start."""
        return f"{key.prefix}…"

    @admin.display(description="limits")
    def limits(self, key: ApiKey) -> str:
        """Requests/min, tokens/min, concurrent (— for none)."""
        def show(value: int | None) -> str:
            return "—" if value is None else f"{value:,}"
        return (f"{show(key.requests_per_minute)} req/min · {show(key.tokens_per_minute)} tok/min · "
                f"{show(key.max_concurrent)} concurrent")

    @admin.display(description="state")
    def state(self, key: ApiKey) -> str:
        """Active, expired or revoked."""
        if key.revoked_at is not None:
            return format_html('<span class="api-key-revoked">revoked {}</span>', f"{key.revoked_at:%Y-%m-%d %H:%M}")
        if not key.is_active:
            return format_html('<span class="api-key-expired">{}</span>', "expired")
        return format_html('<span class="api-key-active">{}</span>', "active")

    @admin.display(description="usage")
    def usage_link(self, key: ApiKey) -> str:
        """Link to the key's usage page."""
        return format_html('<a href="{}">usage</a>', reverse("admin:inference_apikey_usage", args=[key.pk]))

    @admin.action(description="Revoke selected API keys")
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        """Revoke each selected key (routers refuse them within seconds)."""
        count = 0
        for key in queryset:
            if key.revoked_at is None:
                key_actions.revoke_key(key)
                count += 1
        self.message_user(request, f"Revoked {count} API key(s); routers refuse them within seconds.",
                          messages.SUCCESS)

    # ------------------------------------------------------------------ saving

    def save_model(self, request: HttpRequest, obj: ApiKey, form: forms.ModelForm, change: bool) -> None:
        """A new key gets its secret from the action (kept on the request for `response_add` only);
        a change goes through `update_key`."""
        if change:
            changes = {name: form.cleaned_data[name] for name in form.changed_data if name != "deployments"}
            key_actions.update_key(obj, changes)
            return
        fields = {name: form.cleaned_data[name] for name in
                  ("priority", "requests_per_minute", "tokens_per_minute", "max_concurrent", "expires_at")}
        created = key_actions.create_key(name=obj.name, owner=obj.owner, deployments=(), **fields)
        obj.pk = created.key.pk
        obj.prefix, obj.secret_hash = created.key.prefix, created.key.secret_hash
        obj._state.adding = False
        obj._state.db = created.key._state.db
        request._created_api_key_secret = created.secret  # type: ignore[attr-defined]

    def save_related(self, request: HttpRequest, form: forms.ModelForm, formsets: Any, change: bool) -> None:
        """Deployments are saved by the form; the routers are told through `updated_at`."""
        super().save_related(request, form, formsets, change)
        ApiKey.objects.filter(pk=form.instance.pk).update(updated_at=timezone.now())

    def response_add(self, request: HttpRequest, obj: ApiKey, post_url_continue: str | None = None) -> HttpResponse:
        """The page that shows the new key's secret, this once."""
        secret = getattr(request, "_created_api_key_secret", None)
        if secret is None:  # pragma: no cover - save_model always sets it
            return super().response_add(request, obj, post_url_continue)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "original": obj,
            "title": f"API key {obj.name} created",
            "secret": secret,
            "change_url": reverse("admin:inference_apikey_change", args=[obj.pk]),
            "usage_url": reverse("admin:inference_apikey_usage", args=[obj.pk]),
        }
        response = TemplateResponse(request, "admin/inference/apikey/created.html", context)
        response["Cache-Control"] = "no-store"  # the secret must not stay in a browser or proxy cache
        return response

    # ------------------------------------------------------------------ usage

    def get_urls(self) -> list[URLPattern]:
        """Adds <id>/usage/ (chart page) and <id>/usage.csv (every row)."""
        extra = [
            path("<path:object_id>/usage/", self.admin_site.admin_view(self.usage_view),
                 name="inference_apikey_usage"),
            path("<path:object_id>/usage.csv", self.admin_site.admin_view(self.usage_csv_view),
                 name="inference_apikey_usage_csv"),
        ]
        return extra + list(super().get_urls())

    def _viewable(self, request: HttpRequest, object_id: str) -> ApiKey:
        key = get_object_or_404(ApiKey, pk=object_id)
        if not self.has_view_or_change_permission(request, key):
            raise PermissionDenied
        return key

    def usage_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Requests, tokens, errors and 429s per minute over a window (`?minutes=`, default 60)."""
        key = self._viewable(request, object_id)
        window = request.GET.get("minutes", "60")
        if window not in USAGE_WINDOWS:
            return HttpResponseRedirect(reverse("admin:inference_apikey_usage", args=[key.pk]))
        rows = key_selectors.usage_per_minute(key, timezone.now() - timedelta(minutes=int(window)))
        totals = {name: sum(int(r[name] or 0) for r in rows)
                  for name in ("requests", "prompt_tokens", "completion_tokens", "errors", "rejected")}
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "original": key,
            "title": f"Usage of {key.name}",
            "windows": USAGE_WINDOWS,
            "window": window,
            "rows": rows,
            "totals": totals,
            "requests_chart": bar_chart(rows, ["requests", "errors", "rejected"], "requests per minute"),
            "tokens_chart": bar_chart(rows, ["prompt_tokens", "completion_tokens"], "tokens per minute"),
            "csv_url": reverse("admin:inference_apikey_usage_csv", args=[key.pk]),
        }
        return TemplateResponse(request, "admin/inference/apikey/usage.html", context)

    def usage_csv_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Every usage row of the key (minute, deployment, counts, users) as CSV."""
        key = self._viewable(request, object_id)
        response = HttpResponse(content_type="text/csv")
        response["Content-Disposition"] = f'attachment; filename="usage-{key.prefix}.csv"'
        writer = csv.writer(response)
        writer.writerow(["minute", "deployment", "requests", "prompt_tokens", "completion_tokens", "errors",
                         "rejected", "users"])
        for row in key_selectors.usage_rows(key):
            writer.writerow([row.minute.isoformat(), row.deployment, row.requests, row.prompt_tokens,
                             row.completion_tokens, row.errors, row.rejected, " ".join(row.users)])
        return response
