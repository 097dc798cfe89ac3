-- Two foreign keys whose check cannot fail, replaced by statement-level cascades.
--
-- `deliveries.event_id` and `attempts.delivery_id` were foreign keys with ON DELETE
-- CASCADE. Their insert-side check runs a query of its own for every row inserted (a
-- lookup of the parent and a `FOR KEY SHARE` lock on it, which writes a WAL record even on
-- a row the same transaction wrote): about 40,000 of PostgreSQL's instructions for each
-- delivery ingest stores and as many for each outcome the recorder writes (bench row 18,
-- bench/PROFILE.md, "Foreign keys the writing statement already holds").
--
-- Neither check can fail where the gateway writes:
-- - a delivery is inserted only by the statement that inserts its event (the fan-out of
--   `store::events` and of the gateway's own operational events): the parent is this very
--   statement's row, which no other transaction can see, let alone delete;
-- - an attempt is inserted only by the outcome write, from the rows of its own `UPDATE`
--   of those deliveries (`queue::outcomes::RECORD_SQL`): the parent is locked by the same
--   statement until it commits.
--
-- What the keys did on delete stays, set-based: a statement that deletes events deletes
-- their deliveries, and one that deletes deliveries deletes their attempts (so deleting a
-- source, whose events still cascade by their own key, still takes everything under it),
-- and `TRUNCATE` of events or deliveries truncates what hangs under them. Ids are never
-- updated. `tests/it/cascades.rs` holds all of it, and that no row outlives its parent
-- while a source is deleted under ingest and delivery.
--
-- The release before this one writes the same way, and its deletes (the janitor's, which
-- delete attempts, then deliveries, then events explicitly; a source's, through the
-- cascade) do the same beside it. Dropping a foreign key takes a moment's ACCESS
-- EXCLUSIVE lock on both of its tables, and every ingest and outcome would queue behind a
-- request for it: as migrations 0023, 0025 and 0026 do, the change waits at most 2 s for
-- its locks and otherwise leaves the keys as they are (a cost, not a guarantee), with a
-- notice; docs/operating.md says how to finish it by hand at a quiet moment. (The
-- functions are created whatever happens, and replaced if they exist, so the block can be
-- run again.)

-- One function for both cascades (the child table and its key column are the trigger's
-- arguments, the deleted parents its transition table `deleted_parents`), one for both
-- truncations. A delete of parents is rare (retention, a source); its statement is
-- planned where it runs. The child table is named in the parent's schema
-- (`TG_TABLE_SCHEMA`), as the keys named it by identity: a session whose `search_path`
-- does not lead to the gateway's tables still deletes the right rows.
CREATE OR REPLACE FUNCTION wg_delete_children_of_deleted_parents() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('DELETE FROM %I.%I WHERE %I = ANY(ARRAY(SELECT id FROM deleted_parents))',
                   TG_TABLE_SCHEMA, TG_ARGV[0], TG_ARGV[1]);
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION wg_truncate_children() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('TRUNCATE %I.%I', TG_TABLE_SCHEMA, TG_ARGV[0]);
    RETURN NULL;
END
$$;

DO $$
DECLARE
    -- All pending migrations run in one transaction (db::migrate): the bound is put back
    -- for the ones after this.
    previous_lock_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', '2s', true);
    -- The cascades first: a delete between the two never finds its children left.
    CREATE TRIGGER events_deleted_take_their_deliveries AFTER DELETE ON events
        REFERENCING OLD TABLE AS deleted_parents
        FOR EACH STATEMENT EXECUTE FUNCTION wg_delete_children_of_deleted_parents('deliveries', 'event_id');
    CREATE TRIGGER deliveries_deleted_take_their_attempts AFTER DELETE ON deliveries
        REFERENCING OLD TABLE AS deleted_parents
        FOR EACH STATEMENT EXECUTE FUNCTION wg_delete_children_of_deleted_parents('attempts', 'delivery_id');
    CREATE TRIGGER events_truncated_take_their_deliveries AFTER TRUNCATE ON events
        FOR EACH STATEMENT EXECUTE FUNCTION wg_truncate_children('deliveries');
    CREATE TRIGGER deliveries_truncated_take_their_attempts AFTER TRUNCATE ON deliveries
        FOR EACH STATEMENT EXECUTE FUNCTION wg_truncate_children('attempts');
    ALTER TABLE deliveries DROP CONSTRAINT deliveries_event_id_fkey;
    ALTER TABLE attempts DROP CONSTRAINT attempts_delivery_id_fkey;
    PERFORM set_config('lock_timeout', previous_lock_timeout, true);
EXCEPTION
    -- The block's changes, the triggers and the bound among them, are rolled back: the
    -- keys stay and cascade as before.
    WHEN lock_not_available THEN
        RAISE NOTICE 'the foreign keys of deliveries and attempts stay: %', SQLERRM;
END
$$;
