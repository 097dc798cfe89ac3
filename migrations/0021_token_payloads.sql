-- A token may be denied the payloads of stored events (a dashboard or an on-call role
-- that must not see customer data): every view of a stored payload withholds it, and
-- every call that would reveal one (a search by payload content, trying a filter or a
-- transformation on a stored event) is refused. An admin token can create tokens, so it
-- always reads payloads. Adding a column with a constant default rewrites nothing, and a
-- release that does not know it creates tokens that read payloads, as before.
ALTER TABLE api_tokens
    ADD COLUMN payloads boolean NOT NULL DEFAULT true,
    ADD CONSTRAINT api_tokens_admin_reads_payloads CHECK (payloads OR scope <> 'admin');

-- When each token was last used (to the minute: a call updates it at most once a
-- minute), so that an unused token can be found and revoked.
ALTER TABLE api_tokens ADD COLUMN last_used_at timestamptz;
