-- Operator surface: manual redelivery budgets, secret rotation, soft-deleted endpoints,
-- and the test-send namespace.

-- Attempts spent before the last manual redelivery: the budget counts attempts since
-- then, while webhook-attempt keeps counting up (a subscriber sees the true history).
ALTER TABLE deliveries ADD COLUMN attempts_base integer NOT NULL DEFAULT 0;

-- During a rotation's grace period requests are signed with both secrets.
ALTER TABLE endpoints
    ADD COLUMN previous_secret             text,
    ADD COLUMN previous_secret_expires_at  timestamptz,
    -- Soft delete: the endpoint's deliveries (and dead letters) stay inspectable.
    ADD COLUMN deleted_at                  timestamptz;

-- Internal sources may use names operators cannot (a leading underscore), so built-in
-- namespaces never collide with a user's source.
ALTER TABLE sources DROP CONSTRAINT sources_name_check;
ALTER TABLE sources ADD CONSTRAINT sources_name_check
    CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$' OR (kind = 'internal' AND name ~ '^_[a-z]+$'));

-- Test sends (POST /v1/endpoints/{id}/test) live here, never deduplicated against real events.
INSERT INTO sources (name, kind, spec) VALUES ('_test', 'internal', '{"kind": "internal"}');
