"""Models served, deployments of them and their workers, scaling rules, scale events, routers and metric samples."""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models

# Worker lives in its own module (this one holds the deployment side); importing it here registers it with
# the app and gives callers one place to import models from.
from inference.worker_model import ACTIVE_WORKER_STATUSES as ACTIVE_WORKER_STATUSES
from inference.worker_model import Worker
from inference.worker_model import WorkerRole as WorkerRole
from inference.worker_model import WorkerStatus as WorkerStatus


class ModelSource(models.TextChoices):
    """Where `prepare_model` takes a model's weights from."""

    SMOLLM2 = "smollm2", "SmolLM2-135M-Instruct (packaged, offline)"
    TINY = "tiny", "Tiny random Llama (tests)"
    LOCAL = "local", "Local Hugging Face folder"
    HUB = "hub", "Hugging Face hub"


class Model(models.Model):
    """A model checkpoint the platform can serve; prepared into `path` on every node that runs it."""

    name = models.SlugField(max_length=100, unique=True)
    source = models.CharField(max_length=16, choices=ModelSource.choices, default=ModelSource.SMOLLM2)
    source_ref = models.CharField(max_length=500, blank=True, help_text="local folder or hub repo id")
    path = models.CharField(max_length=500, help_text="checkpoint folder on each node (relative: to the checkout)")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class RouterPolicy(models.TextChoices):
    """How the router picks a prefill and a decode worker for each request."""

    ROUND_ROBIN = "round-robin", "Round robin"
    LEAST_CONNECTIONS = "least-connections", "Least connections"
    POWER_OF_TWO = "power-of-two", "Power of two choices"


class KVTransport(models.TextChoices):
    """How KV blocks move from prefill to decode."""

    TCP = "tcp", "TCP"
    RDMA = "rdma", "RDMA (pyverbs)"


class DeploymentStatus(models.TextChoices):
    """Whether the controller keeps a deployment's workers running."""

    ACTIVE = "active", "Active"
    STOPPED = "stopped", "Stopped"


class Deployment(models.Model):
    """A model served disaggregated: desired prefill/decode replicas within min/max, and worker flags."""

    name = models.SlugField(max_length=100, unique=True)
    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="deployments")
    status = models.CharField(max_length=16, choices=DeploymentStatus.choices, default=DeploymentStatus.ACTIVE)
    prefill_replicas = models.PositiveIntegerField(default=1)
    prefill_min = models.PositiveIntegerField(default=1)
    prefill_max = models.PositiveIntegerField(default=4)
    decode_replicas = models.PositiveIntegerField(default=1)
    decode_min = models.PositiveIntegerField(default=1)
    decode_max = models.PositiveIntegerField(default=4)
    router_policy = models.CharField(max_length=32, choices=RouterPolicy.choices, default=RouterPolicy.ROUND_ROBIN)
    context_length = models.PositiveIntegerField(default=2048)
    max_sequence_length = models.PositiveIntegerField(null=True, blank=True)
    batch_size = models.PositiveIntegerField(default=32)
    block_size = models.PositiveIntegerField(default=16)
    kv_transport = models.CharField(max_length=8, choices=KVTransport.choices, default=KVTransport.TCP)
    threads_per_worker = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """min <= replicas <= max for both roles."""
        for role in ("prefill", "decode"):
            low, want, high = (getattr(self, f"{role}_{k}") for k in ("min", "replicas", "max"))
            if low > high:
                raise ValidationError({f"{role}_min": f"{role}_min ({low}) exceeds {role}_max ({high})"})
            if not low <= want <= high:
                raise ValidationError(
                    {f"{role}_replicas": f"{role}_replicas must be within [{low}, {high}], got {want}"}
                )

    def replicas(self, role: str) -> int:
        """Desired replicas of a role."""
        return int(getattr(self, f"{role}_replicas"))

    def bounds(self, role: str) -> tuple[int, int]:
        """(min, max) replicas of a role."""
        return int(getattr(self, f"{role}_min")), int(getattr(self, f"{role}_max"))


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
    role = models.CharField(max_length=16, choices=[("prefill", "Prefill"), ("decode", "Decode")])
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
        return f"{self.deployment.name}: {self.name}"

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
    """What asked for a scale change."""

    MANUAL = "manual", "Admin"
    API = "api", "REST API"
    THRESHOLD = "threshold", "Threshold rule"
    SCHEDULE = "schedule", "Schedule rule"
    SLO = "slo", "SLO rule"
    RECOVERY = "recovery", "Recovery"


class ScaleEvent(models.Model):
    """One change of a deployment's replicas, with its reason, and how long its new workers took to run.

    The controller links each worker it places to the event that asked for it (`placed_workers`); when
    the last of them reports RUNNING, `time_to_run_s` is filled in (inference.worker_actions.report_healthy).
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="scale_events")
    role = models.CharField(max_length=16)
    from_replicas = models.PositiveIntegerField()
    to_replicas = models.PositiveIntegerField()
    source = models.CharField(max_length=16, choices=ScaleSource.choices)
    rule = models.ForeignKey(ScalingRule, null=True, blank=True, on_delete=models.SET_NULL)
    reason = models.TextField()
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
        return f"{self.deployment.name} {self.role} {self.from_replicas}->{self.to_replicas}"


class ScaleOverride(models.Model):
    """An operator's replica count for one role that scaling rules leave alone until `ends_at`.

    A manual scale that an active schedule rule would revert is refused (409) unless it asks for an
    override: then this row holds the role at `replicas` (schedule and threshold rules of the role
    are paused) until `ends_at`, after which the rules take over again. `rule` is the schedule rule
    that was holding the role when the override was made (None: none was). Ending it early sets
    `ends_at` to the present.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="scale_overrides")
    role = models.CharField(max_length=16, choices=[("prefill", "Prefill"), ("decode", "Decode")])
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


class MetricSample(models.Model):
    """A deployment's role-level metrics at one moment (charts and scaling read these); pruned by age."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="metric_samples")
    role = models.CharField(max_length=16)
    at = models.DateTimeField(db_index=True)
    workers = models.PositiveIntegerField(default=0)
    load = models.FloatField(default=0.0)
    ttft_s = models.FloatField(null=True, blank=True)
    itl_s = models.FloatField(null=True, blank=True)
    throughput_tps = models.FloatField(default=0.0)
    queue_depth = models.FloatField(default=0.0)
    running = models.FloatField(default=0.0)
    kv_usage = models.FloatField(default=0.0)
    cpu_utilization = models.FloatField(null=True, blank=True)
    gpu_utilization = models.FloatField(null=True, blank=True)
    # Sums and means over the role's workers of what WorkerSample holds per worker (None: not reported).
    rss_bytes = models.BigIntegerField(null=True, blank=True)
    gpu_memory_bytes = models.BigIntegerField(null=True, blank=True)
    kv_transfer_bytes_per_s = models.FloatField(null=True, blank=True)
    kv_transfer_s = models.FloatField(null=True, blank=True)
    prefix_cache_hit_ratio = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["deployment", "role", "at"])]

    def __str__(self) -> str:
        return f"{self.deployment.name}/{self.role}@{self.at:%H:%M:%S}"


class RouterEndpoint(models.Model):
    """A router serving a deployment: the metrics collector scrapes its `/metrics` (so may Prometheus).

    `last_metrics` holds the cumulative series of the last scrape, which the next one subtracts.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="routers")
    url = models.URLField(max_length=300, help_text="the router's base URL, e.g. http://127.0.0.1:8000")
    enabled = models.BooleanField(default=True, help_text="scraped by the metrics collector")
    last_metrics = models.JSONField(null=True, blank=True, editable=False)
    last_scraped_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_error = models.TextField(blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["deployment_id", "url"]
        constraints = [models.UniqueConstraint(fields=["deployment", "url"], name="unique_router_url")]

    def __str__(self) -> str:
        return f"{self.deployment.name}: {self.url}"


class RouterSample(models.Model):
    """What a deployment's router measured between two scrapes (as clients see it); pruned by age.

    Rates are per second over the interval; quantiles come from the histograms' bucket deltas (None:
    no observation in the interval). `worker_share` is {role: {worker url: share of the role's
    requests the router sent to it}}.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="router_samples")
    router = models.ForeignKey(RouterEndpoint, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(db_index=True)
    interval_s = models.FloatField(null=True, blank=True)
    requests_per_s = models.FloatField(null=True, blank=True)
    error_rate = models.FloatField(null=True, blank=True, help_text="failed / all requests finished")
    rejected_per_s = models.FloatField(null=True, blank=True, help_text="429 answers per second")
    tokens_per_s = models.FloatField(null=True, blank=True)
    dispatch_p50_s = models.FloatField(null=True, blank=True)
    dispatch_p90_s = models.FloatField(null=True, blank=True)
    queue_wait_p50_s = models.FloatField(null=True, blank=True)
    queue_wait_p90_s = models.FloatField(null=True, blank=True)
    ttft_p50_s = models.FloatField(null=True, blank=True)
    ttft_p90_s = models.FloatField(null=True, blank=True)
    itl_p50_s = models.FloatField(null=True, blank=True)
    itl_p90_s = models.FloatField(null=True, blank=True)
    e2e_p50_s = models.FloatField(null=True, blank=True)
    e2e_p90_s = models.FloatField(null=True, blank=True)
    inflight = models.FloatField(null=True, blank=True)
    queued = models.FloatField(null=True, blank=True)
    decode_slots = models.FloatField(null=True, blank=True)
    worker_share = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["deployment", "at"])]

    def __str__(self) -> str:
        return f"{self.deployment.name}/router@{self.at:%H:%M:%S}"


class WorkerSample(models.Model):
    """One worker's metrics at one moment (per-worker charts); pruned by age.

    The worker is named, not referenced: its samples outlive its row. Rates and means are over the
    interval since the previous scrape; None where the worker (or the engine) does not report it.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="worker_samples")
    worker_id = models.PositiveIntegerField()
    name = models.CharField(max_length=150)
    role = models.CharField(max_length=16)
    url = models.CharField(max_length=300, blank=True)
    at = models.DateTimeField(db_index=True)
    load = models.FloatField(null=True, blank=True)
    queue_depth = models.FloatField(null=True, blank=True)
    running = models.FloatField(null=True, blank=True)
    kv_usage = models.FloatField(null=True, blank=True)
    cpu_utilization = models.FloatField(null=True, blank=True)
    gpu_utilization = models.FloatField(null=True, blank=True)
    throughput_tps = models.FloatField(null=True, blank=True)
    ttft_s = models.FloatField(null=True, blank=True)
    itl_s = models.FloatField(null=True, blank=True)
    rss_bytes = models.BigIntegerField(null=True, blank=True)
    gpu_memory_bytes = models.BigIntegerField(null=True, blank=True)
    kv_transfer_bytes_per_s = models.FloatField(null=True, blank=True)
    kv_transfer_s = models.FloatField(null=True, blank=True, help_text="mean duration of one KV transfer")
    prefix_cache_hit_ratio = models.FloatField(null=True, blank=True)
    requests_per_s = models.FloatField(null=True, blank=True, help_text="requests the router sent it, per second")
    request_share = models.FloatField(null=True, blank=True, help_text="its share of its role's requests")

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["deployment", "at"]), models.Index(fields=["worker_id", "at"])]

    def __str__(self) -> str:
        return f"{self.deployment.name}/{self.name}@{self.at:%H:%M:%S}"
