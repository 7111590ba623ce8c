"""The FastAPI application of ``kvbatch serve``: OpenAI's Files and Batches endpoints and
``/v1/models``, and the rows of a key's named batches (``jobs.api.rows``: what a pipeline run
needs), each behind an API key.

Every object belongs to the key that created it: another key gets 404 for it, exactly as for an
id that does not exist. A missing, unknown or revoked key gets 401. Neither keys nor the
content of files reach the logs (uvicorn's access log shows methods, paths and statuses).
"""

from __future__ import annotations

import re
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobs.api.batches import BatchRunner
from jobs.api.keys import KeyStore
from jobs.api.objects import ApiError, batch_object, file_object, list_object, not_found
from jobs.api.quotas import Quotas
from jobs.api.records import ApiRecords, new_id
from jobs.api.rows import row_routes
from jobs.api.settings import ApiSettings
from jobs.api.storage import DirectoryStorage, FileStorage, Upload
from jobs.client import JobClient
from jobs.echo import quote
from jobs.models import ApiBatch, File
from jobs.sdk import validation_message
from jobs.settings import ConnectionSettings

MAX_FIELD_BYTES = 1 << 16  # a form field other than the file (``purpose``)
MAX_FIELDS = 16
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 86400  # OpenAI's bounds of expires_after[seconds]
MAX_JSON_BYTES = 1 << 20  # any other request's body
# A declared body this far past the upload limit is refused before it is read; a smaller one is
# read (and dropped past the limit) so that the client gets the 413 rather than a broken pipe.
REFUSE_UNREAD_FACTOR = 4
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # refused in a filename (PostgreSQL
# takes no NUL in text; the others would reach a terminal through `kvbatch` and the logs)


class BodyLimit:
    """ASGI middleware: a request other than an upload carries at most ``limit`` bytes (the
    JSON of ``POST /v1/batches`` is small), so no unauthenticated client can make the server
    hold a huge body, 413 past it; and every request's body, uploads included, comes at least
    one chunk every ``read_timeout_s`` (uvicorn has no body read timeout), 408 when it stops
    coming, so that a client that stops mid-body does not hold its request forever."""

    def __init__(self, app: ASGIApp, read_timeout_s: float, limit: int = MAX_JSON_BYTES) -> None:
        self.app, self.read_timeout_s, self.limit = app, read_timeout_s, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def timed() -> Message:
            nonlocal body_done
            if body_done:  # past the body: a wait for the client's disconnect, not a read
                return await receive()
            with anyio.move_on_after(self.read_timeout_s) as wait:
                message = await receive()
            if wait.cancelled_caught:
                raise HTTPException(408, f"the request body stopped coming for "
                                         f"{self.read_timeout_s:g} s")
            body_done = not message.get("more_body", False)
            return message

        if (scope["method"], scope["path"]) == ("POST", "/v1/files"):
            await self.app(scope, timed, send)
            return
        too_big = ApiError(413, f"a request body is at most {self.limit} bytes")
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            await JSONResponse(too_big.body(), 413)(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await timed()
            received += len(message.get("body", b""))
            if received > self.limit:  # a body without a declared length
                # HTTPException: FastAPI turns anything else raised while reading into a 400
                raise HTTPException(413, too_big.message)
            return message

        await self.app(scope, limited, send)


class CreateBatch(BaseModel):
    """``POST /v1/batches``; fields kvbatch does not use (``output_expires_after``) are
    accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def owner(request: Request) -> str:
    """The id of the request's API key (``Authorization: Bearer <key>``); 401 without a live
    one."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "You didn't provide an API key: send it as 'Authorization: "
                            "Bearer <key>' (kvbatch keys create NAME makes one).",
                       code="invalid_api_key")
    key_id = request.app.state.keys.authenticate(key.strip())
    if key_id is None:
        raise ApiError(401, "Incorrect API key provided (unknown or revoked).",
                       code="invalid_api_key")
    return str(key_id)


Owner = Annotated[str, Depends(owner)]


def create_app(settings: ApiSettings, conn: ConnectionSettings,
               deployment_models: Sequence[str]) -> FastAPI:
    """The application on the queue and database of ``conn``, for ``deployment_models``
    (``KVBATCH_MODELS``); its batch runner thread runs while the application does."""
    client = JobClient(database=conn.database_url, redis_url=conn.redis_url,
                       key_prefix=conn.key_prefix)
    records = ApiRecords(client.engine)
    keys = KeyStore(client.engine)
    storage = DirectoryStorage(settings.files_dir)
    runner = BatchRunner(client, records, storage, settings, deployment_models)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        thread = threading.Thread(target=runner.run, name="batch-runner", daemon=True)
        thread.start()
        yield
        runner.stop()
        await anyio.to_thread.run_sync(thread.join, 30.0)
        client.close()

    app = FastAPI(title="kvbatch", summary="OpenAI-compatible Files and Batches",
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runner, app.state.keys = runner, keys
    app.add_middleware(BodyLimit, read_timeout_s=settings.body_read_timeout_s)

    app.include_router(row_routes(client, records, runner.quotas, owner, runner.served_models))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # Field paths and messages only: the values sent are not echoed back.
        return JSONResponse(ApiError(400, validation_message(exc.errors())).body(), 400)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), exc.status_code)

    def own_file(file_id: str, key: str) -> File:
        row = records.get(File, key, file_id)
        if row is None:
            raise not_found("file", file_id)
        return row

    def own_batch(batch_id: str, key: str) -> ApiBatch:
        row = records.get(ApiBatch, key, batch_id)
        if row is None:
            raise not_found("batch", batch_id)
        return row

    @app.get("/health", include_in_schema=False)
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models(_: Owner) -> dict[str, Any]:
        return list_object([{"id": m, "object": "model", "created": 0, "owned_by": "kvbatch"}
                            for m in runner.served_models()], False)

    @app.post("/v1/files")
    async def upload(request: Request, key: Owner) -> dict[str, Any]:
        return file_object(await receive_upload(request, key, records, storage,
                                                settings.max_upload_bytes, runner.quotas))

    @app.get("/v1/files")
    def list_files(key: Owner, after: str | None = None,
                   limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                   order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
                   purpose: str | None = None) -> dict[str, Any]:
        where = {} if purpose is None else {"purpose": purpose}
        rows, more = records.page(File, key, after=after, limit=limit,
                                  newest_first=order == "desc", **where)
        return list_object([file_object(r) for r in rows], more)

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str, key: Owner) -> dict[str, Any]:
        return file_object(own_file(file_id, key))

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, key: Owner) -> StreamingResponse:
        row = own_file(file_id, key)
        try:
            body = runner.content(row)
        except FileNotFoundError:
            raise not_found("file content", file_id) from None
        return StreamingResponse(body, media_type="application/octet-stream",
                                 headers={"Content-Disposition":
                                          f'attachment; filename="{row.id}.jsonl"'})

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, key: Owner) -> dict[str, Any]:
        row = own_file(file_id, key)
        if not records.delete_file(key, file_id):
            raise not_found("file", file_id)
        storage.delete(row.id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    def create_batch(body: CreateBatch, key: Owner) -> dict[str, Any]:
        row = runner.create(key, body.input_file_id, body.endpoint, body.completion_window,
                            body.metadata)
        return batch_object(row, {})

    @app.get("/v1/batches")
    def list_batches(key: Owner, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
        rows, more = records.page(ApiBatch, key, after=after, limit=limit)
        return list_object([batch_object(r, runner.counts(r)) for r in rows], more)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str, key: Owner) -> dict[str, Any]:
        row = own_batch(batch_id, key)
        return batch_object(row, runner.counts(row))

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, key: Owner) -> dict[str, Any]:
        row = runner.cancel(key, batch_id)
        return batch_object(row, runner.counts(row))

    return app


async def receive_upload(request: Request, owner: str, records: ApiRecords,
                         storage: FileStorage, limit: int, quotas: Quotas) -> File:
    """Stream a ``multipart/form-data`` upload (``file``, ``purpose``, optionally OpenAI's
    ``expires_after[anchor]=created_at`` and ``expires_after[seconds]``) into ``storage`` and
    record it, expiring then or after the deployment's retention; memory holds one chunk,
    whatever the file's size.

    Raises:
        ApiError: 400 for a malformed form (a boundary over python-multipart's 256 bytes, a
            body cut before its closing boundary, control characters in the filename), a
            purpose other than ``batch``, a bad ``expires_after`` or a quota exceeded, 413 past
            ``limit`` bytes (nothing is kept).
    """
    content_type, options = parse_options_header(request.headers.get("content-type"))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise ApiError(400, "upload a file as multipart/form-data (fields 'file', 'purpose')")
    try:
        declared = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise ApiError(400, "Content-Length is not a number") from None
    too_big = ApiError(413, f"the file is over the {limit}-byte upload limit")
    if declared > REFUSE_UNREAD_FACTOR * limit:
        raise too_big
    form = _Form(storage, new_id("file-"), limit)
    received = 0
    try:
        parser = MultipartParser(boundary, form.callbacks())
        async for chunk in request.stream():
            received += len(chunk)
            if received > REFUSE_UNREAD_FACTOR * limit:  # a body without a declared length
                raise too_big
            await anyio.to_thread.run_sync(parser.write, chunk)
        parser.finalize()
        if parser.state != MultipartState.END:
            raise ApiError(400, "the multipart body ends before its closing boundary")
        return await anyio.to_thread.run_sync(form.finish, records, owner, quotas)
    except ClientDisconnect:
        raise ApiError(400, "the upload was cut off") from None
    except FormParserError as exc:
        raise ApiError(400, f"malformed multipart form: {exc}") from None
    finally:
        form.discard()


class _Form:
    """Callbacks of the multipart parser: the ``file`` part streams into an upload, other
    fields are kept (the first :data:`MAX_FIELDS`, up to :data:`MAX_FIELD_BYTES` each)."""

    def __init__(self, storage: FileStorage, file_id: str, limit: int) -> None:
        self.storage, self.file_id, self.limit = storage, file_id, limit
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.upload: Upload | None = None
        self.size = 0
        self.over_limit = False
        self.done = False
        self._headers: dict[str, str] = {}
        self._field, self._value = b"", b""
        self._name: str | None = None
        self._data = bytearray()
        self._into_file = False

    def callbacks(self) -> Any:
        return {"on_part_begin": self._part_begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
                "on_part_end": self._part_end}

    def _part_begin(self) -> None:
        self._headers, self._data, self._into_file = {}, bytearray(), False

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._field = (self._field + data[start:end])[:MAX_FIELD_BYTES]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value = (self._value + data[start:end])[:MAX_FIELD_BYTES]

    def _header_end(self) -> None:
        self._headers[self._field.decode("latin-1").lower()] = self._value.decode("utf-8",
                                                                                 "replace")
        self._field, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get("content-disposition", ""))
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        filename = options.get(b"filename")
        if self._name == "file" and filename is not None and self.upload is None:
            self.filename = filename.decode("utf-8", "replace")[:255] or "upload.jsonl"
            self.upload = self.storage.begin(self.file_id)
            self._into_file = True

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._into_file:
            assert self.upload is not None
            self.size += end - start
            if self.size > self.limit:
                self.over_limit = True  # read on, keep nothing: the client gets its 413
            elif not self.over_limit:
                self.upload.write(data[start:end])
        elif len(self._data) < MAX_FIELD_BYTES:
            self._data += data[start:end][:MAX_FIELD_BYTES - len(self._data)]

    def _part_end(self) -> None:
        if not self._into_file and self._name and len(self.fields) < MAX_FIELDS:
            self.fields[self._name] = self._data.decode("utf-8", "replace")

    def finish(self, records: ApiRecords, owner: str, quotas: Quotas) -> File:
        if self.over_limit:
            raise ApiError(413, f"the file is over the {self.limit}-byte upload limit")
        if self.upload is None:
            raise ApiError(400, "the form has no 'file' part", param="file")
        if self.filename is not None and CONTROL_CHARACTERS.search(self.filename):
            raise ApiError(400, "the file's name has control characters", param="file")
        purpose = self.fields.get("purpose")
        if purpose != "batch":
            raise ApiError(400, f"purpose {quote(purpose)} is not supported: kvbatch takes files "
                                "with purpose 'batch'", param="purpose")
        expires_in_s = self._expires_in_s(quotas.settings.file_retention_s)
        size = self.upload.commit()
        self.done = True
        try:
            row = records.add(File(id=self.file_id, owner_id=owner, purpose=purpose,
                                   filename=self.filename, bytes=size, kind="upload"),
                              expires_in_s,
                              before=lambda session: quotas.check_upload(session, owner, size))
        except Exception:
            self.storage.delete(self.file_id)
            raise
        return row

    def _expires_in_s(self, default_s: int) -> int:
        """OpenAI's ``expires_after`` (anchor ``created_at``, 3600 to 2592000 seconds), else
        ``default_s``."""
        anchor = self.fields.get("expires_after[anchor]")
        seconds = self.fields.get("expires_after[seconds]")
        if anchor is None and seconds is None:
            return default_s
        if anchor != "created_at" or seconds is None or not seconds.isdigit() or not (
                MIN_EXPIRY_S <= int(seconds) <= MAX_EXPIRY_S):
            raise ApiError(400, "expires_after is {anchor: 'created_at', seconds: "
                                f"{MIN_EXPIRY_S} to {MAX_EXPIRY_S}}}", param="expires_after")
        return int(seconds)

    def discard(self) -> None:
        if self.upload is not None and not self.done:
            self.upload.discard()
