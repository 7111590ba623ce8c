#!/bin/sh
# Runs once, when the postgres container initializes an empty data directory: a read-only role
# for Grafana (and other BI tools) that can read every table and view kvbatch's migrations create.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<SQL
CREATE ROLE "${GRAFANA_DB_USER}" LOGIN PASSWORD '${GRAFANA_DB_PASSWORD}';
GRANT CONNECT ON DATABASE "${POSTGRES_DB}" TO "${GRAFANA_DB_USER}";
GRANT USAGE ON SCHEMA public TO "${GRAFANA_DB_USER}";
GRANT SELECT ON ALL TABLES IN SCHEMA public TO "${GRAFANA_DB_USER}";
ALTER DEFAULT PRIVILEGES FOR ROLE "${POSTGRES_USER}" IN SCHEMA public
    GRANT SELECT ON TABLES TO "${GRAFANA_DB_USER}";
SQL
