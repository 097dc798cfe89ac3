-- Counts for the metrics, taken once per fleet: the replica that leads the `metrics` job
-- (a lease) counts the queue and writes the result here; every replica exports it, with
-- its age. Before, every replica counted every pending row every 15 s.
CREATE TABLE fleet_stats (
    name text PRIMARY KEY,
    stats jsonb NOT NULL,
    sampled_at timestamptz NOT NULL,
    sampled_by text NOT NULL
);
