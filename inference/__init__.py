"""Inference: the Django app (models, API, router views) plus Django-free engine, server and KV code.

This package's __init__ must stay free of Django imports: worker processes import
`inference.engine`, `inference.server` and `inference.kv_transfer` without Django installed or set up.
"""
