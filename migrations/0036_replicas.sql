-- The fleet's roster: each replica's row, written by the replica itself at start-up and
-- every --metrics-sample-secs after (one upsert), and marked stopped when it stops
-- cleanly. What an operator reads during a rolling deploy (GET /v1/admin/replicas): which
-- replicas are running, in which role, on which release and which schema version, and
-- which went away without stopping (killed, partitioned). The janitor deletes a row a day
-- after it was last written, so restarts do not make the table grow with time.
--
-- A new table only (expand): a release that predates it neither writes nor reads it.
CREATE TABLE replicas (
    instance text PRIMARY KEY,
    role text NOT NULL,
    version text NOT NULL,
    -- The newest migration this replica's release carries.
    schema_version bigint NOT NULL,
    started_at timestamptz NOT NULL,
    seen_at timestamptz NOT NULL,
    -- How often it writes its row, seconds: a row older than three of these is lost.
    every_secs double precision NOT NULL,
    -- The database's clock less the replica's host's, as it last measured (the gauge
    -- webhook_gateway_clock_offset_seconds, in milliseconds).
    clock_offset_ms double precision NOT NULL DEFAULT 0,
    stopped_at timestamptz
);
CREATE INDEX replicas_seen ON replicas (seen_at);
