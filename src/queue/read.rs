//! Read-side queries on the `deliveries` table, for the admin API.

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, Postgres, QueryBuilder};

use crate::ids::{DeliveryId, EndpointId, EventId};

/// A delivery as operators see it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Delivery {
    /// Id.
    pub id: DeliveryId,
    /// Event.
    pub event_id: EventId,
    /// Endpoint.
    pub endpoint_id: EndpointId,
    /// pending | delivered | dead.
    pub status: String,
    /// Attempts started.
    pub attempt_count: i32,
    /// Next due time (or lease end while claimed).
    pub next_attempt_at: DateTime<Utc>,
    /// Set while a worker holds the lease.
    pub leased_until: Option<DateTime<Utc>>,
    /// Waiting for its endpoint (open circuit or paused), without spending attempts.
    pub parked: bool,
    /// Why it is dead.
    pub dead_reason: Option<String>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// When it reached delivered or dead.
    pub finished_at: Option<DateTime<Utc>>,
}

const COLUMNS: &str = "id, event_id, endpoint_id, status, attempt_count, next_attempt_at, leased_until, \
                       parked, dead_reason, created_at, updated_at, finished_at";

/// Filters for [`list`]; all optional.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Deliveries of one event.
    pub event_id: Option<EventId>,
    /// Deliveries to one endpoint.
    pub endpoint_id: Option<EndpointId>,
    /// pending | delivered | dead.
    pub status: Option<String>,
    /// Keyset cursor: only ids after this one.
    pub after: Option<DeliveryId>,
}

/// Deliveries matching `filter`, in id (creation) order, at most `limit`.
pub async fn list(db: impl PgExecutor<'_>, filter: &Filter, limit: i64) -> Result<Vec<Delivery>, sqlx::Error> {
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new(format!("SELECT {COLUMNS} FROM deliveries WHERE true"));
    if let Some(id) = filter.event_id {
        q.push(" AND event_id = ").push_bind(id);
    }
    if let Some(id) = filter.endpoint_id {
        q.push(" AND endpoint_id = ").push_bind(id);
    }
    if let Some(status) = &filter.status {
        q.push(" AND status = ").push_bind(status.clone());
    }
    if let Some(after) = filter.after {
        q.push(" AND id > ").push_bind(after);
    }
    q.push(" ORDER BY id LIMIT ").push_bind(limit);
    q.build_query_as().fetch_all(db).await
}

/// One delivery.
pub async fn by_id(db: impl PgExecutor<'_>, id: DeliveryId) -> Result<Option<Delivery>, sqlx::Error> {
    sqlx::query_as(&format!("SELECT {COLUMNS} FROM deliveries WHERE id = $1")).bind(id).fetch_optional(db).await
}
