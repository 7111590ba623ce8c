"""``kvbatch serve`` (the HTTP API) and ``kvbatch keys`` (its API keys)."""

from __future__ import annotations

import argparse
import logging

from jobs.api.settings import ApiSettings
from jobs.commands import connection_arguments, database_url_argument
from jobs.constants import DEFAULT_MODEL
from jobs.settings import DeploymentModels, connection_settings
from jobs.tables import format_table, printable


def add_api_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``serve`` and ``keys`` on the ``kvbatch`` parser."""
    defaults = ApiSettings.model_fields
    serve = sub.add_parser("serve", help="run the OpenAI-compatible Files and Batches HTTP API")
    serve.add_argument("--host", help=f"default $KVBATCH_API_HOST, else "
                                      f"{defaults['host'].default}")
    serve.add_argument("--port", type=int, help=f"default $KVBATCH_API_PORT, else "
                                                f"{defaults['port'].default}")
    serve.add_argument("--files-dir", help="where uploads are stored (default "
                                           "$KVBATCH_API_FILES_DIR, else "
                                           "~/.cache/kvbatch/files)")
    serve.add_argument("--max-upload-bytes", type=int, help="largest upload (default "
                                                            "$KVBATCH_API_MAX_UPLOAD_BYTES, "
                                                            "else 512 MiB)")
    serve.add_argument("--model", action="append", dest="models",
                       help="a model the deployment serves, which batches may name whether or "
                            "not a worker is up (repeatable; default $KVBATCH_MODELS, else the "
                            "default model; those of live workers are accepted too)")
    connection_arguments(serve)
    serve.set_defaults(func=_serve)

    keys = sub.add_parser("keys", help="API keys of kvbatch serve: create, list, revoke")
    keys.add_argument("action", choices=["create", "list", "revoke"])
    keys.add_argument("name", nargs="?", help="create: the key's name; revoke: its id or name")
    database_url_argument(keys)
    keys.set_defaults(func=_keys)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from jobs.api.app import create_app
    from jobs.db import check_schema

    given = {"host": args.host, "port": args.port, "files_dir": args.files_dir,
             "max_upload_bytes": args.max_upload_bytes}
    settings = ApiSettings(**{k: v for k, v in given.items() if v is not None})
    conn = connection_settings(args.redis_url, args.database_url, args.key_prefix)
    check_schema(conn.database_url)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    models = args.models or DeploymentModels().models or [DEFAULT_MODEL]
    uvicorn.run(create_app(settings, conn, models), host=settings.host, port=settings.port,
                log_level="info", proxy_headers=False)
    return 0


def _keys(args: argparse.Namespace) -> int:
    from jobs.api.keys import KeyStore
    from jobs.db import check_schema, make_engine

    url = connection_settings(database_url=args.database_url).database_url
    check_schema(url)
    engine = make_engine(url)
    try:
        store = KeyStore(engine)
        if args.action == "create":
            if not args.name:
                raise ValueError("keys create needs a NAME")
            info, key = store.create(args.name)
            print(f"key {info.id} ({printable(info.name)}); store it now, it is not shown "
                  "again:")
            print(key)
        elif args.action == "list":
            print(format_table(("id", "name", "created", "revoked"),
                               [(k.id, k.name, k.created_at.isoformat(timespec="seconds"),
                                 k.revoked_at.isoformat(timespec="seconds")
                                 if k.revoked_at else None) for k in store.list()]))
        else:
            if not args.name:
                raise ValueError("keys revoke needs a key id or name")
            revoked = store.revoke(args.name)
            if not revoked:
                raise ValueError(f"no live key with id or name {args.name!r}")
            print(f"revoked {', '.join(revoked)}")
    finally:
        engine.dispose()
    return 0
