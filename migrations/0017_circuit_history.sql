-- The circuit's history: each time an endpoint's circuit opened, opened again after a
-- failed half-open probe, or closed, written in the transaction that records the outcome
-- that caused it (`circuit::sql::observe`). The console's endpoint page shows it. A
-- transition is at least a cool-down apart from the next of its endpoint, so the table
-- stays small; rows go with their endpoint.
CREATE TABLE circuit_transitions (
    id          bigserial PRIMARY KEY,
    endpoint_id uuid NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    at          timestamptz NOT NULL DEFAULT now(),
    change      text NOT NULL CHECK (change IN ('opened', 'reopened', 'closed')),
    -- Failures in a row that opened it (or that the probe ended).
    failures    integer NOT NULL,
    -- How many times it had opened since it last closed.
    open_count  integer NOT NULL,
    -- When the next half-open probe may go (open and reopened).
    reopen_at   timestamptz
);
CREATE INDEX circuit_transitions_endpoint ON circuit_transitions (endpoint_id, id DESC);
