"""Worker moves from the `nodes` app to `inference` (next to Deployment), keeping its table and rows.

Only Django's model state changes: `nodes_worker`, its rows, ids, constraints and the ScaleEvent link
table stay as they are (SeparateDatabaseAndState, db_table "nodes_worker"). The content type
nodes.worker becomes inference.worker, so permissions and admin history follow the model.
nodes.0004 then drops Worker from the nodes app's state; `run_before` orders it after this one without
the lower `nodes` app's migrations naming `inference`.
"""
import django.db.models.deletion
from django.apps.registry import Apps
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor


def move_content_type(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    """nodes.worker → inference.worker (unless a fresh database already made inference.worker)."""
    content_type = apps.get_model("contenttypes", "ContentType")
    if not content_type.objects.filter(app_label="inference", model="worker").exists():
        content_type.objects.filter(app_label="nodes", model="worker").update(app_label="inference")


def restore_content_type(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    """inference.worker → nodes.worker, for a migration back."""
    content_type = apps.get_model("contenttypes", "ContentType")
    if not content_type.objects.filter(app_label="nodes", model="worker").exists():
        content_type.objects.filter(app_label="inference", model="worker").update(app_label="nodes")


class Migration(migrations.Migration):

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("inference", "0004_scaling_signals"),
        ("nodes", "0003_worker_process_started_at_node_unreachable"),
    ]
    run_before = [("nodes", "0004_worker_moved_to_inference")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name="Worker",
                    fields=[
                        ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                        ("role", models.CharField(choices=[("prefill", "Prefill"), ("decode", "Decode")], max_length=16)),
                        ("port", models.PositiveIntegerField()),
                        ("kv_port", models.PositiveIntegerField(blank=True, null=True)),
                        ("pid", models.PositiveIntegerField(blank=True, null=True)),
                        ("process_started_at", models.FloatField(blank=True, help_text="start time of the process (epoch seconds, as the OS reports it): with pid and port it tells a restarted agent that a running process is this worker's, not a reused pid", null=True)),
                        ("status", models.CharField(choices=[("pending", "Pending"), ("starting", "Starting"), ("running", "Running"), ("unhealthy", "Unhealthy"), ("draining", "Draining"), ("stopping", "Stopping"), ("stopped", "Stopped"), ("failed", "Failed")], default="pending", max_length=16)),
                        ("restarts", models.PositiveIntegerField(default=0)),
                        ("cpu_ids", models.JSONField(blank=True, default=list)),
                        ("gpu_ids", models.JSONField(blank=True, default=list)),
                        ("last_health", models.JSONField(blank=True, default=dict)),
                        ("last_metrics", models.JSONField(blank=True, default=dict)),
                        ("last_error", models.TextField(blank=True)),
                        ("last_seen", models.DateTimeField(blank=True, null=True)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        ("updated_at", models.DateTimeField(auto_now=True)),
                        ("deployment", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="workers", to="inference.deployment")),
                        ("node", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="workers", to="nodes.node")),
                    ],
                    options={
                        "db_table": "nodes_worker",
                        "ordering": ["deployment_id", "role", "id"],
                        "constraints": [
                            models.UniqueConstraint(condition=models.Q(("status__in", ["stopped", "failed"]), _negated=True), fields=("node", "port"), name="unique_live_port_per_node"),
                        ],
                    },
                ),
                migrations.AlterField(
                    model_name="scaleevent",
                    name="placed_workers",
                    field=models.ManyToManyField(blank=True, help_text="workers the controller placed to carry out this change", related_name="scale_events", to="inference.worker"),
                ),
            ],
        ),
        migrations.RunPython(move_content_type, restore_content_type),
    ]
