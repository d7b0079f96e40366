"""Read-only inlines drawn as a plain table: the rows Django's tabular inline shows (same columns, cells,
classes and links), without a form per row.

The deployment page's live workers (50 rows) and recent events (20) cost 55-70 ms and 25-35 ms of its
~140 ms of CPU at 1,000 workers (Zen 5, bench/sim/page_timing.py): a model form per row with two hidden
inputs each rendered through the widget templates, then every cell through the inline template's
fieldset / line / field loops. These inlines are never edited, so their formset has no forms at all, bound
or not (a submitted deployment page binds none of their rows: rows that appeared after the page was
rendered, an autoscaling event or a rule added meanwhile, cannot disturb its save), and the rows are drawn
once in Python with the cell rules of django.contrib.admin.helpers.AdminReadonlyField.
"""
from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.templatetags.admin_list import _boolean_icon
from django.contrib.admin.utils import display_for_field, help_text_for_field, label_for_field, quote
from django.core.exceptions import ObjectDoesNotExist
from django.db.models import Model, QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest
from django.template.defaultfilters import capfirst, linebreaksbr
from django.templatetags.static import static
from django.urls import NoReverseMatch, reverse
from django.utils.html import conditional_escape, format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext


class TableFormSet(BaseInlineFormSet):
    """A formset of no forms, bound or not, whose rows (`table_rows()`, the queryset by default) the
    template draws through its inline's `ReadOnlyTableInline.table_head` / `table_body`."""

    table_inline: ReadOnlyTableInline  # set by ReadOnlyTableInline.get_formset

    def initial_form_count(self) -> int:
        """No forms: the rows are drawn from the queryset (table_body)."""
        return 0

    def total_form_count(self) -> int:
        """No forms, not even on a submitted page: nothing here is edited."""
        return 0

    def table_rows(self) -> QuerySet:
        """The objects shown (subclasses cap and order them)."""
        return self.get_queryset()

    def table_head(self) -> SafeString:
        """The header cells."""
        return self.table_inline.table_head()

    def table_body(self) -> SafeString:
        """The rows, each as Django's tabular inline draws a read-only row."""
        return self.table_inline.table_body(self.prefix, self.table_rows())


class ReadOnlyTableInline(admin.TabularInline):
    """A tabular inline shown, never edited: no add, change or delete; `fields` are its columns (all
    read-only), drawn by templates/admin/inference/edit_inline/readonly_table.html."""

    template = "admin/inference/edit_inline/readonly_table.html"
    formset = TableFormSet
    extra = 0
    max_num = 0
    can_delete = False

    def get_formset(self, request: HttpRequest, obj: Any = None, **kwargs: Any) -> Any:
        """The formset class, told which inline draws its rows (a class per request, as Django's is)."""
        formset = super().get_formset(request, obj, **kwargs)
        return type(formset.__name__, (formset,), {"table_inline": self})

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Shown only."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Shown only."""
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Shown only."""
        return False

    def table_head(self) -> SafeString:
        """One header cell per column, as the tabular inline labels a read-only field (help text as its icon)."""
        cells = []
        for name in self.fields or ():
            label = capfirst(label_for_field(name, self.model, self))
            help_text = help_text_for_field(name, self.model)
            icon = format_html(
                '<img src="{}" class="help help-tooltip" width="10" height="10" alt="({})" title="{}">',
                static("admin/img/icon-unknown.svg"), help_text, help_text,
            ) if help_text else ""  # fmt: skip
            cells.append(format_html('<th class="column-{}">{}{}</th>', name, label, icon))
        return format_html('<th class="original"></th>{}<th></th>', mark_safe("".join(cells)))

    def table_body(self, prefix: str, rows: QuerySet) -> SafeString:
        """The rows: the object's name (and its page's link), then a cell per column."""
        links: dict[tuple[str, Any], str] = {}  # the pages linked to, reversed once per object
        columns = [(name, *self._column(name)) for name in self.fields or ()]
        return format_html_join(
            "\n", '<tr class="form-row has_original" id="{}-{}"><td class="original"><p>{}{}</p></td>{}'
            '<td class="delete"></td></tr>',
            ((prefix, index, str(obj), self._change_link(obj, links),
              mark_safe("".join(self._cell(column, obj, links) for column in columns)))
             for index, obj in enumerate(rows)),
        )  # fmt: skip

    def _column(self, name: str) -> tuple[Any, Any]:
        """(model field or None, the inline's column method or None) for a column name, as lookup_field
        finds them (a method of the inline first, else the model's field)."""
        method = getattr(self, name, None)
        if callable(method):
            return None, method
        return self.opts.get_field(name), None

    def _url(self, meta: Any, pk: Any, links: dict[tuple[str, Any], str]) -> str:
        key = (meta.label, pk)
        if key not in links:
            links[key] = reverse(f"admin:{meta.app_label}_{meta.model_name}_change", args=[quote(pk)],
                                 current_app=self.admin_site.name)  # fmt: skip
        return links[key]

    def _change_link(self, obj: Model, links: dict[tuple[str, Any], str]) -> SafeString | str:
        """The "View" link to the object's own page, where the inline asks for one."""
        if not (self.show_change_link and self.has_registered_model):
            return ""
        return format_html(' <a href="{}" class="inlineviewlink">{}</a>', self._url(self.opts, obj.pk, links),
                           gettext("View"))  # fmt: skip

    def _cell(self, column: tuple[str, Any, Any], obj: Model, links: dict[tuple[str, Any], str]) -> str:
        """One cell, as helpers.AdminReadonlyField.contents shows a read-only field: a column method's value
        (HTML kept, text escaped with its line breaks), a related object as a link to its page, a model field
        through display_for_field."""
        name, field, method = column
        if method is not None:
            value = method(obj)
            if getattr(method, "boolean", False):
                shown: Any = _boolean_icon(value)
            else:
                shown = value if hasattr(value, "__html__") else linebreaksbr(value)
        else:
            try:
                value = getattr(obj, name)
            except (AttributeError, ObjectDoesNotExist):  # a related row gone: shown empty, as the admin does
                return f'<td class="field-{name}"><p>{conditional_escape(self.get_empty_value_display())}</p></td>'
            if (field.many_to_one or field.one_to_one) and value is not None:
                shown = self._related_link(value, links)
            else:
                shown = display_for_field(value, field, self.get_empty_value_display())
            shown = linebreaksbr(shown)
        return f'<td class="field-{name}"><p>{conditional_escape(shown)}</p></td>'

    def _related_link(self, value: Model, links: dict[tuple[str, Any], str]) -> SafeString | str:
        try:
            url = self._url(value._meta, value.pk, links)
        except NoReverseMatch:
            return str(value)
        return format_html('<a href="{}">{}</a>', url, value)
