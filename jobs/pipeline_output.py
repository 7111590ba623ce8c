"""Where a pipeline run's rows go: a JSONL file written as rows are done, a Parquet file
written when the run ends, or a Hugging Face ``datasets.Dataset``; each final row with its
lineage columns.

An output record is the row as JSON-able values (a pydantic record becomes a dict, a Parquet
struct) plus :data:`LINEAGE_COLUMNS`: ``_stage`` (the stage the row came out of), ``_key``
(its row key there, the ``custom_id`` of its job), ``_parent`` (the key of the row of the
stage before that it came from; null for a first stage's row) and ``_lineage`` (stage -> the
key of each row it came from, its own included). The keys are those in the jobs' metadata
in SQL, so a row can be joined back to its jobs.

pyarrow and ``datasets`` (the ``datasets`` extra: ``pip install 'kvbatch[datasets]'``) are
imported only when Parquet or a Dataset is asked for.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from pydantic_core import to_jsonable_python

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

RowDict = dict[str, Any]
LINEAGE_COLUMNS = ("_stage", "_key", "_parent", "_lineage")
PARQUET_SUFFIX = ".parquet"


def _need(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"a Parquet output or a Dataset needs {module.split('.')[0]}: "
                          "pip install 'kvbatch[datasets]'") from exc


def output_record(row: RowDict, lineage: dict[str, str]) -> RowDict:
    """A final row as written: its fields as JSON-able values, then the lineage columns
    (``lineage``: stage -> key, in stage order, ending with the row's own stage)."""
    stages = list(lineage)
    return {**to_jsonable_python(row), "_stage": stages[-1], "_key": lineage[stages[-1]],
            "_parent": lineage[stages[-2]] if len(stages) > 1 else None,
            "_lineage": dict(lineage)}


def arrow_table(records: Iterable[RowDict]) -> pa.Table:
    """Records as one Arrow table: a column per field any record has (in order of first
    appearance; null where a record lacks it), each column's type inferred from all its values.

    Raises:
        ValueError: a field whose values have no common type (``3`` in one row, ``"x"`` in
            another), naming it.
    """
    pa = _need("pyarrow")
    records = list(records)
    if not records:  # no row, no types to infer: the key columns alone (strings)
        return pa.table({name: pa.array([], pa.string()) for name in LINEAGE_COLUMNS[:3]})
    names = list(dict.fromkeys(name for record in records for name in record))
    columns = {}
    for name in names:
        try:
            columns[name] = pa.array([record.get(name) for record in records])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ValueError(f"field {name!r} has values of no one type, which a Parquet "
                             f"column needs ({exc}); write JSONL instead") from exc
    return pa.table(columns)


def to_dataset(records: Iterable[RowDict]) -> datasets.Dataset:
    """Records as a Hugging Face ``datasets.Dataset`` (in memory, from :func:`arrow_table`)."""
    return _need("datasets").Dataset(arrow_table(records))


class RecordSink(Protocol):
    """Where records are written: ``write`` each, then ``close`` once, ``finished`` when the
    run reached its end (False: it was stopped or failed)."""

    def write(self, record: RowDict) -> None: ...

    def close(self, finished: bool) -> None: ...


class JsonlSink:
    """A JSON line per record, flushed as it is written: a run that is stopped keeps the
    lines of the rows it finished."""

    def __init__(self, path: Path) -> None:
        self.file: IO[str] = open(path, "w")  # noqa: SIM115  # closed by close()

    def write(self, record: RowDict) -> None:
        self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self, finished: bool) -> None:
        self.file.close()


class ParquetSink:
    """The records as one Parquet file, written when the sink is closed (a Parquet file's
    schema and footer come once, after every row): first to a temporary file beside it, then
    renamed; a run that is stopped or fails writes none."""

    def __init__(self, path: Path) -> None:
        _need("pyarrow")  # fail before the run, not after it
        self.path = path
        self.records: list[RowDict] = []
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: RowDict) -> None:
        self.records.append(record)

    def close(self, finished: bool) -> None:
        if not finished:
            return
        partial = self.path.with_name(f".{self.path.name}.partial")
        _need("pyarrow.parquet").write_table(arrow_table(self.records), partial)
        os.replace(partial, self.path)


def open_sink(path: str | Path) -> RecordSink:
    """A sink for ``path``: Parquet when its name ends in ``.parquet``, else JSONL."""
    path = Path(path)
    return ParquetSink(path) if path.suffix == PARQUET_SUFFIX else JsonlSink(path)
