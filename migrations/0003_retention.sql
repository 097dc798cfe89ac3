-- Retention and queue hygiene: what the janitor (src/janitor.rs) needs, and autovacuum
-- tuned for the queue table.

-- Every janitor pass, whichever replica ran it: visible to operators (GET
-- /v1/admin/storage) and to tests. Written only by the replica holding the janitor's
-- advisory lock; pruned by the janitor itself (older than the event retention).
CREATE TABLE janitor_runs (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- host/pid/random of the process that ran the pass.
    instance            text NOT NULL,
    started_at          timestamptz NOT NULL DEFAULT now(),
    finished_at         timestamptz,
    -- running: in progress (or its process died: the next pass marks it abandoned);
    -- complete: nothing expired is left; capped: a phase hit its batch cap, the next pass
    -- comes soon; stopped: shutdown interrupted it between batches; failed: see error.
    status              text NOT NULL DEFAULT 'running'
                        CHECK (status IN ('running', 'complete', 'capped', 'stopped', 'failed', 'abandoned')),
    events_deleted      bigint NOT NULL DEFAULT 0,
    deliveries_deleted  bigint NOT NULL DEFAULT 0,
    attempts_deleted    bigint NOT NULL DEFAULT 0,
    -- Delete statements executed (each its own short transaction).
    batches             integer NOT NULL DEFAULT 0,
    error               text
);
CREATE INDEX janitor_runs_started ON janitor_runs (started_at);

-- Delivered deliveries expire by finished_at (not by creation: a delivery redelivered
-- or parked for a week still gets its full window after it finished). Partial, so it
-- costs ingest nothing (new rows are pending) and holds only delivered rows; the
-- delivered-recording UPDATE already changes indexed columns (status, next_attempt_at)
-- and is never HOT, so this adds one index insertion to an update that does several.
CREATE INDEX deliveries_delivered_finished ON deliveries (finished_at) WHERE status = 'delivered';

-- Attempts expire by age. The table is append-only, so this b-tree only grows at its
-- right edge (the cheapest insert there is); BRIN would be smaller but degrades here:
-- retention frees the oldest pages and new rows reuse them, so ranges stop being ordered.
CREATE INDEX attempts_recorded_at ON attempts (recorded_at);

-- Autovacuum for the queue. Every delivery is updated at least twice (claim, outcome) and
-- every update leaves a dead tuple in the heap and dead entries in the indexes, including
-- deliveries_due, which the claim walks in order: until vacuum removes them, each claim
-- steps over the dead entries of everything claimed since the last vacuum. The defaults
-- (vacuum at 20% of the table dead, analyze at 10% changed) scale with the table, which
-- is mostly finished history, so on a large table they let millions of dead entries pile
-- up at the head of the claim index. Trigger on a small fixed fraction instead, so each
-- vacuum is small and frequent, and re-analyze often so the planner's idea of how few
-- rows are pending stays current. Vacuum is throttled less than the default (2 ms per
-- 200 cost units) so a run keeps up with the churn rather than lagging behind it.
-- insert_scale_factor (PostgreSQL 13+): ingest inserts alone also get the visibility map
-- and freezing done in small steps, not in one anti-wraparound vacuum of the whole table.
ALTER TABLE deliveries SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_analyze_threshold = 1000,
    autovacuum_vacuum_cost_delay = 1
);
