-- Room for a lease, granted to deliveries the ingest statement inserts already leased.
--
-- A lone webhook's deliveries were inserted pending and then, in the same statement,
-- leased by `wg_claim_fresh_v2`: a second version of each row, whose foreign keys, CHECK
-- constraints and index entries PostgreSQL wrote again, and two more statements with
-- their plans set up. Counted with bench row 18, leasing cost more than storing (about
-- 1,257,000 instructions of a lone webhook's 2,207,000).
--
-- The ingest statement (`store::events::insert_and_claim_sql`) now asks this function
-- which of the endpoints its unordered deliveries go to may take one more lease now, and
-- inserts those deliveries leased: attempt 1, a fresh fencing token, the lease's end as
-- their next attempt. One row version each.
--
-- It keeps what any claim keeps:
--   * the endpoint rows are locked (FOR NO KEY UPDATE, in id order, as every claim
--     locks them) where the circuit is closed, the endpoint not paused, not deleted;
--   * the in-flight count is read by a second statement, after the lock: its snapshot is
--     newer than every lease committed by whoever held the lock before (one statement
--     cannot do both: its snapshot is older than its lock wait);
--   * the rate limit's token bucket is paid on the locked row;
--   * at most `claim_limit` endpoints are granted (the worker slots the caller holds).
--
-- It returns what the worker needs of each endpoint granted, read from the locked row.

CREATE FUNCTION wg_lease_room_v1(wanted uuid[], claim_limit int8, default_max int4)
RETURNS TABLE (endpoint_id uuid, url text, secret text, previous_secrets text[])
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
    WITH locked AS (
        SELECT ep.id FROM endpoints ep
        WHERE ep.id = ANY(wanted)
          AND ep.circuit_state = 'closed' AND NOT ep.paused AND ep.deleted_at IS NULL
        ORDER BY ep.id
        FOR NO KEY UPDATE OF ep
    )
    SELECT ARRAY(SELECT l.id FROM locked l ORDER BY l.id) INTO locked_ids;

    IF cardinality(locked_ids) = 0 THEN
        RETURN;
    END IF;

    RETURN QUERY
    WITH room AS (
        SELECT ep.id, ep.url, ep.secret, ep.previous_secrets, ep.previous_secrets_until,
               ep.rate_limit_per_sec, tokens.now AS tokens
        FROM endpoints ep CROSS JOIN LATERAL (
            SELECT LEAST(ep.rate_limit_burst::float8,
                         COALESCE(ep.rate_tokens, ep.rate_limit_burst)
                         + extract(epoch FROM now() - COALESCE(ep.rate_tokens_at, now()))
                           * ep.rate_limit_per_sec) AS now
        ) tokens
        WHERE ep.id = ANY(locked_ids)
          AND (ep.rate_limit_per_sec IS NULL OR tokens.now >= 1)
          AND COALESCE(ep.max_in_flight, default_max)
              > (SELECT count(*) FROM deliveries f
                 WHERE f.endpoint_id = ep.id AND f.status = 'pending'
                   AND f.leased_until IS NOT NULL AND f.leased_until > now())
        ORDER BY ep.id
        LIMIT claim_limit
    ), paid AS (
        UPDATE endpoints ep
        SET rate_tokens = room.tokens - 1, rate_tokens_at = now()
        FROM room
        WHERE ep.id = room.id AND room.rate_limit_per_sec IS NOT NULL
    )
    SELECT room.id, room.url, room.secret,
           CASE WHEN cardinality(room.previous_secrets) = 0 THEN ARRAY[]::text[]
                ELSE ARRAY(SELECT p.s FROM unnest(room.previous_secrets, room.previous_secrets_until) AS p(s, u)
                           WHERE p.u > now() ORDER BY p.u DESC) END
    FROM room;
END
$$;
