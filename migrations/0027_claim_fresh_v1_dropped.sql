-- `wg_claim_fresh_v1` (migration 0022) dropped: the contraction docs/upgrades.md asks for
-- a release after its replacement.
--
-- Migration 0024 added `wg_claim_fresh_v2` (fencing tokens a lost claim cannot hand out
-- again) and kept v1 for the release before it, which still called v1 during a rolling
-- deploy. The release this one runs beside (`tests/previous-release`, 211889e) calls v2
-- only, so no replica can call v1 any more. Dropping a function takes no lock on a table.
DROP FUNCTION IF EXISTS wg_claim_fresh_v1(uuid[], int8, float8, int4);
