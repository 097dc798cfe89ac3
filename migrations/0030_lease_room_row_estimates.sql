-- Row estimates for the lease-room functions, so the ingest statements that call them
-- join their answer by nested loops.
--
-- A set-returning function is estimated at 1,000 rows unless it says otherwise. The
-- leasing ingest statements (`store::events::insert_and_claim_sql`, and the batch's)
-- join the function's answer to their deliveries twice, and for 1,000 rows PostgreSQL
-- planned hash joins: a hash table built for each, at every execution, for the one or
-- few endpoints a webhook goes to. Counted with bench row 18, their set-up was about a
-- tenth of a lone webhook's instructions. The functions grant at most one row per
-- endpoint wanted: one for a lone webhook (`v1`, most often one endpoint), a few for a
-- batch (`v2`).
--
-- Only the planner's estimate changes: what the functions do, and the releases that call
-- them, are the same (a release before this one plans with the new estimate too).

ALTER FUNCTION wg_lease_room_v1(uuid[], int8, int4) ROWS 1;
