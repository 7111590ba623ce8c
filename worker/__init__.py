"""The kvbatch worker: Redis stream → engine thread → SQL, with leases and metrics."""
