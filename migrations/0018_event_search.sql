-- Finding an event by its content (src/search.rs): the hashes of its terms, one per
-- scalar of a JSON payload (path and value), per kept header and for the dedupe key,
-- computed by the gateway when it stores the event. NULL for events stored before this
-- column existed, or by a release without it (expand only: such a release keeps working,
-- and its events are found by the other filters).
ALTER TABLE events ADD COLUMN search int8[];

-- GIN over 8-byte keys. fastupdate (the default) lets an insert append its keys to the
-- pending list instead of descending the index once per key; the list is merged in bulk
-- by autovacuum or when it passes gin_pending_list_limit.
CREATE INDEX events_search ON events USING gin (search);
