"""Browser tests: the admin console driven through headless Chromium against a live Django server."""
