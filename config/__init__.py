"""The Django project of the platform (named `config`, not `platform`, which would shadow the stdlib)."""
