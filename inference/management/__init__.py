"""Management commands of the inference app."""
