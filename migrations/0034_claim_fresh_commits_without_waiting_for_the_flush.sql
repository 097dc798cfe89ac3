-- The claim by key commits without waiting for its WAL flush.
--
-- `wg_claim_fresh_v2` (migration 0024) runs in a transaction of its own (one statement),
-- and its commit waited for the WAL's flush like every other. Two things waited with it:
-- the endpoint rows the claim locked, which every other claim and every leasing ingest
-- statement of those endpoints meets (a lease skips a held row since migration 0033, and
-- its deliveries come back to this claim), and the dispatcher, which starts the
-- attempts only once the claim returns.
--
-- `v3` is `v2` with `synchronous_commit` off for the transaction it runs in (`set_config`
-- with is_local: the setting lasts until that transaction ends, past the function's own
-- settings, so a caller inside a wider transaction makes that whole transaction
-- asynchronous; the gateway calls it alone). What a crash can lose is then the claim itself,
-- within `wal_writer_delay` (three times that at worst) after its commit, before any later
-- durable commit writes the WAL out (a webhook stored, an outcome recorded: the WAL is
-- written in order, so those carry the claim with them). A lost claim leaves its rows as
-- they were: due, no attempt counted, their old token; its worker, still sending, is
-- fenced by the random step of `claim_token` (migration 0024), and the delivery is claimed
-- and sent again: at least once, as after a failover to an asynchronous standby
-- (`tests/it/lost_claims.rs`). Until the crash's claims are taken again, their requests
-- in flight do not count against the endpoint's `max_in_flight`, and the rate tokens
-- they paid are paid again.
--
-- Ingest's own statements, the general claim and the outcome writes keep durable commits.
-- `v2` stays: `v3` calls it, and the release before this one calls it during a rolling
-- deploy.

CREATE FUNCTION wg_claim_fresh_v3(handed_ids uuid[], claim_limit int8, lease_secs float8, default_max int4)
RETURNS TABLE (
    id uuid, event_id uuid, endpoint_id uuid, attempt int4, attempts_base int4, claim_token int8,
    url text, secret text, previous_secrets text[], event_type text, source_name text, content_type text,
    payload bytea, payload_bytes int4, ordered boolean, traceparent text, tracestate text, transform text,
    event_headers text, probe_token int8, candidates int8
)
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY SELECT * FROM wg_claim_fresh_v2(handed_ids, claim_limit, lease_secs, default_max);
END
$$;
