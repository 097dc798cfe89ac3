//! `webhook-gateway` binary: CLI -> configuration -> the async runtime (sized by
//! `--runtime-threads`) -> listen address -> admin token -> database -> `app::start_on`
//! -> banner.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use tracing_subscriber::EnvFilter;
use webhook_gateway::banner::{self, Banner, TokenSource};
use webhook_gateway::config::{Cli, Command, LogFormat, SecretsAction, ServeArgs};
use webhook_gateway::db;
use webhook_gateway::secrets::Keyring;
use webhook_gateway::{admin_token, app, cli};

fn main() -> ExitCode {
    // glibc raises its mmap threshold each time a large block is freed, after which large
    // bodies come from the heap and their freed pages stay in the process. A fixed
    // threshold keeps blocks of 128 KiB and more in their own mappings, returned when
    // freed: bench row 17 (1 MB webhooks) measures what this holds.
    // SAFETY: mallopt only sets an allocator parameter; called before any thread starts.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
    let matches = match Cli::command().try_get_matches() {
        Ok(matches) => matches,
        Err(e) => match cli::from_environment(&e) {
            Some(line) => return fail(&line),
            None => e.exit(),
        },
    };
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if let Command::Tokens(webhook_gateway::config::TokensArgs {
        action:
            webhook_gateway::config::TokensAction::Create {
                no_payloads: true,
                scope: webhook_gateway::tokens::Scope::Admin,
                ..
            },
        ..
    }) = &cli.command
    {
        Cli::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "--no-payloads with --scope admin: an admin token always reads payloads (it can create tokens)",
            )
            .exit();
    }
    // `serve`'s settings are complete (file merged, checked) before the runtime is built:
    // one of them sizes it.
    let mut threads = None;
    if let Command::Serve(args) = &mut cli.command {
        let Some((_, sub)) = matches.subcommand() else {
            return fail("missing subcommand");
        };
        if let Err(e) = args.merge_file(sub).and_then(|()| args.validate()) {
            return fail(&e.to_string());
        }
        threads = args.runtime_threads;
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = threads {
        builder.worker_threads(threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return fail(&format!("cannot start the async runtime: {e}")),
    };
    let result = match cli.command {
        Command::Migrate(args) => {
            init_tracing(LogFormat::Pretty, None);
            runtime.block_on(async {
                let target = db::DbConfig {
                    pooler: args.db_pooler,
                    start_wait: std::time::Duration::from_secs(args.db_start_wait_secs),
                    ..db::DbConfig::direct(&args.database_url, 2)
                };
                let pool = db::open(&target).await?;
                db::migrate(&pool).await?;
                cli::print("migrations applied\n");
                Ok(())
            })
        }
        Command::Secrets(command) => match command.action {
            SecretsAction::Reencrypt(args) => {
                let keyring = match args.keys.keyring() {
                    Ok(keyring) if keyring.encrypts() => keyring,
                    Ok(_) => {
                        return fail(
                            "secrets reencrypt needs the key to encrypt under: --secrets-key or --secrets-key-file",
                        );
                    }
                    Err(e) => return fail(&e.to_string()),
                };
                init_tracing(LogFormat::Pretty, None);
                runtime.block_on(cli::secrets::reencrypt(args, keyring))
            }
        },
        Command::AdminToken(args) => cli::admin_token::run(&args),
        Command::Tokens(args) => {
            init_tracing(LogFormat::Pretty, None);
            runtime.block_on(cli::tokens::run(args))
        }
        Command::Serve(args) => {
            // Traces only for `serve`: the one-shot commands have nothing worth a trace.
            let endpoint = args.otel_endpoint.as_deref();
            let (telemetry, tracer) = match webhook_gateway::telemetry::start(endpoint, runtime.handle().clone()) {
                Ok(exporting) => exporting.unzip(),
                Err(e) => return fail(&e.to_string()),
            };
            init_tracing(args.log_format, tracer);
            if telemetry.is_some() {
                let endpoint = args
                    .otel_endpoint
                    .clone()
                    .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").ok())
                    .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok())
                    .unwrap_or_default();
                tracing::info!(endpoint = %without_credentials(&endpoint), "OpenTelemetry traces exported over OTLP/HTTP");
            }
            let result = runtime.block_on(serve(args));
            // After the last span ended, while the runtime that sends the export still runs.
            if let Some(telemetry) = telemetry {
                telemetry.shutdown();
            }
            result
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&cli::chain_text(&e)),
    }
}

/// Configuration and start-up errors are one line on stderr and exit code 1.
fn fail(message: &str) -> ExitCode {
    eprintln!("webhook-gateway: error: {message}");
    ExitCode::FAILURE
}

/// The log filter without `RUST_LOG`. sqlx's pool logs every connection whose set-up the
/// gateway refused at ERROR, again at each of its immediate retries (a read-only node: one
/// line per new connection); the gateway says it itself, throttled (`db::connect_refused`).
const DEFAULT_LOG_FILTER: &str = "info,sqlx=warn,sqlx_core::pool::inner=off";

/// Logs on stderr, and spans to OpenTelemetry when `otel` is given. The spans meant for
/// OpenTelemetry (target `otel`) are kept out of the logs, so the log lines are the same
/// with tracing on or off.
fn init_tracing(format: LogFormat, otel: Option<opentelemetry_sdk::trace::SdkTracer>) {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG_FILTER));
    let filter = match format!("{}=off", webhook_gateway::telemetry::TARGET).parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    };
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(colours(std::io::stderr().is_terminal(), std::env::var_os("NO_COLOR").as_deref()));
    let fmt = match format {
        LogFormat::Pretty => fmt.with_filter(filter).boxed(),
        LogFormat::Json => fmt.json().with_filter(filter).boxed(),
    };
    tracing_subscriber::registry().with(fmt).with(otel.map(webhook_gateway::telemetry::layer)).init();
}

/// Colours only for a person at a terminal: escape codes in a file (a service manager's
/// journal, `nohup.out`, CI logs) are noise, and `NO_COLOR` (no-color.org: set and not
/// empty) turns them off everywhere.
fn colours(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// `url` without the `user:password@` a collector's URL may carry, for the log.
fn without_credentials(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if !parsed.username().is_empty() || parsed.password().is_some() => {
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            parsed.to_string()
        }
        Ok(_) => url.to_owned(),
        Err(_) => "(not a URL)".to_owned(),
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // Whatever can fail without leaving anything behind comes first, so that a taken port
    // or a bad key is one line and exit 1 before a database is started (and would have
    // to be stopped again, its pool complaining on the way out).
    // The signal handlers come before the bind: a client may connect (and a supervisor
    // send SIGTERM) as soon as the port is bound, and that SIGTERM must be a graceful stop
    // (after the start-up under way), not the default action (death by signal).
    let stop = shutdown_signal()?;
    let listener = app::bind(args.listen).await?;
    // The address as bound: with `--listen 127.0.0.1:0` the port is the kernel's choice,
    // and a supervisor (or a test harness) learns it here, before the database is ready.
    tracing::info!(addr = %listener.local_addr()?, "listen address bound; serving once start-up is done");
    let keyring = args.secrets.keyring()?;
    let metrics = webhook_gateway::metrics::install()?;
    let (admin_token, token_source) = match &args.admin_token {
        Some(token) => (token.clone(), TokenSource::Configured),
        None => {
            let (token, created) = admin_token::load_or_create(&args.data_dir)?;
            if args.database_url.is_some() {
                tracing::warn!(
                    file = %admin_token::path(&args.data_dir).display(),
                    "admin token generated and kept in this machine's data directory: replicas elsewhere keep their \
                     own; configure one (--admin-token, WEBHOOK_GATEWAY_ADMIN_TOKEN) to share it"
                );
            }
            (token, TokenSource::Kept { path: admin_token::path(&args.data_dir), created })
        }
    };
    let (url, cluster) = cli::database(args.database_url.as_deref(), &args.data_dir).await?;
    let banner = Banner {
        addr: listener.local_addr()?,
        role: args.role,
        database: match &cluster {
            Some(cluster) => banner::Database::Embedded(cluster.data_dir().to_path_buf()),
            None => banner::Database::Url,
        },
        token: admin_token,
        token_source,
        data_dir: args.data_dir.clone(),
        sources: Vec::new(),
        console: args.console.0,
    };
    let target = db::DbConfig {
        url: url.clone(),
        pool_size: args.db_pool_size,
        pooler: args.db_pooler,
        session_url: args.db_session_url.clone(),
        start_wait: std::time::Duration::from_secs(args.db_start_wait_secs),
    };
    let mut stop = std::pin::pin!(stop);
    let result = async {
        let pool = tokio::select! {
            pool = db::open(&target) => pool?,
            () = stop.as_mut() => {
                stopped_during_start_up();
                return Ok(());
            }
        };
        match run(args, &pool, listener, keyring, metrics, banner, stop).await {
            // A start-up statement may still be waiting on the database: closing the pool
            // waits for every connection to come back, so it would wait for that
            // statement. Dropping the pool closes the sockets instead.
            Ok(Ending::StoppedDuringStartUp) => Ok(()),
            // Closed on every other path, before the cluster stops: a pool whose server
            // vanishes under it logs connection errors. Closing waits for every connection
            // to come back, and one abandoned on a dead path (a claim sent into a
            // partition: the stop raced it) is tested by sqlx before it comes back, for as
            // long as the path stays silent: the wait is bounded, then the pool is dropped.
            result => {
                if tokio::time::timeout(POOL_CLOSE_WAIT, pool.close()).await.is_err() {
                    tracing::warn!(
                        wait = ?POOL_CLOSE_WAIT,
                        "a database connection did not come back (a dead network path?): exiting without it"
                    );
                }
                result.map(|_| ())
            }
        }
    }
    .await;
    cli::stop_embedded(cluster).await?;
    result
}

/// Longest the shutdown waits for the pool's connections to come back before it drops them.
const POOL_CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// A stop signal came before the gateway served anything: nothing to finish.
fn stopped_during_start_up() {
    tracing::info!("stop signal during start-up: exiting before serving");
}

/// How [`run`] ended (when it did not fail).
enum Ending {
    /// It served, then shut down on a stop signal.
    Served,
    /// A stop signal came during the start-up, which was abandoned where it was.
    StoppedDuringStartUp,
}

/// Start the gateway on `pool` and serve until `stop`. A stop during the start-up ends it
/// at once: the start-up waits on the database (migrations wait for locks without a
/// statement timeout), and a supervisor's SIGTERM must not wait for a database that may
/// be partitioned away or locked by another deploy's migration.
async fn run(
    args: ServeArgs,
    pool: &crate::db::Pool,
    listener: tokio::net::TcpListener,
    keyring: Keyring,
    metrics: metrics_exporter_prometheus::PrometheusHandle,
    mut banner: Banner,
    mut stop: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> anyhow::Result<Ending> {
    let running = tokio::select! {
        running = start(args, pool, listener, keyring, metrics, &mut banner) => running?,
        () = stop.as_mut() => {
            stopped_during_start_up();
            return Ok(Ending::StoppedDuringStartUp);
        }
    };
    cli::print(&banner.render(std::io::stdout().is_terminal()));
    stop.await;
    tracing::info!("shutting down: no new requests or claims; finishing in-flight work");
    running.shutdown().await?;
    Ok(Ending::Served)
}

/// The settings the arguments give, and the gateway started with them (`app::start_on`:
/// migrations, the stored secrets' check, the gateway's tasks); the banner learns the
/// sources.
async fn start(
    args: ServeArgs,
    pool: &crate::db::Pool,
    listener: tokio::net::TcpListener,
    keyring: Keyring,
    metrics: metrics_exporter_prometheus::PrometheusHandle,
    banner: &mut Banner,
) -> anyhow::Result<app::Running> {
    let settings = app::Settings {
        listen: banner.addr,
        admin_token: banner.token.clone(),
        max_body_bytes: args.max_body_bytes,
        role: args.role,
        delivery: args.delivery(),
        egress: args.egress(),
        janitor: args.janitor(),
        resolver: None,
        metrics: Some(metrics),
        metrics_sample: std::time::Duration::from_secs(args.metrics_sample_secs),
        // A quarter of the pool: fewer writers make bigger batches (fewer commits, less
        // PostgreSQL CPU per event); workers, the admin API and the janitor keep the rest.
        ingest_writers: (args.db_pool_size as usize / 4).max(1),
        db_timeout: std::time::Duration::from_secs(args.db_timeout_secs),
        drain: args.shutdown_drain(),
        http: args.http(),
        secrets: keyring,
        console: args.console.0,
        operational: args.operational(),
        ingest_memory_bytes: args.ingest_memory_mib * 1024 * 1024,
        indexing: args.indexing(),
    };
    let running = app::start_on(pool.clone(), settings, listener).await?;
    banner.sources.clone_from(&running.sources);
    Ok(running)
}

/// Start listening for SIGINT and SIGTERM now (the handlers are installed by this call),
/// and return the future that completes on the first of them.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use anyhow::Context as _;
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot listen for SIGINT")?;
    let mut terminate = signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    })
}

#[cfg(test)]
mod tests {
    /// A collector's URL is logged without the credentials it may carry.
    #[test]
    fn a_collector_url_is_logged_without_its_credentials() {
        assert_eq!(super::without_credentials("http://u:pw@otel.internal:4318/"), "http://otel.internal:4318/");
        assert_eq!(super::without_credentials("http://otel.internal:4318"), "http://otel.internal:4318");
        assert_eq!(super::without_credentials("not a url"), "(not a URL)");
    }

    #[test]
    fn colours_only_on_a_terminal_and_never_with_no_color() {
        use std::ffi::OsStr;
        assert!(super::colours(true, None));
        assert!(!super::colours(false, None), "a file gets no escape codes");
        assert!(!super::colours(true, Some(OsStr::new("1"))), "NO_COLOR set");
        assert!(super::colours(true, Some(OsStr::new(""))), "NO_COLOR empty counts as unset (no-color.org)");
    }
}
