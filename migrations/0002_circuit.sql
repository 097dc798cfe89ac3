-- Per-endpoint circuit breaker, shared by every worker of every replica.
--
-- closed: deliveries flow. open: nothing is sent; due deliveries are parked (no attempt
-- spent). Once reopen_at has passed the circuit is half-open: exactly one probe is
-- admitted, by claiming the endpoint row (probe_until is the probe's lease, probe_token
-- fences its outcome). Probe success closes the circuit and releases the parked backlog
-- at a bounded rate; failure re-opens it with a doubled cool-down.
ALTER TABLE endpoints
    ADD COLUMN circuit_state         text NOT NULL DEFAULT 'closed' CHECK (circuit_state IN ('closed', 'open')),
    ADD COLUMN consecutive_failures  integer NOT NULL DEFAULT 0,
    -- Opens since the circuit was last closed: the cool-down doubles with each.
    ADD COLUMN open_count            integer NOT NULL DEFAULT 0,
    ADD COLUMN opened_at             timestamptz,
    ADD COLUMN reopen_at             timestamptz,
    ADD COLUMN probe_token           bigint NOT NULL DEFAULT 0,
    ADD COLUMN probe_until           timestamptz,
    -- Operator pause: like an open circuit that only the operator closes.
    ADD COLUMN paused                boolean NOT NULL DEFAULT false;

-- A parked delivery waits for its endpoint (open circuit or paused) without spending
-- attempts, outside the claim index, so a dead endpoint's backlog costs the claim nothing.
ALTER TABLE deliveries ADD COLUMN parked boolean NOT NULL DEFAULT false;

DROP INDEX deliveries_due;
CREATE INDEX deliveries_due ON deliveries (next_attempt_at) WHERE status = 'pending' AND NOT parked;
-- Probe selection and backlog release, per endpoint.
CREATE INDEX deliveries_endpoint_pending ON deliveries (endpoint_id, id) WHERE status = 'pending';
-- Half-open endpoints, for the probe claim.
CREATE INDEX endpoints_open ON endpoints (reopen_at) WHERE circuit_state = 'open';
