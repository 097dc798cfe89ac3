//! The delivery workers' settings (built by `config` from the flags, by tests directly).

use std::time::Duration;

use crate::circuit::CircuitConfig;

/// Settings of the delivery workers.
#[derive(Debug, Clone)]
pub struct DeliverySettings {
    /// Concurrent outbound requests in this process.
    pub workers: usize,
    /// Lease on a claimed delivery.
    pub lease: Duration,
    /// Attempt budget per delivery.
    pub max_attempts: u32,
    /// Backoff base.
    pub backoff_base: Duration,
    /// Backoff cap.
    pub backoff_cap: Duration,
    /// Cap on an honoured Retry-After.
    pub retry_after_cap: Duration,
    /// Idle poll interval.
    pub poll_interval: Duration,
    /// Shutdown grace for in-flight requests.
    pub shutdown_grace: Duration,
    /// Concurrent requests per endpoint (across replicas) unless the endpoint sets its own.
    pub endpoint_max_in_flight: i32,
    /// Circuit breaker settings.
    pub circuit: CircuitConfig,
    /// Bytes of bodies held by attempts at once, each counted twice
    /// (`--delivery-memory-mib`; `deliver::bodies`).
    pub body_memory_bytes: u64,
}
