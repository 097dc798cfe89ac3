-- Routing by content: a subscription may carry a filter, an SQL/JSON path predicate
-- (PostgreSQL's jsonpath) over the event's document (see wg_event_doc). The fan-out
-- evaluates it in the ingest statement itself, against the subscription row as it is at
-- that moment: an event the filter does not match creates no delivery for it.
ALTER TABLE subscriptions
    ADD COLUMN filter jsonpath,
    ADD CONSTRAINT subscriptions_filter_size CHECK (octet_length(filter::text) <= 4096);

-- What a filter sees of an event: {"payload": the body as JSON (null when it is not
-- JSON), "headers": the stored headers, "type": the event type, "source": the source's
-- name}. One definition for the fan-out and the API's filter test.
-- A body that is not JSON (not UTF-8, not JSON, or JSON that jsonb cannot hold, such as a
-- \u0000 escape) is a null payload: a filter on it does not match, and nothing fails.
-- (The exception block costs a subtransaction, paid only by the events of sources that
-- have filtered subscriptions.)
CREATE FUNCTION wg_event_doc(source_id uuid, event_type text, headers jsonb, payload bytea)
RETURNS jsonb AS $$
DECLARE
    body jsonb;
BEGIN
    BEGIN
        body := convert_from(payload, 'UTF8')::jsonb;
    EXCEPTION WHEN others THEN
        body := NULL;
    END;
    RETURN jsonb_build_object(
        'payload', body,
        'headers', headers,
        'type', event_type,
        'source', (SELECT s.name FROM sources s WHERE s.id = source_id));
END
$$ LANGUAGE plpgsql STABLE;
