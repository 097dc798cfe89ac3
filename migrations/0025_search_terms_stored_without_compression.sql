-- An event's search terms (`events.search`, migration 0018) stored without compression.
--
-- The terms are 64-bit hashes: random bytes, which no compression shrinks. But a
-- webhook's row passes PostgreSQL's TOAST threshold (about 2 kB) with a body of about
-- 1.4 kB, and then PostgreSQL tries to compress each of its largest values in turn: the
-- terms with pglz (the column kept the server's default method), which fails every time.
-- Counted under callgrind (bench/PROFILE.md, "PostgreSQL's instructions per webhook"),
-- that failed attempt was about 45,000 instructions of every insert. Stored EXTERNAL, the
-- terms are never compressed; they still move out of line when they are the row's largest
-- value, as they did after the failed attempt.
--
-- Only a column's storage changes: no rewrite, every release reads the rows of both.
-- It needs a moment's ACCESS EXCLUSIVE lock on `events`, which would queue every ingest
-- behind it: as migration 0023 does, it waits for it at most 2 s and otherwise leaves the
-- storage as it was, with a notice (a cost, not a guarantee). By hand, at a quiet moment:
-- `ALTER TABLE events ALTER COLUMN search SET STORAGE EXTERNAL` (docs/operating.md).
DO $$
DECLARE
    -- All pending migrations run in one transaction (db::migrate): the bound is put back
    -- for the ones after this.
    previous_lock_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '2s', true);
    ALTER TABLE events ALTER COLUMN search SET STORAGE EXTERNAL;
    PERFORM set_config('lock_timeout', previous_lock_timeout, true);
EXCEPTION
    -- The block's changes, the bound among them, are rolled back.
    WHEN lock_not_available THEN
        RAISE NOTICE 'events keeps the storage of its search terms: %', SQLERRM;
END
$$;
