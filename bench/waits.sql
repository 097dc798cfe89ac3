-- What PostgreSQL's client backends are doing during a run, sampled from one connection
-- (bench/PROFILE.md, "Ingest at 16 connections: two batches taking turns").
--
--   PGPASSWORD=$(cat /tmp/wg-bench-*/gateway-password) \
--     psql -h 127.0.0.1 -p PORT -U postgres -d postgres -q -f bench/waits.sql
--
-- PORT is the bench's embedded cluster's (`ps aux | grep wg-bench`). It samples
-- pg_stat_activity every 10 ms for about 10 s inside one server-side loop, so the sampler
-- costs the machine almost nothing (a psql started per sample took a core's tenth and
-- halved the rate it was measuring). It prints the average number of backends in each
-- state (`cpu` is active with no wait event) and the WAL's flushes and bytes a second
-- over the window.
CREATE TEMP TABLE samples (n int, what text);
CREATE TEMP TABLE wal_before AS SELECT wal_sync, wal_write, wal_bytes, clock_timestamp() AS at FROM pg_stat_wal;
DO $$
BEGIN
    FOR n IN 1..1000 LOOP
        INSERT INTO samples
        SELECT n, coalesce(wait_event_type, 'cpu') || ':' || coalesce(wait_event, '-') || ':'
                  || left(regexp_replace(query, '\s+', ' ', 'g'), 30)
        FROM pg_stat_activity
        WHERE state = 'active' AND backend_type = 'client backend' AND pid <> pg_backend_pid();
        PERFORM pg_stat_clear_snapshot();
        PERFORM pg_sleep(0.01);
    END LOOP;
END $$;
SELECT round(count(*) / 1000.0, 3) AS backends_on_average, what
FROM samples GROUP BY what ORDER BY 1 DESC LIMIT 12;
SELECT round((w.wal_sync - b.wal_sync) / s.secs) AS flushes_a_second,
       round((w.wal_write - b.wal_write) / s.secs) AS writes_a_second,
       round((w.wal_bytes - b.wal_bytes) / s.secs / 1e6, 1) AS wal_mb_a_second
FROM pg_stat_wal w, wal_before b, LATERAL (SELECT extract(epoch FROM clock_timestamp() - b.at) AS secs) s;
