//! `webhook-gateway admin-token show|rotate`.

use super::print;
use crate::admin_token;
use crate::config::{AdminTokenAction, AdminTokenArgs};

/// `admin-token show|rotate`: the token kept in the data directory, on stdout alone.
pub fn run(args: &AdminTokenArgs) -> anyhow::Result<()> {
    let path = admin_token::path(&args.data_dir);
    let token = match args.action {
        AdminTokenAction::Show => admin_token::read(&args.data_dir)?.ok_or_else(|| {
            anyhow::anyhow!(
                "no admin token in {}: `webhook-gateway serve` generates it on its first start without a configured \
                 token (or create one now with `webhook-gateway admin-token rotate`)",
                path.display()
            )
        })?,
        AdminTokenAction::Rotate => {
            let token = admin_token::rotate(&args.data_dir)?;
            eprintln!(
                "webhook-gateway: a new admin token is kept in {}; a running gateway accepts the old one until it \
                 restarts",
                path.display()
            );
            token
        }
    };
    // Exported from an earlier start, the variable would be taken as a configured token
    // by the next `serve` in that shell, and this file ignored.
    if std::env::var("WEBHOOK_GATEWAY_ADMIN_TOKEN").is_ok_and(|v| !v.is_empty() && v != token) {
        eprintln!(
            "webhook-gateway: note: WEBHOOK_GATEWAY_ADMIN_TOKEN in this environment holds another token, and `serve` \
             would use it instead of this file: {}",
            admin_token::export_line("$(webhook-gateway admin-token show)")
        );
    }
    print(&format!("{token}\n"));
    Ok(())
}
