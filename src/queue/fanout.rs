//! The fan-out: the deliveries an event creates, and the ordering lines they join. SQL
//! only: the ingest statement (`store::events`) stores the event and runs this in the
//! same statement, so there is no state with an event but not its deliveries.

/// The condition that subscription `$s` takes the events of source `$source`: its own
/// source's, or one of every source but the gateway's own (`_gateway`, whose events only
/// subscriptions naming it take). One rule for the full fan-out, the lean one and the
/// lean one's guard, so they cannot drift apart.
macro_rules! takes_source {
    ($s:literal, $source:literal) => {
        concat!(
            "(",
            $s,
            ".source_id = ",
            $source,
            " OR (",
            $s,
            ".source_id IS NULL AND ",
            $source,
            " <> ",
            gateway_source!(),
            "))"
        )
    };
}

/// The gateway's own source (`_gateway`), whose events only subscriptions naming it take.
macro_rules! gateway_source {
    () => {
        "'00000000-0000-7000-8000-00000000ca7e'"
    };
}

/// [`takes_source`] for any of the sources in the array `$sources`: subscription `$s`
/// takes the events of one of them (its own source's, or one of every source but the
/// gateway's own while one of them is another).
macro_rules! takes_any_source {
    ($s:literal, $sources:literal) => {
        concat!(
            "(",
            $s,
            ".source_id = ANY (",
            $sources,
            ") OR (",
            $s,
            ".source_id IS NULL AND ",
            gateway_source!(),
            " <> ANY (",
            $sources,
            ")))"
        )
    };
}

/// The condition that subscription `$s` takes events of type `$event_type`: it names no
/// pattern, or one of its patterns (`LIKE` patterns: `crate::fanout::to_like`) matches.
/// `LIKE ANY` is one expression; the `EXISTS` over `unnest` it replaced was a subplan and
/// a function scan, set up at every execution of every ingest statement whether or not a
/// subscription named a pattern (bench row 18). The two agree on every array: none
/// matching, empty or holding a null is not a match.
macro_rules! takes_type {
    ($s:literal, $event_type:literal) => {
        concat!("(", $s, ".event_type_likes IS NULL OR ", $event_type, " LIKE ANY (", $s, ".event_type_likes))")
    };
}

/// The columns every fan-out's insert into `deliveries` writes, in
/// [`fan_values`]'s order.
macro_rules! fan_columns {
    () => {
        "id, event_id, endpoint_id, ordering_key, line_seq, waiting, blocks_on_dead, transform_by"
    };
}

/// [`fan_columns`]'s values, from `n`: a row of `sequenced` or `numbered` (`delivery_id`,
/// `event_id`, `endpoint_id`, `ordering_key`, `line_seq`, `head_id`, `blocks_on_dead`,
/// `transform_by`). An ordered delivery waits unless it became its line's head.
macro_rules! fan_values {
    () => {
        "n.delivery_id, n.event_id, n.endpoint_id, n.ordering_key, n.line_seq,
                   n.ordering_key IS NOT NULL AND n.head_id IS DISTINCT FROM n.delivery_id,
                   n.ordering_key IS NOT NULL AND n.blocks_on_dead, n.transform_by"
    };
}

/// The fan-out: one delivery per endpoint subscribed to the source and event type of
/// each row of `ev` (the events just inserted, with `ord`: their order in this
/// statement) whose filter, if it has one, matches; shared by the single and batch
/// statements, which also define `bodies` (`id`, `headers` jsonb, `payload` bytea) for
/// the events of `ev`.
///
/// **Transformations**: a delivery records the subscription whose transformation
/// applies (`transform_by`: the first by id of the endpoint's matching subscriptions that
/// has one); the worker runs it when it sends (`crate::transforms`).
///
/// **Filters** are evaluated here, in the ingest statement, against the subscription rows
/// as they are now (no cache can be stale): `docs` builds each event's document
/// (`wg_event_doc`: payload, headers, type, source) once, and only for events whose
/// source has a filtered subscription, so a gateway without filters reads no body; a
/// filter that does not yield `true` (false, missing fields, a type error, a body that
/// is not JSON) does not match, and nothing fails. `targets` joins each event to its
/// document once: looked up by a subquery in the filter's condition instead, the
/// document was searched for in `docs` for every (event, subscription) pair, a scan of
/// the batch's documents each time (ten subscriptions and a batch of 64: 40,000 rows
/// read a statement; bench/PROFILE.md, "Filters: each event's document joined once").
///
/// A delivery is ordered when a matching subscription of its endpoint asks for it and the
/// event has an ordering key: it joins its line (endpoint, key). The line's row is
/// upserted, and an upsert always sees (and locks) the row's latest version: if the line
/// has no head, this statement's first delivery of the line becomes it; every other
/// ordered delivery waits, outside the claim's indexes, until the recorder promotes it
/// ([`super::record`]). Unordered deliveries (no ordered subscription, or no key) are as
/// before: no line, nothing waits.
///
/// The line sequence number is taken only once every line of the statement is locked
/// (`sequenced` sorts the whole join with `lines` first; PostgreSQL evaluates a volatile
/// output column such as `nextval` after the sort, in sorted order). Taken before the
/// lock, a statement that waited for one line's lock could join another line after a
/// later statement that had become its head, with a lower number than that head: the line
/// would then deliver out of its own order (found behind a pooler, whose stalls make that
/// wait common; `ordering::a_statement_that_waits_for_a_line_takes_its_place_after_the_line_s_head`).
///
/// This macro is the fan-out up to `sequenced` (the deliveries to insert, numbered and in
/// their lines), shared by [`FANOUT`] and [`FANOUT_LEASED`], which differ only in how
/// they insert them ([`fan_pending`], [`fan_leased`]). Where no subscription of the
/// source filters, orders or transforms, the lone webhook's statements use the lean
/// fan-out ([`FANOUT_LEAN`]).
macro_rules! fanout_sequenced {
    () => {
        concat!(
            "
        docs AS MATERIALIZED (
            SELECT b.id, wg_event_doc(ev.source_id, ev.event_type, b.headers, b.payload) AS doc
            FROM ev JOIN bodies b ON b.id = ev.id
            WHERE EXISTS (SELECT 1 FROM subscriptions f
                          WHERE f.filter IS NOT NULL AND ",
            takes_source!("f", "ev.source_id"),
            ")
        ), targets AS (
            SELECT ev.id AS event_id, ev.ord, s.endpoint_id,
                   CASE WHEN bool_or(s.ordered) THEN ev.ordering_key END AS ordering_key,
                   bool_or(s.ordered AND s.ordered_on_dead = 'block') AS blocks_on_dead,
                   (array_agg(s.id ORDER BY s.id) FILTER (WHERE s.transform IS NOT NULL))[1] AS transform_by
            FROM ev LEFT JOIN docs d ON d.id = ev.id
                 JOIN subscriptions s ON ",
            takes_source!("s", "ev.source_id"),
            "
            WHERE ",
            takes_type!("s", "ev.event_type"),
            "
              AND (s.filter IS NULL OR jsonb_path_match(d.doc, s.filter, silent => true) IS TRUE)
            GROUP BY ev.id, ev.ord, s.endpoint_id, ev.ordering_key
        ), numbered AS (
            SELECT t.*, wg_uuid_v7() AS delivery_id FROM targets t
        ), lines AS (
            INSERT INTO order_lines (endpoint_id, ordering_key, head_id)
            SELECT DISTINCT ON (endpoint_id, ordering_key) endpoint_id, ordering_key, delivery_id
            FROM numbered WHERE ordering_key IS NOT NULL
            ORDER BY endpoint_id, ordering_key, ord
            ON CONFLICT (endpoint_id, ordering_key)
                DO UPDATE SET head_id = COALESCE(order_lines.head_id, EXCLUDED.head_id)
            RETURNING endpoint_id, ordering_key, head_id
        ), sequenced AS (
            SELECT n.*, l.head_id,
                   CASE WHEN n.ordering_key IS NOT NULL THEN nextval('deliveries_line_seq') END AS line_seq
            FROM numbered n
            LEFT JOIN lines l ON l.endpoint_id = n.endpoint_id AND l.ordering_key = n.ordering_key
            ORDER BY n.ord, n.endpoint_id
        )"
        )
    };
}

/// The insert of the deliveries `$from` lists (`sequenced` or `numbered`, as
/// [`fan_values`] reads them; or the lean `numbered`, with [`fan_columns_lean`] and
/// [`fan_values_lean`]), every one pending, its first attempt due now.
macro_rules! fan_pending {
    ($from:literal) => {
        fan_pending!($from, fan_columns!(), fan_values!())
    };
    ($from:literal, $columns:expr, $values:expr) => {
        concat!(
            ", fan AS (
            INSERT INTO deliveries (",
            $columns,
            ")
            SELECT ",
            $values,
            "
            FROM ",
            $from,
            " n
            ON CONFLICT ON CONSTRAINT deliveries_once DO NOTHING
            RETURNING id, event_id
        )"
        )
    };
}

/// The insert of the deliveries `n` (read `FROM $from n`) where those joined to a row of
/// `leases` (`l`, on `$join`) go in already leased, as a claim would leave them: attempt
/// 1, a fresh fencing token each, due again when the lease (`$lease` in seconds) runs
/// out; the others pending, due now. One row version, where a claim after the insert
/// wrote a second one with its index entries and constraint checks again (bench row 18).
/// `fan` also returns what the claim's answer needs (`leased`, the token, the attempt).
/// Shared by [`fan_leased`] and [`fan_leased_batch`], which differ in how they grant;
/// the columns and values of the fan-out's own part are [`fan_columns`] and
/// [`fan_values`] unless given.
macro_rules! fan_insert_leased {
    ($from:literal, $join:literal, $lease:literal) => {
        fan_insert_leased!($from, $join, $lease, fan_columns!(), fan_values!())
    };
    ($from:literal, $join:literal, $lease:literal, $columns:expr, $values:expr) => {
        concat!(
            ", fan AS (
            INSERT INTO deliveries (",
            $columns,
            ", attempt_count, claim_token, leased_until, next_attempt_at)
            SELECT ",
            $values,
            ",
                   CASE WHEN l.endpoint_id IS NULL THEN 0 ELSE 1 END,
                   CASE WHEN l.endpoint_id IS NULL THEN 0 ELSE 1 + floor(random() * 4294967296)::int8 END,
                   CASE WHEN l.endpoint_id IS NOT NULL THEN now() + make_interval(secs => ",
            $lease,
            ") END,
                   CASE WHEN l.endpoint_id IS NULL THEN now() ELSE now() + make_interval(secs => ",
            $lease,
            ") END
            FROM ",
            $from,
            " n LEFT JOIN leases l ON ",
            $join,
            "
            ON CONFLICT ON CONSTRAINT deliveries_once DO NOTHING
            RETURNING id, event_id, endpoint_id, attempt_count, attempts_base, claim_token, transform_by,
                      leased_until IS NOT NULL AS leased
        )"
        )
    };
}

/// The insert of the deliveries `$from` lists (as [`fan_pending`]) where each unordered
/// one whose endpoint `wg_lease_room_v5` grants room is inserted already leased
/// ([`fan_insert_leased`]; `$11` most leases, `$12` lease in seconds, `$13` default max
/// in flight). The room (migration 0033): the endpoint row locked unless another
/// transaction holds it (then skipped, not waited for), its in-flight count read after
/// the lock, its rate token paid; for one endpoint, the lone webhook's most common case,
/// by `v4`'s path of its own (0032), for several by `v3` (0031: `v1`'s of 0028 without
/// the rate tokens' update where no endpoint locked has a rate limit). An event has one
/// delivery per endpoint, so one lease per endpoint is all it can take. `leases` is what
/// the worker needs of each endpoint granted. The endpoints go to the function in any
/// order (it waits for no lock, so no order of locking can deadlock; a sort here was a
/// plan node set up at every execution). The lean form (`lean`) has no ordered delivery
/// to leave out, and the lean columns.
macro_rules! fan_leased {
    ($from:literal) => {
        concat!(
            ", leases AS MATERIALIZED (
            SELECT r.endpoint_id, r.url, r.secret, r.previous_secrets
            FROM wg_lease_room_v5(ARRAY(SELECT n.endpoint_id FROM numbered n WHERE n.ordering_key IS NULL),
                                  $11, $13) r
        )",
            fan_insert_leased!($from, "l.endpoint_id = n.endpoint_id AND n.ordering_key IS NULL", "$12")
        )
    };
    (lean) => {
        concat!(
            ", leases AS MATERIALIZED (
            SELECT r.endpoint_id, r.url, r.secret, r.previous_secrets
            FROM wg_lease_room_v5(ARRAY(SELECT n.endpoint_id FROM numbered n), $11, $13) r
        )",
            fan_insert_leased!(
                "numbered",
                "l.endpoint_id = n.endpoint_id",
                "$12",
                fan_columns_lean!(),
                fan_values_lean!()
            )
        )
    };
}

/// The insert of a batch's deliveries (`$from` as in [`fan_pending`]) where each endpoint
/// `wg_lease_room_v6` grants room for `granted` leases (migration 0033: `v2`'s of 0029 for
/// the endpoint rows no other transaction holds; as [`fan_leased`]'s room, but several
/// per endpoint) has its first `granted` unordered deliveries, in the batch's arrival
/// order, inserted already leased
/// ([`fan_insert_leased`]; `$14` most leases, `$15` lease in seconds, `$16` default max
/// in flight: the batch statement's own parameters come first).
macro_rules! fan_leased_batch {
    ($from:literal) => {
        concat!(
            ", leases AS MATERIALIZED (
            SELECT r.endpoint_id, r.url, r.secret, r.previous_secrets, r.granted
            FROM wg_lease_room_v6(ARRAY(SELECT n.endpoint_id FROM numbered n WHERE n.ordering_key IS NULL),
                                  $14, $16) r
        ), turns AS (
            SELECT n.*, row_number() OVER (PARTITION BY n.endpoint_id, n.ordering_key IS NULL ORDER BY n.ord) AS turn
            FROM ",
            $from,
            " n
        )",
            fan_insert_leased!(
                "turns",
                "l.endpoint_id = n.endpoint_id AND n.ordering_key IS NULL AND n.turn <= l.granted",
                "$15"
            )
        )
    };
    (lean) => {
        concat!(
            ", leases AS MATERIALIZED (
            SELECT r.endpoint_id, r.url, r.secret, r.previous_secrets, r.granted
            FROM wg_lease_room_v6(ARRAY(SELECT n.endpoint_id FROM numbered n), $14, $16) r
        ), turns AS (
            SELECT n.*, row_number() OVER (PARTITION BY n.endpoint_id ORDER BY n.ord) AS turn
            FROM numbered n
        )",
            fan_insert_leased!(
                "turns",
                "l.endpoint_id = n.endpoint_id AND n.turn <= l.granted",
                "$15",
                fan_columns_lean!(),
                fan_values_lean!()
            )
        )
    };
}

/// The fan-out ([`fanout_sequenced`]) with every delivery inserted pending: the
/// statements that store events without leasing.
pub const FANOUT: &str = concat!(fanout_sequenced!(), fan_pending!("sequenced"));

/// The fan-out ([`fanout_sequenced`]) of the ingest statement that leases what it creates
/// (`store::events::insert_and_claim_sql`): [`fan_leased`].
pub const FANOUT_LEASED: &str = concat!(fanout_sequenced!(), fan_leased!("sequenced"));

/// The fan-out ([`fanout_sequenced`]) of the batch statement that leases what it creates
/// (`store::events::insert_batch_and_claim`): [`fan_leased_batch`].
pub const FANOUT_BATCH_LEASED: &str = concat!(fanout_sequenced!(), fan_leased_batch!("sequenced"));

/// Whether a subscription `s` that `$takes` (a condition on `s`) filters, orders or
/// transforms: [`NEEDS_FULL_FANOUT`] and [`NEEDS_FULL_FANOUT_BATCH`].
macro_rules! needs_full_fanout {
    ($takes:expr) => {
        concat!(
            "SELECT EXISTS (
            SELECT 1 FROM subscriptions s
            WHERE ",
            $takes,
            "
              AND (s.filter IS NOT NULL OR s.ordered OR s.transform IS NOT NULL)
        ) AS needed"
        )
    };
}

/// Whether an event of `ev`'s source `$1` needs the full fan-out: a subscription that may
/// take it (its own source's, or one of every source but the gateway's own) filters,
/// orders or transforms. The lean statements ([`FANOUT_LEAN`]) store nothing when it
/// does, and say so (`store::events::lean`); read with the statement's snapshot, as the
/// full fan-out reads the subscriptions.
pub const NEEDS_FULL_FANOUT: &str = needs_full_fanout!(takes_source!("s", "$1"));

/// The lean fan-out up to `numbered`: for events whose source no subscription filters,
/// orders or transforms ([`NEEDS_FULL_FANOUT`]), so no document, no line, and no
/// transformation to pick; one delivery per endpoint subscribed to the source and event
/// type (`$1` and `$3`, the statement's own: `ev` returns only the event's id),
/// `numbered` holding only the event and the endpoint ([`fan_columns_lean`]: the
/// rest are the columns' defaults, where constants carried through every node of the
/// plan cost each node a column to set up, 2 % of the statement, bench row 18). About a
/// fifth of the single ingest statement's instructions less than the full fan-out, nearly
/// all of it the set-up of the plan nodes that serve what it leaves out (bench row 18).
/// An endpoint subscribed twice is listed twice here: the insert's `ON CONFLICT ON
/// CONSTRAINT deliveries_once DO NOTHING` keeps one delivery, where a `DISTINCT` cost a
/// sort set up at every execution for a case that is rare (about 17,000 instructions a
/// webhook, bench row 18; `prelease_statement::an_endpoint_subscribed_twice_is_delivered_and_leased_once`).
///
/// For a batch (`batch`): each new event's source and type (`ev`'s), and its place in the
/// batch (`ord`, which orders the leases a batch grants one endpoint). The full batch
/// fan-out sets up its documents, lines, sequence and sort at every execution; for a
/// batch of sources that need none of them, this is 8 % (a batch of 16) to 12 % (a leased
/// batch of 8) of the statement's instructions less (bench row 18).
macro_rules! fanout_lean_numbered {
    () => {
        fanout_lean_numbered!("", "$1", "$3")
    };
    (batch) => {
        fanout_lean_numbered!(" ev.ord,", "ev.source_id", "ev.event_type")
    };
    ($ord:literal, $source:literal, $event_type:literal) => {
        concat!(
            "
        numbered AS (
            SELECT ev.id AS event_id,",
            $ord,
            " s.endpoint_id
            FROM ev JOIN subscriptions s ON ",
            takes_source!("s", $source),
            "
            WHERE ",
            takes_type!("s", $event_type),
            "
        )"
        )
    };
}

/// The columns the lean fan-out's insert writes: the others take their defaults (an id of
/// its own, no line, no transformation, not waiting), what the full fan-out writes for a
/// delivery that no line orders and no transformation shapes.
macro_rules! fan_columns_lean {
    () => {
        "event_id, endpoint_id"
    };
}

/// [`fan_columns_lean`]'s values, from a row `n` of the lean `numbered`.
macro_rules! fan_values_lean {
    () => {
        "n.event_id, n.endpoint_id"
    };
}

/// The lean fan-out ([`fanout_lean_numbered`]), every delivery pending.
pub const FANOUT_LEAN: &str =
    concat!(fanout_lean_numbered!(), fan_pending!("numbered", fan_columns_lean!(), fan_values_lean!()));

/// The lean fan-out ([`fanout_lean_numbered`]), leasing as [`FANOUT_LEASED`] does.
pub const FANOUT_LEAN_LEASED: &str = concat!(fanout_lean_numbered!(), fan_leased!(lean));

/// Whether an event of any of the batch's sources (`$1`, one per event) needs the full
/// fan-out: [`NEEDS_FULL_FANOUT`] for a batch. The lean batch statements
/// (`store::events::lean_insert_batch_sql`) store nothing when it does, and say so.
pub const NEEDS_FULL_FANOUT_BATCH: &str = needs_full_fanout!(takes_any_source!("s", "$1::uuid[]"));

/// The lean batch fan-out ([`fanout_lean_numbered`]), every delivery pending.
pub const FANOUT_LEAN_BATCH: &str =
    concat!(fanout_lean_numbered!(batch), fan_pending!("numbered", fan_columns_lean!(), fan_values_lean!()));

/// The lean batch fan-out ([`fanout_lean_numbered`]), leasing as
/// [`FANOUT_BATCH_LEASED`] does: each endpoint's first `granted` deliveries by arrival.
pub const FANOUT_LEAN_BATCH_LEASED: &str = concat!(fanout_lean_numbered!(batch), fan_leased_batch!(lean));
