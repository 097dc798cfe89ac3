//! The configuration's parsing, precedence and validation.

use super::*;
use clap::{CommandFactory, FromArgMatches};

fn parse(args: &[&str]) -> Result<ServeArgs, String> {
    let matches = Cli::command().try_get_matches_from(args).map_err(|e| e.to_string())?;
    let cli = Cli::from_arg_matches(&matches).map_err(|e| e.to_string())?;
    let Command::Serve(mut serve) = cli.command else { return Err("not serve".into()) };
    let (_, sub) = matches.subcommand().ok_or("no subcommand")?;
    serve.merge_file(sub).map_err(|e| e.to_string())?;
    serve.validate().map_err(|e| e.to_string())?;
    Ok(serve)
}

#[test]
fn defaults_are_valid() {
    let serve = parse(&["webhook-gateway", "serve"]).unwrap();
    assert_eq!(serve.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(serve.max_body_bytes, 1024 * 1024);
    assert_eq!(serve.lease_secs, 60);
    assert!(serve.egress_allow.is_empty());
}

#[test]
fn egress_allow_refuses_host_bits_and_unconfirmed_wide_ranges() {
    let allow = |args: &[&str]| {
        let mut all = vec!["webhook-gateway", "serve"];
        all.extend_from_slice(args);
        parse(&all)
    };
    let err = allow(&["--egress-allow", "127.0.0.1/0"]).unwrap_err();
    assert!(err.contains("host bits") && err.contains("0.0.0.0/0") && err.contains("127.0.0.1/32"), "{err}");
    let err = allow(&["--egress-allow", "10.1.2.3/24"]).unwrap_err();
    assert!(err.contains("10.1.2.0/24") && err.contains("10.1.2.3/32"), "{err}");
    assert!(allow(&["--egress-allow", "fd00::1/8"]).unwrap_err().contains("fd00::/8"));
    for wide in ["0.0.0.0/0", "::/0", "8.0.0.0/7", "fc00::/7"] {
        let err = allow(&["--egress-allow", wide]).unwrap_err();
        assert!(err.contains("--egress-allow-wide"), "{wide}: {err}");
        allow(&["--egress-allow", wide, "--egress-allow-wide"]).unwrap();
    }
    for fine in ["10.0.0.0/8", "192.168.1.0/24", "127.0.0.1/32", "fd00::/8", "::1/128"] {
        allow(&["--egress-allow", fine]).unwrap();
    }
}

/// IPv6 entries that reach IPv4 hosts under another spelling are as wide as the IPv4
/// space they carry: `::ffff:0:0/96` is all of IPv4 (found by review: it opened the
/// metadata service through `[::ffff:169.254.169.254]` with no `--egress-allow-wide`).
#[test]
fn egress_allow_refuses_ipv6_ranges_that_carry_ipv4_unless_confirmed() {
    let allow = |extra: &[&str]| parse(&[&["webhook-gateway", "serve"], extra].concat());
    for carrying in ["::ffff:0:0/96", "::/8", "64:ff9b::/96", "64:ff9b:1::/64", "2002::/16", "2001::/32", "2000::/3"] {
        let err = allow(&["--egress-allow", carrying]).unwrap_err();
        assert!(err.contains("carry IPv4") && err.contains("--egress-allow-wide"), "{carrying}: {err}");
        allow(&["--egress-allow", carrying, "--egress-allow-wide"]).unwrap();
    }
    let err = allow(&["--egress-allow", "::ffff:10.1.2.0/120"]).unwrap_err();
    assert!(err.contains("10.1.2.0/24"), "the IPv4 range to write instead: {err}");
    for fine in ["::1/128", "fd00::/8", "2a01:4f8::/32", "10.1.2.0/24"] {
        allow(&["--egress-allow", fine]).unwrap();
    }
}

#[test]
fn an_otel_endpoint_must_be_an_http_url() {
    assert!(parse(&["webhook-gateway", "serve", "--otel-endpoint", "http://collector:4318"]).is_ok());
    for bad in ["collector:4318", "grpc://collector:4317", "http://"] {
        let err = parse(&["webhook-gateway", "serve", "--otel-endpoint", bad]).unwrap_err();
        assert!(err.contains("otel-endpoint must be an http(s) URL"), "{bad}: {err}");
    }
}

#[test]
fn lease_shorter_than_timeout_is_refused() {
    let err = parse(&["webhook-gateway", "serve", "--lease-secs", "20", "--request-timeout-secs", "15"]).unwrap_err();
    assert!(err.contains("lease-secs (20) must be at least"), "{err}");
}

#[test]
fn a_request_deadline_inside_the_database_deadline_is_refused() {
    let err = parse(&["webhook-gateway", "serve", "--db-timeout-secs", "30", "--http-request-timeout-secs", "30"])
        .unwrap_err();
    assert!(err.contains("http-request-timeout-secs (30) must be above db-timeout-secs (30) + 1 s (31)"), "{err}");
    assert!(
        parse(&["webhook-gateway", "serve", "--db-timeout-secs", "28", "--http-request-timeout-secs", "30"]).is_ok()
    );
    let defaults = parse(&["webhook-gateway", "serve"]).unwrap();
    assert!(defaults.http_request_timeout_secs > defaults.db_timeout_secs + 1, "the defaults agree");
}

#[test]
fn the_drain_defaults_to_5_s_with_a_database_url_and_0_with_the_embedded_database() {
    // (DATABASE_URL in this process's environment would count as a database URL.)
    if std::env::var_os("DATABASE_URL").is_none() {
        let embedded = parse(&["webhook-gateway", "serve"]).unwrap();
        assert_eq!(embedded.shutdown_drain(), std::time::Duration::ZERO);
    }
    let remote = parse(&["webhook-gateway", "serve", "--database-url", "postgres://u@h/db"]).unwrap();
    assert_eq!(remote.shutdown_drain(), std::time::Duration::from_secs(5));
    let set = parse(&["webhook-gateway", "serve", "--shutdown-drain-secs", "9"]).unwrap();
    assert_eq!(set.shutdown_drain(), std::time::Duration::from_secs(9));
}

/// A value of the wrong type in a config file is named by its line and key, never shown:
/// a secrets key written as a string where a list is expected was printed on stderr
/// (found by review).
#[test]
fn a_wrong_value_in_a_config_file_is_named_by_line_and_key_and_never_shown() {
    let dir = std::env::temp_dir().join(format!("wg-config-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gw.toml");
    let key = "9G7hOqk8thN3utFn8uztmKWSAZf/VttGOX0u/KswHpo=";
    std::fs::write(&path, format!("listen = \"127.0.0.1:9999\"\nsecrets_key_previous = \"{key}\"\n")).unwrap();
    let err = parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap()]).unwrap_err();
    assert!(!err.contains(key), "the value shown: {err}");
    assert!(err.contains("line 2") && err.contains("`secrets_key_previous`") && err.contains("expected"), "{err}");
    std::fs::write(&path, "workers = \"many\"\n").unwrap();
    let err = parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap()]).unwrap_err();
    assert!(!err.contains("many") && err.contains("`workers`"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A secrets key given on the command line wins over a key file in the config file, as
/// every setting does (it was refused: "give secrets-key or secrets-key-file, not both").
#[test]
fn a_secrets_key_on_the_command_line_wins_over_a_key_file_in_the_config_file() {
    let dir = std::env::temp_dir().join(format!("wg-config-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (file_key, given_key) =
        ("AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=", "AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=");
    let key_path = dir.join("k1.key");
    std::fs::write(&key_path, file_key).unwrap();
    let path = dir.join("gw.toml");
    std::fs::write(&path, format!("secrets_key_file = {:?}\n", key_path.to_str().unwrap())).unwrap();
    let config = path.to_str().unwrap();
    let from_file = parse(&["webhook-gateway", "serve", "--config", config]).unwrap();
    let given = parse(&["webhook-gateway", "serve", "--config", config, "--secrets-key", given_key]).unwrap();
    let id = |s: &ServeArgs| s.secrets.keyring().unwrap().current_key_id().unwrap_or_default().to_owned();
    assert_ne!(id(&from_file), id(&given), "the command line's key, not the file's");
    assert_eq!(given.secrets.secrets_key_file, None);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn file_fills_only_what_the_command_line_left_unset() {
    let dir = std::env::temp_dir().join(format!("wg-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gw.toml");
    std::fs::write(&path, "listen = \"127.0.0.1:9999\"\nmax_body_bytes = 42\negress_allow = [\"127.0.0.1/32\"]\n")
        .unwrap();
    let serve =
        parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap(), "--max-body-bytes", "7"]).unwrap();
    assert_eq!(serve.listen.to_string(), "127.0.0.1:9999");
    assert_eq!(serve.max_body_bytes, 7);
    assert_eq!(serve.egress_allow.len(), 1);

    std::fs::write(&path, "lisen = \"127.0.0.1:1\"\n").unwrap();
    let err = parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap()]).unwrap_err();
    assert!(err.contains("unknown field `lisen`"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn db_timeout_defaults_validates_and_comes_from_the_file() {
    let serve = parse(&["webhook-gateway", "serve"]).unwrap();
    assert_eq!(serve.db_timeout_secs, 5);
    let err = parse(&["webhook-gateway", "serve", "--db-timeout-secs", "3"]).unwrap_err();
    assert!(err.contains("db-timeout-secs must be between 4 (above the 3 s pool acquire timeout) and 300"), "{err}");
    let err = parse(&["webhook-gateway", "serve", "--db-timeout-secs", "301"]).unwrap_err();
    assert!(err.contains("db-timeout-secs must be between"), "{err}");

    let dir = std::env::temp_dir().join(format!("wg-config-db-timeout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gw.toml");
    std::fs::write(&path, "db_timeout_secs = 10\n").unwrap();
    let serve = parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap()]).unwrap();
    assert_eq!(serve.db_timeout_secs, 10);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn retention_flags_default_validate_and_come_from_the_file() {
    let serve = parse(&["webhook-gateway", "serve"]).unwrap();
    let janitor = serve.janitor();
    assert_eq!(janitor.events_retention, Duration::from_secs(30 * 86_400));
    assert_eq!(janitor.attempts_retention, Duration::from_secs(30 * 86_400));
    assert_eq!(janitor.delivered_retention, Duration::from_secs(7 * 86_400));
    assert_eq!(janitor.interval, Duration::from_secs(300));
    assert_eq!(janitor.batch_size, 5000);

    let err = parse(&["webhook-gateway", "serve", "--retention-delivered-days", "31"]).unwrap_err();
    assert!(err.contains("retention-delivered-days (31) must not exceed retention-events-days (30)"), "{err}");
    let err = parse(&["webhook-gateway", "serve", "--retention-attempts-days", "0"]).unwrap_err();
    assert!(err.contains("retention-attempts-days must be between 1 and"), "{err}");
    let err = parse(&["webhook-gateway", "serve", "--janitor-batch-size", "0"]).unwrap_err();
    assert!(err.contains("janitor-batch-size must be between 1 and"), "{err}");
    let err = parse(&["webhook-gateway", "serve", "--janitor-interval-secs", "0"]).unwrap_err();
    assert!(err.contains("janitor-interval-secs must be between 1 and 86400"), "{err}");

    let dir = std::env::temp_dir().join(format!("wg-config-retention-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gw.toml");
    std::fs::write(
        &path,
        "retention_events_days = 90\nretention_attempts_days = 14\nretention_delivered_days = 3\n\
         janitor_interval_secs = 60\njanitor_batch_size = 1000\n",
    )
    .unwrap();
    let serve =
        parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap(), "--retention-delivered-days", "2"])
            .unwrap();
    assert_eq!(
        (serve.retention_events_days, serve.retention_attempts_days, serve.retention_delivered_days),
        (90, 14, 2)
    );
    assert_eq!((serve.janitor_interval_secs, serve.janitor_batch_size), (60, 1000));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_secrets_key_comes_from_a_flag_a_file_or_the_config_file_and_is_checked() {
    let key = crate::secrets::encode_key(&[3u8; crate::secrets::KEY_BYTES]);
    let serve = parse(&["webhook-gateway", "serve"]).unwrap();
    assert!(!serve.secrets.keyring().unwrap().encrypts(), "off by default");
    let serve = parse(&["webhook-gateway", "serve", "--secrets-key", &key]).unwrap();
    assert!(serve.secrets.keyring().unwrap().encrypts());
    assert!(!format!("{serve:?}").contains(&key), "Debug hides the key");

    let err = parse(&["webhook-gateway", "serve", "--secrets-key", "c2hvcnQ="]).unwrap_err();
    assert!(err.starts_with("secrets-key: must be 32 bytes in base64"), "{err}");
    let err = parse(&["webhook-gateway", "serve", "--secrets-key-previous", &key]).unwrap_err();
    assert!(err.contains("needs a current secrets-key"), "{err}");

    let dir = std::env::temp_dir().join(format!("wg-config-secrets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key_file = dir.join("key");
    std::fs::write(&key_file, format!("{key}\n")).unwrap();
    let serve = parse(&["webhook-gateway", "serve", "--secrets-key-file", key_file.to_str().unwrap()]).unwrap();
    assert_eq!(
        serve.secrets.keyring().unwrap().current_key_id(),
        crate::secrets::Key::from_base64(&key).ok().as_ref().map(|k| k.id())
    );
    let err =
        parse(&["webhook-gateway", "serve", "--secrets-key-file", key_file.to_str().unwrap(), "--secrets-key", &key])
            .unwrap_err();
    assert!(err.contains("not both"), "{err}");

    let path = dir.join("gw.toml");
    let previous = crate::secrets::encode_key(&[4u8; crate::secrets::KEY_BYTES]);
    std::fs::write(
        &path,
        format!("secrets_key_file = {:?}\nsecrets_key_previous = [{previous:?}]\n", key_file.to_str().unwrap()),
    )
    .unwrap();
    let serve = parse(&["webhook-gateway", "serve", "--config", path.to_str().unwrap()]).unwrap();
    let keyring = serve.secrets.keyring().unwrap();
    assert!(keyring.encrypts());
    assert_eq!(keyring.previous_key_ids().len(), 1);
    let old_file = dir.join("old.key");
    std::fs::write(&old_file, &previous).unwrap();
    let serve = parse(&[
        "webhook-gateway",
        "serve",
        "--secrets-key",
        &crate::secrets::encode_key(&[5u8; crate::secrets::KEY_BYTES]),
        "--secrets-key-previous-file",
        old_file.to_str().unwrap(),
        "--secrets-key-previous-file",
        key_file.to_str().unwrap(),
    ])
    .unwrap();
    assert_eq!(serve.secrets.keyring().unwrap().previous_key_ids().len(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A setting of the `settings!` list, as the reachability test drives it.
pub(super) struct Setting {
    /// Its name: the clap id and the key in the file.
    key: &'static str,
    /// Two different values (the first differs from the default), each as the command
    /// line, the environment and the file write it, and as it reads back.
    values: [Written; 2],
    /// Reads the setting back from parsed settings (its `Debug`).
    read: fn(&ServeArgs) -> String,
}

/// One value of a setting, written each way.
struct Written {
    /// Command-line occurrences: `Some(v)` is `--flag=v`, `None` the bare `--flag`.
    occurrences: Vec<Option<String>>,
    env: String,
    toml: toml::Value,
    debug: String,
}

impl Setting {
    pub(super) fn new<T: Sample>(key: &'static str, read: fn(&ServeArgs) -> String) -> Setting {
        let values = T::samples().map(|v| Written {
            occurrences: v.occurrences(),
            env: v.text(),
            toml: v.toml(),
            debug: format!("{v:?}"),
        });
        Setting { key, values, read }
    }
}

/// The values a type of setting takes in the reachability test.
pub(super) trait Sample: Sized + std::fmt::Debug {
    /// Two different values; the first must differ from the setting's default.
    fn samples() -> [Self; 2];
    /// As the environment (and a command-line value) writes it.
    fn text(&self) -> String;
    /// As the file writes it.
    fn toml(&self) -> toml::Value {
        toml::Value::String(self.text())
    }
    /// The command-line occurrences that give it.
    fn occurrences(&self) -> Vec<Option<String>> {
        vec![Some(self.text())]
    }
}

macro_rules! sample {
    ($($ty:ty: $a:expr, $b:expr;)+) => {$(
        impl Sample for $ty {
            fn samples() -> [Self; 2] {
                [$a, $b]
            }
            fn text(&self) -> String {
                self.to_string()
            }
        }
    )+};
}
sample! {
    String: "value-a-0123456789".into(), "value-b-0123456789".into();
    SocketAddr: SocketAddr::from(([127, 0, 0, 2], 4001)), "[::1]:4002".parse().unwrap();
    ipnet::IpNet: "10.1.0.0/16".parse().unwrap(), "fd00::/8".parse().unwrap();
}

macro_rules! sample_integer {
    ($($ty:ty),+) => {$(
        impl Sample for $ty {
            fn samples() -> [Self; 2] {
                [4001, 4002]
            }
            fn text(&self) -> String {
                self.to_string()
            }
            fn toml(&self) -> toml::Value {
                toml::Value::Integer(i64::try_from(*self).unwrap())
            }
        }
    )+};
}
sample_integer!(u32, u64, usize);

macro_rules! sample_value_enum {
    ($($ty:ty: $a:expr, $b:expr;)+) => {$(
        impl Sample for $ty {
            fn samples() -> [Self; 2] {
                [$a, $b]
            }
            fn text(&self) -> String {
                self.to_possible_value().unwrap().get_name().to_owned()
            }
        }
    )+};
}
sample_value_enum! {
    Role: Role::Worker, Role::Ingest;
    LogFormat: LogFormat::Json, LogFormat::Pretty;
    crate::db::Pooler: crate::db::Pooler::Transaction, crate::db::Pooler::None;
}

impl Sample for PathBuf {
    fn samples() -> [Self; 2] {
        ["/tmp/wg-sample-a".into(), "/tmp/wg-sample-b".into()]
    }
    fn text(&self) -> String {
        self.display().to_string()
    }
}

/// A flag: `true` is the bare flag on the command line, `false` cannot be written there
/// (so only the first value, `true`, is ever given on the command line).
impl Sample for bool {
    fn samples() -> [Self; 2] {
        [true, false]
    }
    fn text(&self) -> String {
        self.to_string()
    }
    fn toml(&self) -> toml::Value {
        toml::Value::Boolean(*self)
    }
    fn occurrences(&self) -> Vec<Option<String>> {
        if *self { vec![None] } else { vec![] }
    }
}

/// An on-by-default setting: `--flag=false` (the first value differs from the default).
impl Sample for Enabled {
    fn samples() -> [Self; 2] {
        [Enabled(false), Enabled(true)]
    }
    fn text(&self) -> String {
        self.to_string()
    }
    fn toml(&self) -> toml::Value {
        toml::Value::Boolean(self.0)
    }
}

impl<T: Sample> Sample for Option<T> {
    fn samples() -> [Self; 2] {
        T::samples().map(Some)
    }
    fn text(&self) -> String {
        self.as_ref().map(T::text).unwrap_or_default()
    }
    fn toml(&self) -> toml::Value {
        self.as_ref().map_or_else(|| toml::Value::String(String::new()), T::toml)
    }
    fn occurrences(&self) -> Vec<Option<String>> {
        self.as_ref().map(T::occurrences).unwrap_or_default()
    }
}

/// Two items (the flag repeated; comma-separated in the environment) and one.
impl<T: Sample> Sample for Vec<T> {
    fn samples() -> [Self; 2] {
        let [a, b] = T::samples();
        let [_, b_again] = T::samples();
        [vec![a, b], vec![b_again]]
    }
    fn text(&self) -> String {
        self.iter().map(T::text).collect::<Vec<_>>().join(",")
    }
    fn toml(&self) -> toml::Value {
        toml::Value::Array(self.iter().map(T::toml).collect())
    }
    fn occurrences(&self) -> Vec<Option<String>> {
        self.iter().flat_map(T::occurrences).collect()
    }
}

/// Environment variables given to a child process.
type Env<'a> = [(&'a str, &'a str)];

/// Set in a child process (this test binary, this test): parse what the parent asks
/// under the environment the parent gave it.
const PROBE: &str = "WG_CONFIG_REACHABILITY_PROBE";

/// The settings as the command line, the environment and the file give them, without
/// validation; each setting's `Debug`, in the `settings!` order.
fn parse_unvalidated(args: &[String]) -> Result<Vec<String>, String> {
    let matches = Cli::command().try_get_matches_from(args).map_err(|e| e.to_string())?;
    let cli = Cli::from_arg_matches(&matches).map_err(|e| e.to_string())?;
    let Command::Serve(mut serve) = cli.command else { return Err("not serve".into()) };
    let (_, sub) = matches.subcommand().ok_or("no subcommand")?;
    serve.merge_file(sub).map_err(|e| e.to_string())?;
    Ok(ServeArgs::settings().iter().map(|s| (s.read)(&serve)).collect())
}

/// Parses, in a child process whose environment is exactly `env` as far as settings
/// go, each command line of `parses`.
fn probe(env: &Env, parses: &[Vec<String>], dir: &std::path::Path) -> Vec<Result<Vec<String>, String>> {
    static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let job = dir.join(format!("probe-{n}.json"));
    let out = dir.join(format!("probe-{n}.out.json"));
    std::fs::write(&job, serde_json::to_vec(&(parses, &out)).unwrap()).unwrap();
    let test =
        concat!(module_path!(), "::", "every_setting_is_reachable_from_the_command_line_the_environment_and_the_file");
    let test = test.split_once("::").unwrap().1;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap());
    child.args([test, "--exact", "--test-threads=1", "--nocapture"]);
    for arg in Cli::command().find_subcommand("serve").unwrap().get_arguments() {
        if let Some(name) = arg.get_env() {
            child.env_remove(name);
        }
    }
    let status = child.envs(env.iter().copied()).env(PROBE, &job).output().unwrap();
    assert!(status.status.success(), "probe {n}: {status:?}");
    let answers = std::fs::read(&out).unwrap_or_else(|e| panic!("probe {n} answered nothing ({e}): {status:?}"));
    serde_json::from_slice(&answers).unwrap()
}

/// The child's side of [`probe`].
fn answer_probe(job: &std::ffi::OsStr) {
    let (parses, out): (Vec<Vec<String>>, PathBuf) = serde_json::from_slice(&std::fs::read(job).unwrap()).unwrap();
    let answers: Vec<_> = parses.iter().map(|args| parse_unvalidated(args)).collect();
    std::fs::write(out, serde_json::to_vec(&answers).unwrap()).unwrap();
}

/// Every `serve` flag is a setting of the `settings!` list with its environment variable
/// and file key, and a value given only on the command line, only in the environment or
/// only in the file arrives; command line > environment > file > default. Fails for a
/// flag declared outside the list, or one whose environment variable or file key is
/// missing or misnamed. The environment is a child process's (this test again, re-run
/// with `PROBE` set), never this process's own.
#[test]
fn every_setting_is_reachable_from_the_command_line_the_environment_and_the_file() {
    if let Some(job) = std::env::var_os(PROBE) {
        return answer_probe(&job);
    }
    let settings = ServeArgs::settings();
    let command = Cli::command();
    let serve = command.find_subcommand("serve").unwrap();
    let mut problems = Vec::new();

    // The list is the whole command line, and names each path by the convention.
    let mut flags = std::collections::HashMap::new(); // key -> (flag, environment variable)
    for arg in serve.get_arguments() {
        let id = arg.get_id().as_str();
        if matches!(id, "help" | "version" | "config") {
            continue; // `config` names the file itself: command line and environment only
        }
        let long = id.replace('_', "-");
        let env = if id == "database_url" {
            "DATABASE_URL".to_owned()
        } else {
            format!("WEBHOOK_GATEWAY_{}", id.to_uppercase())
        };
        if arg.get_long() != Some(long.as_str()) {
            problems.push(format!("{id}: flag {:?}, expected --{long}", arg.get_long()));
        }
        if arg.get_env() != Some(std::ffi::OsStr::new(&env)) {
            problems.push(format!("{id}: environment variable {:?}, expected {env}", arg.get_env()));
        }
        if !settings.iter().any(|s| s.key == id) {
            problems.push(format!("{id}: a serve flag outside the settings! list (no file key)"));
        }
        flags.insert(id.to_owned(), (long, env));
    }
    for setting in &settings {
        if !flags.contains_key(setting.key) {
            problems.push(format!("{}: in the settings! list but no serve flag", setting.key));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");

    // Every setting at once, given its first or second value, each way.
    let command_line = |config: Option<&str>, value: Option<usize>| -> Vec<String> {
        let mut args = vec!["webhook-gateway".to_owned(), "serve".to_owned()];
        args.extend(config.map(|c| format!("--config={c}")));
        let Some(i) = value else { return args };
        for setting in &settings {
            let long = &flags[setting.key].0;
            args.extend(setting.values[i].occurrences.iter().map(|occurrence| match occurrence {
                Some(v) => format!("--{long}={v}"),
                None => format!("--{long}"),
            }));
        }
        args
    };
    let environment = |i: usize| -> Vec<(&str, &str)> {
        settings.iter().map(|s| (flags[s.key].1.as_str(), s.values[i].env.as_str())).collect()
    };
    let dir = std::env::temp_dir().join(format!("wg-config-reach-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |i: usize| -> String {
        let table: toml::Table = settings.iter().map(|s| (s.key.to_owned(), s.values[i].toml.clone())).collect();
        let path = dir.join(format!("gw-{i}.toml"));
        std::fs::write(&path, toml::to_string(&table).unwrap()).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let (file_0, file_1) = (file(0), file(1));
    let (env_0, env_1) = (environment(0), environment(1));
    let config_env = vec![("WEBHOOK_GATEWAY_CONFIG", file_0.as_str())];
    struct Run<'a> {
        given: &'a str,
        env: &'a Env<'a>,
        args: Vec<String>,
        /// Which value arrives; `None`: the default (which the first value must not be).
        arrives: Option<usize>,
    }
    let run = |given, env, args, arrives| Run { given, env, args, arrives };
    let runs = [
        run("nothing", &[], command_line(None, None), None),
        run("command line only", &[], command_line(None, Some(0)), Some(0)),
        run("file only", &[], command_line(Some(&file_0), None), Some(0)),
        run("environment only", &env_0, command_line(None, None), Some(0)),
        run("file named by the environment", &config_env, command_line(None, None), Some(0)),
        run("command line over file", &[], command_line(Some(&file_1), Some(0)), Some(0)),
        run("environment over file", &env_1, command_line(Some(&file_0), None), Some(1)),
        run("command line over environment", &env_1, command_line(None, Some(0)), Some(0)),
        run("command line over environment and file", &env_1, command_line(Some(&file_1), Some(0)), Some(0)),
    ];
    // One child process per environment.
    let mut by_env: Vec<(&Env, Vec<&Run>)> = Vec::new();
    for run in &runs {
        match by_env.iter_mut().find(|(env, _)| *env == run.env) {
            Some((_, runs)) => runs.push(run),
            None => by_env.push((run.env, vec![run])),
        }
    }
    for (env, runs) in by_env {
        let parses: Vec<Vec<String>> = runs.iter().map(|run| run.args.clone()).collect();
        for (run, answer) in runs.into_iter().zip(probe(env, &parses, &dir)) {
            let read = match answer {
                Ok(read) => read,
                Err(e) => {
                    problems.push(format!("{}: {e}", run.given));
                    continue;
                }
            };
            for (setting, read) in settings.iter().zip(read) {
                match run.arrives {
                    Some(i) if read != setting.values[i].debug => problems.push(format!(
                        "{}: {}: read {read}, expected {}",
                        setting.key, run.given, setting.values[i].debug
                    )),
                    None if read == setting.values[0].debug => {
                        problems.push(format!("{}: its first sample value {read} is its default", setting.key))
                    }
                    _ => {}
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn runtime_threads_are_between_one_and_the_cap() {
    assert_eq!(parse(&["webhook-gateway", "serve"]).unwrap().runtime_threads, None);
    assert_eq!(parse(&["webhook-gateway", "serve", "--runtime-threads", "1"]).unwrap().runtime_threads, Some(1));
    for bad in ["0", "1025"] {
        let err = parse(&["webhook-gateway", "serve", "--runtime-threads", bad]).unwrap_err();
        assert!(err.contains("runtime-threads must be between 1 and 1024"), "{bad}: {err}");
    }
}
