-- webhook-gateway schema, first version.
--
-- The queue is the deliveries table: the event, its fan-out and the queue state commit in
-- one transaction, so there is no state in which an event is stored without its work.

-- Time-ordered UUIDs (RFC 9562 version 7): ids sort by creation time, which keeps
-- b-tree inserts at the right edge and gives cursor pagination a stable order.
CREATE FUNCTION wg_uuid_v7() RETURNS uuid AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$ LANGUAGE sql VOLATILE PARALLEL SAFE;

CREATE TABLE sources (
    id          uuid PRIMARY KEY DEFAULT wg_uuid_v7(),
    name        text NOT NULL UNIQUE CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$'),
    kind        text NOT NULL,
    -- The verifier spec (kind, secrets, locators); see src/verify/mod.rs.
    spec        jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- Internal producers publish through POST /v1/events without naming a source.
INSERT INTO sources (name, kind, spec) VALUES ('api', 'internal', '{"kind": "internal"}');

CREATE TABLE endpoints (
    id          uuid PRIMARY KEY DEFAULT wg_uuid_v7(),
    url         text NOT NULL,
    -- Standard Webhooks signing secret, whsec_<base64>.
    secret      text NOT NULL,
    description text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE subscriptions (
    id                uuid PRIMARY KEY DEFAULT wg_uuid_v7(),
    endpoint_id       uuid NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    -- NULL: every source.
    source_id         uuid REFERENCES sources (id) ON DELETE CASCADE,
    -- As the operator wrote them (NULL: every event type) ...
    event_types       text[],
    -- ... and as LIKE patterns, so fan-out matches inside the ingest statement.
    event_type_likes  text[],
    created_at        timestamptz NOT NULL DEFAULT now(),
    CHECK ((event_types IS NULL) = (event_type_likes IS NULL))
);
CREATE INDEX subscriptions_source ON subscriptions (source_id);
CREATE INDEX subscriptions_endpoint ON subscriptions (endpoint_id);

CREATE TABLE events (
    id            uuid PRIMARY KEY DEFAULT wg_uuid_v7(),
    source_id     uuid NOT NULL REFERENCES sources (id) ON DELETE CASCADE,
    -- The provider's delivery id (or caller's event id, or a body hash).
    dedupe_key    text NOT NULL,
    event_type    text NOT NULL,
    content_type  text,
    -- Request headers, signature values redacted before storage.
    headers       jsonb NOT NULL,
    -- The raw body, stored once and never copied per delivery.
    payload       bytea NOT NULL,
    received_at   timestamptz NOT NULL DEFAULT now(),
    -- Exactly once at the persistence boundary.
    CONSTRAINT events_dedupe UNIQUE (source_id, dedupe_key)
);
CREATE INDEX events_received_at ON events (received_at);

-- The queue. Rows are narrow (no payload) and updated often: fillfactor leaves room on
-- each page for HOT updates of the non-indexed columns.
CREATE TABLE deliveries (
    id               uuid PRIMARY KEY DEFAULT wg_uuid_v7(),
    event_id         uuid NOT NULL REFERENCES events (id) ON DELETE CASCADE,
    endpoint_id      uuid NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    status           text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'delivered', 'dead')),
    -- Attempts started (incremented by the claim: a crash mid-request still counts).
    attempt_count    integer NOT NULL DEFAULT 0 CHECK (attempt_count >= 0),
    -- When pending: when it is next due. While claimed: when the lease runs out.
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    -- Fencing token, bumped by every claim; outcomes are recorded only with the current one.
    claim_token      bigint NOT NULL DEFAULT 0,
    -- Set while a worker holds the lease; cleared when the outcome is recorded.
    leased_until     timestamptz,
    -- Why a delivery ended dead (budget spent, permanent 4xx, forbidden address ...).
    dead_reason      text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    -- One delivery per (event, endpoint): fan-out is idempotent by construction.
    CONSTRAINT deliveries_once UNIQUE (event_id, endpoint_id)
) WITH (fillfactor = 80);

-- The claim path: only pending rows are in it, so delivered and dead history never
-- slows the claim.
CREATE INDEX deliveries_due ON deliveries (next_attempt_at) WHERE status = 'pending';
CREATE INDEX deliveries_endpoint ON deliveries (endpoint_id, id);
-- The dead-letter queue, listed newest first by operators.
CREATE INDEX deliveries_dead ON deliveries (id) WHERE status = 'dead';

CREATE TABLE attempts (
    id                   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    delivery_id          uuid NOT NULL REFERENCES deliveries (id) ON DELETE CASCADE,
    attempt_number       integer NOT NULL,
    started_at           timestamptz NOT NULL,
    duration_ms          integer NOT NULL,
    status_code          integer,
    -- timeout, connect, dns, tls, forbidden_address, ... (NULL when a response came back).
    error_kind           text,
    -- delivered | retry | dead
    outcome              text NOT NULL,
    reason               text NOT NULL,
    response_excerpt     text,
    next_attempt_at      timestamptz,
    -- Why the next attempt is when it is: backoff, retry_after, ...
    next_attempt_reason  text,
    recorded_at          timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX attempts_delivery ON attempts (delivery_id, attempt_number);
