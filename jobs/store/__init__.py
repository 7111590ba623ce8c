"""The SQL system of record, one class per role. Every job state change is one transaction.

=====================  ==================================================================
``ProducerStore``      producers: insert jobs and batches, configure a batch, cancel
``DeliveryStore``      workers: count deliveries and decide, store outcomes, hand jobs back
``FeedStore``          producers and workers: take the backlog in order, mark it fed
``MaintenanceStore``   the reconciler and the control plane: deadlines, reaping, retention
``BatchStore``         the control plane: batch completion, finalization, webhook attempts
``JobReader``          everyone who reads: jobs, batches, counts, the ``job_stats`` rows
=====================  ==================================================================

Invariants (all roles):
  * A job row exists from submission on; Redis only ever holds copies of queued jobs, and only
    of those marked fed (``fed_at``): the rest wait in SQL, the backlog.
  * Terminal transitions are guarded by ``status IN ('queued', 'running')``, so however often a
    job is delivered, exactly one transition (and one ``job_metrics`` row) wins.
  * ``attempts`` counts deliveries to workers; a voluntary hand-back (graceful shutdown) gives
    the attempt back.

Each class holds only a SQLAlchemy ``Engine`` and is thread-safe to the extent it is (each call
is its own session and transaction).
"""

from jobs.store.batches import BatchState, BatchStore
from jobs.store.delivery import Decision, DeliveryStore
from jobs.store.feed import FeedStore
from jobs.store.maintenance import MaintenanceStore
from jobs.store.producer import ProducerStore
from jobs.store.reads import JobReader
from jobs.store.transitions import db_now, to_dt

__all__ = ["BatchState", "BatchStore", "Decision", "DeliveryStore", "FeedStore", "JobReader",
           "MaintenanceStore", "ProducerStore", "db_now", "to_dt"]
