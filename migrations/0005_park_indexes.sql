-- Per-endpoint access to pending deliveries, split by parked-ness so each path walks
-- only the rows it wants:
--  * parking (queue::park_blocked) and the probe's fallback pick walk a blocked
--    endpoint's *unparked* due rows, oldest due first, never its parked backlog;
--  * the probe pick and the backlog release walk its *parked* rows, oldest first.
-- The predicates are disjoint, so each pending row sits in exactly one of the two (the
-- same per-row cost as the single index they replace).
DROP INDEX deliveries_endpoint_pending;
CREATE INDEX deliveries_endpoint_unparked ON deliveries (endpoint_id, next_attempt_at)
    WHERE status = 'pending' AND NOT parked;
CREATE INDEX deliveries_endpoint_parked ON deliveries (endpoint_id, id)
    WHERE status = 'pending' AND parked;
