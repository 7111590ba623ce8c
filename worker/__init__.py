"""The kvbatch worker: Redis stream → engine process → SQL, with leases and metrics."""
