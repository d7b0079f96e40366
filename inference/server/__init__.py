"""Prefill and decode worker servers (Django-free): `python -m inference.launch_server`."""
