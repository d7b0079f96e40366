"""Settings of the platform, read from the environment in this one place.

With nothing configured the platform runs on embedded defaults (SQLite, in-process channel layer,
a filesystem Celery broker), which is what `make up` uses. DATABASE_URL and REDIS_URL select
PostgreSQL and Redis. Malformed values fail at startup with a message naming the variable.
"""
from __future__ import annotations

from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from config.env import env_bool, env_float, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("PLATFORM_VAR_DIR", str(BASE_DIR / "var")) or BASE_DIR / "var")

DEBUG = env_bool("DJANGO_DEBUG", False)
_INSECURE_DEV_KEY = "dev-only-insecure-key-set-DJANGO_SECRET_KEY-in-production"
SECRET_KEY = env_str("DJANGO_SECRET_KEY") or _INSECURE_DEV_KEY
if SECRET_KEY == _INSECURE_DEV_KEY and env_bool("PLATFORM_PRODUCTION", False):
    raise ImproperlyConfigured("DJANGO_SECRET_KEY must be set when PLATFORM_PRODUCTION=1")
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS") or ["*"]
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI as static files: /api/docs/ works offline
    "django_celery_beat",
    "nodes",
    "inference",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

DATABASE_URL = env_str("DATABASE_URL")
if DATABASE_URL:
    try:
        DATABASES = {
            "default": dj_database_url.parse(
                DATABASE_URL, conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0), conn_health_checks=True
            )
        }
    except Exception as exc:  # dj_database_url raises several types for a bad URL
        raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL: {exc}") from exc
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(VAR_DIR / "platform.sqlite3"),
            # WAL plus a busy timeout lets the router, agents and admin share the file. IMMEDIATE: a
            # transaction takes the write lock when it begins, so one that reads then writes waits
            # for another writer (busy timeout) instead of failing with "database is locked" at its
            # first write (a deferred transaction's read snapshot cannot be upgraded once stale).
            "OPTIONS": {"timeout": 20, "init_command": "PRAGMA journal_mode=WAL;", "transaction_mode": "IMMEDIATE"},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = env_str("PLATFORM_TIME_ZONE", "UTC") or "UTC"
USE_I18N = True
USE_TZ = True
# Timestamps to the second everywhere in the admin (config/formats/en/formats.py).
FORMAT_MODULE_PATH = ["config.formats"]

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
LOGIN_URL = "/admin/login/"

REDIS_URL = env_str("REDIS_URL")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL]},
        }
    }
    CELERY_BROKER_URL = REDIS_URL
    CELERY_RESULT_BACKEND = REDIS_URL
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    # A filesystem broker lets the agent, controller and beat processes of a single host talk
    # without any server installed: the quick start's embedded default.
    _broker_dir = VAR_DIR / "celery"
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        # kombu keeps exchange bindings in "control_folder", relative to the cwd unless set.
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
    }
    CELERY_RESULT_BACKEND = f"file://{_broker_dir / 'results'}"
    # kombu's filesystem transport and Celery's file result backend fail when their folders are missing.
    for _sub in ("queue", "processed", "results", "control"):
        try:
            (_broker_dir / _sub).mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only checkout: the first send names the folder
            pass
# The controller's queue. Agents consume only their own queue node.<name>. Another name lets two
# platforms share one Redis (the multi-host test uses it to stay apart from other test runs).
CELERY_TASK_DEFAULT_QUEUE = env_str("PLATFORM_CONTROL_QUEUE", "control") or "control"
# The agent's tasks (inference.agent.tasks.*, or their legacy names nodes.tasks.*) go to the queue of the
# worker's node even when sent without a queue.
CELERY_TASK_ROUTES = ["inference.agent.tasks.route_node_task"]
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_TIMEZONE = TIME_ZONE

# Metric samples (charts, scaling) older than this are pruned (inference.actions.samples.prune_metric_samples).
METRICS_RETENTION_HOURS = env_int("METRICS_RETENTION_HOURS", 72, minimum=1)
# Per-worker samples (one per worker per scrape) are kept raw this long, then only as per-minute rollups
# (kept METRICS_RETENTION_HOURS) and per-hour rollups (kept METRICS_ROLLUP_RETENTION_DAYS); see
# inference.metrics.downsampling. At 1,000 workers a raw hour is 720,000 rows, a rolled-up hour 60,000.
METRICS_RAW_RETENTION_HOURS = min(env_int("METRICS_RAW_RETENTION_HOURS", 2, minimum=1), METRICS_RETENTION_HOURS)
METRICS_ROLLUP_RETENTION_DAYS = env_int("METRICS_ROLLUP_RETENTION_DAYS", 30, minimum=1)
# Stopped and failed Worker rows older than this (since their last change) are deleted
# (inference.actions.workers.prune_stopped_workers, hourly): every `make down`/`make up` leaves a set behind.
WORKER_RETENTION_HOURS = env_int("WORKER_RETENTION_HOURS", 24, minimum=1)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 100,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Disaggregated inference platform API",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Served from our own static files (drf-spectacular-sidecar, pinned), never from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
}

# Router (static endpoints from `python -m inference.launch_router`).
ROUTER_PREFILL_ENDPOINTS = env_list("ROUTER_PREFILL_ENDPOINTS")
ROUTER_DECODE_ENDPOINTS = env_list("ROUTER_DECODE_ENDPOINTS")
# kv-aware by default: ahead of round-robin in issue 19's benchmarks (README, router; docs/benchmarks.md).
ROUTER_POLICY = env_str("ROUTER_POLICY", "kv-aware") or "kv-aware"
# Managed mode: the router follows the RUNNING workers (and policy) of this deployment in the database.
ROUTER_DEPLOYMENT = env_str("ROUTER_DEPLOYMENT")
ROUTER_FOLLOW_INTERVAL_S = env_float("ROUTER_FOLLOW_INTERVAL_S", 2.0)
ROUTER_REQUEST_TIMEOUT_S = env_float("ROUTER_REQUEST_TIMEOUT_S", 300.0)
ROUTER_CONNECT_TIMEOUT_S = env_float("ROUTER_CONNECT_TIMEOUT_S", 3.0)
ROUTER_HEALTH_INTERVAL_S = env_float("ROUTER_HEALTH_INTERVAL_S", 2.0)
# The kv-aware policy's cost: token weight x prompt tokens a worker would still compute + load weight x
# its requests in flight (a request in flight costs as much as computing that many prompt tokens).
ROUTER_KV_TOKEN_WEIGHT = env_float("ROUTER_KV_TOKEN_WEIGHT", 1.0)
ROUTER_KV_LOAD_WEIGHT = env_float("ROUTER_KV_LOAD_WEIGHT", 64.0)
# kv-aware decode choice with remote prefill: a cached token saves only its KV transfer (this share).
ROUTER_KV_REMOTE_DECODE_SHARE = env_float("ROUTER_KV_REMOTE_DECODE_SHARE", 1 / 16)
# Per-request disaggregation: a decode worker with at most this many prompt tokens left to compute (its
# prefix cache holding the rest) prefills the prompt itself, without the hop; 0: always a prefill worker.
ROUTER_LOCAL_PREFILL_TOKENS = env_int("ROUTER_LOCAL_PREFILL_TOKENS", 0, minimum=0)
if ROUTER_KV_TOKEN_WEIGHT < 0 or ROUTER_KV_LOAD_WEIGHT < 0:
    raise ImproperlyConfigured("ROUTER_KV_TOKEN_WEIGHT and ROUTER_KV_LOAD_WEIGHT must be >= 0")
# Admission (inference/router/admission.py): each decode worker is given its batch slots plus a
# quarter; further requests wait in a FIFO queue at most ROUTER_QUEUE_TIMEOUT_S seconds, and at most
# ROUTER_MAX_QUEUE of them, before a 429 with Retry-After.
ROUTER_QUEUE_TIMEOUT_S = env_float("ROUTER_QUEUE_TIMEOUT_S", 30.0)
if ROUTER_QUEUE_TIMEOUT_S <= 0:
    raise ImproperlyConfigured(f"ROUTER_QUEUE_TIMEOUT_S={ROUTER_QUEUE_TIMEOUT_S} must be > 0")
ROUTER_MAX_QUEUE = env_int("ROUTER_MAX_QUEUE", 1024, minimum=0)
# An optional hard cap on the generations one router process holds (admitted and queued); 0: none,
# the deployment's decode slots and ROUTER_MAX_QUEUE bound it.
ROUTER_MAX_INFLIGHT = env_int("ROUTER_MAX_INFLIGHT", 0, minimum=0)
# A stream whose decode worker fails after its first token moves to another decode worker (prompt +
# tokens so far are prefilled again) at most this many times; 0 ends it with an error event instead.
ROUTER_MAX_MIGRATIONS = env_int("ROUTER_MAX_MIGRATIONS", 2, minimum=0)
# Tokens a decode worker may generate past what this router has handed to the client (acknowledged
# every half of it): a client that hangs up costs at most about this many tokens, however late
# its abort lands. 0: off (the worker generates on until the abort).
ROUTER_STREAM_CREDIT = env_int("ROUTER_STREAM_CREDIT", 16, minimum=0)
if ROUTER_STREAM_CREDIT == 1:
    raise ImproperlyConfigured("ROUTER_STREAM_CREDIT=1 would stall every stream after each token: use 0 (off) or >= 2")
# Other names the OpenAI endpoints accept for the served model ("alias=served,..."); any other
# unknown `model` is a 404 in OpenAI's error format.
ROUTER_MODEL_ALIASES: dict[str, str] = {}
for _item in env_list("ROUTER_MODEL_ALIASES"):
    _alias, _sep, _served = (part.strip() for part in _item.partition("="))
    if not _sep or not _alias or not _served:
        raise ImproperlyConfigured(f"ROUTER_MODEL_ALIASES: {_item!r} is not alias=served-model-name")
    ROUTER_MODEL_ALIASES[_alias] = _served
ROUTER_MAX_BODY_BYTES = env_int("ROUTER_MAX_BODY_BYTES", 1_000_000, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = ROUTER_MAX_BODY_BYTES
# Shared secret that internal worker endpoints and KV ports accept (empty: no check, dev only).
PLATFORM_SHARED_SECRET = env_str("PLATFORM_SHARED_SECRET", "") or ""

# Security of the public generation API (docs/security.md; enforced by inference/gateway/auth.py).
# Keys the router accepts as `Authorization: Bearer <key>` (comma separated); DRF tokens of active
# users are accepted too once auth is on. No keys and no ROUTER_REQUIRE_AUTH: open (quick start only).
PLATFORM_PRODUCTION = env_bool("PLATFORM_PRODUCTION", False)
ROUTER_API_KEYS = env_list("ROUTER_API_KEYS")
ROUTER_REQUIRE_AUTH = env_bool("ROUTER_REQUIRE_AUTH", False)
# How long a DRF token lookup is trusted (a revoked token keeps working at most this long).
ROUTER_AUTH_CACHE_S = env_float("ROUTER_AUTH_CACHE_S", 30.0)
# API keys made in the admin / REST API (inference/gateway/api_keys.py): each router process reloads them
# in the background when its snapshot is older than ROUTER_KEY_REFRESH_S, and before answering when it is
# older than ROUTER_KEY_MAX_STALE_S: a revoked key is refused by every router within that bound.
ROUTER_KEY_REFRESH_S = env_float("ROUTER_KEY_REFRESH_S", 2.0)
ROUTER_KEY_MAX_STALE_S = env_float("ROUTER_KEY_MAX_STALE_S", 4.0)
if not 0 < ROUTER_KEY_REFRESH_S <= ROUTER_KEY_MAX_STALE_S:
    raise ImproperlyConfigured("need 0 < ROUTER_KEY_REFRESH_S <= ROUTER_KEY_MAX_STALE_S")
# Per-key usage counted by a router is written to the database this long after its first count.
ROUTER_USAGE_FLUSH_S = env_float("ROUTER_USAGE_FLUSH_S", 10.0)
# Per-key limits in Redis are leased to each router in small blocks; what a router that died held
# (permits, concurrency slots) is given back this long after its last renewal.
ROUTER_QUOTA_LEASE_S = env_float("ROUTER_QUOTA_LEASE_S", 10.0)
if ROUTER_QUOTA_LEASE_S <= 0:
    raise ImproperlyConfigured("ROUTER_QUOTA_LEASE_S must be > 0")
# Production refuses to start with an open generation API unless this says it is meant (a private network).
ROUTER_ALLOW_OPEN_GENERATION = env_bool("ROUTER_ALLOW_OPEN_GENERATION", False)
# Largest ws/generate message; HTTP bodies are bounded by ROUTER_MAX_BODY_BYTES above.
ROUTER_MAX_WS_MESSAGE_BYTES = env_int("ROUTER_MAX_WS_MESSAGE_BYTES", ROUTER_MAX_BODY_BYTES, minimum=1024)
if PLATFORM_PRODUCTION:
    # Fail at startup rather than serve an open API or unauthenticated workers by accident.
    if not ROUTER_API_KEYS and not ROUTER_REQUIRE_AUTH and not ROUTER_ALLOW_OPEN_GENERATION:
        raise ImproperlyConfigured(
            "PLATFORM_PRODUCTION=1 needs ROUTER_REQUIRE_AUTH=1 (API keys from the admin or POST /api/keys/, "
            "and DRF tokens) or ROUTER_API_KEYS (comma separated): the generation API must not be open "
            "(ROUTER_ALLOW_OPEN_GENERATION=1 if it is meant to be)"
        )
    if not PLATFORM_SHARED_SECRET:
        raise ImproperlyConfigured(
            "PLATFORM_PRODUCTION=1 needs PLATFORM_SHARED_SECRET: workers' internal endpoints and KV "
            "ports accept only callers holding it"
        )

# Control plane: agents (inference.agent), controller (inference.controller), scaling (inference.scaling).
# A node whose agent has not sent a heartbeat for this long goes OFFLINE; its workers are re-placed.
NODE_HEARTBEAT_TIMEOUT_S = env_float("NODE_HEARTBEAT_TIMEOUT_S", 15.0)
AGENT_HEARTBEAT_INTERVAL_S = env_float("AGENT_HEARTBEAT_INTERVAL_S", 2.0)
AGENT_HEALTH_INTERVAL_S = env_float("AGENT_HEALTH_INTERVAL_S", 2.0)
AGENT_HEALTH_TIMEOUT_S = env_float("AGENT_HEALTH_TIMEOUT_S", 2.0)
# Consecutive failed health checks before a RUNNING worker is UNHEALTHY (one slow answer is no failure).
AGENT_HEALTH_FAILURES = env_int("AGENT_HEALTH_FAILURES", 3, minimum=1)
# Loading a large model takes a while; a worker not healthy by then is killed and restarted.
AGENT_STARTUP_TIMEOUT_S = env_float("AGENT_STARTUP_TIMEOUT_S", 180.0)
# A live process failing health checks this long is killed and restarted.
AGENT_UNHEALTHY_TIMEOUT_S = env_float("AGENT_UNHEALTHY_TIMEOUT_S", 30.0)
# Crash restarts wait BACKOFF * 2^(n-1) (capped at BACKOFF_MAX) for the n-th crash in the window;
# the (MAX_RESTARTS + 1)-th crash within the window marks the worker FAILED.
AGENT_RESTART_BACKOFF_S = env_float("AGENT_RESTART_BACKOFF_S", 1.0)
AGENT_RESTART_BACKOFF_MAX_S = env_float("AGENT_RESTART_BACKOFF_MAX_S", 60.0)
AGENT_MAX_RESTARTS = env_int("AGENT_MAX_RESTARTS", 5, minimum=0)
AGENT_RESTART_WINDOW_S = env_float("AGENT_RESTART_WINDOW_S", 600.0)
# SIGTERM, then SIGKILL after this long.
AGENT_STOP_TIMEOUT_S = env_float("AGENT_STOP_TIMEOUT_S", 10.0)
# A draining worker is stopped once idle, or after this long whatever it still runs.
AGENT_DRAIN_TIMEOUT_S = env_float("AGENT_DRAIN_TIMEOUT_S", 120.0)
# How often an agent compares its processes with the database (covers lost Celery messages).
AGENT_SYNC_INTERVAL_S = env_float("AGENT_SYNC_INTERVAL_S", 5.0)
AGENT_LOG_DIR = Path(env_str("AGENT_LOG_DIR", str(VAR_DIR / "logs")) or VAR_DIR / "logs")
# A PENDING worker's start request is sent again when its agent has not picked it up after this long.
CONTROLLER_PENDING_RESEND_S = env_float("CONTROLLER_PENDING_RESEND_S", 60.0)
# After a worker FAILED on a node, the controller places that deployment+role elsewhere for this long.
CONTROLLER_FAILURE_COOLDOWN_S = env_float("CONTROLLER_FAILURE_COOLDOWN_S", 300.0)
# A freshly started controller only logs (does not record as events) placements refused because no agent
# has registered yet, for this long: the normal start-up order is not a fault.
CONTROLLER_STARTUP_GRACE_S = env_float("CONTROLLER_STARTUP_GRACE_S", 60.0)
# collect_metrics: per-request timeout when scraping a worker's /metrics and /health.
METRICS_SCRAPE_TIMEOUT_S = env_float("METRICS_SCRAPE_TIMEOUT_S", 2.0)
# Scaling ignores a worker's load when its last health report is older than this.
SCALING_HEALTH_MAX_AGE_S = env_float("SCALING_HEALTH_MAX_AGE_S", 30.0)
# Rules judge a window of readings (their duration_s, one reading per evaluation, every 10 s): this
# share of the window's readings must breach (the rest may be missing or dissent), and the window's
# first reading may come at most SCALING_WINDOW_GAP_S after its start (evaluation jitter).
SCALING_WINDOW_SHARE = env_float("SCALING_WINDOW_SHARE", 0.8)
SCALING_WINDOW_GAP_S = env_float("SCALING_WINDOW_GAP_S", 5.0)
# The prefill queueing wait (pending prompt tokens over the tokens/s prefill sustains) at which prefill
# load reads 1.0.
SCALING_PREFILL_WAIT_TARGET_S = env_float("SCALING_PREFILL_WAIT_TARGET_S", 1.0)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("PLATFORM_LOG_LEVEL", "INFO") or "INFO"},
}
