"""The router's Django-free core: endpoints, load-balancing policies, the worker pool with its
health checks, and the disaggregated (decode + prefill) request client.

Nothing here imports Django (an import-linter contract in .ci/run checks it): the Channels
consumers of `inference.gateway` are thin layers on top, and this package can be used and tested
alone.
"""
from inference.router.admission import Admission
from inference.router.endpoint import Endpoint, normalize_url
from inference.router.errors import RouterError
from inference.router.events import DoneEvent, ErrorEvent, Event, GenerateRequest, TokenEvent, new_request_id
from inference.router.metrics import RouterMetrics
from inference.router.pd_client import DisaggregatedClient
from inference.router.policies import make_policy, policy_names
from inference.router.pool import WorkerPool

__all__ = [
    "Admission",
    "DisaggregatedClient",
    "DoneEvent",
    "Endpoint",
    "ErrorEvent",
    "Event",
    "GenerateRequest",
    "RouterError",
    "RouterMetrics",
    "TokenEvent",
    "WorkerPool",
    "make_policy",
    "new_request_id",
    "normalize_url",
    "policy_names",
]
