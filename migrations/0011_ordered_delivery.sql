-- Ordered delivery per key (opt-in per subscription; the key is read by the source, like
-- the dedupe key). Deliveries of one key to one endpoint form a line: only its head may be
-- claimed; the rest wait outside the claim's indexes and are promoted one at a time, in
-- ingest order, when the head finishes (delivered, or dead when the line skips the dead).
ALTER TABLE events ADD COLUMN ordering_key text;

ALTER TABLE subscriptions
    ADD COLUMN ordered          boolean NOT NULL DEFAULT false,
    -- What a dead delivery does to its line: 'block' it until an operator redelivers or
    -- unblocks it, or 'skip' it.
    ADD COLUMN ordered_on_dead  text NOT NULL DEFAULT 'block' CHECK (ordered_on_dead IN ('block', 'skip'));

ALTER TABLE deliveries
    ADD COLUMN ordering_key    text,
    -- Ingest order within a line (a global sequence: only the order matters).
    ADD COLUMN line_seq        bigint,
    -- Not its line's head: not claimable until promoted.
    ADD COLUMN waiting         boolean NOT NULL DEFAULT false,
    -- Dead-lettering it blocks its line (the subscription's ordered_on_dead = 'block').
    ADD COLUMN blocks_on_dead  boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT deliveries_ordered_complete CHECK ((ordering_key IS NULL) = (line_seq IS NULL));

CREATE SEQUENCE deliveries_line_seq;

-- One row per line: its head (the only delivery of the line that may be claimed), NULL
-- when the line is idle. The row is also the line's lock: ingest takes it with an upsert
-- (which always sees the latest version), the recorder before it promotes the next head,
-- so a head never finishes unseen by a delivery joining the line.
CREATE TABLE order_lines (
    endpoint_id   uuid NOT NULL REFERENCES endpoints (id) ON DELETE CASCADE,
    ordering_key  text NOT NULL,
    head_id       uuid,
    PRIMARY KEY (endpoint_id, ordering_key)
);

-- The claim's indexes leave waiting deliveries out (they are pending but not claimable).
DROP INDEX deliveries_due;
CREATE INDEX deliveries_due ON deliveries (next_attempt_at) WHERE status = 'pending' AND NOT parked AND NOT waiting;
DROP INDEX deliveries_endpoint_unparked;
CREATE INDEX deliveries_endpoint_unparked ON deliveries (endpoint_id, next_attempt_at)
    WHERE status = 'pending' AND NOT parked AND NOT waiting;
-- The next head of a line.
CREATE INDEX deliveries_waiting ON deliveries (endpoint_id, ordering_key, line_seq) WHERE waiting;
-- Finding a line by its head (when the head finishes; retention keeps a blocking head).
CREATE INDEX order_lines_head ON order_lines (head_id) WHERE head_id IS NOT NULL;
