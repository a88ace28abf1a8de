"""Chords and batches the ledger completes: how a canvas is written with its members
(`recording`), how it ends exactly once (`completion`), and the run results its
callback is given (`results`). The user's `chord` is `questpie_celery.chord`."""
