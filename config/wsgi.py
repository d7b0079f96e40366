"""WSGI entry point (admin and REST API behind a WSGI server, if preferred over ASGI)."""
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
application = get_wsgi_application()

from config.web_gc import tune_web_gc  # noqa: E402  (after Django's setup)

# Once the app is loaded: the full collections that set the admin pages' p95 walk only what the process
# allocated since (config/web_gc.py).
tune_web_gc()
