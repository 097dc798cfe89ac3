//! Typed ids: an `EventId` can't be passed where a `DeliveryId` is expected.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// An id's name in messages ("source", "delivery"): a malformed or unknown one is
/// answered "`<name>` not found".
pub trait Named {
    /// The name.
    const NAME: &'static str;
}

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, sqlx::Type, utoipa::ToSchema,
        )]
        #[serde(transparent)]
        #[sqlx(transparent)]
        pub struct $name(pub Uuid);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl Named for $name {
            const NAME: &'static str = $what;
        }

        impl FromStr for $name {
            type Err = uuid::Error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s).map($name)
            }
        }
    };
}

typed_id!(
    /// A source (where webhooks come from).
    SourceId, "source"
);
typed_id!(
    /// An endpoint (a subscriber URL).
    EndpointId, "endpoint"
);
typed_id!(
    /// A subscription (source + event-type patterns -> endpoint).
    SubscriptionId, "subscription"
);
typed_id!(
    /// A stored event.
    EventId, "event"
);
typed_id!(
    /// A delivery: one event to one endpoint.
    DeliveryId, "delivery"
);

impl DeliveryId {
    /// The `webhook-id` / `Idempotency-Key` sent with every attempt of this delivery:
    /// derived from the delivery id, so it is stable across attempts, crashes and
    /// redeliveries.
    pub fn webhook_id(&self) -> String {
        format!("msg_{}", self.0.simple())
    }
}
