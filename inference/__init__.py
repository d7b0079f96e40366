"""Inference: the Django app `inference` (the control plane) beside the Django-free data plane.

Control plane (Django): models/, actions/, selectors/, scaling/, controller/, metrics/, jobs.py, admin/, api/,
gateway/ (how the router is hosted), agent/, management/, tasks.py. Data plane (no Django): engine/,
kv_transfer/, server/, router/, wire/, tools/. lint-imports checks both the split and the control plane's
layers (pyproject.toml).

This package's __init__ must stay free of Django imports: worker processes import `inference.engine`,
`inference.server` and `inference.kv_transfer` without Django installed or set up.
"""
