-- Room for a lease (as `wg_lease_room_v3`, migration 0031), with a path of its own for a
-- webhook that goes to one endpoint, the most common lone webhook.
--
-- `v3`'s statements serve any number of endpoints: the locks taken in id order (a sort),
-- the locked ids gathered into an array (a CTE, an aggregate and a second sort), the
-- grants sorted and limited. PostgreSQL sets up every one of those nodes at each
-- execution, for one row. Counted with bench row 18.
--
-- For one endpoint `v4` locks its row with a lookup by key and reads the in-flight count
-- after the lock, in a second statement, as `v3` does (one statement cannot do both: its
-- snapshot is older than its lock wait). Everything else is `v3`'s: the row locked only
-- where the circuit is closed, the endpoint not paused, not deleted; a rate limit paid
-- by `v1` (so `v1` and `v3` stay as long as `v4` does); what the worker needs, read from
-- the locked row. Any other call (several endpoints, or no slot to grant) is `v3`'s.

CREATE FUNCTION wg_lease_room_v4(wanted uuid[], claim_limit int8, default_max int4)
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
BEGIN
    IF cardinality(wanted) = 0 THEN
        RETURN;
    END IF;

    IF cardinality(wanted) > 1 OR claim_limit < 1 THEN
        RETURN QUERY SELECT * FROM wg_lease_room_v3(wanted, claim_limit, default_max);
        RETURN;
    END IF;

    SELECT ep.id, ep.rate_limit_per_sec IS NOT NULL INTO locked_id, rated
    FROM endpoints ep
    WHERE ep.id = wanted[1]
      AND ep.circuit_state = 'closed' AND NOT ep.paused AND ep.deleted_at IS NULL
    FOR NO KEY UPDATE OF ep;

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
