-- The recorder's outcome write (queue::record) as a function, so that a healthy batch is
-- recorded in one round trip.
--
-- The recorder wrote every batch in a transaction of four round trips: BEGIN with the
-- planner settings, the outcomes, the circuits' read (FOR UPDATE), COMMIT. At low load
-- a batch holds a webhook or two, and a round trip costs PostgreSQL about as much as
-- waking an idle backend (bench/PROFILE.md). Most batches change no circuit: every
-- outcome a success (or a retry that is not a failure) at endpoints with no failures on
-- record and their circuits closed. Called with `only_if_healthy`, this function writes
-- such a batch by itself (the call commits it), and otherwise writes nothing and answers
-- one row with `needs_circuit`: the recorder then writes the batch in its transaction,
-- with the circuits, calling this function without the flag.
--
-- Reading the endpoints without a lock is enough for that choice: a failure another
-- recorder has not committed yet is ordered after this batch's successes, as it would be
-- had it waited for this transaction's lock.
--
-- The outcome statement is the one the recorder ran before, unchanged but for its
-- parameters' names: each outcome fenced by its claim token, idempotent per claim (an
-- outcome already on record is answered `fresh = false` and not written again). The
-- rows it answers are checked against the batch (queue's invariant
-- recorded_from_batch) before the call commits. The settings are `db::Planning::Cached`'s
-- (tests/it/plans.rs).
--
-- A new name for every change of its body or its result (docs/upgrades.md).
CREATE FUNCTION wg_record_v1(
    ids uuid[], tokens int8[], attempts int4[], started timestamptz[], durations int4[], codes int4[],
    kinds text[], outcomes text[], statuses text[], reasons text[], excerpts text[], next_ats timestamptz[],
    next_whys text[], sents text[], endpoint_ids uuid[], only_if_healthy boolean
)
RETURNS TABLE (delivery_id uuid, fresh boolean, needs_circuit boolean)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
DECLARE
    seen uuid[] := '{}';
BEGIN
    IF only_if_healthy AND EXISTS (
        SELECT 1 FROM endpoints ep
        WHERE ep.id = ANY(endpoint_ids) AND (ep.consecutive_failures > 0 OR ep.circuit_state <> 'closed')
    ) THEN
        delivery_id := NULL;
        fresh := NULL;
        needs_circuit := true;
        RETURN NEXT;
        RETURN;
    END IF;
    needs_circuit := false;
    FOR delivery_id, fresh IN
        WITH o AS (
            SELECT * FROM unnest(ids, tokens, attempts, started, durations, codes, kinds, outcomes, statuses,
                                 reasons, excerpts, next_ats, next_whys, sents)
                AS o(id, token, attempt, started_at, duration_ms, status_code, error_kind, outcome,
                     status, reason, excerpt, next_at, next_why, sent)
        ), upd AS (
            UPDATE deliveries d
            SET status = o.status,
                next_attempt_at = COALESCE(o.next_at, d.next_attempt_at),
                leased_until = NULL,
                recorded_token = o.token,
                dead_reason = CASE WHEN o.status = 'dead' THEN o.reason END,
                finished_at = CASE WHEN o.status = 'pending' THEN NULL ELSE now() END,
                updated_at = now()
            FROM o
            WHERE d.id = o.id AND d.claim_token = o.token AND d.status = 'pending'
              AND d.recorded_token IS DISTINCT FROM o.token
            RETURNING d.id
        ), ins AS (
            INSERT INTO attempts (delivery_id, attempt_number, started_at, duration_ms, status_code, error_kind,
                                  outcome, reason, response_excerpt, next_attempt_at, next_attempt_reason,
                                  sent_excerpt)
            SELECT o.id, o.attempt, o.started_at, o.duration_ms, o.status_code, o.error_kind, o.outcome,
                   o.reason, o.excerpt, o.next_at, o.next_why, o.sent
            FROM o JOIN upd ON upd.id = o.id
            RETURNING attempts.delivery_id
        ), prior AS (
            -- The statement's snapshot, before `upd`: what an earlier write of the same
            -- claim recorded.
            SELECT o.id FROM o JOIN deliveries d ON d.id = o.id
            WHERE d.claim_token = o.token AND d.recorded_token = o.token
        )
        SELECT ins.delivery_id, true FROM ins
        UNION ALL
        SELECT prior.id, false FROM prior
    LOOP
        -- Refused (the whole call rolled back) rather than report what the batch does
        -- not hold, or a delivery twice.
        IF NOT delivery_id = ANY(ids) OR delivery_id = ANY(seen) THEN
            RAISE EXCEPTION 'invariant broken (recorded_from_batch): delivery % reported outside the batch or twice',
                delivery_id;
        END IF;
        seen := seen || delivery_id;
        RETURN NEXT;
    END LOOP;
END
$$;
