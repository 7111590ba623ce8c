-- The read-only role Grafana and BI tools (Superset, Metabase) log in as. Idempotent: the
-- compose service `db-roles` runs it after every migration, as the database owner:
--   psql --set=schema=public --file=reader-role.sql
-- with GRAFANA_DB_USER and GRAFANA_DB_PASSWORD in the environment. Values reach SQL only as
-- psql variables (:'literal', :"identifier"), which psql quotes, never pasted into the text.
--
-- What the role may read: the job_stats view, and the columns of jobs and batches that carry no
-- payload. Prompts and sampling parameters (jobs.spec), outputs (text, token_ids, logprobs,
-- choices), free-form metadata and webhook URLs (which may embed tokens) stay unreadable.
\set ON_ERROR_STOP on
\getenv reader GRAFANA_DB_USER
\getenv reader_password GRAFANA_DB_PASSWORD
\if :{?reader}
\else
  \echo 'GRAFANA_DB_USER is not set'
  \quit 1
\endif
\if :{?reader_password}
\else
  \echo 'GRAFANA_DB_PASSWORD is not set'
  \quit 1
\endif

SELECT format('CREATE ROLE %I', :'reader')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'reader') \gexec
ALTER ROLE :"reader" WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'reader_password';
SELECT format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), :'reader') \gexec
GRANT USAGE ON SCHEMA :"schema" TO :"reader";

-- Start from nothing: revoking table privileges also revokes column privileges, and default
-- privileges granted by earlier versions of this stack (SELECT on every new table) are dropped.
ALTER DEFAULT PRIVILEGES IN SCHEMA :"schema" REVOKE SELECT ON TABLES FROM :"reader";
REVOKE ALL ON ALL TABLES IN SCHEMA :"schema" FROM :"reader";

GRANT SELECT ON :"schema".job_stats TO :"reader";
GRANT SELECT (id, model, status, num_jobs, created_at, deadline_at, completed_at,
              webhook_attempts, webhook_error, results_path, notified_at)
    ON :"schema".batches TO :"reader";
GRANT SELECT (id, batch_id, custom_id, model, status, priority, created_at, deadline_at,
              started_at, finished_at, attempts, worker_id, error, finish_reason)
    ON :"schema".jobs TO :"reader";
