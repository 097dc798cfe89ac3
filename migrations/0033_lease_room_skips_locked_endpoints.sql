-- Room for a lease that does not wait for another transaction's lock on an endpoint.
--
-- Ingest's statements that lease (a lone webhook's through `wg_lease_room_v4`, a small
-- batch's through `v2`) locked each endpoint row the way a claim does, waiting for it,
-- and held it until their commit. Every write to one endpoint then went single file:
-- a second writer's statement waited for the first one's commit (its WAL flush
-- included), and the claims by key waited behind both. On a slow spell of the bench's
-- host, end to end at 1,000/s to one endpoint ran with about one backend queued on
-- the endpoint's row (`Lock:tuple`), leasing batch statements of three webhooks took
-- 5.9 ms on average against 0.6 ms for a lone one, and the delivery p50 was 14-15 ms
-- (bench/PROFILE.md, "Leasing skips a locked endpoint").
--
-- `v5` (a lone webhook's) and `v6` (a batch's) lock the endpoint rows with `SKIP LOCKED`.
-- An endpoint whose row another transaction holds (a claim, another writer's lease, an
-- update of the endpoint) is granted nothing: its deliveries are stored pending and
-- handed over by id, as when no worker slot is free, and the claim by key that takes
-- them waits for the row in the dispatcher, not in ingest's commit. What a lease keeps
-- is unchanged, because for the rows it does lock each function hands over to the one
-- before it, which locks them again (already this transaction's: no wait) and counts
-- the room after the lock:
--   * `v5` for one endpoint is `v4`'s own path (a rate limit paid by `v1`); for several
--     it asks `v3` with the endpoints it locked;
--   * `v6` asks `v2` with the deliveries of the endpoints it locked.
-- Nothing waits, so the order the rows are locked in no longer matters. With no worker
-- slot to grant (`claim_limit` below 1) nothing is locked at all.
--
-- `v1` to `v4` stay: `v5` and `v6` call them, and the release before this one calls them
-- during a rolling deploy.

CREATE FUNCTION wg_lease_room_v5(wanted uuid[], claim_limit int8, default_max int4)
RETURNS TABLE (endpoint_id uuid, url text, secret text, previous_secrets text[])
LANGUAGE plpgsql VOLATILE
ROWS 1
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
DECLARE
    locked_id uuid;
    rated boolean;
    locked_ids uuid[];
BEGIN
    IF cardinality(wanted) = 0 OR claim_limit < 1 THEN
        RETURN;
    END IF;

    IF cardinality(wanted) > 1 THEN
        WITH locked AS (
            SELECT ep.id FROM endpoints ep
            WHERE ep.id = ANY(wanted)
              AND ep.circuit_state = 'closed' AND NOT ep.paused AND ep.deleted_at IS NULL
            FOR NO KEY UPDATE OF ep SKIP LOCKED
        )
        SELECT ARRAY(SELECT l.id FROM locked l) INTO locked_ids;
        IF cardinality(locked_ids) = 0 THEN
            RETURN;
        END IF;
        RETURN QUERY SELECT * FROM wg_lease_room_v3(locked_ids, claim_limit, default_max);
        RETURN;
    END IF;

    SELECT ep.id, ep.rate_limit_per_sec IS NOT NULL INTO locked_id, rated
    FROM endpoints ep
    WHERE ep.id = wanted[1]
      AND ep.circuit_state = 'closed' AND NOT ep.paused AND ep.deleted_at IS NULL
    FOR NO KEY UPDATE OF ep SKIP LOCKED;

    IF locked_id IS NULL THEN
        RETURN;
    END IF;

    IF rated THEN
        RETURN QUERY SELECT * FROM wg_lease_room_v1(ARRAY[locked_id], claim_limit, default_max);
        RETURN;
    END IF;

    RETURN QUERY
    SELECT ep.id, ep.url, ep.secret,
           CASE WHEN cardinality(ep.previous_secrets) = 0 THEN ARRAY[]::text[]
                ELSE ARRAY(SELECT p.s FROM unnest(ep.previous_secrets, ep.previous_secrets_until) AS p(s, u)
                           WHERE p.u > now() ORDER BY p.u DESC) END
    FROM endpoints ep
    WHERE ep.id = locked_id
      AND COALESCE(ep.max_in_flight, default_max)
          > (SELECT count(*) FROM deliveries f
             WHERE f.endpoint_id = ep.id AND f.status = 'pending'
               AND f.leased_until IS NOT NULL AND f.leased_until > now());
END
$$;

CREATE FUNCTION wg_lease_room_v6(wanted uuid[], claim_limit int8, default_max int4)
RETURNS TABLE (endpoint_id uuid, url text, secret text, previous_secrets text[], granted int8)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
DECLARE
    locked_ids uuid[];
BEGIN
    IF cardinality(wanted) = 0 OR claim_limit < 1 THEN
        RETURN;
    END IF;

    WITH locked AS (
        SELECT ep.id FROM endpoints ep
        WHERE ep.id = ANY(wanted)
          AND ep.circuit_state = 'closed' AND NOT ep.paused AND ep.deleted_at IS NULL
        FOR NO KEY UPDATE OF ep SKIP LOCKED
    )
    SELECT ARRAY(SELECT l.id FROM locked l) INTO locked_ids;

    IF cardinality(locked_ids) = 0 THEN
        RETURN;
    END IF;

    RETURN QUERY
    SELECT * FROM wg_lease_room_v2(ARRAY(SELECT w.id FROM unnest(wanted) AS w(id) WHERE w.id = ANY(locked_ids)),
                                   claim_limit, default_max);
END
$$;
