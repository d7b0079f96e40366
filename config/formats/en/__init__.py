"""English formats (see formats.py)."""
