"""Operator tools that run outside Django: the ``load_test`` client and model preparation.

Django-free (import-linter forbids Django here): both run on hosts and in containers that have only
the data-plane dependencies, and the control plane reaches them through thin wrappers (the
``prepare_model`` management command).
"""
