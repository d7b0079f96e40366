"""Worker now belongs to the `inference` app (inference.0005 runs first and took over its table):
drop it from this app's state only, the table `nodes_worker` and its rows stay."""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("nodes", "0003_worker_process_started_at_node_unreachable"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[migrations.DeleteModel(name="Worker")],
        ),
    ]
