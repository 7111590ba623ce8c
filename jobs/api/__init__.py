"""The OpenAI-compatible HTTP API (``kvbatch serve``): Files and Batches, owned by API keys.

==================  =====================================================================
``app``             the FastAPI application: routes, key checks, streamed uploads
``batches``         a batch's life: validating the input file, submitting its rows as jobs,
                    following them, finalizing its output and error files
``objects``         the OpenAI-shaped JSON of files, batches and errors
``keys``            API keys: made, listed, revoked, checked (only hashes are stored)
``storage``         where uploaded files live (:class:`DirectoryStorage`)
``records``         the SQL of files and batch objects
``rows``            rows of a key's named batches, submitted and followed job by job (the
                    transport of a pipeline run: ``jobs.remote.RemoteClient``)
``settings``        ``KVBATCH_API_*``
==================  =====================================================================

Imported only by ``kvbatch serve`` and ``kvbatch keys``: the SDK does not load FastAPI.
"""
