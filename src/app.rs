//! Wiring: the start-up checks, the handlers' state, the HTTP server, the delivery
//! workers, the janitor, graceful shutdown. [`start_on`] is the one way a gateway starts:
//! the binary and every in-process test go through it.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::db::Pool;
use anyhow::Context;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::api::AppState;
use crate::deliver::{DeliverySettings, Dispatcher};
use crate::egress::{EgressClient, EgressConfig, HostResolver};
use crate::ingest::Intake;
use crate::janitor::{Janitor, JanitorSettings};
use crate::role::Role;
use crate::secrets::Keyring;

/// Everything a gateway process needs besides its database pool.
#[derive(Clone)]
pub struct Settings {
    /// Listen address (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Admin API bearer token.
    pub admin_token: String,
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// Which parts run.
    pub role: Role,
    /// Delivery worker settings.
    pub delivery: DeliverySettings,
    /// Outbound client settings (allow-list, timeouts, extra CAs).
    pub egress: EgressConfig,
    /// Retention: what the janitor deletes, and how often it tries.
    pub janitor: JanitorSettings,
    /// Name resolver for outbound requests; `None` is the system resolver. (Tests inject
    /// one to point test host names at local subscribers.)
    pub resolver: Option<Arc<dyn HostResolver>>,
    /// The Prometheus exporter (`GET /metrics`); `None` disables metrics.
    pub metrics: Option<PrometheusHandle>,
    /// How often database-derived gauges are sampled.
    pub metrics_sample: std::time::Duration,
    /// Concurrent ingest statements (each carries a batch of events under load).
    pub ingest_writers: usize,
    /// How long an HTTP request (ingest, admin) waits for the database before answering
    /// 503 (`--db-timeout-secs`; see `db` for every bound on database calls).
    pub db_timeout: std::time::Duration,
    /// What one inbound client can hold: header and request timeouts, connection cap.
    pub http: crate::server::HttpLimits,
    /// On shutdown, how long to keep serving while `/readyz` answers 503
    /// (`--shutdown-drain-secs`).
    pub drain: std::time::Duration,
    /// Secrets at rest: the operator key(s); the default stores plaintext.
    pub secrets: Keyring,
    /// Serve the web console at `/console` (`--console`; roles with the admin API only).
    pub console: bool,
    /// The gateway's own events (`crate::operational`).
    pub operational: crate::operational::OperationalSettings,
    /// Webhook bodies held at once, in bytes, each counted four times (`--ingest-memory-mib`;
    /// `crate::ingest::budget`).
    pub ingest_memory_bytes: u64,
    /// What ingest indexes of each event for searches (`--content-search`).
    pub indexing: crate::search::Indexing,
}

/// A running gateway: its address, and a handle to stop it.
pub struct Running {
    /// The address the HTTP server listens on.
    pub addr: SocketAddr,
    /// The sources that take webhooks from outside (for the start-up banner).
    pub sources: Vec<String>,
    shutdown: watch::Sender<bool>,
    server: JoinHandle<std::io::Result<()>>,
    dispatcher: Option<Dispatcher>,
    background: Vec<JoinHandle<()>>,
    janitor: Janitor,
    draining: Arc<std::sync::atomic::AtomicBool>,
    drain: std::time::Duration,
    /// This replica in the fleet's roster, marked draining when the drain begins.
    member: crate::roster::Member,
    /// The roster row's heartbeat and what stops it: written until the whole stop is over
    /// (a stop longer than three of its intervals otherwise read as a replica lost).
    heartbeat: (watch::Sender<bool>, JoinHandle<()>),
}

impl Running {
    /// Drain (keep serving for the drain period while `/readyz` answers 503, so load
    /// balancers stop sending here first), then stop accepting requests and claims, finish
    /// in-flight HTTP requests and deliveries (up to the grace period), record them, and
    /// return.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        // The fleet's roster reads this replica draining from here to the end of its stop;
        // the marks are bounded (a database that does not answer holds nothing back).
        let drained = !self.drain.is_zero();
        if drained {
            self.draining.store(true, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(
                drain = ?self.drain,
                "draining: /readyz answers 503 and answers close their connections; still serving until load \
                 balancers have stopped sending here"
            );
            tokio::join!(self.member.draining(), tokio::time::sleep(self.drain));
        }
        let _ = self.shutdown.send(true);
        // Both drain within the grace period, side by side: a slow client cannot add its
        // wait to the deliveries' (or the other way round).
        let deliveries = async {
            if let Some(dispatcher) = self.dispatcher {
                dispatcher.shutdown().await;
            }
        };
        let marked = async {
            if !drained {
                self.member.draining().await;
            }
        };
        let (server, (), ()) = tokio::join!(self.server, deliveries, marked);
        for task in self.background {
            let _ = task.await;
        }
        self.janitor.shutdown().await;
        let (beat, heart) = self.heartbeat;
        let _ = beat.send(true);
        let _ = heart.await;
        self.member.stopped().await;
        server.context("server task panicked")??;
        Ok(())
    }
}

/// Bind `settings.listen`, then [`start_on`] it.
pub async fn start(pool: Pool, settings: Settings) -> anyhow::Result<Running> {
    let listener = bind(settings.listen).await?;
    start_on(pool, settings, listener).await
}

/// Bind the listen address: one line naming the address (and the likely cause) when it
/// cannot be had. `serve` calls it before anything else starts, so a taken port stops the
/// process before it starts a database it would have to stop again.
pub async fn bind(listen: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                "; another process (another gateway?) is listening there: stop it, or choose another address with \
                 --listen"
            }
            std::io::ErrorKind::PermissionDenied => "; ports below 1024 need privileges: choose another with --listen",
            std::io::ErrorKind::AddrNotAvailable => "; no interface of this machine has that address",
            _ => "",
        };
        anyhow::anyhow!("cannot listen on {listen}: {e}{hint}")
    })
}

/// [`start`] on a listener bound beforehand (with [`bind`]); `settings.listen` is not used.
/// Start a gateway on `pool` and `listener`: apply the migrations (waiting for another
/// process's), check that every stored secret opens with `settings.secrets`, say what is
/// worth knowing about the stored configuration, then serve: the HTTP server, and the
/// workers, janitor and background tasks of `settings.role`.
pub async fn start_on(pool: Pool, settings: Settings, listener: tokio::net::TcpListener) -> anyhow::Result<Running> {
    let wait = pool.start_wait();
    crate::db::waiting(wait, "migrations", || crate::db::migrate(&pool)).await?;
    crate::db::kept_plans::install(&pool, &kept_statements()).await;
    crate::telemetry::describe_database(&pool);
    crate::db::waiting(wait, "stored secrets check", || crate::secrets::check_stored(&pool, &settings.secrets)).await?;
    log_secrets_at_rest(&settings.secrets);
    let sources = crate::db::waiting(wait, "sources", || ingestible_sources(&pool)).await?;
    if let Some(limit) = crate::server::raise_open_file_limit() {
        tracing::debug!(open_files = limit, "open-file limit");
    }
    serve(pool, settings, listener, sources).await
}

/// The statements whose plans are kept behind a transaction pooler
/// ([`crate::db::kept_plans`]): those of every webhook, every outcome write and the
/// general claim, whose planning at each call cost as much as their work.
fn kept_statements() -> Vec<&'static str> {
    use crate::store::events;
    vec![
        events::insert_sql(),
        events::insert_and_claim_sql(),
        events::lean::insert_sql(),
        events::lean::insert_and_claim_sql(),
        events::insert_batch_sql(),
        events::insert_batch_and_claim_sql(),
        events::lean_insert_batch_sql(),
        events::lean_insert_batch_and_claim_sql(),
        crate::queue::RECORD_SQL,
        crate::queue::lines::PROMOTE_SQL,
        crate::queue::lines::promote_leasing_sql(),
        crate::queue::claim_sql(),
    ]
}

/// Whether secrets are encrypted at rest, and with which keys.
fn log_secrets_at_rest(keyring: &Keyring) {
    match keyring.current_key_id() {
        Some(key_id) => tracing::info!(
            key_id,
            previous = ?keyring.previous_key_ids(),
            "secrets at rest: source and endpoint secrets are encrypted"
        ),
        None => tracing::warn!(
            "secrets at rest: source and endpoint secrets are stored in plaintext; set --secrets-key \
             (WEBHOOK_GATEWAY_SECRETS_KEY, from `openssl rand -base64 32`) to encrypt them, then run \
             `webhook-gateway secrets reencrypt`"
        ),
    }
}

/// The sources that take webhooks from outside, with a warning for each that accepts them
/// unverified.
async fn ingestible_sources(pool: &Pool) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for source in crate::store::sources::list(pool).await? {
        if source.spec.0.kind == crate::verify::Kind::None {
            tracing::warn!(source = %source.name, "source of kind `none`: its webhooks are accepted unverified");
        }
        // `api` and `_test` take no webhooks from outside: not worth a line.
        if source.spec.0.kind != crate::verify::Kind::Internal {
            names.push(source.name);
        }
    }
    Ok(names)
}

/// The gateway's tasks, once the database is ready for this release.
async fn serve(
    pool: Pool,
    settings: Settings,
    listener: tokio::net::TcpListener,
    sources: Vec<String>,
) -> anyhow::Result<Running> {
    let wake = Arc::new(Notify::new());
    // Ingest hands the deliveries it stores straight to the dispatcher of the same process.
    let handoff = (settings.role == Role::All).then(|| Arc::new(crate::wake::Handoff::default()));
    // And leases the deliveries of a webhook it writes alone in the statement that stores it.
    let (prelease, preleased) = crate::deliver::prelease::Prelease::new(&settings.delivery);
    let intake_prelease = (settings.role == Role::All).then(|| prelease.clone());
    let state = AppState::new(crate::state::Shared {
        pool: pool.clone(),
        admin_token: settings.admin_token.clone().into(),
        max_body_bytes: settings.max_body_bytes,
        wake: wake.clone(),
        egress_allow: settings.egress.allow.clone().into(),
        egress_https_only: settings.egress.https_only,
        release_per_sec: settings.delivery.circuit.release_per_sec,
        metrics: settings.metrics.clone(),
        intake: Intake::start(
            pool.clone(),
            settings.ingest_writers,
            settings.secrets.clone(),
            wake,
            handoff.clone(),
            intake_prelease,
            settings.indexing,
        ),
        db_timeout: settings.db_timeout,
        request_timeout: settings.http.request_timeout,
        secrets: settings.secrets.clone(),
        default_max_in_flight: settings.delivery.endpoint_max_in_flight,
        draining: Arc::default(),
        operational_events: settings.operational.enabled,
        ingest_budget: crate::ingest::budget::ingest_budget(settings.ingest_memory_bytes),
    });
    if settings.role.runs_workers() {
        let allow: Vec<String> = settings.egress.allow.iter().map(ToString::to_string).collect();
        if allow.is_empty() {
            tracing::info!("egress: public addresses only (no --egress-allow)");
        } else {
            tracing::warn!(allow = %allow.join(", "), "egress: these ranges are open besides public addresses");
        }
    }
    // This gateway's name as a lease holder (janitor, housekeeping, metrics).
    let instance = crate::lease::instance_id();
    let (shutdown, stop) = watch::channel(false);
    let mut background = Vec::new();
    // Before any delivery is scheduled: the times written for PostgreSQL to compare follow
    // its clock, whatever this host's says.
    let measured = crate::clock::first_sync(&state.pool).await;
    background.push(tokio::spawn(crate::clock::keep_in_step(state.pool.clone(), measured, stop.clone())));
    let housekeeping = crate::deliver::Housekeeping::default();
    let dispatcher = if settings.role.runs_workers() {
        let egress = match &settings.resolver {
            Some(resolver) => EgressClient::with_resolver(settings.egress.clone(), resolver.clone()),
            None => EgressClient::new(settings.egress.clone()),
        }?;
        Some(Dispatcher::spawn(
            state.pool.clone(),
            egress,
            settings.delivery.clone(),
            state.wake.clone(),
            crate::deliver::dispatcher::Handovers { ids: handoff.unwrap_or_default(), prelease, preleased },
            settings.secrets.clone(),
            housekeeping.clone(),
        ))
    } else {
        None
    };
    if settings.role.runs_workers() {
        background.push(tokio::spawn(housekeeping.run(
            state.pool.clone(),
            instance.clone(),
            settings.delivery.circuit.release_per_sec,
            state.wake.clone(),
            stop.clone(),
        )));
    }
    // Every role runs it: each replica reports its own refusals, and the lease makes one
    // replica at a time run the fleet-wide checks.
    background.push(tokio::spawn(crate::operational::run(
        state.pool.clone(),
        settings.operational.clone(),
        instance.clone(),
        stop.clone(),
    )));
    // Every role writes its row of the fleet's roster.
    let member =
        crate::roster::Member::new(state.pool.clone(), instance.clone(), settings.role, settings.metrics_sample);
    let (beat, beating) = watch::channel(false);
    let heartbeat = (beat, tokio::spawn(member.clone().run(beating)));
    // Replicas that store events merge the search index's pending list, one at a time.
    if settings.role != Role::Worker {
        background.push(tokio::spawn(crate::search::pending::run(state.pool.clone(), instance.clone(), stop.clone())));
    }
    let addr = listener.local_addr()?;
    // Every role runs one: the lease makes one replica at a time do a pass.
    let janitor = Janitor::spawn(state.pool.clone(), settings.janitor.clone(), instance.clone());
    if settings.metrics.is_some() {
        background.push(tokio::spawn(crate::metrics::sample(
            state.pool.clone(),
            settings.metrics_sample,
            settings.delivery.endpoint_max_in_flight,
            instance.clone(),
            stop.clone(),
        )));
    }
    // Every role that delivers listens: a `--role all` replica beside `--role ingest` ones
    // would otherwise find their webhooks only at its poll (its own ingest hands over
    // directly, and sends nothing).
    let wake_task = match settings.role {
        Role::Ingest => {
            Some(tokio::spawn(crate::wake::notify_others(state.pool.clone(), state.wake.clone(), stop.clone())))
        }
        Role::Worker | Role::All => {
            Some(tokio::spawn(crate::wake::listen(state.pool.clone(), state.wake.clone(), settings.role, stop.clone())))
        }
    };
    background.extend(wake_task);
    let console = (settings.console && settings.role != Role::Worker).then(crate::console::router);
    let draining = state.draining.clone();
    let router = crate::api::router(state, settings.role, console);
    // Before the first request is served: `/metrics` has the gauge from the start.
    let runtime_threads = tokio::runtime::Handle::current().metrics().num_workers();
    crate::metrics::runtime_threads(runtime_threads);
    crate::metrics::build_info(settings.role);
    let server = tokio::spawn(crate::server::serve(
        listener,
        router,
        settings.http,
        settings.delivery.shutdown_grace,
        stop.clone(),
    ));
    tracing::info!(%addr, role = ?settings.role, runtime_threads, "gateway listening");
    Ok(Running {
        addr,
        sources,
        shutdown,
        server,
        dispatcher,
        background,
        janitor,
        draining,
        drain: settings.drain,
        member,
        heartbeat,
    })
}
