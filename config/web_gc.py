"""Garbage collection of the web process (the ASGI app: admin, REST API, router; or the WSGI app), set once
at startup by config/asgi.py and config/wsgi.py.

Python's full (generation-2) collection walks every tracked object, and a Django process holds ~130,000
of them after setup (modules, models, admin, URL patterns, compiled templates) that live as long as the
process. Before this, one admin deployment page in about eight paid a full collection during the request:
+100-300 ms of CPU at 1,000 workers (Zen 4 and Zen 5 EPYC, bench/sim/page_timing.py), the pages' p95.
`gc.freeze()` moves the objects alive after setup, and again after the first requests (URL resolvers,
compiled templates, caches filled lazily), out of the collector's sight: later full collections walk only
what the process allocated since. A larger generation-0 threshold makes the young collections, which a
rendered page triggers dozens of times, fewer (each walks only young objects, so the total work is similar).
Cyclic garbage is still collected; only objects alive at a freeze are never walked again.
"""
from __future__ import annotations

import gc
import itertools
from typing import Any

from django.core.signals import request_finished

# Young objects allocated before a generation-0 collection (Python's default: 700).
GEN0_THRESHOLD = 7000
# Requests after which what they left (templates compiled, URL patterns resolved) is frozen too.
WARM_UP_REQUESTS = 3

_finished = itertools.count(1)


def tune_web_gc() -> None:
    """Freeze what Django's setup left, raise the generation-0 threshold, and freeze once more after the
    first WARM_UP_REQUESTS requests. Call once, after the application is loaded."""
    gc.collect()  # garbage frozen would never be freed
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
    request_finished.connect(_freeze_after_warm_up, dispatch_uid="config.web_gc")


def _freeze_after_warm_up(sender: Any, **kwargs: Any) -> None:
    if next(_finished) < WARM_UP_REQUESTS:
        return
    request_finished.disconnect(dispatch_uid="config.web_gc")
    gc.collect()
    gc.freeze()
