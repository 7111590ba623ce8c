"""The control plane: a Celery app (Redis broker, JSON only) whose beat schedule expires jobs
and batches past their deadline, finalizes batches, purges old results and reaps jobs that used
up their deliveries. Not on the hot path; every task is idempotent. ``kvbatch control`` runs a
Celery worker with the beat scheduler embedded."""
