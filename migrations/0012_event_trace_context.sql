-- The W3C trace context that follows a webhook (issue 19): the producer's `traceparent`
-- (and `tracestate`), or, with tracing on, the gateway's own ingest span's context.
-- Every delivery attempt links to it, however much later and on whichever replica it
-- runs. NULL when there is none; adding nullable columns rewrites nothing.
ALTER TABLE events
    ADD COLUMN traceparent text,
    ADD COLUMN tracestate  text;
