"""Formats for English (Django's FORMAT_MODULE_PATH): every timestamp of the admin to the second, in
ISO order ("2026-12-04 03:00:12"), so that events seconds apart can be ordered by eye; Django's own
English default ("Dec. 4, 2026, 3 a.m.") drops the minutes and seconds."""

DATETIME_FORMAT = "Y-m-d H:i:s"
SHORT_DATETIME_FORMAT = "Y-m-d H:i:s"
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = "Y-m-d"
TIME_FORMAT = "H:i:s"
