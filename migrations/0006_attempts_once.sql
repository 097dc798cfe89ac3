-- One attempt row per (delivery, attempt number). The claim gives every attempt its own
-- number, so a second row for the same number can only be the same outcome written
-- twice: a batch retried after an ambiguous commit (the connection died while the
-- COMMIT was in flight). With this constraint the recorder's statement treats such a row
-- as already recorded instead of writing it again.
DELETE FROM attempts a
USING attempts b
WHERE a.delivery_id = b.delivery_id AND a.attempt_number = b.attempt_number AND a.id > b.id;

CREATE UNIQUE INDEX attempts_once ON attempts (delivery_id, attempt_number);
-- The unique index serves every lookup the old one did (same columns).
DROP INDEX attempts_delivery;
