-- Room for a lease (as `wg_lease_room_v1`, migration 0028), without the rate tokens'
-- UPDATE where no endpoint granted has a rate limit.
--
-- `v1`'s room statement carried an `UPDATE endpoints` (the rate tokens paid) whether or
-- not any endpoint it granted had a rate limit, and PostgreSQL sets up every node of a
-- plan at each execution: the update's, with its target table and indexes opened, for a
-- webhook whose endpoints have no rate limit (the default). Counted with bench row 18.
--
-- `v3` reads, with the endpoint locks it takes, whether any endpoint locked has a rate
-- limit (stable until the transaction ends: the rows are locked). Where none has, it
-- runs the room statement without the payment; where one has, it asks `v1`, which pays
-- (so `v1` stays as long as `v3` does). Everything else is `v1`'s: the locks in id order,
-- the in-flight count read after the lock, at most `claim_limit` endpoints, the rows
-- the worker needs. It is estimated at one row (a lone webhook most often goes to one
-- endpoint; migration 0030).

CREATE FUNCTION wg_lease_room_v3(wanted uuid[], claim_limit int8, default_max int4)
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
    locked_ids uuid[];
    any_rated boolean;
BEGIN
    WITH locked AS (
        SELECT ep.id, ep.rate_limit_per_sec IS NOT NULL AS rated FROM endpoints ep
        WHERE ep.id = ANY(wanted)
          AND ep.circuit_state = 'closed' AND NOT ep.paused AND ep.deleted_at IS NULL
        ORDER BY ep.id
        FOR NO KEY UPDATE OF ep
    )
    SELECT ARRAY(SELECT l.id FROM locked l ORDER BY l.id), COALESCE(bool_or(l.rated), false)
    INTO locked_ids, any_rated
    FROM locked l;

    IF cardinality(locked_ids) = 0 THEN
        RETURN;
    END IF;

    IF NOT any_rated THEN
        RETURN QUERY
        SELECT ep.id, ep.url, ep.secret,
               CASE WHEN cardinality(ep.previous_secrets) = 0 THEN ARRAY[]::text[]
                    ELSE ARRAY(SELECT p.s FROM unnest(ep.previous_secrets, ep.previous_secrets_until) AS p(s, u)
                               WHERE p.u > now() ORDER BY p.u DESC) END
        FROM endpoints ep
        WHERE ep.id = ANY(locked_ids)
          AND COALESCE(ep.max_in_flight, default_max)
              > (SELECT count(*) FROM deliveries f
                 WHERE f.endpoint_id = ep.id AND f.status = 'pending'
                   AND f.leased_until IS NOT NULL AND f.leased_until > now())
        ORDER BY ep.id
        LIMIT claim_limit;
        RETURN;
    END IF;

    -- A rate limit to pay: `v1`'s room statement, which pays it. `v1` locks the same rows
    -- again (already this transaction's: no wait) and reads the same conditions of them.
    RETURN QUERY SELECT * FROM wg_lease_room_v1(locked_ids, claim_limit, default_max);
END
$$;
