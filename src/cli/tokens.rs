//! `webhook-gateway tokens create|list|revoke`: scoped API tokens, against the database.

use super::{database, print, stop_embedded, write_out};
use crate::config::{TokensAction, TokensArgs};
use crate::db;
use crate::tokens;

/// `webhook-gateway tokens ...`: each change is written to the audit log as `cli`, with
/// the operating-system user as the actor.
pub async fn run(args: TokensArgs) -> anyhow::Result<()> {
    let (url, cluster) = database(args.database_url.as_deref(), &args.data_dir).await?;
    let actor = format!("cli:{}", std::env::var("USER").unwrap_or_else(|_| "unknown".into()));
    let result = async {
        let pool = db::open(&db::DbConfig::direct(&url, 2)).await?;
        db::require_migrated(&pool).await?;
        let audit = |action: &'static str, target: String, status: u16| {
            let pool = pool.clone();
            let actor = actor.clone();
            async move {
                let entry = crate::audit::Entry {
                    actor: &actor,
                    via: crate::audit::Via::Cli,
                    action,
                    target: &target,
                    status,
                    address: None,
                    request_id: None,
                };
                crate::audit::record(&pool, &entry).await
            }
        };
        match args.action {
            TokensAction::Create { name, scope, expires_in_days, no_payloads } => {
                // Name, scope and the expiry's range were checked as the command line was read.
                let expires_at = expires_in_days
                    .map(tokens::expiry_in)
                    .transpose()
                    .map_err(|e| anyhow::anyhow!("--expires-in-days: {e}"))?;
                let token = tokens::generate();
                let new = tokens::sql::NewToken { name: &name, scope, expires_at, payloads: !no_payloads };
                let created = tokens::sql::create(&pool, &new, &tokens::hash(&token), &actor).await?;
                audit("tokens create", format!("token {name}"), if created.is_some() { 201 } else { 409 }).await?;
                anyhow::ensure!(created.is_some(), "a token is named {name:?}");
                // Shown once, here: a token nobody could read (stdout closed) is revoked
                // rather than left valid and unseen.
                if let Err(e) = write_out(&format!("{token}\n")) {
                    tokens::sql::revoke(&pool, &name).await?;
                    audit("tokens revoke", format!("token {name} (never shown)"), 200).await?;
                    anyhow::bail!("the token could not be written to stdout ({e}), so it was revoked");
                }
            }
            TokensAction::List => {
                for t in tokens::sql::list(&pool).await? {
                    let state = match (t.revoked_at, t.expires_at) {
                        (Some(at), _) => format!("revoked {at}"),
                        (None, Some(at)) => format!("expires {at}"),
                        (None, None) => "no expiry".into(),
                    };
                    let payloads = if t.payloads { "payloads" } else { "no payloads" };
                    let used = t.last_used_at.map_or_else(|| "never used".to_owned(), |at| format!("last used {at}"));
                    print(&format!(
                        "{}\t{}\t{}\t{payloads}\t{state}\tcreated {} by {}\t{used}\n",
                        t.id, t.name, t.scope, t.created_at, t.created_by
                    ));
                }
            }
            TokensAction::Revoke { name } => {
                let revoked = tokens::sql::revoke(&pool, &name).await?;
                audit("tokens revoke", format!("token {name}"), if revoked.is_some() { 200 } else { 404 }).await?;
                let revoked = revoked.ok_or_else(|| anyhow::anyhow!("no token is named {name:?}"))?;
                print(&format!("revoked {} ({})\n", revoked.name, revoked.id));
            }
        }
        pool.close().await;
        anyhow::Ok(())
    }
    .await;
    stop_embedded(cluster).await?;
    result
}
