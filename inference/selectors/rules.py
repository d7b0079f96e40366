"""Scaling rules as operators read them: the signal each kind reads, its condition in words and one unit per
quantity (latencies in milliseconds, although a TTFT rule stores its target in seconds and an ITL rule in
milliseconds, as inference.scaling reads them), a rule's recent readings, and whether it holds or breaches now.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from django.utils import timezone

from inference.models import SLO_ROLES, Comparison, RuleKind, ScalingRule
from inference.selectors import schedules

# Short names of the kinds (the model's choice labels predate the console's one unit for latencies).
KIND_LABELS: dict[str, str] = {
    "threshold": "Threshold", "ttft_slo": "SLO: TTFT p90", "itl_slo": "SLO: ITL p90", "schedule": "Schedule",
}
# What each windowed kind compares, as inference.scaling.signals computes it.
SIGNALS: dict[str, str] = {
    "threshold": "load",
    "ttft_slo": "TTFT p90",
    "itl_slo": "ITL p90",
}
SIGNAL_HELP: dict[str, str] = {
    "threshold": (
        "the role's load, a ratio from 0 to 1: decode (running + queued) / batch size; prefill the largest of "
        "its batch fill, busy share and queueing wait, averaged over the role's running workers"
    ),
    "ttft_slo": "p90 time to first token over the decode workers' last 30 s, in ms",
    "itl_slo": "p90 inter-token latency over the decode workers' last 30 s, in ms",
}
# A rule's stored threshold times this is the number shown: load as the ratio the guide writes ("load > 0.8"),
# both latencies in ms.
DISPLAY_SCALE: dict[str, float] = {"threshold": 1.0, "ttft_slo": 1000.0, "itl_slo": 1.0}
DISPLAY_UNIT: dict[str, str] = {"threshold": "", "ttft_slo": "ms", "itl_slo": "ms"}


def shown(kind: str, value: float | None) -> str:
    """A reading or threshold of a rule of `kind` in its display unit: "0.70", "2000 ms" ("–" for None)."""
    if value is None:
        return "–"
    number = value * DISPLAY_SCALE.get(kind, 1.0)
    if kind == RuleKind.THRESHOLD:
        return f"{number:.2f}"
    text = f"{number:.0f}" if abs(number) >= 10 or number == int(number) else f"{number:.2g}"
    return f"{text} ms"


def kind_label(rule: ScalingRule) -> str:
    """The rule's kind in a few words ("SLO: TTFT p90")."""
    return KIND_LABELS.get(rule.kind, rule.kind)


def seconds_text(seconds: int) -> str:
    """Whole seconds as "45 s", "5 min", "1 h 30 min"."""
    if seconds < 60 or seconds % 60:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, rest = divmod(minutes, 60)
    return f"{hours} h {rest:02d} min" if rest else f"{hours} h"


def signal_name(rule: ScalingRule) -> str:
    """The signal a rule reads, with its role: "decode load", "TTFT p90 (decode workers)", "schedule"."""
    if rule.kind == RuleKind.THRESHOLD:
        return f"{rule.role} load"
    if rule.kind in SLO_ROLES:
        return f"{SIGNALS[rule.kind]} (decode workers)"
    return "time of day"


def active_now(rule: ScalingRule, now: datetime | None = None) -> bool:
    """Whether an enabled schedule rule's window contains now (in settings.TIME_ZONE)."""
    if rule.kind != RuleKind.SCHEDULE or not rule.enabled or rule.start_time is None or rule.end_time is None:
        return False
    return schedules.in_window(rule.start_time, rule.end_time, schedules.local_time(now or timezone.now()))


def describe(rule: ScalingRule, now: datetime | None = None) -> str:
    """The rule in words, naming its signal and units, e.g. "decode load above 0.70 for 1 min → +1 decode
    (cooldown 5 min)", "TTFT p90 (decode workers) ≤ 2000 ms, else +1 prefill after 1 min (cooldown 5 min)",
    "22:00–07:00 (UTC): decode = 1 · active now"."""
    if rule.kind == RuleKind.SCHEDULE:
        text = f"{schedules.window_text(rule) or '?–?'}: {rule.role} = {rule.target_replicas}"
        return f"{text} · active now" if active_now(rule, now) else text
    after = f"{seconds_text(rule.duration_s)}"
    cooldown = f"(cooldown {seconds_text(rule.cooldown_s)})"
    if rule.kind in SLO_ROLES:
        return (
            f"{signal_name(rule)} ≤ {shown(rule.kind, rule.threshold)}, else {rule.step:+d} {rule.role} "
            f"after {after} {cooldown}"
        )
    word = "below" if rule.comparison == Comparison.BELOW else "above"
    return (
        f"{signal_name(rule)} {word} {shown(rule.kind, rule.threshold)} for {after} → {rule.step:+d} {rule.role} "
        f"{cooldown}"
    )


@dataclass(frozen=True)
class Reading:
    """One evaluation of a windowed rule: when, and what it read (None: no worker reported)."""

    at: datetime
    value: float | None
    text: str
    breaching: bool


def readings(rule: ScalingRule) -> list[Reading]:
    """The rule's stored window (`observations`: [epoch seconds, value or null]), oldest first, each in the
    rule's display unit and marked when on the wrong side of the threshold; malformed entries are skipped."""
    out: list[Reading] = []
    for item in rule.observations if isinstance(rule.observations, list) else []:
        try:
            at, value = item
            moment = datetime.fromtimestamp(float(at), tz=UTC)
            number = None if value is None else float(value)
        except (TypeError, ValueError):
            continue
        out.append(Reading(at=moment, value=number, text=shown(rule.kind, number), breaching=breaches(rule, number)))
    return sorted(out, key=lambda r: r.at)


def breaches(rule: ScalingRule, value: float | None) -> bool:
    """Whether a reading is on the rule's wrong side of its threshold (SLO rules: above the target)."""
    if value is None or rule.threshold is None:
        return False
    if rule.kind == RuleKind.THRESHOLD and rule.comparison == Comparison.BELOW:
        return value < rule.threshold
    return value > rule.threshold


def state(rule: ScalingRule, now: datetime | None = None) -> str:
    """"active now" / "inactive" for a schedule rule; for a windowed one "breaching" (its latest reading
    breaches), "ok", or "no reading" (none yet, or the latest was empty); "disabled" when off."""
    if not rule.enabled:
        return "disabled"
    if rule.kind == RuleKind.SCHEDULE:
        return "active now" if active_now(rule, now) else "inactive"
    window = readings(rule)
    if not window or window[-1].value is None:
        return "no reading"
    return "breaching" if window[-1].breaching else "ok"
