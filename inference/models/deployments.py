"""Models served and their deployments (desired replicas per role, worker flags), and the routers serving them."""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from inference.models.workers import WorkerRole
from inference.server.args import MAX_SPECULATIVE_TOKENS


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
    KV_AWARE = "kv-aware", "KV-aware (cached prefix + load)"


class KVTransport(models.TextChoices):
    """How KV blocks move from prefill to decode."""

    TCP = "tcp", "TCP"
    RDMA = "rdma", "RDMA (pyverbs)"


class Speculative(models.TextChoices):
    """Speculative decoding of the deployment's decode (and colocated) workers: `--speculative`."""

    OFF = "off", "Off"
    NGRAM = "ngram", "n-gram prompt lookup (no draft model)"


class DeploymentStatus(models.TextChoices):
    """Whether the controller keeps a deployment's workers running."""

    ACTIVE = "active", "Active"
    STOPPED = "stopped", "Stopped"


class Deployment(models.Model):
    """A model served disaggregated: desired prefill/decode (and colocated `both`) replicas within min/max,
    worker flags, and the managed routers' kv-aware weights and local prefill threshold."""

    name = models.SlugField(max_length=100, unique=True)
    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="deployments")
    status = models.CharField(max_length=16, choices=DeploymentStatus.choices, default=DeploymentStatus.ACTIVE)
    prefill_replicas = models.PositiveIntegerField(default=1)
    prefill_min = models.PositiveIntegerField(default=1)
    prefill_max = models.PositiveIntegerField(default=4)
    decode_replicas = models.PositiveIntegerField(default=1)
    decode_min = models.PositiveIntegerField(default=1)
    decode_max = models.PositiveIntegerField(default=4)
    # Workers that prefill and decode (`--service-type both`): a one-host deployment without the hop.
    both_replicas = models.PositiveIntegerField(default=0)
    both_min = models.PositiveIntegerField(default=0)
    both_max = models.PositiveIntegerField(default=4)
    # kv-aware by default since issue 19's benchmarks put it ahead of round-robin (docs/benchmarks.md).
    router_policy = models.CharField(
        max_length=32, choices=RouterPolicy.choices, default=RouterPolicy.KV_AWARE,
        help_text="how the managed routers pick workers. kv-aware (the default): the worker with the least work "
        "ahead, its cached prefix of the prompt credited, plus its load; in the multi-turn chat benchmark 1.1-1.75x "
        "round-robin's TTFT p50 and 1.2-1.6x its output tok/s (README, router). With one worker of a role "
        "every policy picks that one")
    # The managed routers' kv-aware cost weights and per-request disaggregation threshold (README, router).
    kv_token_weight = models.FloatField(
        default=1.0, validators=[MinValueValidator(0.0)],
        help_text="kv-aware: cost of a prompt token the worker would still compute (ROUTER_KV_TOKEN_WEIGHT)")
    kv_load_weight = models.FloatField(
        default=64.0, validators=[MinValueValidator(0.0)],
        help_text="kv-aware: cost of a request in flight on the worker, in prompt tokens (ROUTER_KV_LOAD_WEIGHT)")
    local_prefill_tokens = models.PositiveIntegerField(
        default=0, validators=[MaxValueValidator(1_000_000)],
        help_text="a decode worker with at most this many prompt tokens left to compute prefills the prompt "
        "itself; 0: always a prefill worker (ROUTER_LOCAL_PREFILL_TOKENS)")
    context_length = models.PositiveIntegerField(default=2048)
    max_sequence_length = models.PositiveIntegerField(null=True, blank=True)
    batch_size = models.PositiveIntegerField(default=32)
    block_size = models.PositiveIntegerField(default=16)
    kv_transport = models.CharField(max_length=8, choices=KVTransport.choices, default=KVTransport.TCP)
    threads_per_worker = models.PositiveIntegerField(default=1)
    speculative = models.CharField(
        max_length=8, choices=Speculative.choices, default=Speculative.OFF,
        help_text="decode and prefill + decode workers: speculative decoding (--speculative; README, worker flags)")
    num_speculative_tokens = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(MAX_SPECULATIVE_TOKENS)],
        help_text=f"tokens proposed per request and step, 1-{MAX_SPECULATIVE_TOKENS}; empty: the worker's default "
        "(--num-speculative-tokens)")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """min <= replicas <= max for every role."""
        for role in ("prefill", "decode", "both"):
            low, want, high = (getattr(self, f"{role}_{k}") for k in ("min", "replicas", "max"))
            if low > high:
                raise ValidationError({f"{role}_min": f"{role}_min ({low}) exceeds {role}_max ({high})"})
            if not low <= want <= high:
                raise ValidationError(
                    {f"{role}_replicas": f"{role}_replicas must be within [{low}, {high}], got {want}"}
                )
        if self.num_speculative_tokens is not None and self.speculative == Speculative.OFF:
            # The worker refuses --num-speculative-tokens without --speculative: say it here, not at launch.
            raise ValidationError({"num_speculative_tokens": "needs speculative decoding on (speculative: ngram)"})

    def replicas(self, role: str) -> int:
        """Desired replicas of a role."""
        return int(getattr(self, f"{role}_replicas"))

    def bounds(self, role: str) -> tuple[int, int]:
        """(min, max) replicas of a role."""
        return int(getattr(self, f"{role}_min")), int(getattr(self, f"{role}_max"))

    def roles_in_use(self) -> list[str]:
        """The roles this deployment runs or keeps a floor of (desired or minimum above 0), in
        WorkerRole's order: a prefill + decode deployment is not shown an idle `both` role, nor a
        colocated one idle prefill and decode roles. At least prefill and decode when none is."""
        used = [role for role in WorkerRole.values if self.replicas(role) or self.bounds(role)[0]]
        return used or [WorkerRole.PREFILL, WorkerRole.DECODE]


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
