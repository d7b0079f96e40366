"""One form per kind of scaling rule, each with only the fields its kind reads, help text and units:

- threshold: the role's load (a ratio, as the guide writes "load > 0.8") compared over a window, a step;
- SLO: a p90 latency target in milliseconds for TTFT and ITL alike (the rule stores TTFT in seconds, as
  inference.scaling reads it; the form converts), the role follows from the latency (TTFT adds prefill,
  ITL adds decode), scale-out only;
- schedule: a window in settings.TIME_ZONE (named beside the times) and the replicas it holds.

Each form sets the fields its kind fixes (kind, role, comparison) before the model's own `clean()` runs, and
checks the fields it shows itself, so the model never reports an error on a field the form does not have.
"""
from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.core.validators import MinValueValidator

from inference.models import SLO_ROLES, ScalingRule
from inference.selectors import rules as rule_selectors

WINDOW_HELP = (
    "seconds the condition must hold: the rule judges all its readings of this window together (80 % of them "
    "must breach), so one stray reading neither fires nor resets it"
)
COOLDOWN_HELP = "seconds to wait after the rule fired before it may fire again"


class RuleForm(forms.ModelForm):
    """Common base: the kind the form edits, and the labels of the fields every windowed kind shares."""

    KIND: str = ""

    class Meta:
        model = ScalingRule
        fields: list[str] = []
        labels = {"duration_s": "Window (s)", "cooldown_s": "Cooldown (s)", "enabled": "Enabled"}
        help_texts = {"duration_s": WINDOW_HELP, "cooldown_s": COOLDOWN_HELP}

    def fix_kind_fields(self, data: dict[str, Any]) -> None:
        """Set the instance's fields the kind fixes (before the model's clean())."""
        self.instance.kind = self.KIND

    def clean(self) -> dict[str, Any]:
        """The kind's fixed fields first, so the model's clean() judges the rule as it will be saved."""
        data = super().clean() or {}
        self.fix_kind_fields(data)
        return data


class ThresholdRuleForm(RuleForm):
    """A threshold rule: the role's load against a ratio over a window, then a step."""

    KIND = "threshold"

    class Meta(RuleForm.Meta):
        fields = ["deployment", "name", "role", "enabled", "comparison", "threshold", "duration_s", "cooldown_s",
                  "step"]  # fmt: skip
        labels = {**RuleForm.Meta.labels, "threshold": "Load threshold (ratio 0–1)", "step": "Step (replicas)"}
        help_texts = {
            **RuleForm.Meta.help_texts,
            "threshold": f"the signal: {rule_selectors.SIGNAL_HELP['threshold']}; e.g. 0.8",
            "comparison": "above: scale when the load is over the threshold (scale out); below: under it (scale in)",
            "step": "replicas to add when the rule fires (negative removes), within the deployment's min and max",
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["threshold"].required = True
        self.fields["threshold"].validators.append(MinValueValidator(0.0))

    def clean_step(self) -> int:
        """A step of 0 would fire and change nothing."""
        step = int(self.cleaned_data["step"])
        if step == 0:
            raise forms.ValidationError("step must not be 0: positive adds replicas, negative removes them")
        return step


SLO_KIND_CHOICES = [
    ("ttft_slo", "TTFT p90 (time to first token): adds prefill workers"),
    ("itl_slo", "ITL p90 (inter-token latency): adds decode workers"),
]


class SloRuleForm(RuleForm):
    """An SLO rule: a p90 latency target in milliseconds; the role is the one that limits the latency."""

    KIND = "ttft_slo"  # or ITL_SLO: the form's kind field says which

    target_ms = forms.FloatField(
        label="P90 target (ms)", min_value=0.001,
        help_text="the rule adds workers while the p90 latency stays above this many milliseconds over the window",
    )  # fmt: skip

    class Meta(RuleForm.Meta):
        fields = ["deployment", "name", "kind", "enabled", "duration_s", "cooldown_s", "step"]
        labels = {**RuleForm.Meta.labels, "kind": "Latency", "step": "Step (replicas added)"}
        help_texts = {
            **RuleForm.Meta.help_texts,
            "kind": "the signal: p90 over the decode workers' last 30 s. TTFT is limited by prefill (queueing and "
                    "computing the prompt), ITL by decode, so the rule adds workers of that role",
            "step": "workers added when the rule fires (at least 1, within the deployment's max)",
        }  # fmt: skip

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["kind"] = forms.ChoiceField(
            choices=SLO_KIND_CHOICES, label="Latency", help_text=self.Meta.help_texts["kind"],
            initial=self.instance.kind if self.instance.kind in SLO_ROLES else "ttft_slo",
        )  # fmt: skip
        self.fields["step"].validators.append(MinValueValidator(1))
        self.fields["step"].widget.attrs["min"] = 1
        if self.instance.pk is not None and self.instance.threshold is not None and self.instance.kind in SLO_ROLES:
            scale = rule_selectors.DISPLAY_SCALE[self.instance.kind]
            self.initial["target_ms"] = round(self.instance.threshold * scale, 3)
        # The target shows beside the latency, before the window.
        self.order_fields(["deployment", "name", "kind", "target_ms", "enabled"])

    def fix_kind_fields(self, data: dict[str, Any]) -> None:
        """Role from the latency, comparison above, the target stored in the unit the rule reads."""
        kind = str(data.get("kind") or "ttft_slo")
        self.instance.kind = kind
        self.instance.role = SLO_ROLES[kind]
        self.instance.comparison = "above"
        target = data.get("target_ms")
        if target is not None:
            self.instance.threshold = float(target) / rule_selectors.DISPLAY_SCALE[kind]


class ScheduleRuleForm(RuleForm):
    """A schedule rule: a daily window in the platform's time zone and the replicas it holds."""

    KIND = "schedule"

    class Meta(RuleForm.Meta):
        fields = ["deployment", "name", "role", "enabled", "start_time", "end_time", "target_replicas"]
        widgets = {
            "start_time": forms.TimeInput(format="%H:%M", attrs={"type": "time"}),
            "end_time": forms.TimeInput(format="%H:%M", attrs={"type": "time"}),
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        zone = settings.TIME_ZONE
        self.fields["start_time"].label = f"Start ({zone})"
        self.fields["end_time"].label = f"End ({zone})"
        self.fields["start_time"].help_text = f"wall-clock time in {zone} (PLATFORM_TIME_ZONE) when the window opens"
        self.fields["end_time"].help_text = (
            "when it closes; before the start the window wraps midnight (22:00–07:00); nothing is restored when it "
            "closes: add a second rule for the rest of the day"
        )
        self.fields["target_replicas"].label = "Replicas held"
        self.fields["target_replicas"].help_text = (
            "the role's replicas inside the window (within the deployment's min and max); its threshold rules are "
            "paused meanwhile, and a manual scale needs an override"
        )
        for name in ("start_time", "end_time", "target_replicas"):
            self.fields[name].required = True


FORMS: dict[str, type[RuleForm]] = {
    "threshold": ThresholdRuleForm,
    "ttft_slo": SloRuleForm,
    "itl_slo": SloRuleForm,
    "slo": SloRuleForm,
    "schedule": ScheduleRuleForm,
}
# The kinds offered when adding a rule, as `?kind=` of the add page.
ADD_CHOICES = [
    ("threshold", "Threshold rule", "the role's load over a window → add or remove replicas"),
    ("slo", "SLO rule", "TTFT or ITL p90 above a target in ms → add workers of the role that limits it"),
    ("schedule", "Schedule rule", f"hold a replica count during a daily window ({settings.TIME_ZONE})"),
]


def form_for(kind: str | None) -> type[RuleForm] | None:
    """The form of a rule kind (or of an add page's `?kind=`); None for an unknown one."""
    return FORMS.get(kind or "")
