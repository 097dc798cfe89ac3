//! The generated admin token, kept in the data directory so it survives restarts.
//!
//! Without a configured token (`--admin-token`, `WEBHOOK_GATEWAY_ADMIN_TOKEN`, the
//! `--config` file), `serve` reads [`TOKEN_FILE`] in `--data-dir`, creating it (0600) with
//! a fresh token on the first start. The token a user exported after the first start keeps
//! working after every restart, like the data next to it. `webhook-gateway admin-token
//! show|rotate` read and replace it. A configured token is never written anywhere.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// The file in `--data-dir` holding the generated admin token.
pub const TOKEN_FILE: &str = "admin-token";

/// The shortest token accepted (the same floor as `--admin-token`).
pub const MIN_LEN: usize = 16;

/// Where the token of `data_dir` is kept.
pub fn path(data_dir: &Path) -> PathBuf {
    data_dir.join(TOKEN_FILE)
}

/// A fresh token: `wgadm_` and 43 random letters and digits (256 bits), so it can be
/// pasted into a shell or a header without quoting and selected with a double click.
pub fn generate() -> String {
    use rand::Rng as _;
    let random: String = rand::rng().sample_iter(rand::distr::Alphanumeric).take(43).map(char::from).collect();
    format!("wgadm_{random}")
}

/// The token kept in `data_dir`, if there is one.
pub fn read(data_dir: &Path) -> anyhow::Result<Option<String>> {
    let file = path(data_dir);
    let text = match std::fs::read_to_string(&file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read the admin token in {}", file.display())),
    };
    let token = text.trim();
    if token.len() < MIN_LEN || token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        bail!(
            "{} does not hold a usable admin token (one line of at least {MIN_LEN} characters): replace it with \
             `webhook-gateway admin-token rotate`",
            file.display()
        );
    }
    // Someone may have copied it around with a looser mode; it guards the whole admin API.
    if let Ok(meta) = std::fs::metadata(&file)
        && meta.permissions().mode() & 0o077 != 0
    {
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("cannot make {} private (0600)", file.display()))?;
    }
    Ok(Some(token.to_owned()))
}

/// The token kept in `data_dir`, creating it on first use; `true` when it was just created.
pub fn load_or_create(data_dir: &Path) -> anyhow::Result<(String, bool)> {
    if let Some(token) = read(data_dir)? {
        return Ok((token, false));
    }
    let token = generate();
    if write(data_dir, &token, false)? {
        return Ok((token, true));
    }
    // Another process started at the same moment created it first: use theirs, so both
    // accept the same token.
    let kept =
        read(data_dir)?.ok_or_else(|| anyhow::anyhow!("{} vanished while it was read", path(data_dir).display()))?;
    Ok((kept, false))
}

/// Replace the token kept in `data_dir` with a fresh one, and return it.
pub fn rotate(data_dir: &Path) -> anyhow::Result<String> {
    let token = generate();
    write(data_dir, &token, true)?;
    Ok(token)
}

/// Write `token` as the whole file, 0600 from its first byte, atomically: a reader or a
/// crash sees the old token or the new one, never half of one. With `replace` an earlier
/// file is replaced; without, an existing file is left alone and `false` returned.
fn write(data_dir: &Path, token: &str, replace: bool) -> anyhow::Result<bool> {
    std::fs::create_dir_all(data_dir).with_context(|| format!("cannot create {}", data_dir.display()))?;
    let file = path(data_dir);
    let tmp = data_dir.join(format!("{TOKEN_FILE}.{}.{:08x}.tmp", std::process::id(), rand::random::<u32>()));
    let keep = |e: std::io::Error| {
        anyhow::anyhow!(
            "cannot keep the generated admin token in {}: {e} (set --admin-token or WEBHOOK_GATEWAY_ADMIN_TOKEN \
             instead)",
            file.display()
        )
    };
    let mut out = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp).map_err(keep)?;
    out.write_all(format!("{token}\n").as_bytes()).map_err(keep)?;
    out.sync_all().map_err(keep)?;
    let placed = if replace {
        std::fs::rename(&tmp, &file).map(|()| true)
    } else {
        // link(2) fails when the name exists: create-if-absent, whole file at once.
        let linked = match std::fs::hard_link(&tmp, &file) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(e),
        };
        let _ = std::fs::remove_file(&tmp);
        linked
    };
    placed.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        keep(e)
    })
}

/// The line a user pastes into a shell to use `token` with the README's commands.
pub fn export_line(token: &str) -> String {
    format!("export WEBHOOK_GATEWAY_ADMIN_TOKEN={token}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("wg-admin-token-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn created_once_private_then_reused_and_rotated() {
        let dir = temp_dir("cycle");
        assert_eq!(read(&dir).unwrap(), None);
        let (token, created) = load_or_create(&dir).unwrap();
        assert!(created && token.starts_with("wgadm_") && token.len() == 6 + 43, "{token}");
        let mode = std::fs::metadata(path(&dir)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(load_or_create(&dir).unwrap(), (token.clone(), false));
        assert!(!write(&dir, &generate(), false).unwrap(), "an existing token is kept");
        assert_eq!(read(&dir).unwrap().as_deref(), Some(token.as_str()));
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(leftovers, [TOKEN_FILE], "no temporary file left behind");
        let rotated = rotate(&dir).unwrap();
        assert_ne!(rotated, token);
        assert_eq!(read(&dir).unwrap(), Some(rotated));
        assert_eq!(std::fs::metadata(path(&dir)).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn starts_at_the_same_moment_agree_on_one_token() {
        for round in 0..20 {
            let dir = temp_dir(&format!("race-{round}"));
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(8));
            let tokens: Vec<String> = (0..8)
                .map(|_| {
                    let (dir, barrier) = (dir.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        load_or_create(&dir).unwrap().0
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|t| t.join().unwrap())
                .collect();
            assert!(tokens.iter().all(|t| *t == tokens[0]), "round {round}: {tokens:?}");
            assert_eq!(read(&dir).unwrap().as_deref(), Some(tokens[0].as_str()));
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn a_loose_file_is_made_private_and_a_bad_one_refused() {
        let dir = temp_dir("loose");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(path(&dir), "a-token-written-by-hand-0123\n").unwrap();
        std::fs::set_permissions(path(&dir), std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(read(&dir).unwrap().as_deref(), Some("a-token-written-by-hand-0123"));
        assert_eq!(std::fs::metadata(path(&dir)).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::write(path(&dir), "short\n").unwrap();
        let err = read(&dir).unwrap_err().to_string();
        assert!(err.contains("admin-token rotate"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
