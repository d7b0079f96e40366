"""The supervisor of this agent process, for the Celery tasks of `inference.agent.tasks` to reach."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference.agent.supervisor import Supervisor

_lock = threading.Lock()
_supervisor: Supervisor | None = None


class NoSupervisor(RuntimeError):
    """A node task ran in a process that is not an agent (it was routed to the wrong queue)."""


def set_supervisor(supervisor: Supervisor | None) -> None:
    """Install (or remove, with None) this process's supervisor; the agent command calls it."""
    global _supervisor
    with _lock:
        _supervisor = supervisor


def get_supervisor() -> Supervisor:
    """This process's supervisor; NoSupervisor outside an agent."""
    with _lock:
        if _supervisor is None:
            raise NoSupervisor("no agent supervisor in this process: node tasks must go to a node.<name> queue")
        return _supervisor
