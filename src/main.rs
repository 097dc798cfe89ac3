//! `webhook-gateway` binary: CLI -> configuration -> database -> `app::start`.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use tracing_subscriber::EnvFilter;
use webhook_gateway::config::{Cli, Command, LogFormat, ReencryptArgs, SecretsAction, ServeArgs};
use webhook_gateway::db::{self, embedded};
use webhook_gateway::secrets::{self, Keyring};
use webhook_gateway::{api, app};

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return fail(&format!("cannot start the async runtime: {e}")),
    };
    let result = match cli.command {
        Command::Migrate(args) => {
            init_tracing(LogFormat::Pretty);
            runtime.block_on(async {
                let pool = db::connect(&args.database_url, 2).await?;
                db::migrate(&pool).await?;
                println!("migrations applied");
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
                init_tracing(LogFormat::Pretty);
                runtime.block_on(reencrypt(args, keyring))
            }
        },
        Command::Serve(mut args) => {
            let Some((_, sub)) = matches.subcommand() else {
                return fail("missing subcommand");
            };
            if let Err(e) = args.merge_file(sub).and_then(|()| args.validate()) {
                return fail(&e.to_string());
            }
            init_tracing(args.log_format);
            runtime.block_on(serve(args))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&format!("{e:#}")),
    }
}

/// Configuration and start-up errors are one line on stderr and exit code 1.
fn fail(message: &str) -> ExitCode {
    eprintln!("webhook-gateway: error: {message}");
    ExitCode::FAILURE
}

fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Pretty => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let (url, cluster) = database(args.database_url.as_deref(), &args.data_dir).await?;
    let result = run(args, &url).await;
    stop_embedded(cluster).await?;
    result
}

/// The database URL: the given one, or that of the embedded cluster in `data_dir`
/// (started here; stop it with [`stop_embedded`]).
async fn database(
    url: Option<&str>,
    data_dir: &std::path::Path,
) -> anyhow::Result<(String, Option<embedded::Cluster>)> {
    if let Some(url) = url {
        return Ok((url.to_owned(), None));
    }
    let options =
        embedded::ClusterOptions { data_dir: data_dir.join("pg"), throwaway: false, port: None, settings: Vec::new() };
    std::fs::create_dir_all(data_dir)?;
    let started = tokio::task::spawn_blocking(move || embedded::Cluster::start(&options)).await??;
    tracing::info!(
        data_dir = %started.data_dir().display(),
        port = started.port(),
        "embedded PostgreSQL started (set DATABASE_URL to use your own server)"
    );
    let url = started.url("postgres");
    Ok((url, Some(started)))
}

async fn stop_embedded(cluster: Option<embedded::Cluster>) -> anyhow::Result<()> {
    if let Some(mut cluster) = cluster {
        tokio::task::spawn_blocking(move || cluster.stop()).await?;
        tracing::info!("embedded PostgreSQL stopped");
    }
    Ok(())
}

/// `secrets reencrypt`: prints what it rewrote; unreadable values are listed and make the
/// exit code 1 (the rest is still rewritten).
async fn reencrypt(args: ReencryptArgs, keyring: Keyring) -> anyhow::Result<()> {
    let (url, cluster) = database(args.database_url.as_deref(), &args.data_dir).await?;
    let result = async {
        let pool = db::connect(&url, 2).await?;
        let done = secrets::reencrypt(&pool, &keyring, args.batch_size).await?;
        pool.close().await;
        anyhow::Ok(done)
    }
    .await;
    stop_embedded(cluster).await?;
    let done = result?;
    let key = keyring.current_key_id().unwrap_or_default();
    println!(
        "re-encrypted {} secrets under key {key} ({} endpoint, {} source); {} already under it",
        done.rewritten(),
        done.endpoint_values,
        done.source_values,
        done.unchanged
    );
    if done.unreadable > 0 {
        for problem in &done.problems {
            eprintln!("webhook-gateway: cannot re-encrypt {problem}");
        }
        anyhow::bail!("{} secrets could not be read and were left as they were", done.unreadable);
    }
    Ok(())
}

async fn run(args: ServeArgs, url: &str) -> anyhow::Result<()> {
    let pool = db::connect(url, args.db_pool_size).await?;
    db::migrate(&pool).await?;
    let keyring = args.secrets.keyring()?;
    secrets::check_stored(&pool, &keyring).await?;
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
    for source in webhook_gateway::store::sources::list(&pool).await? {
        if source.spec.0.kind == webhook_gateway::verify::Kind::None {
            tracing::warn!(source = %source.name, "source of kind `none`: its webhooks are accepted unverified");
        }
    }
    let admin_token = match &args.admin_token {
        Some(token) => token.clone(),
        None => {
            let token = api::generate_secret().replacen("whsec_", "wgadm_", 1).replace(['+', '/', '='], "");
            println!("admin token (generated; set WEBHOOK_GATEWAY_ADMIN_TOKEN to keep one): {token}");
            token
        }
    };
    let settings = app::Settings {
        listen: args.listen,
        admin_token,
        max_body_bytes: args.max_body_bytes,
        role: args.role,
        delivery: args.delivery(),
        egress: args.egress(),
        janitor: args.janitor(),
        resolver: None,
        metrics: Some(webhook_gateway::metrics::install()?),
        metrics_sample: std::time::Duration::from_secs(args.metrics_sample_secs),
        // A quarter of the pool: fewer writers make bigger batches (fewer commits, less
        // PostgreSQL CPU per event); workers, the admin API and the janitor keep the rest.
        ingest_writers: (args.db_pool_size as usize / 4).max(1),
        db_timeout: std::time::Duration::from_secs(args.db_timeout_secs),
        http: args.http(),
        secrets: keyring,
        console: args.console.0,
    };
    if let Some(limit) = webhook_gateway::server::raise_open_file_limit() {
        tracing::debug!(open_files = limit, "open-file limit");
    }
    // Listening before the server starts: a SIGTERM that arrives as soon as the gateway
    // answers must be a graceful stop, not the default action (death, exit by signal).
    let stop = shutdown_signal()?;
    let running = app::start(pool.clone(), settings).await?;
    stop.await;
    tracing::info!("shutting down: no new requests or claims; finishing in-flight work");
    running.shutdown().await?;
    pool.close().await;
    Ok(())
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
