"""Reads of the inference app shared by the admin, the REST API, the charts and the scaling rules.

- `schedules`: who holds a role's replicas now (active override, active schedule rule) and window texts;
- `metrics`: a deployment's metric series (per role, per worker, router), downsampled;
- `charts`: presentation of those series (labels, units, the charts of the metrics page).
State changes are in inference.actions.
"""
