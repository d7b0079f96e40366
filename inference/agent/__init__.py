"""The per-host agent: a supervisor of worker processes, a heartbeat, and (in the command) a Celery worker.

`inference.agent.supervisor.Supervisor` does the process work (its parts: `launch`, the argv and environment
of a worker; `processes`, probes and signals; `lifecycle`, the per-worker steps; `adoption`, recovery
after a restart and the sync with the database; `state`); `inference.agent.runtime` holds the supervisor of
this process so that the Celery tasks in `inference.agent.tasks` (run by the agent's own Celery worker) reach it.
"""
