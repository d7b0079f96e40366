"""`python manage.py <command>` entry points of the inference app."""
