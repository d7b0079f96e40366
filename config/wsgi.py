"""WSGI entry point (admin and REST API behind a WSGI server, if preferred over ASGI)."""
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
application = get_wsgi_application()
