"""The columns that show a scaling rule in words, shared by the rules list and the deployment page's
rules table (inline), so both say the same thing in the same way."""
from __future__ import annotations

from django.contrib import admin
from django.utils.html import format_html
from django.utils.safestring import SafeString

from inference.models import ScalingRule
from inference.selectors import rules as rule_selectors


class RuleInWords:
    """Admin columns: the rule's kind, its condition naming the signal it reads, and its state now."""

    @admin.display(description="kind", ordering="kind")
    def kind_name(self, rule: ScalingRule) -> str:
        """The kind in a few words."""
        return rule_selectors.kind_label(rule)

    @admin.display(description="rule")
    def condition(self, rule: ScalingRule) -> str:
        """The rule in words, naming the signal it reads and its units."""
        return rule_selectors.describe(rule)

    @admin.display(description="state now")
    def state_now(self, rule: ScalingRule) -> SafeString:
        """Active now / inactive (schedule), breaching / ok / no reading (windowed), disabled."""
        state = rule_selectors.state(rule)
        return format_html('<span class="rule-state rule-{}">{}</span>', state.replace(" ", "-"), state)
