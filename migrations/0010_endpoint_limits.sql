-- Per-endpoint limits, enforced across every replica by the claim (queue::claim):
--   max_in_flight   concurrent requests (leased deliveries); NULL = the gateway's default
--                   (--endpoint-max-in-flight), so one endpoint cannot take every worker;
--   rate_limit_*    an optional token bucket: requests per second and burst; the bucket's
--                   state (rate_tokens at rate_tokens_at) is kept on the row and updated
--                   by the claim under the endpoint row's lock.
ALTER TABLE endpoints
    ADD COLUMN max_in_flight       integer CHECK (max_in_flight BETWEEN 1 AND 10000),
    ADD COLUMN rate_limit_per_sec  double precision CHECK (rate_limit_per_sec > 0 AND rate_limit_per_sec <= 100000),
    ADD COLUMN rate_limit_burst    integer CHECK (rate_limit_burst BETWEEN 1 AND 100000),
    ADD COLUMN rate_tokens         double precision,
    ADD COLUMN rate_tokens_at      timestamptz,
    ADD CONSTRAINT endpoints_rate_limit_complete
        CHECK ((rate_limit_per_sec IS NULL) = (rate_limit_burst IS NULL));

-- Deliveries in flight per endpoint: leased and not yet recorded. Small (at most the
-- fleet's workers plus leases left by crashed workers, which stop counting when they
-- run out).
CREATE INDEX deliveries_in_flight ON deliveries (endpoint_id, leased_until)
    WHERE status = 'pending' AND leased_until IS NOT NULL;
