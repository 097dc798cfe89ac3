-- Scoped API tokens: besides the bootstrap admin token (configured or generated), named
-- tokens with a scope (read, operate, admin) and an optional expiry. Only a SHA-256 of
-- each token is stored: it is shown once, when created, and never again.
CREATE TABLE api_tokens (
    id          uuid PRIMARY KEY DEFAULT wg_uuid_v7(),
    name        text NOT NULL UNIQUE CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._ -]{0,99}$'),
    scope       text NOT NULL CHECK (scope IN ('read', 'operate', 'admin')),
    token_hash  bytea NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    created_by  text NOT NULL,
    expires_at  timestamptz,
    revoked_at  timestamptz
);

-- The audit log: every change made through the API, the console or the CLI, and every
-- refused attempt, with who, what, from where and the outcome. Never a secret or a payload.
CREATE TABLE audit_log (
    id          bigserial PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    actor       text NOT NULL,
    via         text NOT NULL CHECK (via IN ('api', 'console', 'cli')),
    action      text NOT NULL,
    target      text NOT NULL,
    status      integer NOT NULL,
    address     text,
    request_id  text
);
CREATE INDEX audit_log_at ON audit_log (at);
CREATE INDEX audit_log_actor ON audit_log (actor, at);
