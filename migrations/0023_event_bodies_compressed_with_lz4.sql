-- Event bodies and headers compressed with lz4 instead of pglz.
--
-- A webhook's row in `events` passes PostgreSQL's TOAST threshold (about 2 kB) with a
-- body of about 1.4 kB beside its headers and search terms, so every insert compresses
-- its largest values. With pglz that was 6.4 % of PostgreSQL's CPU in the bench's ingest
-- at 16 connections (perf); lz4 compresses and decompresses several times faster.
-- Measured on the bench, same build, the cluster's compression switched run by run:
-- ingest at 64 connections 8,548 and 8,354/s against 7,607 and 7,931/s, PostgreSQL CPU
-- per webhook 93-99 µs against 107-113 µs (bench/PROFILE.md).
--
-- Only values written from now on are compressed so: no rewrite, and a release that
-- predates this migration reads both kinds (PostgreSQL decompresses by the method
-- stored with each value).
--
-- The change takes an ACCESS EXCLUSIVE lock on `events` for a moment, and waiting for it
-- would queue every ingest behind it: it waits at most 2 s, and a server where it cannot
-- be made (before PostgreSQL 14, no lz4 in this build, the lock not granted in time) keeps pglz,
-- with a notice. Compression is a cost, not a guarantee: nothing else depends on it, and
-- `ALTER TABLE events ALTER COLUMN payload SET COMPRESSION lz4, ALTER COLUMN headers SET
-- COMPRESSION lz4` can be run by hand at a quiet moment (docs/operating.md).
DO $$
DECLARE
    -- All pending migrations run in one transaction (db::migrate): the bound is put back
    -- for the ones after this.
    previous_lock_timeout text := current_setting('lock_timeout');
BEGIN
    IF current_setting('server_version_num')::int < 140000 THEN
        -- Column compression methods came with PostgreSQL 14 (EXECUTE: parsed only here).
        RAISE NOTICE 'events keeps its compression: PostgreSQL % has no lz4 for columns', current_setting('server_version');
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', '2s', true);
    EXECUTE 'ALTER TABLE events
                 ALTER COLUMN payload SET COMPRESSION lz4,
                 ALTER COLUMN headers SET COMPRESSION lz4';
    PERFORM set_config('lock_timeout', previous_lock_timeout, true);
EXCEPTION
    -- The block's changes, the bound among them, are rolled back.
    WHEN feature_not_supported OR lock_not_available THEN
        RAISE NOTICE 'events keeps its compression: %', SQLERRM;
END
$$;
