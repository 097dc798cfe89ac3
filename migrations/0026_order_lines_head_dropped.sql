-- The index `order_lines_head` dropped: the contraction docs/upgrades.md announced.
--
-- Since the release that carries migration 0025, no statement finds a line by its head:
-- the recorder's release of finished heads, the operator's unblock and the janitor's
-- check each find it by its own key, which the head carries (`queue::lines`;
-- `tests/it/plans.rs` checks the release). That release (211889e) is the one this one
-- runs beside in a rolling deploy (`tests/previous-release`); the releases before it,
-- which looked lines up through this index (without it, their recorder would scan
-- `order_lines` for every batch), are not.
--
-- Without it, moving a line's head (twice a line step: released, then promoted) changes
-- no indexed column, so it is a HOT update: no new index entry, no index WAL. Counted
-- before this migration (bench row 18, bench/PROFILE.md): 255,659 instructions a line
-- step against 277,502; row 10's WAL at 100 keys 2,616 bytes a delivery against 2,780.
--
-- Dropping an index takes a moment's ACCESS EXCLUSIVE lock on `order_lines`, and every
-- ordered ingest and line step would queue behind a request for it: as migrations 0023
-- and 0025 do, it waits at most 2 s and otherwise leaves the index, with a notice (a
-- cost, not a guarantee). By hand, at a quiet moment: `DROP INDEX CONCURRENTLY IF EXISTS
-- order_lines_head` (docs/operating.md).
DO $$
DECLARE
    -- All pending migrations run in one transaction (db::migrate): the bound is put back
    -- for the ones after this.
    previous_lock_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '2s', true);
    DROP INDEX IF EXISTS order_lines_head;
    PERFORM set_config('lock_timeout', previous_lock_timeout, true);
EXCEPTION
    -- The block's changes, the bound among them, are rolled back.
    WHEN lock_not_available THEN
        RAISE NOTICE 'order_lines_head stays: %', SQLERRM;
END
$$;
