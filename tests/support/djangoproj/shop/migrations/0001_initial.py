from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = []  # noqa: RUF012

    operations = [  # noqa: RUF012
        migrations.CreateModel(
            name="Order",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("tag", models.CharField(max_length=200)),
            ],
        ),
        migrations.CreateModel(
            name="Run",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("job", models.CharField(max_length=200)),
                ("tag", models.CharField(max_length=200)),
                ("dispatch_id", models.CharField(max_length=64)),
                ("attempt", models.IntegerField()),
                ("pid", models.IntegerField()),
                ("ran_at", models.DateTimeField(auto_now_add=True)),
            ],
        ),
    ]
