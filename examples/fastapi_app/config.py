"""Settings, from the environment: the web app and the worker read the same ones."""

from __future__ import annotations

import os

#: The application's database, which also holds the ledger: a publish can then ride in
#: the same transaction as the order it belongs to. psycopg 3 serves both the sync
#: engine (worker, migrations) and the asyncio one (web app) under this one URL.
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://localhost/shop")
BROKER_URL = os.environ.get("BROKER_URL", "redis://localhost:6379/0")
#: At least 32 bytes, the same in the web app and every worker: it seals secret payloads.
QUESTPIE_SECRET = os.environ["QUESTPIE_SECRET"]
#: Where the links in sign-in emails point.
PUBLIC_URL = os.environ.get("PUBLIC_URL", "http://localhost:8000")
