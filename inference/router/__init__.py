"""The router's Django-free core: endpoints, load-balancing policies, the worker pool with its
health checks, and the disaggregated (decode + prefill) request client.

Nothing here imports Django: the Django views and the Channels consumer are thin layers on top
(`inference.router_views`, `inference.consumers`), and this package can be used and tested alone.
"""
from inference.router.endpoint import Endpoint, normalize_url
from inference.router.errors import RouterError
from inference.router.pd_client import (
    DisaggregatedClient,
    DoneEvent,
    ErrorEvent,
    Event,
    GenerateRequest,
    TokenEvent,
    new_request_id,
)
from inference.router.policies import make_policy, policy_names
from inference.router.pool import WorkerPool

__all__ = [
    "DisaggregatedClient",
    "DoneEvent",
    "Endpoint",
    "ErrorEvent",
    "Event",
    "GenerateRequest",
    "RouterError",
    "TokenEvent",
    "WorkerPool",
    "make_policy",
    "new_request_id",
    "normalize_url",
    "policy_names",
]
