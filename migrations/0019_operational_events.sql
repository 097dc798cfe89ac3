-- The gateway's own events (src/operational): published under the built-in source
-- `_gateway`, delivered like any other event to the endpoints whose subscriptions name
-- it. Its id is fixed, so the fan-out can leave it out of the subscriptions to every
-- source with a constant (operational::SOURCE_ID): who asked for every source asked for
-- webhooks, not for the gateway's own news.
INSERT INTO sources (id, name, kind, spec)
VALUES ('00000000-0000-7000-8000-00000000ca7e', '_gateway', 'internal', '{"kind": "internal"}');

-- Where each check of the publisher stands, one row per check: how far a windowed check
-- has looked (`until`), and since when a condition has been raised (`raised_at`, NULL
-- while it is not). A check locks its row, publishes and moves it in one transaction, so
-- each event is published once whichever replica runs the check, however they crash.
CREATE TABLE operational_state (
    name       text PRIMARY KEY,
    until      timestamptz,
    raised_at  timestamptz
);
INSERT INTO operational_state (name) VALUES ('circuits'), ('dead_letters'), ('backlog'), ('retention');

-- The dead-letter check counts deliveries that died in a window, and the circuit check
-- reads the transitions of the last minutes: both by time.
CREATE INDEX deliveries_dead_finished ON deliveries (finished_at) WHERE status = 'dead';
CREATE INDEX circuit_transitions_at ON circuit_transitions (at);
