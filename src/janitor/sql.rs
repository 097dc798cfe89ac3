//! The janitor's deleting statements, one per phase of a pass that deletes rows in
//! batches (the pass, its lease and its bounds are in the parent module).
//!
//! The batch statements are public so tests can EXPLAIN them. Parameters: `$1`
//! retention in seconds, `$2` batch size, and for events `$3`, `$4` where to resume (NULL:
//! from the oldest). Each returns (candidates, events, deliveries, attempts deleted, and
//! for events the last candidate's received_at and id).
//!
//! Rows are addressed as `= ANY(ARRAY(SELECT ...))` rather than joined to the CTE: the
//! planner cannot see the array's length and plans an index scan per table, where a join
//! with a 5,000-row CTE can tip it into hashing a sequential scan of the whole table.

/// Delivered deliveries past their retention, oldest first, with their attempts. The
/// row locks (`SKIP LOCKED`) re-check the status on the latest row version, so a delivery
/// being replayed at this moment is left alone.
pub const DELIVERED_BATCH: &str = "
    WITH doomed AS MATERIALIZED (
        SELECT id FROM deliveries
        WHERE status = 'delivered' AND finished_at < now() - make_interval(secs => $1)
        ORDER BY finished_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    ), gone_attempts AS (
        DELETE FROM attempts WHERE delivery_id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING 1
    ), gone AS (
        DELETE FROM deliveries WHERE id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING 1
    )
    SELECT (SELECT count(*) FROM doomed), 0::int8, (SELECT count(*) FROM gone), (SELECT count(*) FROM gone_attempts),
           0::int8, NULL::timestamptz, NULL::uuid";

/// The next `$2` expired events after the previous batch's last one (`$3`, `$4`: its
/// `received_at` and id; NULL for the first batch), oldest first, deleted with all their
/// deliveries and attempts unless one of their deliveries is pending, or dead for less
/// than the retention. Deliveries and
/// attempts are deleted here rather than by the cascade (migration 0035) so they are
/// counted, and so that what is deleted is decided on locked rows.
///
/// `ev` is a plain walk of `events_received_at`: no per-event test in it, so a batch reads
/// `$2` events whatever the table holds. `dl` locks every delivery of those events, which
/// returns each row's latest committed version: a delivery moved back to pending
/// (redelivery) after this statement's snapshot shows as pending and its event is kept; a
/// redelivery arriving later waits for this statement and then finds the row gone. Events
/// kept for a pending delivery are stepped over by the next batch (it resumes after this
/// batch's last event), so they cost one visit per pass.
pub const EVENTS_BATCH: &str = "
    WITH ev AS MATERIALIZED (
        SELECT id, received_at FROM events
        WHERE received_at < now() - make_interval(secs => $1)
          AND received_at >= COALESCE($3, '-infinity'::timestamptz)
          AND ($3 IS NULL OR received_at > $3 OR id > $4)
        ORDER BY received_at, id
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    ), dl AS MATERIALIZED (
        SELECT id, event_id, status, endpoint_id, ordering_key, finished_at FROM deliveries
        WHERE event_id = ANY(ARRAY(SELECT id FROM ev))
        FOR UPDATE
    ), doomed AS MATERIALIZED (
        SELECT ev.id FROM ev
        WHERE NOT EXISTS (SELECT 1 FROM dl WHERE dl.event_id = ev.id AND dl.status = 'pending')
          -- A dead letter stays inspectable for the retention from its death, not its
          -- event's arrival (one that died after a long pause or a late redelivery).
          AND NOT EXISTS (SELECT 1 FROM dl WHERE dl.event_id = ev.id AND dl.status = 'dead'
                                             AND dl.finished_at >= now() - make_interval(secs => $1))
          -- A dead delivery blocking its ordering line stays until an operator acts.
          AND NOT EXISTS (SELECT 1 FROM dl JOIN order_lines l
                              ON l.endpoint_id = dl.endpoint_id AND l.ordering_key = dl.ordering_key
                                 AND l.head_id = dl.id
                          WHERE dl.event_id = ev.id)
    ), gone_attempts AS (
        DELETE FROM attempts
        WHERE delivery_id = ANY(ARRAY(SELECT dl.id FROM dl JOIN doomed ON doomed.id = dl.event_id))
        RETURNING 1
    ), gone_deliveries AS (
        DELETE FROM deliveries WHERE event_id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING 1
    ), gone_events AS (
        DELETE FROM events WHERE id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING 1
    ), last AS (
        SELECT received_at, id FROM ev ORDER BY received_at DESC, id DESC LIMIT 1
    )
    SELECT (SELECT count(*) FROM ev), (SELECT count(*) FROM gone_events), (SELECT count(*) FROM gone_deliveries),
           (SELECT count(*) FROM gone_attempts), 0::int8, (SELECT received_at FROM last), (SELECT id FROM last)";

/// Attempts past their retention, oldest first. Attempts are never updated, so there is
/// nothing to lock against.
pub const ATTEMPTS_BATCH: &str = "
    WITH doomed AS MATERIALIZED (
        SELECT id FROM attempts WHERE recorded_at < now() - make_interval(secs => $1) ORDER BY recorded_at LIMIT $2
    ), gone AS (
        DELETE FROM attempts WHERE id = ANY(ARRAY(SELECT id FROM doomed)) RETURNING 1
    )
    SELECT (SELECT count(*) FROM doomed), 0::int8, 0::int8, (SELECT count(*) FROM gone), 0::int8, NULL::timestamptz,
           NULL::uuid";

/// Ordering lines with no head, locked for [`crate::queue::lines::promote`] (`$1` most
/// lines). Those an earlier release left idle (it kept idle lines forever; lines are now
/// deleted by the outcome that empties them) are deleted by the promotion; one with a
/// delivery waiting behind no head (a broken invariant: nothing would ever claim that
/// delivery or those after it) is given that delivery as its head. A line locked by an
/// outcome being recorded is skipped.
///
/// A line whose head names a delivery that no longer exists (deleted with its source or
/// endpoint by a path that did not move the line on) is headless too: its waiting
/// deliveries would otherwise wait behind it for ever.
pub const HEADLESS_LINES_LOCK: &str = "
    SELECT l.endpoint_id, l.ordering_key FROM order_lines l
    WHERE l.head_id IS NULL OR NOT EXISTS (SELECT 1 FROM deliveries h WHERE h.id = l.head_id)
    LIMIT $1
    FOR UPDATE OF l SKIP LOCKED";
