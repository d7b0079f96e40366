"""Date and time formats of the admin (FORMAT_MODULE_PATH): timestamps to the second, in ISO order."""
