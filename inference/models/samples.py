"""Metric samples: per role, per worker and per router, written by the collector; charts and scaling read them."""
from __future__ import annotations

from django.db import models

from inference.models.deployments import Deployment, RouterEndpoint


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


class RouterSample(models.Model):
    """What a deployment's router measured between two scrapes (as clients see it); pruned by age.

    Rates are per second over the interval; quantiles come from the histograms' bucket deltas (None:
    no observation in the interval). `worker_share` is {role: {worker url: share of the role's
    requests the router sent to it}}. Where prompts were prefilled (on the decode worker itself or by a
    prefill worker) and the share of prompt tokens no worker computed are the router's per-request
    decisions and the workers' reports on them (issue 19's KV-aware routing).
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
    prompt_tokens_per_s = models.FloatField(null=True, blank=True, help_text="prompt tokens of finished requests")
    cached_prompt_tokens_per_s = models.FloatField(
        null=True, blank=True, help_text="of which no worker computed (the workers' reported cached tokens)")
    prompt_cached_ratio = models.FloatField(
        null=True, blank=True, help_text="cached / all prompt tokens of the requests finished (None: none)")
    local_prefills_per_s = models.FloatField(null=True, blank=True, help_text="prompts prefilled on the decode worker")
    remote_prefills_per_s = models.FloatField(null=True, blank=True, help_text="prompts prefilled by a prefill worker")
    worker_share = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["deployment", "at"])]

    def __str__(self) -> str:
        return f"{self.deployment.name}/router@{self.at:%H:%M:%S}"


class WorkerValues(models.Model):
    """What is known of one worker at a moment or over a bucket: its identity (named, not referenced,
    so that its history outlives its row) and the values the collector reads from its health and
    metrics. WorkerSample holds them per scrape, WorkerSampleRollup as means per minute or hour."""

    worker_id = models.PositiveIntegerField()
    name = models.CharField(max_length=150)
    role = models.CharField(max_length=16)
    url = models.CharField(max_length=300, blank=True)
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
        abstract = True


class WorkerSample(WorkerValues):
    """One worker's metrics at one moment (per-worker charts); pruned by age.

    The worker is named, not referenced: its samples outlive its row. Rates and means are over the
    interval since the previous scrape; None where the worker (or the engine) does not report it.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="worker_samples")
    at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["deployment", "at"]), models.Index(fields=["worker_id", "at"])]

    def __str__(self) -> str:
        return f"{self.deployment.name}/{self.name}@{self.at:%H:%M:%S}"


class RollupResolution(models.IntegerChoices):
    """The bucket width of a WorkerSampleRollup, in seconds."""

    MINUTE = 60, "1 minute"
    HOUR = 3600, "1 hour"


class WorkerSampleRollup(WorkerValues):
    """One worker's samples over a minute or an hour, averaged (inference.metrics.downsampling).

    Raw WorkerSamples are kept METRICS_RAW_RETENTION_HOURS; per-minute rollups METRICS_RETENTION_HOURS
    and per-hour ones METRICS_ROLLUP_RETENTION_DAYS, so a long history costs a row per worker per
    minute (then hour) instead of one per scrape. The value fields are the WorkerSample fields of the
    same names (the mean over the bucket; None when no sample in it had one); `load_max` is the
    bucket's peak load and `samples` how many raw samples the bucket holds.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="worker_rollups")
    resolution_s = models.PositiveIntegerField(choices=RollupResolution.choices)
    at = models.DateTimeField(help_text="start of the bucket")
    samples = models.PositiveIntegerField(default=0)
    load_max = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["deployment", "resolution_s", "at"])]
        constraints = [
            models.UniqueConstraint(fields=["worker_id", "resolution_s", "at"], name="unique_worker_rollup_bucket")
        ]

    def __str__(self) -> str:
        return f"{self.deployment.name}/{self.name}@{self.at:%Y-%m-%d %H:%M} ({self.resolution_s}s)"
