"""Every state change of the inference app: the admin, the REST API, Celery tasks, consumers and agents
call these instead of saving models themselves.

- `scale`: replica changes (locked, clamped, recorded as ScaleEvents, reconciled on commit) and the
  operator's manual scale, checked against schedule rules and queued for the controller;
- `deployments`: create, edit and delete deployments; `rules`: scaling rule saves;
- `workers`: requests to a worker's agent (start, stop, restart) and the agent's reports;
- `nodes`: a node's workers given up, probed or drained; `recovery`: the "recovery" ScaleEvent they share;
- `samples`: metric samples written and pruned.
Actions enqueue Celery work through inference.jobs, by task name: tasks import actions, never the reverse.
Reads are in inference.selectors.
"""
