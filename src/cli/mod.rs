//! The commands besides `serve` (`tokens`, `secrets reencrypt`, `admin-token`) and what
//! every command shares: writing to stdout without panicking on a closed pipe, one line
//! for an error and its causes, an environment variable's bad value told by its name, and
//! the embedded cluster a command starts when no database URL is given.

pub mod admin_token;
pub mod secrets;
pub mod tokens;

use std::io::Write as _;

use clap::CommandFactory as _;

use crate::config::Cli;
use crate::db::embedded;

/// An error and its causes on one line, `a: b: c`, leaving out a cause whose text is
/// already there: sqlx's database error repeats its server message as its source.
pub fn chain_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if !text.contains(&part) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&part);
        }
    }
    text
}

/// A value the command line's parser refused that came from an environment variable,
/// told as configuration (one line naming the variable, exit 1, as docs/configuration.md
/// says), where clap would name only the flag the variable stands for and exit 2 with a
/// usage hint. `None`: the error is the command line's own, left to clap.
pub fn from_environment(e: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(e.kind(), ErrorKind::ValueValidation | ErrorKind::InvalidValue) {
        return None;
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else { return None };
    let Some(ContextValue::String(value)) = e.get(ContextKind::InvalidValue) else { return None };
    let long = arg.split_whitespace().next()?.strip_prefix("--")?;
    let flag = format!("--{long}");
    let on_command_line = std::env::args_os()
        .skip(1)
        .any(|a| a.to_str().is_some_and(|a| a == flag || a.starts_with(&format!("{flag}="))));
    if on_command_line {
        return None;
    }
    let mut commands = vec![Cli::command()];
    let found = std::iter::from_fn(|| {
        let command = commands.pop()?;
        commands.extend(command.get_subcommands().cloned());
        Some(command)
    })
    .find_map(|command| {
        let arg = command.get_arguments().find(|a| a.get_long() == Some(long))?;
        let env = arg.get_env()?.to_str()?.to_owned();
        // A list's variable (`a,b`) is refused by its one bad element.
        let set = std::env::var(&env).ok()?;
        let holds = set == *value || arg.get_value_delimiter().is_some_and(|d| set.split(d).any(|part| part == value));
        holds.then(|| (env, arg.is_hide_env_values_set()))
    });
    let (env, hidden) = found?;
    let reason = match (e.kind(), e.get(ContextKind::ValidValue)) {
        (ErrorKind::InvalidValue, Some(ContextValue::Strings(valid))) => format!("must be one of {}", valid.join(", ")),
        _ => std::error::Error::source(e).map_or_else(|| "not a valid value".to_owned(), ToString::to_string),
    };
    let shown = if hidden { String::new() } else { format!(" {value:?}") };
    Some(format!("{env} (for {flag}): invalid value{shown}: {reason}"))
}

/// Write to stdout, ignoring a closed pipe (`webhook-gateway ... | head`): `println!`
/// would panic.
pub fn print(text: &str) {
    let _ = write_out(text);
}

/// Write to stdout, saying whether it could be written (a closed pipe cannot).
pub fn write_out(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|()| out.flush())
}

/// The database URL: the given one, or that of the embedded cluster in `data_dir`
/// (started here; stop it with [`stop_embedded`]).
pub async fn database(
    url: Option<&str>,
    data_dir: &std::path::Path,
) -> anyhow::Result<(String, Option<embedded::Cluster>)> {
    if let Some(url) = url {
        return Ok((url.to_owned(), None));
    }
    let options = embedded::ClusterOptions {
        data_dir: data_dir.join("pg"),
        throwaway: false,
        port: None,
        settings: Vec::new(),
        env: Vec::new(),
    };
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

/// Stop the embedded cluster [`database`] started, if it did.
pub async fn stop_embedded(cluster: Option<embedded::Cluster>) -> anyhow::Result<()> {
    if let Some(mut cluster) = cluster {
        tokio::task::spawn_blocking(move || cluster.stop()).await?;
        tracing::info!("embedded PostgreSQL stopped");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("error returned from database: {0}")]
    struct Outer(#[source] Inner);

    #[derive(Debug, thiserror::Error)]
    #[error("relation \"api_tokens\" does not exist")]
    struct Inner;

    #[test]
    fn an_error_s_chain_is_one_line_and_says_nothing_twice() {
        let repeated = anyhow::Error::new(Outer(Inner)).context("tokens list");
        assert_eq!(
            super::chain_text(&repeated),
            "tokens list: error returned from database: relation \"api_tokens\" does not exist"
        );
        let plain = anyhow::Error::new(Inner).context("reading the key");
        assert_eq!(super::chain_text(&plain), "reading the key: relation \"api_tokens\" does not exist");
    }
}
