//! Secrets in the database: the start-up check ([`check_stored`]: a process never starts
//! on secrets it cannot read) and re-encryption under the current key ([`reencrypt`]).

use crate::db::Pool;

use super::{Keyring, Place, Sealed, is_key_id};

/// Every stored secret, as `(place, value)` rows: endpoints (deleted ones too: their
/// secrets are still at rest) and source specs.
const STORED_VALUES: &str = "
    SELECT 'endpoint' AS place, e.secret AS v FROM endpoints e
    UNION ALL
    SELECT 'endpoint', p.v FROM endpoints e, unnest(e.previous_secrets) AS p(v)
    UNION ALL
    SELECT 'source', s.v FROM sources src, jsonb_array_elements_text(
        CASE WHEN jsonb_typeof(src.spec -> 'secrets') = 'array' THEN src.spec -> 'secrets' ELSE '[]' END) AS s(v)";

/// Refuse to start when the database holds a secret this keyring cannot open by its key
/// id: encrypted under a key that is neither current nor previous, or encrypted at all
/// when there is no key. The message is one line naming the key ids and what to do.
pub async fn check_stored(pool: &Pool, keyring: &Keyring) -> anyhow::Result<()> {
    let found: Vec<(String, i64)> = crate::db::query_as(&format!(
        "SELECT split_part(v, ':', 3) AS key_id, count(*)::int8 FROM ({STORED_VALUES}) stored
         WHERE v LIKE 'enc:v1:%' GROUP BY 1 ORDER BY 1"
    ))
    .fetch_all(pool)
    .await?;
    let unknown: Vec<String> = found
        .iter()
        .filter(|(id, _)| !keyring.knows(id))
        .map(|(id, n)| format!("{n} under key {}", printable_id(id)))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    let held = match keyring.current_key_id() {
        None => "no secrets key is configured: set --secrets-key (WEBHOOK_GATEWAY_SECRETS_KEY) to the key they \
                 were written with"
            .to_owned(),
        Some(current) => {
            let previous = keyring.previous_key_ids();
            format!(
                "this process holds key {current} (current){}: add the key they were written with as \
                 --secrets-key-previous (WEBHOOK_GATEWAY_SECRETS_KEY_PREVIOUS)",
                if previous.is_empty() { String::new() } else { format!(" and {} (previous)", previous.join(", ")) }
            )
        }
    };
    anyhow::bail!(
        "the database holds encrypted secrets this process cannot read ({}); {held}. Refusing to start rather than \
         fail every webhook's verification and every delivery's signature",
        unknown.join(", ")
    )
}

/// A key id as read from the database, safe to print on one line.
fn printable_id(id: &str) -> String {
    if is_key_id(id) { id.to_owned() } else { format!("{:?} (malformed)", id.chars().take(16).collect::<String>()) }
}

/// What [`reencrypt`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reencrypted {
    /// Endpoint secrets (current and previous) rewritten.
    pub endpoint_values: u64,
    /// Source secrets rewritten.
    pub source_values: u64,
    /// Values already under the current key (checked, left as they were).
    pub unchanged: u64,
    /// Values that could not be opened, left as they were: `endpoint <id>: reason`
    /// (at most [`MAX_REPORTED`]; `unreadable` counts them all).
    pub problems: Vec<String>,
    /// How many values could not be opened.
    pub unreadable: u64,
}

/// Most unreadable values [`reencrypt`] lists.
pub const MAX_REPORTED: usize = 20;

impl Reencrypted {
    /// Values rewritten.
    pub fn rewritten(&self) -> u64 {
        self.endpoint_values + self.source_values
    }

    fn unreadable(&mut self, what: String) {
        self.unreadable += 1;
        if self.problems.len() < MAX_REPORTED {
            self.problems.push(what);
        }
    }
}

/// Rewrite every stored secret in the form `keyring` writes: plaintext and values under a
/// previous key are sealed under the current key; values already under it are opened (so
/// checked) and left alone. Rows are locked and rewritten `batch` at a time, each batch
/// its own transaction; running it again rewrites nothing. A value that cannot be opened
/// is left as it is and reported; the rest still proceed.
pub async fn reencrypt(pool: &Pool, keyring: &Keyring, batch: u32) -> Result<Reencrypted, sqlx::Error> {
    let mut done = Reencrypted::default();
    let batch = i64::from(batch.max(1));
    let mut after: Option<uuid::Uuid> = None;
    loop {
        let mut tx = pool.begin().await?;
        let rows: Vec<(uuid::Uuid, Sealed, Vec<Sealed>)> = crate::db::query_as(
            "SELECT id, secret, previous_secrets FROM endpoints
             WHERE $1::uuid IS NULL OR id > $1 ORDER BY id LIMIT $2 FOR UPDATE",
        )
        .bind(after)
        .bind(batch)
        .fetch_all(&mut *tx)
        .await?;
        for (id, secret, previous) in &rows {
            let values: Vec<Sealed> = std::iter::once(secret).chain(previous).cloned().collect();
            let what = format!("endpoint {id}");
            if let Some((values, n)) = rewrite_row(keyring, Place::EndpointSecret, &values, &what, &mut done) {
                done.endpoint_values += n;
                crate::db::query("UPDATE endpoints SET secret = $2, previous_secrets = $3 WHERE id = $1")
                    .bind(id)
                    .bind(&values[0])
                    .bind(&values[1..])
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        match rows.last() {
            Some((id, ..)) if rows.len() as i64 == batch => after = Some(*id),
            _ => break,
        }
    }
    let mut after: Option<uuid::Uuid> = None;
    loop {
        let mut tx = pool.begin().await?;
        let rows: Vec<(uuid::Uuid, String, Option<sqlx::types::Json<serde_json::Value>>)> = crate::db::query_as(
            "SELECT id, name, spec -> 'secrets' FROM sources
             WHERE ($1::uuid IS NULL OR id > $1) ORDER BY id LIMIT $2 FOR UPDATE",
        )
        .bind(after)
        .bind(batch)
        .fetch_all(&mut *tx)
        .await?;
        for (id, name, secrets) in &rows {
            let what = format!("source {name}");
            // No list (e.g. the built-in `api` source): nothing to rewrite.
            let Some(values) = secrets.as_ref().and_then(|s| s.0.as_array()) else { continue };
            let Some(values) = values
                .iter()
                .map(|v| v.as_str().map(|s| Sealed::from_stored(s.to_owned())))
                .collect::<Option<Vec<_>>>()
            else {
                done.unreadable(format!("{what}: its secrets are not a list of strings"));
                continue;
            };
            if let Some((values, n)) = rewrite_row(keyring, Place::SourceSecret, &values, &what, &mut done) {
                done.source_values += n;
                crate::db::query("UPDATE sources SET spec = jsonb_set(spec, '{secrets}', $2) WHERE id = $1")
                    .bind(id)
                    .bind(sqlx::types::Json(&values))
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        match rows.last() {
            Some((id, ..)) if rows.len() as i64 == batch => after = Some(*id),
            _ => break,
        }
    }
    Ok(done)
}

/// The new values of one row and how many of them changed, or `None` when none changes
/// (counted as unchanged) or one cannot be opened (reported; the row is left as it is, so
/// no value is lost).
fn rewrite_row(
    keyring: &Keyring,
    place: Place,
    values: &[Sealed],
    what: &str,
    done: &mut Reencrypted,
) -> Option<(Vec<Sealed>, u64)> {
    let mut out = Vec::with_capacity(values.len());
    let mut rewritten = 0u64;
    for (i, stored) in values.iter().enumerate() {
        // Opened even when current: the pass also proves every value authenticates.
        let sealed = keyring.open(place, stored).and_then(|plaintext| {
            if keyring.is_current(stored) { Ok(None) } else { keyring.seal(place, &plaintext).map(Some) }
        });
        match sealed {
            Ok(Some(new)) => {
                out.push(new);
                rewritten += 1;
            }
            Ok(None) => out.push(stored.clone()),
            Err(e) => {
                done.unreadable(format!("{what}, secret {i}: {e}"));
                return None;
            }
        }
    }
    done.unchanged += values.len() as u64 - rewritten;
    (rewritten > 0).then_some((out, rewritten))
}
