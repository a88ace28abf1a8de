"""The floor of a fenced run: the two durable writes a run makes (its claim, its end),
as the bare driver makes them, for the benchmarks that measure against it
(`bench/app.py`'s raw two-write task, `bench/limits.py`'s floor)."""

CLAIM = (
    "UPDATE questpie_queue_dispatch SET status = 'active', attempt = attempt + 1, "
    "lease_expires_at = now() + interval '60 s', started_at = now() WHERE id = %s "
    "RETURNING *"
)
FINISH = (
    "UPDATE questpie_queue_dispatch SET status = 'completed', finished_at = now(), "
    "lease_expires_at = NULL WHERE id = %s"
)
