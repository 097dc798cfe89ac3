-- Payload transformations: a subscription may carry a JavaScript `handler(webhook)` whose
-- result is the body sent to its endpoint. The fan-out records on each delivery the
-- subscription whose transformation applies (the first of the endpoint's matching
-- subscriptions that has one, by id); the worker runs it when it sends.
ALTER TABLE subscriptions
    ADD COLUMN transform text,
    ADD CONSTRAINT subscriptions_transform_size CHECK (octet_length(transform) <= 16384);
ALTER TABLE deliveries ADD COLUMN transform_by uuid;
-- What a transformed attempt sent: the start of the body its handler returned (the
-- attempt log shows what the subscriber received, not the event's body).
ALTER TABLE attempts ADD COLUMN sent_excerpt text;
