-- The claim token whose outcome was last recorded: recording is idempotent per claim
-- (a batch retried after an ambiguous commit finds its rows already recorded) without
-- reading the attempts table on the hot path. An earlier version looked the attempt row
-- up in `attempts`; under a cached generic plan made while that table was small the
-- lookup became a sequential scan, and the delivery drain halved.
ALTER TABLE deliveries ADD COLUMN recorded_token bigint;
