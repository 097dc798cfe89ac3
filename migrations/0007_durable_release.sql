-- Durable release of a parked backlog. When a circuit closes (or an operator resumes an
-- endpoint) the same transaction sets release_pending; every dispatcher's housekeeping
-- pass then un-parks the endpoint's parked deliveries in bounded batches until none are
-- left, and only then clears the flag. A crash at any instant leaves the flag set, so the
-- next pass of any replica finishes the release: no delivery stays parked on a closed
-- endpoint.
--
-- release_next_at is the spacing cursor: the due time of the next released row, so
-- successive batches (in any replica) continue one ramp at --circuit-release-per-sec
-- instead of each starting its own.
ALTER TABLE endpoints
    ADD COLUMN release_pending  boolean NOT NULL DEFAULT false,
    ADD COLUMN release_next_at  timestamptz;

CREATE INDEX endpoints_release_pending ON endpoints (id) WHERE release_pending;

-- Backlogs stranded before this migration (a release that failed or a process that died
-- after the circuit closed) are released by the first pass.
UPDATE endpoints ep SET release_pending = true
WHERE EXISTS (SELECT 1 FROM deliveries d WHERE d.endpoint_id = ep.id AND d.status = 'pending' AND d.parked);
