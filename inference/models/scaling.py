"""Scaling rules (threshold, schedule, SLO), the scale events that record every replica change, and
operators' overrides of the rules."""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models

from inference.models.deployments import Deployment
from inference.models.workers import Worker, WorkerRole


class RuleKind(models.TextChoices):
    """Threshold rules react to load; schedule rules set replicas in a time window; SLO rules keep a
    latency percentile under a target by adding workers of the role that limits it."""

    THRESHOLD = "threshold", "Threshold"
    SCHEDULE = "schedule", "Schedule"
    TTFT_SLO = "ttft_slo", "SLO: TTFT p90 ≤ threshold seconds (adds prefill)"
    ITL_SLO = "itl_slo", "SLO: ITL p90 ≤ threshold milliseconds (adds decode)"


# The role whose workers an SLO rule adds: time to first token is prefill work (queueing and computing
# the prompt), the gap between tokens is decode work (as in NVIDIA Dynamo's planner).
SLO_ROLES: dict[str, str] = {"ttft_slo": "prefill", "itl_slo": "decode"}  # RuleKind values


class Comparison(models.TextChoices):
    """Direction of a threshold rule."""

    ABOVE = "above", "above"
    BELOW = "below", "below"


class ScalingRule(models.Model):
    """A load- or time-based rule changing a deployment's replicas of one role.

    Threshold: when the role's load (see inference.scaling) stays `comparison` `threshold` over a
    window of `duration_s` (samples evaluated together, a tolerated share may dissent), add `step`
    replicas (negative to remove), then wait `cooldown_s`.
    SLO (ttft_slo, itl_slo): when the p90 latency stays above `threshold` (seconds for TTFT,
    milliseconds for ITL) over the window, add `step` workers of the role that limits it (SLO_ROLES).
    Schedule: between `start_time` and `end_time` (may wrap midnight) hold `target_replicas`.
    The deployment's min/max always bound the result.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="rules")
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=16, choices=RuleKind.choices)
    role = models.CharField(max_length=16, choices=WorkerRole.choices)
    enabled = models.BooleanField(default=True)
    threshold = models.FloatField(null=True, blank=True)
    comparison = models.CharField(max_length=8, choices=Comparison.choices, default=Comparison.ABOVE)
    duration_s = models.PositiveIntegerField(default=60)
    cooldown_s = models.PositiveIntegerField(default=300)
    step = models.IntegerField(default=1)
    start_time = models.TimeField(null=True, blank=True)
    end_time = models.TimeField(null=True, blank=True)
    target_replicas = models.PositiveIntegerField(null=True, blank=True)
    breach_started_at = models.DateTimeField(null=True, blank=True)
    last_triggered_at = models.DateTimeField(null=True, blank=True)
    observations = models.JSONField(
        default=list, blank=True,
        help_text="the rule's window: [epoch seconds, reading or null] at its recent evaluations (load, or p90)",
    )

    class Meta:
        ordering = ["deployment_id", "name"]
        constraints = [models.UniqueConstraint(fields=["deployment", "name"], name="unique_rule_name")]

    def __str__(self) -> str:
        # The signal it reads, so a rule listed by name ("hot", "night") still says what it watches.
        signal = {"threshold": f"{self.role} load", "ttft_slo": "TTFT p90", "itl_slo": "ITL p90"}.get(
            self.kind, "schedule"
        )
        return f"{self.deployment.name}: {self.name} ({signal})"

    def clean(self) -> None:
        """Each kind needs its own fields."""
        if self.kind == RuleKind.THRESHOLD:
            if self.threshold is None:
                raise ValidationError({"threshold": "a threshold rule needs a threshold"})
            if self.step == 0:
                raise ValidationError({"step": "step must not be 0"})
        elif self.kind in SLO_ROLES:
            self._clean_slo()
        elif self.kind == RuleKind.SCHEDULE:
            missing = [f for f in ("start_time", "end_time", "target_replicas") if getattr(self, f) is None]
            if missing:
                raise ValidationError({f: "required for a schedule rule" for f in missing})

    def _clean_slo(self) -> None:
        """An SLO rule: a positive target, the limiting role, scale-out only."""
        unit = "seconds" if self.kind == RuleKind.TTFT_SLO else "milliseconds"
        what = "TTFT" if self.kind == RuleKind.TTFT_SLO else "ITL"
        if self.threshold is None or self.threshold <= 0:
            raise ValidationError(
                {"threshold": f"a {what} SLO rule needs its p90 target in {unit} as threshold (> 0)"}
            )
        role = SLO_ROLES[self.kind]
        if self.role != role:
            raise ValidationError(
                {"role": f"a {what} SLO rule adds {role} workers ({what} is limited by {role}); role must be {role}"}
            )
        if self.step <= 0:
            raise ValidationError({"step": f"a {what} SLO rule only adds workers: step must be >= 1"})
        if self.comparison != Comparison.ABOVE:
            raise ValidationError(
                {"comparison": f"a {what} SLO rule fires when the p90 is above its target: comparison must be above"}
            )


class ScaleSource(models.TextChoices):
    """What asked for a scale change: an operator (admin, REST API), a rule (threshold, schedule, SLO), the
    controller restoring the desired count (recovery: failover, re-placement, adoption) or the platform's
    own first start (bootstrap: the quick start's deployment created by `bootstrap_demo`)."""

    MANUAL = "manual", "Admin"
    API = "api", "REST API"
    THRESHOLD = "threshold", "Threshold rule"
    SCHEDULE = "schedule", "Schedule rule"
    SLO = "slo", "SLO rule"
    RECOVERY = "recovery", "Recovery"
    BOOTSTRAP = "bootstrap", "Bootstrap"


class ScaleEvent(models.Model):
    """One change of a deployment's replicas, with its reason, and how long its new workers took to run.

    `refused`: the event records workers the controller could not place (no node fits; the reason names
    each node and why), not a change of the desired count; its source is that of the scale it could not
    carry out (recovery when none asked).

    The controller links each worker it places to the event that asked for it (`placed_workers`); when
    the last of them reports RUNNING, `time_to_run_s` is filled in (inference.actions.workers.report_healthy).
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="scale_events")
    role = models.CharField(max_length=16)
    from_replicas = models.PositiveIntegerField()
    to_replicas = models.PositiveIntegerField()
    source = models.CharField(max_length=16, choices=ScaleSource.choices)
    rule = models.ForeignKey(ScalingRule, null=True, blank=True, on_delete=models.SET_NULL)
    reason = models.TextField()
    refused = models.BooleanField(
        default=False, help_text="the controller could not place the workers (the reason says why)",
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    placed_workers = models.ManyToManyField(
        Worker, blank=True, related_name="scale_events",
        help_text="workers the controller placed to carry out this change",
    )
    time_to_run_s = models.FloatField(
        null=True, blank=True,
        help_text="seconds from this event until the workers placed for it were RUNNING",
    )

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        refused = " (refused)" if self.refused else ""
        return f"{self.deployment.name} {self.role} {self.from_replicas}->{self.to_replicas}{refused}"


class ScaleOverride(models.Model):
    """An operator's replica count for one role that scaling rules leave alone until `ends_at`.

    A manual scale that an active schedule rule would revert is refused (409) unless it asks for an
    override: then this row holds the role at `replicas` (schedule and threshold rules of the role
    are paused) until `ends_at`, after which the rules take over again. `rule` is the schedule rule
    that was holding the role when the override was made (None: none was). Ending it early sets
    `ends_at` to the present.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="scale_overrides")
    role = models.CharField(max_length=16, choices=WorkerRole.choices)
    replicas = models.PositiveIntegerField()
    ends_at = models.DateTimeField(db_index=True)
    rule = models.ForeignKey(
        ScalingRule, null=True, blank=True, on_delete=models.SET_NULL, related_name="overrides",
        help_text="the schedule rule holding the role when the override was made",
    )
    source = models.CharField(max_length=16, choices=ScaleSource.choices)
    created_by = models.CharField(max_length=150, blank=True)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["deployment", "role", "ends_at"])]

    def __str__(self) -> str:
        return f"{self.deployment.name} {self.role}={self.replicas} until {self.ends_at:%Y-%m-%d %H:%M}"
