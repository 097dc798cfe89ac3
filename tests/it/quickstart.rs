//! The README's quickstart is a test: its marked shell blocks run with bash against the
//! real binary, and what they print must be what the README says they print.
//!
//! Markers (HTML comments: invisible on GitHub), each on the line right before a ```sh
//! fence:
//!
//! - `<!-- quickstart: serve -->`: the block that starts the gateway (the first terminal).
//!   It runs in the background, in a fresh directory (so the embedded default starts a
//!   private PostgreSQL in `./.webhook-gateway`, as on a user's machine), until the test
//!   stops it with SIGTERM.
//! - `<!-- quickstart -->`: the blocks of the second terminal, run in order as one
//!   `bash -e -o pipefail` script in the same directory once the gateway is ready.
//!
//! Expected output: every command that prints is followed by `# => <JSON>` lines, in
//! order. The JSON it prints is compared with them: `"..."` matches any value, a string
//! ending in `...` any string with that prefix, `"<name>"` any value the first time and
//! that same value every later time (`"<event id>"` twice: the same id), `, ...}` lets the
//! object have more keys, `, ...]` the array more elements; anything else must be equal.
//!
//! What the test changes: `cargo run [flags] -- ARGS` runs the binary under test with
//! ARGS (a shell function), and `127.0.0.1:8080` is a free port (`WEBHOOK_GATEWAY_LISTEN`
//! for the gateway, the text of the blocks for the rest).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_webhook-gateway");

/// A marked block of the README.
struct Block {
    serve: bool,
    text: String,
}

fn quickstart_blocks(readme: &str) -> Vec<Block> {
    let lines: Vec<&str> = readme.lines().collect();
    let mut blocks = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let marker = line.trim();
        let serve = match marker {
            "<!-- quickstart -->" => false,
            "<!-- quickstart: serve -->" => true,
            m if m.starts_with("<!-- quickstart") => panic!("README line {}: unknown marker {m}", i + 1),
            _ => continue,
        };
        assert_eq!(
            lines.get(i + 1).map(|l| l.trim()),
            Some("```sh"),
            "README line {}: a marker must precede ```sh",
            i + 1
        );
        let body: Vec<&str> = lines[i + 2..].iter().take_while(|l| l.trim() != "```").copied().collect();
        blocks.push(Block { serve, text: body.join("\n") });
    }
    blocks
}

/// The expected outputs: every `# => ` line of the script blocks, as JSON.
fn expected_outputs(script: &str) -> Vec<Value> {
    script
        .lines()
        .filter_map(|l| l.trim().strip_prefix("# => "))
        .map(|shown| {
            let json = shown.replace(", ...}", r#", "...": "..."}"#).replace(", ...]", r#", "..."]"#);
            serde_json::from_str(&json).unwrap_or_else(|e| panic!("README `# => {shown}` is not JSON ({e})"))
        })
        .collect()
}

/// What `"<name>"` placeholders stood for so far.
type Bindings = std::collections::HashMap<String, Value>;

/// Compare `actual` with what the README shows, collecting every difference.
fn compare(expected: &Value, actual: &Value, at: &str, bound: &mut Bindings, problems: &mut Vec<String>) {
    match expected {
        Value::String(s) if s == "..." => {}
        Value::String(s) if s.len() > 2 && s.starts_with('<') && s.ends_with('>') => match bound.get(s) {
            Some(earlier) if earlier != actual => {
                problems.push(format!("{at}: {s} was {earlier} before, now {actual}"));
            }
            Some(_) => {}
            None => {
                bound.insert(s.clone(), actual.clone());
            }
        },
        Value::String(s) if s.ends_with("...") => {
            let prefix = &s[..s.len() - 3];
            if !actual.as_str().is_some_and(|a| a.starts_with(prefix)) {
                problems.push(format!("{at}: expected a string starting with {prefix:?}, got {actual}"));
            }
        }
        Value::Object(shown) => {
            let Some(got) = actual.as_object() else {
                problems.push(format!("{at}: expected an object, got {actual}"));
                return;
            };
            for (key, value) in shown.iter().filter(|(k, _)| *k != "...") {
                match got.get(key) {
                    Some(a) => compare(value, a, &format!("{at}.{key}"), bound, problems),
                    None => problems.push(format!("{at}: no key {key:?} in {actual}")),
                }
            }
            if !shown.contains_key("...") {
                for key in got.keys().filter(|k| !shown.contains_key(*k)) {
                    problems.push(format!("{at}: key {key:?} is not shown in the README (add it, or `, ...`)"));
                }
            }
        }
        Value::Array(shown) => {
            let Some(got) = actual.as_array() else {
                problems.push(format!("{at}: expected an array, got {actual}"));
                return;
            };
            let open = shown.last().is_some_and(|l| l == "...");
            let shown = if open { &shown[..shown.len() - 1] } else { &shown[..] };
            if got.len() < shown.len() || (!open && got.len() != shown.len()) {
                problems.push(format!("{at}: {} elements, the README shows {}", got.len(), shown.len()));
                return;
            }
            for (i, (e, a)) in shown.iter().zip(got).enumerate() {
                compare(e, a, &format!("{at}[{i}]"), bound, problems);
            }
        }
        _ if expected != actual => problems.push(format!("{at}: expected {expected}, got {actual}")),
        _ => {}
    }
}

/// `cargo run [flags] -- ARGS` is the binary under test; `exec` in the gateway's shell,
/// so that the test's SIGTERM reaches the gateway itself.
fn prelude(exec: bool) -> String {
    format!(
        "cargo() {{\n  while [ \"$#\" -gt 0 ] && [ \"$1\" != \"--\" ]; do shift; done\n  \
         [ \"$#\" -gt 0 ] || {{ echo 'quickstart: only `cargo run ... -- ARGS` is supported' >&2; return 1; }}\n  \
         shift\n  {}'{BIN}' \"$@\"\n}}\n",
        if exec { "exec " } else { "" }
    )
}

/// The environment of a user who set nothing: no database URL, no gateway settings.
fn clean_command(dir: &std::path::Path) -> Command {
    let mut command = Command::new("bash");
    command.current_dir(dir).env_remove("DATABASE_URL").env_remove("NO_COLOR").env_remove("RUST_LOG");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("WEBHOOK_GATEWAY_") {
            command.env_remove(name);
        }
    }
    command
}

#[test]
fn the_readme_matchers_mean_what_the_readme_says() {
    let shown = expected_outputs(
        "# => {\"id\": \"...\", \"secret\": \"whsec_...\", \"list\": [1, ...], \"n\": null, ...}\n\
         # => {\"event_id\": \"...\", \"duplicate\": true}\n\
         # => [\"<id>\", \"<id>\"]",
    );
    let ok = serde_json::json!({"id": "x", "secret": "whsec_abc", "list": [1, 2], "n": null, "more": 1});
    let mut problems = Vec::new();
    compare(&shown[0], &ok, "$", &mut Bindings::new(), &mut problems);
    assert!(problems.is_empty(), "{problems:?}");
    compare(&shown[2], &serde_json::json!(["a", "a"]), "$", &mut Bindings::new(), &mut problems);
    assert!(problems.is_empty(), "{problems:?}");
    compare(&shown[2], &serde_json::json!(["a", "b"]), "$", &mut Bindings::new(), &mut problems);
    assert_eq!(problems.len(), 1, "a placeholder stands for one value: {problems:?}");
    for bad in [
        serde_json::json!({"id": "x", "secret": "sk_abc", "list": [1], "n": null}),
        serde_json::json!({"id": "x", "secret": "whsec_", "list": [2], "n": null}),
        serde_json::json!({"secret": "whsec_", "list": [1], "n": null}),
    ] {
        let mut problems = Vec::new();
        compare(&shown[0], &bad, "$", &mut Bindings::new(), &mut problems);
        assert!(!problems.is_empty(), "{bad} matched");
    }
    let mut problems = Vec::new();
    let extra = serde_json::json!({"event_id": "e", "duplicate": true, "extra": 1});
    compare(&shown[1], &extra, "$", &mut Bindings::new(), &mut problems);
    assert_eq!(problems.len(), 1, "a closed object refuses keys the README does not show: {problems:?}");
}

#[test]
fn the_readme_quickstart_runs_as_written() {
    for tool in ["bash", "curl", "jq"] {
        let found =
            Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().is_ok_and(|o| o.status.success());
        assert!(found, "the README's quickstart uses {tool}: install it (e.g. `apt install {tool}`)");
    }
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README.md");
    let blocks = quickstart_blocks(&readme);
    let serve: Vec<&Block> = blocks.iter().filter(|b| b.serve).collect();
    let script: Vec<&Block> = blocks.iter().filter(|b| !b.serve).collect();
    assert_eq!(serve.len(), 1, "the README marks one `<!-- quickstart: serve -->` block");
    assert!(!script.is_empty(), "the README marks its quickstart commands with `<!-- quickstart -->`");

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let local = |text: &str| text.replace("127.0.0.1:8080", &addr);
    let dir = std::env::temp_dir().join(format!("wg-quickstart-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();

    let serve_log = dir.join("serve.log");
    let serve_out = dir.join("serve.out");
    let mut gateway = clean_command(&dir)
        .args(["-e", "-c", &format!("{}{}", prelude(true), serve[0].text)])
        .env("WEBHOOK_GATEWAY_LISTEN", &addr)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&serve_out).unwrap())
        .stderr(std::fs::File::create(&serve_log).unwrap())
        .spawn()
        .expect("bash");
    let logs = || {
        format!(
            "gateway stdout:\n{}\ngateway stderr:\n{}",
            std::fs::read_to_string(&serve_out).unwrap_or_default(),
            std::fs::read_to_string(&serve_log).unwrap_or_default()
        )
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    while !std::fs::read_to_string(&serve_out).unwrap_or_default().contains(&format!("is ready on http://{addr}")) {
        if let Ok(Some(status)) = gateway.try_wait() {
            panic!("the quickstart's gateway exited ({status}) before it was ready\n{}", logs());
        }
        assert!(Instant::now() < deadline, "the quickstart's gateway was not ready within 90 s\n{}", logs());
        std::thread::sleep(Duration::from_millis(50));
    }

    let commands = script.iter().map(|b| local(&b.text)).collect::<Vec<_>>().join("\n");
    let ran = clean_command(&dir)
        .args(["-e", "-o", "pipefail", "-c", &format!("{}{commands}", prelude(false))])
        .stdin(Stdio::null())
        .output()
        .expect("bash");
    let stdout = String::from_utf8_lossy(&ran.stdout);
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(ran.status.success(), "the quickstart failed ({}):\n{stdout}\n{stderr}\n{}", ran.status, logs());

    let expected = expected_outputs(&commands);
    let printed: Vec<Value> = serde_json::Deserializer::from_str(&stdout)
        .into_iter::<Value>()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("the quickstart printed something that is not JSON ({e}):\n{stdout}"));
    let mut problems = Vec::new();
    let mut bound = Bindings::new();
    if printed.len() != expected.len() {
        problems.push(format!(
            "the commands printed {} JSON values, the README shows {} `# =>` lines",
            printed.len(),
            expected.len()
        ));
    }
    for (i, (e, a)) in expected.iter().zip(&printed).enumerate() {
        compare(e, a, &format!("output {}", i + 1), &mut bound, &mut problems);
    }
    assert!(
        problems.is_empty(),
        "the README's quickstart drifted from the product:\n{problems:#?}\nprinted:\n{stdout}"
    );

    // SAFETY: kill(2) on our own child (bash exec'd into the gateway).
    unsafe { libc::kill(gateway.id() as i32, libc::SIGTERM) };
    let status = gateway.wait().unwrap();
    assert!(status.success(), "the gateway's exit: {status}\n{}", logs());
    let all = logs();
    assert!(!all.contains('\u{1b}'), "escape codes in output that goes to a file:\n{all}");
    let token = std::fs::read_to_string(dir.join(".webhook-gateway/admin-token")).expect("the kept token");
    assert!(!all.contains(token.trim()), "the admin token was printed into output that goes to a file:\n{all}");
    std::fs::remove_dir_all(&dir).ok();
}
