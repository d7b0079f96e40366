"""ScaleEvent.refused (placements the controller could not make) and the "bootstrap" scale source.

Existing events whose reason starts with "placement refused" (how refusals were told apart before)
are marked refused, so lists and charts show the history the same way as new events.
"""
from django.apps.registry import Apps
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

SOURCES = [
    ("manual", "Admin"), ("api", "REST API"), ("threshold", "Threshold rule"), ("schedule", "Schedule rule"),
    ("slo", "SLO rule"), ("recovery", "Recovery"), ("bootstrap", "Bootstrap"),
]


def mark_refused(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    """Flag the refusals recorded before the field existed."""
    event_model = apps.get_model("inference", "ScaleEvent")
    event_model.objects.filter(reason__startswith="placement refused").update(refused=True)


class Migration(migrations.Migration):
    dependencies = [
        ("inference", "0005_worker_from_nodes"),
    ]

    operations = [
        migrations.AddField(
            model_name="scaleevent",
            name="refused",
            field=models.BooleanField(
                default=False, help_text="the controller could not place the workers (the reason says why)"
            ),
        ),
        migrations.AlterField(
            model_name="scaleevent", name="source", field=models.CharField(choices=SOURCES, max_length=16),
        ),
        migrations.AlterField(
            model_name="scaleoverride", name="source", field=models.CharField(choices=SOURCES, max_length=16),
        ),
        migrations.RunPython(mark_refused, migrations.RunPython.noop),
    ]
