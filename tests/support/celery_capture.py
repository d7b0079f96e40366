"""Record the Celery messages the control plane sends, instead of sending them (import the fixtures).

Every message goes through inference.jobs, which publishes by task name with the project's Celery
app (`app.send_task`); the fixtures replace that one method. `tasks_run_inline` also runs the
controller's tasks (inference.tasks.*) in this process with the published kwargs, as a controller's
Celery worker would, minus the broker; agent tasks are only recorded (they need an agent's supervisor).
"""
from __future__ import annotations

import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import inference.agent.tasks  # noqa: F401  (registers the agent's tasks with the app, as an agent does)
import inference.tasks  # noqa: F401  (registers the controller's tasks, as a controller does)
from config.celery import app


@dataclass
class SentTasks:
    """Messages recorded as (task name, kwargs, queue); `results` of the tasks run inline."""

    calls: list[tuple[str, dict[str, Any], str | None]] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)

    def named(self, name: str) -> list[tuple[dict[str, Any], str | None]]:
        """Calls of one task (short name, e.g. "start_worker"): (kwargs, queue)."""
        return [(kw, q) for n, kw, q in self.calls if n.rsplit(".", 1)[-1] == name]

    def clear(self) -> None:
        """Forget what was recorded."""
        self.calls.clear()
        self.results.clear()


def capture(
    monkeypatch: pytest.MonkeyPatch, *, run_controller_tasks: bool = False, run_only: tuple[str, ...] = ()
) -> SentTasks:
    """Replace the app's send_task: record each message and, if asked, run controller tasks inline
    (all of them, or the ones named in `run_only`)."""
    sent = SentTasks()

    def send_task(name: str, args: Any = None, kwargs: Any = None, queue: str | None = None, **options: Any) -> Any:
        sent.calls.append((name, dict(kwargs or {}), queue))
        if (run_controller_tasks and name.startswith("inference.tasks.")) or name in run_only:
            sent.results.append(app.tasks[name].run(*(args or ()), **(kwargs or {})))
        return types.SimpleNamespace(id=str(uuid.uuid4()))

    monkeypatch.setattr(app, "send_task", send_task)
    return sent


@pytest.fixture
def sent_tasks(monkeypatch: pytest.MonkeyPatch) -> Iterator[SentTasks]:
    """Messages recorded, not sent."""
    yield capture(monkeypatch, run_controller_tasks=False)


@pytest.fixture
def tasks_run_inline(monkeypatch: pytest.MonkeyPatch) -> Iterator[SentTasks]:
    """Messages recorded; the controller's tasks among them run in this process at once."""
    yield capture(monkeypatch, run_controller_tasks=True)
