"""Metrics of the platform's processes, read by the control plane.

- `exposition`: parsing of the Prometheus text the workers and routers serve, and what two scrapes differ by;
- `collector`: scrapes RUNNING workers and routers, stores role, worker and router samples (Celery beat);
- `prometheus`: file_sd target groups for an external Prometheus (`manage.py prometheus_targets`).
"""
