"""A FastAPI shop that publishes questpie jobs from its request handlers.

`app.py` is the web app, `jobs/definition.py` the Celery app and its jobs, `models.py` the tables
they share. See README.md in this folder for how to run it.
"""
