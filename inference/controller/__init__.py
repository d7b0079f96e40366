"""The controller: desired replicas made real.

- `reconciler`: per deployment and role, start missing workers and drain surplus ones;
- `placement`: where a new worker goes (node, ports, CPU pinning, GPUs) and the scale event it carries out;
- `pinning`: CPU ranges that live workers share (the node admin shows them);
- `heartbeats`: silent nodes become UNREACHABLE, their workers are probed and failed over when they stop answering.
Celery runs these through inference.tasks; they change workers through inference.actions.
"""
