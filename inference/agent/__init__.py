"""The per-host agent: a supervisor of worker processes, a heartbeat, and (in the command) a Celery worker.

`inference.agent.supervisor.Supervisor` does the process work; `inference.agent.runtime` holds the supervisor of
this process so that the Celery tasks in `inference.agent.tasks` (run by the agent's own Celery worker) reach it.
"""
