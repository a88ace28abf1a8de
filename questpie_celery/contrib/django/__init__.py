"""questpie_celery in a Django project."""
