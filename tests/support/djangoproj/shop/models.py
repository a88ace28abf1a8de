"""The test app's own table: every handler run, recorded by the handler."""

from django.db import models


class Run(models.Model):
    job = models.CharField(max_length=200)
    tag = models.CharField(max_length=200)
    dispatch_id = models.CharField(max_length=64)
    attempt = models.IntegerField()
    pid = models.IntegerField()
    ran_at = models.DateTimeField(auto_now_add=True)


class Order(models.Model):
    tag = models.CharField(max_length=200)
