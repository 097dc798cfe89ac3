//! A claimed delivery: what a worker needs to send it, and how it is read out of a
//! claim's rows.
//!
//! The rows are read by column position, each position looked up once per claim: a
//! lookup by name hashes the name (SipHash) for every column of every row, which was
//! about a thirteenth of a delivery's instructions in the worker (bench/PROFILE.md).

use sqlx::Row as _;
use sqlx::postgres::PgRow;

use crate::ids::{DeliveryId, EndpointId, EventId};

/// A claimed delivery: everything needed to send it.
#[derive(Debug, Clone)]
pub struct Claimed {
    /// Delivery id (its `webhook-id` derives from it).
    pub id: DeliveryId,
    /// The event whose body is sent.
    pub event_id: EventId,
    /// Where it goes (and whose circuit the attempt informs).
    pub endpoint_id: EndpointId,
    /// This attempt's number (1-based), already counted.
    pub attempt: i32,
    /// Attempts spent before the last manual redelivery (the budget counts from here).
    pub attempts_base: i32,
    /// Fencing token of this claim.
    pub claim_token: i64,
    /// The endpoint's URL as stored (checked again by egress before sending).
    pub url: String,
    /// The endpoint's current signing secret, as stored (sealed when a secrets key is set).
    pub secret: crate::secrets::Sealed,
    /// The secrets it replaced whose rotation grace periods still last (newest first).
    pub previous_secrets: Vec<crate::secrets::Sealed>,
    /// Sent as `webhook-event-type`.
    pub event_type: String,
    /// Sent as `webhook-source`.
    pub source_name: String,
    /// The producer's content type, replayed (`application/json` when absent).
    pub content_type: Option<String>,
    /// The body exactly as it was received; empty when it is over
    /// [`crate::deliver::bodies::INLINE_BODY_BYTES`]: its worker reads it once it has room
    /// for it in the delivery memory budget.
    // Shared, not copied, by each attempt's request body (and its memory bound).
    pub payload: bytes::Bytes,
    /// The body's size in bytes (whether it came with the claim or not).
    pub payload_bytes: i32,
    /// Whether the delivery is in an ordering line (its outcome may move the line on).
    pub ordered: bool,
    /// Set when this attempt is its endpoint's half-open probe: the probe's fencing token.
    pub probe_token: Option<i64>,
    /// The event's stored W3C `traceparent` (the producer's or the ingest span's), which
    /// the attempt's span links to.
    pub traceparent: Option<String>,
    /// The `tracestate` stored with it.
    pub tracestate: Option<String>,
    /// The transformation to run on the event before sending (`crate::transforms`), when
    /// the subscription that made this delivery has one.
    pub transform: Option<String>,
    /// The event's stored headers as JSON text, claimed only with a transformation (its
    /// input; as text, so they go into the handler's input without a parse and a print).
    pub event_headers: Option<String>,
}

/// The claim's columns, for a test that holds them to `deliver::bodies`.
#[cfg(test)]
pub(crate) fn claimed_columns() -> &'static str {
    CLAIMED_COLUMNS
}

/// Columns a worker needs, from the claimed delivery `d`, its event `e`, endpoint `ep`
/// and source `s`.
pub(super) const CLAIMED_COLUMNS: &str = "d.id, d.event_id, d.endpoint_id, d.attempt_count AS attempt, d.attempts_base, \
     d.claim_token, ep.url, ep.secret, \
     CASE WHEN cardinality(ep.previous_secrets) = 0 THEN ARRAY[]::text[] \
          ELSE ARRAY(SELECT p.s FROM unnest(ep.previous_secrets, ep.previous_secrets_until) AS p(s, u) \
                     WHERE p.u > now() ORDER BY p.u DESC) END AS previous_secrets, \
     e.event_type, s.name AS source_name, e.content_type, \
     COALESCE(CASE WHEN octet_length(e.payload) <= 65536 THEN e.payload END, ''::bytea) AS payload, \
     octet_length(e.payload) AS payload_bytes, d.ordering_key IS NOT NULL AS ordered, \
     e.traceparent, e.tracestate, \
     (SELECT tr.transform FROM subscriptions tr WHERE tr.id = d.transform_by) AS transform, \
     CASE WHEN d.transform_by IS NOT NULL THEN e.headers::text END AS event_headers";

/// The claimed deliveries among a claim's `rows`. A claim that took nothing still answers
/// one row, whose claim columns are null, to carry its summary columns (`summary` in
/// `claims`).
pub(super) fn claimed_in(rows: &[PgRow]) -> Result<Vec<Claimed>, sqlx::Error> {
    let Some(first) = rows.first() else { return Ok(Vec::new()) };
    let at = Positions::of(first)?;
    let mut claimed = Vec::with_capacity(rows.len());
    for row in rows {
        if let Some(id) = row.try_get::<Option<DeliveryId>, _>(at.id)? {
            claimed.push(at.read(id, row)?);
        }
    }
    Ok(claimed)
}

/// Where each of [`Claimed`]'s columns is in the rows of one claim (every row of a result
/// has the same columns).
struct Positions {
    id: usize,
    event_id: usize,
    endpoint_id: usize,
    attempt: usize,
    attempts_base: usize,
    claim_token: usize,
    url: usize,
    secret: usize,
    previous_secrets: usize,
    event_type: usize,
    source_name: usize,
    content_type: usize,
    payload: usize,
    payload_bytes: usize,
    ordered: usize,
    probe_token: usize,
    traceparent: usize,
    tracestate: usize,
    transform: usize,
    event_headers: usize,
}

impl Positions {
    /// The positions of the columns named as [`Claimed`]'s fields; an error naming the
    /// first one missing.
    fn of(row: &PgRow) -> Result<Self, sqlx::Error> {
        let at = |name: &str| row.try_column(name).map(sqlx::Column::ordinal);
        Ok(Self {
            id: at("id")?,
            event_id: at("event_id")?,
            endpoint_id: at("endpoint_id")?,
            attempt: at("attempt")?,
            attempts_base: at("attempts_base")?,
            claim_token: at("claim_token")?,
            url: at("url")?,
            secret: at("secret")?,
            previous_secrets: at("previous_secrets")?,
            event_type: at("event_type")?,
            source_name: at("source_name")?,
            content_type: at("content_type")?,
            payload: at("payload")?,
            payload_bytes: at("payload_bytes")?,
            ordered: at("ordered")?,
            probe_token: at("probe_token")?,
            traceparent: at("traceparent")?,
            tracestate: at("tracestate")?,
            transform: at("transform")?,
            event_headers: at("event_headers")?,
        })
    }

    /// The claimed delivery `id` out of its `row`.
    fn read(&self, id: DeliveryId, row: &PgRow) -> Result<Claimed, sqlx::Error> {
        Ok(Claimed {
            id,
            event_id: row.try_get(self.event_id)?,
            endpoint_id: row.try_get(self.endpoint_id)?,
            attempt: row.try_get(self.attempt)?,
            attempts_base: row.try_get(self.attempts_base)?,
            claim_token: row.try_get(self.claim_token)?,
            url: row.try_get(self.url)?,
            secret: row.try_get(self.secret)?,
            previous_secrets: row.try_get(self.previous_secrets)?,
            event_type: row.try_get(self.event_type)?,
            source_name: row.try_get(self.source_name)?,
            content_type: row.try_get(self.content_type)?,
            payload: bytes::Bytes::from(row.try_get::<Vec<u8>, _>(self.payload)?),
            payload_bytes: row.try_get(self.payload_bytes)?,
            ordered: row.try_get(self.ordered)?,
            probe_token: row.try_get(self.probe_token)?,
            traceparent: row.try_get(self.traceparent)?,
            tracestate: row.try_get(self.tracestate)?,
            transform: row.try_get(self.transform)?,
            event_headers: row.try_get(self.event_headers)?,
        })
    }
}

/// What a delivery's worker needs of its event, from a caller that has the event in
/// hand: the ingest statements that lease (`store::events::insert_and_claim_sql`, the
/// batch's `insert_batch_and_claim_sql`) return only the lease's columns (the delivery's
/// and its endpoint's, [`leased_in`]), not the event's echoed back.
#[derive(Debug, Clone)]
pub struct EventColumns<'a> {
    /// Sent as `webhook-event-type`.
    pub event_type: &'a str,
    /// The source's name, as the webhook arrived under it: sent as `webhook-source`.
    pub source_name: &'a str,
    /// The producer's content type.
    pub content_type: Option<&'a str>,
    /// The body a lease carries ([`lease_body`]).
    pub payload: bytes::Bytes,
    /// The body's size in bytes.
    pub payload_bytes: i32,
    /// The trace context stored with the event.
    pub traceparent: Option<&'a str>,
    /// The `tracestate` stored with it.
    pub tracestate: Option<&'a str>,
}

/// The body a lease carries of an event's `payload`, as a claim carries it: all of it up
/// to [`crate::deliver::bodies::INLINE_BODY_BYTES`], else none (the worker reads it when
/// it has room); `shared` when the caller holds it as `Bytes` (not copied), and its size.
pub fn lease_body(payload: &[u8], shared: Option<&bytes::Bytes>) -> Result<(bytes::Bytes, i32), sqlx::Error> {
    let size = i32::try_from(payload.len())
        .map_err(|_| sqlx::Error::Protocol(format!("a body of {} bytes leased", payload.len())))?;
    let body = match shared {
        _ if payload.len() > crate::deliver::bodies::INLINE_BODY_BYTES => bytes::Bytes::new(),
        Some(shared) => shared.clone(),
        None => bytes::Bytes::copy_from_slice(payload),
    };
    Ok((body, size))
}

/// The leased deliveries among the rows of a statement that leased deliveries of events
/// the caller holds (columns `id`, `event_id`, `endpoint_id`, `attempt`, `attempts_base`,
/// `claim_token`, `url`, `secret`, `previous_secrets`, `transform`, `event_headers`; a
/// row whose `id` is null leased nothing), each completed with its event's own columns:
/// `event_of` finds them for a row.
pub(super) fn leased_in<'e>(
    rows: &[PgRow],
    event_of: impl Fn(&PgRow) -> Result<&'e EventColumns<'e>, sqlx::Error>,
) -> Result<Vec<Claimed>, sqlx::Error> {
    let Some(first) = rows.first() else { return Ok(Vec::new()) };
    let at = |name: &str| first.try_column(name).map(sqlx::Column::ordinal);
    let (id, event_id, endpoint_id, attempt, attempts_base, claim_token) =
        (at("id")?, at("event_id")?, at("endpoint_id")?, at("attempt")?, at("attempts_base")?, at("claim_token")?);
    let (url, secret, previous_secrets, transform, event_headers) =
        (at("url")?, at("secret")?, at("previous_secrets")?, at("transform")?, at("event_headers")?);
    let mut leased = Vec::with_capacity(rows.len());
    for row in rows {
        let Some(delivery) = row.try_get::<Option<DeliveryId>, _>(id)? else { continue };
        let event = event_of(row)?;
        leased.push(Claimed {
            id: delivery,
            event_id: row.try_get(event_id)?,
            endpoint_id: row.try_get(endpoint_id)?,
            attempt: row.try_get(attempt)?,
            attempts_base: row.try_get(attempts_base)?,
            claim_token: row.try_get(claim_token)?,
            url: row.try_get(url)?,
            secret: row.try_get(secret)?,
            previous_secrets: row.try_get(previous_secrets)?,
            event_type: event.event_type.to_owned(),
            source_name: event.source_name.to_owned(),
            content_type: event.content_type.map(str::to_owned),
            // Shared by the event's leases, as the request body shares it.
            payload: event.payload.clone(),
            payload_bytes: event.payload_bytes,
            // The leasing statements lease no ordered delivery.
            ordered: false,
            probe_token: None,
            traceparent: event.traceparent.map(str::to_owned),
            tracestate: event.tracestate.map(str::to_owned),
            transform: row.try_get(transform)?,
            event_headers: row.try_get(event_headers)?,
        });
    }
    Ok(leased)
}
