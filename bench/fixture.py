"""A PostgreSQL ledger the size of weeks of work, written by one set-based INSERT.

Shared by the benchmarks that need a big ledger (`million.py`, `status_page.py`).
`fill(engine, rows)` adds `rows` dispatches created over the last 30 days, newest first
(i = 1 is the newest), in the proportions a busy ledger has:

- 1% in flight, the newest: queued and pending (the relay's next look an hour ahead),
  active under a live lease, retry due in 5 minutes, parked in a `singleton` slot. Plus
  exactly 20 rows due for the relay (pending, never sent), at any size, so the relay's
  due scan has the same work to do in every ledger.
- 99% ended: completed, 2% of them failed with `RuntimeError`.
- 40% keyed (`order-<i>`), 1% schedule fires (`questpie-schedule:call:<i>`), the rest
  unkeyed; every row with a payload of about 100 bytes and the options a publish stores.

About 77% of the ended rows ended more than 7 days ago: what retention finds the first
time it runs on such a ledger.
"""

from __future__ import annotations

from sqlalchemy import Engine, text

#: The span the rows are created over.
SPAN_SECONDS = 30 * 86400
#: Rows due for the relay, whatever the size.
DUE_ROWS = 20

FILL = f"""
INSERT INTO questpie_queue_dispatch
  (id, job_name, idempotency_key, status, policy, slot, payload, secret, options,
   attempt, claim_token, lease_expires_at, run_after, send_count, next_send_at,
   last_error, created_at, queued_at, started_at, finished_at)
SELECT
  md5('qp' || i)::uuid::text,
  'job-' || (i % 12),
  CASE WHEN i % 100 = 57 THEN 'questpie-schedule:call:' || i
       WHEN i % 10 < 4 THEN 'order-' || i END,
  s.status,
  CASE WHEN s.status = 'parked' THEN 'singleton' END,
  CASE WHEN s.status = 'parked' THEN 'slot-' || (i % 50) END,
  json_build_object('order_id', i, 'email', 'customer-' || i || '@example.com',
                    'items', i % 7, 'note', 'gift wrap'),
  false,
  '{{"run": {{"retry_limit": 2, "retry_delay": 0.0, "retry_backoff": false, '
  '"expire_in_seconds": 900}}, "priority": null, "queue": null}}'::json,
  CASE WHEN s.status IN ('pending', 'queued', 'parked') THEN 0 ELSE 1 END,
  CASE WHEN s.status IN ('pending', 'queued', 'parked') THEN NULL
       ELSE md5('token' || i)::uuid::text END,
  CASE WHEN s.status = 'active' THEN now() + interval '1 minute' END,
  CASE WHEN s.status = 'pending' AND i > {DUE_ROWS} THEN now() + interval '1 hour'
       ELSE s.created END,
  CASE WHEN s.status IN ('pending', 'queued', 'parked') THEN 0 ELSE 1 END,
  CASE WHEN i <= {DUE_ROWS} THEN now() - interval '1 minute'
       WHEN s.status IN ('pending', 'queued') THEN now() + interval '1 hour'
       WHEN s.status = 'retry' THEN now() + interval '5 minutes'
       ELSE s.created + interval '1 hour' END,
  CASE WHEN s.status = 'failed' THEN 'RuntimeError' END,
  s.created,
  CASE WHEN s.status <> 'pending' THEN s.created + interval '50 milliseconds' END,
  CASE WHEN s.status IN ('active', 'retry', 'completed', 'failed')
       THEN s.created + interval '1 second' END,
  CASE WHEN s.status IN ('completed', 'failed') THEN s.created + interval '2 seconds' END
FROM generate_series(1, :rows) AS i,
LATERAL (SELECT
  now() - make_interval(secs => i * {SPAN_SECONDS}.0 / :rows) AS created,
  CASE WHEN i <= {DUE_ROWS} THEN 'pending'
       WHEN i <= greatest(:rows / 100, {DUE_ROWS} + 10) THEN
         (ARRAY['queued', 'queued', 'queued', 'queued', 'pending', 'pending',
                'active', 'active', 'retry', 'parked'])[i % 10 + 1]
       WHEN i % 50 = 0 THEN 'failed'
       ELSE 'completed' END AS status) AS s
"""


def fill(engine: Engine, rows: int) -> None:
    """Add `rows` dispatches to a migrated, empty ledger, then VACUUM ANALYZE it."""
    with engine.begin() as conn:
        conn.execute(text(FILL), {"rows": rows})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE questpie_queue_dispatch"))
