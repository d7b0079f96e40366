"""Record the Celery messages the control plane sends, instead of sending them (import the fixture)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class SentTasks:
    """Messages recorded as (task name, kwargs, queue)."""

    calls: list[tuple[str, dict[str, Any], str | None]] = field(default_factory=list)

    def named(self, name: str) -> list[tuple[dict[str, Any], str | None]]:
        """Calls of one task (short name, e.g. "start_worker"): (kwargs, queue)."""
        return [(kw, q) for n, kw, q in self.calls if n.rsplit(".", 1)[-1] == name]

    def clear(self) -> None:
        """Forget what was recorded."""
        self.calls.clear()


@pytest.fixture
def sent_tasks(monkeypatch: pytest.MonkeyPatch) -> Iterator[SentTasks]:
    """Patch apply_async/delay of the node and controller tasks to record (not send) their messages."""
    import inference.agent.tasks
    import inference.tasks

    sent = SentTasks()

    def patch(task: Any) -> None:
        def apply_async(args: Any = None, kwargs: Any = None, queue: str | None = None, **options: Any) -> None:
            sent.calls.append((task.name, dict(kwargs or {}), queue))

        def delay(*args: Any, **kwargs: Any) -> None:
            sent.calls.append((task.name, dict(kwargs), None))

        monkeypatch.setattr(task, "apply_async", apply_async)
        monkeypatch.setattr(task, "delay", delay)

    for task in (inference.agent.tasks.start_worker, inference.agent.tasks.stop_worker,
                 inference.agent.tasks.restart_worker,
                 inference.tasks.reconcile_deployment):
        patch(task)
    yield sent
