"""Scaling rule saves: a changed condition restarts the rule's breach timer and window.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from inference.models import (
    ScalingRule,
)

logger = logging.getLogger(__name__)

# Fields whose change makes a threshold rule's ongoing breach meaningless.
_RULE_CONDITION_FIELDS = {"kind", "role", "threshold", "comparison", "duration_s", "enabled", "deployment"}


def save_rule(rule: ScalingRule, *, changed_fields: Iterable[str] | None = None) -> ScalingRule:
    """Create or update a scaling rule (already validated with its `clean()`).

    When the rule's condition changes, its breach timer restarts: a breach measured against the
    old threshold must not trigger the new rule early.
    """
    changed = None if changed_fields is None else set(changed_fields)
    if rule.pk is not None and (changed is None or changed & _RULE_CONDITION_FIELDS):
        rule.breach_started_at = None
        rule.observations = []  # its window too (a changed kind reads another unit)
    rule.save()
    return rule


def update_rule(rule: ScalingRule, changes: Mapping[str, Any]) -> ScalingRule:
    """Apply `changes` to a rule, validate it (model `clean()` included) and save it.

    Raises django.core.exceptions.ValidationError naming the fields at fault.
    """
    for field, value in changes.items():
        setattr(rule, field, value)
    rule.full_clean()
    return save_rule(rule, changed_fields=changes.keys())
