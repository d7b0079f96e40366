"""Autoscaling: rules turned into replica changes.

- `rules`: threshold, SLO and schedule rules and overrides evaluated into scale actions (Celery beat);
- `signals`: the readings rules judge (role load, p90 TTFT/ITL of fresh worker healths);
- `window`: a rule's window of readings and its verdict (a share may dissent, the window must be covered).
"""
