-- Fencing tokens that a lost claim cannot hand out again.
--
-- A claim's token was the row's old token plus one. A claim the database loses after
-- its worker was told (a failover to an asynchronous standby that had not received the
-- last commits; a restore to a point in time) leaves the row with the old token, so the
-- next claim handed out the lost claim's token again, and the lost claim's worker, still
-- sending, could record its outcome over the new lease (and free its in-flight room
-- early). The token is now the old one plus a random step of 1 to 2^32
-- (queue::NEXT_CLAIM_TOKEN): still growing, still compared for equality only, and a
-- lost token comes back once in 2^32 draws.
--
-- wg_claim_fresh_v2 is v1 (migration 0022) with that token. v1 stays for the release
-- before this one during a rolling deploy (docs/upgrades.md): its step of one is fenced
-- the same way against this release's random steps.

CREATE FUNCTION wg_claim_fresh_v2(handed_ids uuid[], claim_limit int8, lease_secs float8, default_max int4)
RETURNS TABLE (
    id uuid, event_id uuid, endpoint_id uuid, attempt int4, attempts_base int4, claim_token int8,
    url text, secret text, previous_secrets text[], event_type text, source_name text, content_type text,
    payload bytea, payload_bytes int4, ordered boolean, traceparent text, tracestate text, transform text,
    event_headers text, probe_token int8, candidates int8
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
DECLARE
    locked_ids uuid[];
    claimable int8;
    found_any boolean := false;
    seen uuid[] := '{}';
BEGIN
    WITH handed AS MATERIALIZED (
        -- By key only: a condition that a partial index's predicate implies would offer
        -- the planner that index to walk.
        SELECT d.endpoint_id, d.status, d.parked, d.waiting, d.next_attempt_at FROM deliveries d
        WHERE d.id = ANY(handed_ids)
    ), fresh AS (
        SELECT h.endpoint_id FROM handed h
        WHERE h.status = 'pending' AND NOT h.parked AND NOT h.waiting AND h.next_attempt_at <= now()
    ), locked AS (
        SELECT ep.id FROM endpoints ep
        WHERE ep.id IN (SELECT f.endpoint_id FROM fresh f)
          AND ep.circuit_state = 'closed' AND NOT ep.paused AND ep.deleted_at IS NULL
        ORDER BY ep.id
        FOR NO KEY UPDATE OF ep
    )
    SELECT ARRAY(SELECT l.id FROM locked l ORDER BY l.id), (SELECT count(*) FROM fresh)
    INTO locked_ids, claimable;

    IF cardinality(locked_ids) > 0 THEN
        FOR id, event_id, endpoint_id, attempt, attempts_base, claim_token, url, secret, previous_secrets,
            event_type, source_name, content_type, payload, payload_bytes, ordered, traceparent, tracestate,
            transform, event_headers, probe_token IN
        WITH room_n AS (
            SELECT ep.id, ep.rate_limit_per_sec, tokens.now AS tokens,
                   LEAST(claim_limit,
                         COALESCE(ep.max_in_flight, default_max)
                         - (SELECT count(*) FROM deliveries f
                            WHERE f.endpoint_id = ep.id AND f.status = 'pending'
                              AND f.leased_until IS NOT NULL AND f.leased_until > now()),
                         CASE WHEN ep.rate_limit_per_sec IS NULL THEN claim_limit ELSE floor(tokens.now) END) AS n
            FROM endpoints ep CROSS JOIN LATERAL (
                SELECT LEAST(ep.rate_limit_burst::float8,
                             COALESCE(ep.rate_tokens, ep.rate_limit_burst)
                             + extract(epoch FROM now() - COALESCE(ep.rate_tokens_at, now()))
                               * ep.rate_limit_per_sec) AS now
            ) tokens
            WHERE ep.id = ANY(locked_ids)
        ), room AS (
            SELECT room_n.*,
                   ceil(claim_limit::float8 / GREATEST(count(*) FILTER (WHERE room_n.n > 0) OVER (), 1)) AS share
            FROM room_n
        ), fresh AS MATERIALIZED (
            SELECT d.id, d.endpoint_id, d.next_attempt_at, d.status, d.parked, d.waiting
            FROM deliveries d
            WHERE d.id = ANY(handed_ids)
            FOR UPDATE SKIP LOCKED
        ), picked AS (
            SELECT f.id, f.next_attempt_at, f.turn FROM (
                SELECT fresh.id, fresh.next_attempt_at,
                       row_number() OVER (PARTITION BY room.id ORDER BY fresh.next_attempt_at) AS turn,
                       GREATEST(LEAST(room.n, room.share), 0) AS room_left
                FROM fresh JOIN room ON room.id = fresh.endpoint_id
                WHERE fresh.status = 'pending' AND NOT fresh.parked AND NOT fresh.waiting
                  AND fresh.next_attempt_at <= now()
            ) f
            WHERE f.turn <= f.room_left
        ), due AS (
            SELECT p.id FROM picked p ORDER BY p.turn, p.next_attempt_at LIMIT claim_limit
        ), claimed AS (
            UPDATE deliveries d
            SET next_attempt_at = now() + make_interval(secs => lease_secs),
                leased_until = now() + make_interval(secs => lease_secs),
                claim_token = d.claim_token + 1 + floor(random() * 4294967296)::int8,
                attempt_count = d.attempt_count + 1,
                updated_at = now()
            WHERE d.id = ANY(ARRAY(SELECT id FROM due))
            RETURNING d.id, d.event_id, d.endpoint_id, d.attempt_count, d.attempts_base, d.claim_token,
                      d.ordering_key, d.transform_by
        ), paid AS (
            UPDATE endpoints ep
            SET rate_tokens = room.tokens - spent.n, rate_tokens_at = now()
            FROM room JOIN (SELECT endpoint_id, count(*) AS n FROM claimed GROUP BY endpoint_id) spent
                 ON spent.endpoint_id = room.id
            WHERE ep.id = room.id AND room.rate_limit_per_sec IS NOT NULL
        )
        SELECT d.id, d.event_id, d.endpoint_id, d.attempt_count, d.attempts_base, d.claim_token, ep.url, ep.secret,
               CASE WHEN cardinality(ep.previous_secrets) = 0 THEN ARRAY[]::text[]
                    ELSE ARRAY(SELECT p.s FROM unnest(ep.previous_secrets, ep.previous_secrets_until) AS p(s, u)
                               WHERE p.u > now() ORDER BY p.u DESC) END,
               e.event_type, s.name, e.content_type,
               COALESCE(CASE WHEN octet_length(e.payload) <= 65536 THEN e.payload END, ''::bytea),
               octet_length(e.payload), d.ordering_key IS NOT NULL,
               e.traceparent, e.tracestate,
               (SELECT tr.transform FROM subscriptions tr WHERE tr.id = d.transform_by),
               CASE WHEN d.transform_by IS NOT NULL THEN e.headers::text END,
               NULL::int8
        FROM claimed d JOIN events e ON e.id = d.event_id JOIN endpoints ep ON ep.id = d.endpoint_id
             JOIN sources s ON s.id = e.source_id
        LOOP
            -- Refused (the whole statement rolled back) rather than sent twice at once.
            IF id = ANY(seen) THEN
                RAISE EXCEPTION 'invariant broken: one claim leased delivery % twice', id;
            END IF;
            seen := seen || id;
            candidates := claimable;
            found_any := true;
            RETURN NEXT;
        END LOOP;
    END IF;
    IF NOT found_any THEN
        -- The other columns are still NULL: output parameters start so, and the loop
        -- assigned none.
        candidates := claimable;
        RETURN NEXT;
    END IF;
END
$$;
