//! `webhook-gateway secrets reencrypt`: every stored secret rewritten under the current key.

use super::{database, print, stop_embedded};
use crate::config::ReencryptArgs;
use crate::db;
use crate::secrets::{self, Keyring};

/// Prints what it rewrote; unreadable values are listed and make the exit code 1 (the rest
/// is still rewritten).
pub async fn reencrypt(args: ReencryptArgs, keyring: Keyring) -> anyhow::Result<()> {
    let (url, cluster) = database(args.database_url.as_deref(), &args.data_dir).await?;
    let result = async {
        let pool = db::open(&db::DbConfig { pooler: args.db_pooler, ..db::DbConfig::direct(&url, 2) }).await?;
        db::require_migrated(&pool).await?;
        let done = secrets::reencrypt(&pool, &keyring, args.batch_size).await?;
        pool.close().await;
        anyhow::Ok(done)
    }
    .await;
    stop_embedded(cluster).await?;
    let done = result?;
    let key = keyring.current_key_id().unwrap_or_default();
    print(&format!(
        "re-encrypted {} secrets under key {key} ({} endpoint, {} source); {} already under it\n",
        done.rewritten(),
        done.endpoint_values,
        done.source_values,
        done.unchanged
    ));
    if done.unreadable > 0 {
        for problem in &done.problems {
            eprintln!("webhook-gateway: cannot re-encrypt {problem}");
        }
        anyhow::bail!("{} secrets could not be read and were left as they were", done.unreadable);
    }
    Ok(())
}
