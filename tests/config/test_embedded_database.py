"""The embedded default database (SQLite, what `make up` uses without DATABASE_URL): processes and
threads that read then write inside one transaction wait for each other instead of failing."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Thread A reads then writes in one transaction while thread B writes and commits in between. With
# SQLite's default deferred transactions A's write fails at once with "database is locked" (its read
# snapshot is stale: the busy timeout does not apply); this is how the agent's node registration
# failed against the controller's writes during `make up`.
SCRIPT = textwrap.dedent(
    """
    import threading, time
    import django
    django.setup()
    from django.db import connection, transaction
    with connection.cursor() as c:
        c.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v INTEGER)")
        c.execute("INSERT INTO t VALUES (1, 0)")
    read, errors = threading.Event(), []

    def writer():
        read.wait(5)
        try:
            with transaction.atomic(), connection.cursor() as c:
                c.execute("UPDATE t SET v = v + 1")
        except Exception as exc:
            errors.append(repr(exc))
        finally:
            connection.close()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        with transaction.atomic(), connection.cursor() as c:
            c.execute("SELECT v FROM t")
            read.set()
            time.sleep(0.5)  # the other writer commits meanwhile, or waits for this transaction
            c.execute("UPDATE t SET v = v + 10")
    except Exception as exc:
        errors.append(repr(exc))
    thread.join(30)
    with connection.cursor() as c:
        c.execute("SELECT v FROM t")
        print(errors, c.fetchone()[0])
    """
)


def test_read_then_write_transactions_wait_instead_of_failing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(DJANGO_SETTINGS_MODULE="config.settings", PLATFORM_VAR_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]", "11"]  # no error, both updates applied
