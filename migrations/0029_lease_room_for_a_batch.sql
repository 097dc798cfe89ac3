-- Room for leases granted to a batch's deliveries, several per endpoint.
--
-- Group commit writes the webhooks that arrive during another's commit as one batch
-- (`store::events::insert_batch_with_fanout`). Their deliveries were inserted pending and
-- handed over by id after the commit, for a claim by key (`wg_claim_fresh_v2`): a second
-- statement, a second commit and a second version of every row. At 500-1,000/s on the
-- bench most webhooks come in batches, and those claims were a third of the time of the
-- gateway's six costliest statements (bench/PROFILE.md).
--
-- The batch statement that leases (`store::events::insert_batch_and_claim`) asks this
-- function how many of its unordered deliveries each endpoint may take now. `wanted`
-- names the endpoint of each delivery (an endpoint once per delivery). It keeps what any
-- claim keeps, as `wg_lease_room_v1` (migration 0028) does:
--   * the endpoint rows are locked (FOR NO KEY UPDATE, in id order, as every claim
--     locks them) where the circuit is closed, the endpoint not paused, not deleted;
--   * the in-flight count is read by a second statement, after the lock;
--   * an endpoint is granted no more than its room under its in-flight limit, no more
--     than its whole rate tokens, and no more than it asked for; its rate tokens are paid
--     for every lease granted;
--   * at most `claim_limit` leases in all (the worker slots the caller holds), shared as
--     `wg_claim_fresh_v2` shares them: no endpoint more than an equal share of the limit
--     among the endpoints with room, then in id order.
--
-- The caller uses it only for small batches (`deliver::prelease::LARGEST_LEASED_BATCH`):
-- the endpoint rows it locks stay locked until the batch commits, and under load
-- (large batches) the claims then waited behind ingest's commits and delivery fell
-- behind (bench/PROFILE.md).
--
-- v1 stays: it grants one lease per endpoint, for a lone webhook's statement, and the
-- release before this one calls it during a rolling deploy.

CREATE FUNCTION wg_lease_room_v2(wanted uuid[], claim_limit int8, default_max int4)
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
    WITH asked AS (
        SELECT w.id, count(*) AS n FROM unnest(wanted) AS w(id)
        WHERE w.id = ANY(locked_ids)
        GROUP BY w.id
    ), room_n AS (
        SELECT ep.id, ep.url, ep.secret, ep.previous_secrets, ep.previous_secrets_until,
               ep.rate_limit_per_sec, tokens.now AS tokens,
               GREATEST(LEAST(asked.n,
                              COALESCE(ep.max_in_flight, default_max)
                              - (SELECT count(*) FROM deliveries f
                                 WHERE f.endpoint_id = ep.id AND f.status = 'pending'
                                   AND f.leased_until IS NOT NULL AND f.leased_until > now()),
                              CASE WHEN ep.rate_limit_per_sec IS NULL THEN asked.n
                                   ELSE floor(tokens.now)::int8 END), 0) AS n
        FROM asked JOIN endpoints ep ON ep.id = asked.id CROSS JOIN LATERAL (
            SELECT LEAST(ep.rate_limit_burst::float8,
                         COALESCE(ep.rate_tokens, ep.rate_limit_burst)
                         + extract(epoch FROM now() - COALESCE(ep.rate_tokens_at, now()))
                           * ep.rate_limit_per_sec) AS now
        ) tokens
    ), shared AS (
        SELECT r.*,
               LEAST(r.n, ceil(claim_limit::float8
                               / GREATEST(count(*) FILTER (WHERE r.n > 0) OVER (), 1))::int8) AS fair
        FROM room_n r
    ), room AS (
        SELECT s.*,
               GREATEST(LEAST(s.fair, claim_limit - (sum(s.fair) OVER (ORDER BY s.id) - s.fair)), 0)::int8
                   AS granted
        FROM shared s
    ), paid AS (
        UPDATE endpoints ep
        SET rate_tokens = room.tokens - room.granted, rate_tokens_at = now()
        FROM room
        WHERE ep.id = room.id AND room.rate_limit_per_sec IS NOT NULL AND room.granted > 0
    )
    SELECT room.id, room.url, room.secret,
           CASE WHEN cardinality(room.previous_secrets) = 0 THEN ARRAY[]::text[]
                ELSE ARRAY(SELECT p.s FROM unnest(room.previous_secrets, room.previous_secrets_until) AS p(s, u)
                           WHERE p.u > now() ORDER BY p.u DESC) END,
           room.granted
    FROM room
    WHERE room.granted > 0
    ORDER BY room.id;
END
$$;
