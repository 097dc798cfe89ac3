-- Every secret still inside its rotation grace period keeps signing, not only the last
-- one: rotating twice within a grace period used to drop the first old secret while
-- subscribers could still be using it. Parallel arrays, newest expiry first, at most 10
-- entries (queue::claim reads the unexpired ones with each claimed delivery).
ALTER TABLE endpoints
    ADD COLUMN previous_secrets        text[]        NOT NULL DEFAULT '{}',
    ADD COLUMN previous_secrets_until  timestamptz[] NOT NULL DEFAULT '{}',
    ADD CONSTRAINT endpoints_previous_secrets_paired
        CHECK (cardinality(previous_secrets) = cardinality(previous_secrets_until));

UPDATE endpoints
SET previous_secrets = ARRAY[previous_secret], previous_secrets_until = ARRAY[previous_secret_expires_at]
WHERE previous_secret IS NOT NULL AND previous_secret_expires_at > now();

ALTER TABLE endpoints DROP COLUMN previous_secret, DROP COLUMN previous_secret_expires_at;
