//! End-to-end tests against plain-HTTP servers on loopback.
//!
//! Every connection these tests make goes to 127.0.0.0/8; forbidden answers such as
//! 169.254.169.254 are refused inside the resolver, before any packet is sent.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use ipnet::IpNet;
use url::Url;

use super::test_support::{Reply, Seen, SequenceResolver, StaticResolver, loopback_listener, spawn_http};
use super::{AddressClass, EgressClient, EgressConfig, Refusal, SendError};

fn allow_loopback_one() -> EgressConfig {
    EgressConfig { allow: vec!["127.0.0.1/32".parse::<IpNet>().unwrap()], ..EgressConfig::default() }
}

fn hook_url(host: &str, port: u16) -> Url {
    Url::parse(&format!("http://{host}:{port}/hook")).unwrap()
}

async fn post(client: &EgressClient, url: &Url) -> Result<reqwest::Response, SendError> {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    // A caller-supplied Host must not override the URL's host.
    headers.insert("host", HeaderValue::from_static("evil.example"));
    client.post(url, headers, Bytes::from_static(b"{\"n\":1}")).await
}

#[tokio::test]
async fn hostname_resolving_to_loopback_is_refused_unless_allowed() {
    let server = spawn_http(loopback_listener().await, Reply::Ok);
    let resolver = StaticResolver::one("hooks.internal.test", "127.0.0.1");
    let url = hook_url("hooks.internal.test", server.port());

    // The static check cannot know what the name resolves to: it passes.
    let strict = EgressClient::with_resolver(EgressConfig::default(), resolver.clone()).unwrap();
    assert_eq!(strict.check_url(&url), Ok(()));
    let err = post(&strict, &url).await.unwrap_err();
    match err {
        SendError::Refused(Refusal::ForbiddenAddress { addr, class }) => {
            assert_eq!(addr, "127.0.0.1".parse::<IpAddr>().unwrap());
            assert_eq!(class, AddressClass::Loopback);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(server.connection_count(), 0, "refused before connecting");

    let allowed = EgressClient::with_resolver(allow_loopback_one(), resolver.clone()).unwrap();
    let resp = post(&allowed, &url).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "ok");
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].request_line, "POST /hook HTTP/1.1");
    let expected_host = format!("hooks.internal.test:{}", server.port());
    assert_eq!(seen[0].host.as_deref(), Some(expected_host.as_str()));
    assert_eq!(seen[0].body, b"{\"n\":1}");
    assert!(seen[0].headers.iter().any(|(k, v)| k == "user-agent" && v.starts_with("webhook-gateway/")));
}

#[tokio::test]
async fn rebinding_cannot_move_a_validated_connection() {
    // Validated target on 127.0.0.1; the attacker's second answer, 127.0.0.2, also
    // has a listener on the same port, so a connection that went there would be seen.
    let server = spawn_http(loopback_listener().await, Reply::Ok);
    let port = server.port();
    let attacker = spawn_http(tokio::net::TcpListener::bind(("127.0.0.2", port)).await.unwrap(), Reply::Ok);
    let resolver = SequenceResolver::new(&[&["127.0.0.1"], &["127.0.0.2"]]);
    let url = hook_url("rebind.test", port);

    let client = EgressClient::with_resolver(allow_loopback_one(), resolver.clone()).unwrap();
    assert_eq!(post(&client, &url).await.unwrap().status(), 200);
    assert_eq!(resolver.calls.load(Ordering::SeqCst), 1, "one lookup for the request");
    // The pooled connection is reused: no second lookup, same validated peer.
    assert_eq!(post(&client, &url).await.unwrap().status(), 200);
    assert_eq!(resolver.calls.load(Ordering::SeqCst), 1, "no lookup for a pooled connection");
    assert_eq!(server.seen().len(), 2);
    assert_eq!(server.connection_count(), 1);

    // A new connection (fresh pool) resolves again and the rebound answer is refused.
    let fresh = EgressClient::with_resolver(allow_loopback_one(), resolver.clone()).unwrap();
    let err = post(&fresh, &url).await.unwrap_err();
    assert!(
        matches!(
            err,
            SendError::Refused(Refusal::ForbiddenAddress { class: AddressClass::Loopback, addr })
                if addr == "127.0.0.2".parse::<IpAddr>().unwrap()
        ),
        "{err:?}"
    );
    assert_eq!(resolver.calls.load(Ordering::SeqCst), 2);
    assert_eq!(attacker.connection_count(), 0, "nothing ever reached the rebound address");
    assert_eq!(server.seen().len(), 2);
}

#[tokio::test]
async fn rebinding_to_metadata_is_refused_without_sending() {
    let resolver = SequenceResolver::new(&[&["169.254.169.254"]]);
    let client = EgressClient::with_resolver(allow_loopback_one(), resolver).unwrap();
    let err = post(&client, &hook_url("metadata.test", 80)).await.unwrap_err();
    assert_eq!(err.kind().as_str(), "forbidden_address");
    assert_eq!(err.to_string(), "forbidden_address: 169.254.169.254 is link-local");
}

#[tokio::test]
async fn any_forbidden_address_in_the_answer_refuses_the_whole_answer() {
    let server = spawn_http(loopback_listener().await, Reply::Ok);
    // 127.0.0.1 is allowed and listening, but the answer also carries 10.0.0.1.
    let resolver = SequenceResolver::new(&[&["127.0.0.1", "10.0.0.1"]]);
    let client = EgressClient::with_resolver(allow_loopback_one(), resolver).unwrap();
    let err = post(&client, &hook_url("mixed.test", server.port())).await.unwrap_err();
    assert!(
        matches!(err, SendError::Refused(Refusal::ForbiddenAddress { class: AddressClass::Private, .. })),
        "{err:?}"
    );
    assert_eq!(server.connection_count(), 0);
}

#[tokio::test]
async fn ip_literals_are_checked_before_reqwest_sees_them() {
    let server = spawn_http(loopback_listener().await, Reply::Ok);
    let resolver = Arc::new(StaticResolver::default());
    let client = EgressClient::with_resolver(EgressConfig::default(), resolver.clone()).unwrap();
    for url in [
        format!("http://127.0.0.1:{}/", server.port()),
        format!("http://2130706433:{}/", server.port()),
        format!("http://[::ffff:127.0.0.1]:{}/", server.port()),
    ] {
        let err = post(&client, &Url::parse(&url).unwrap()).await.unwrap_err();
        assert_eq!(err.kind().as_str(), "forbidden_address", "{url}");
    }
    let err = post(&client, &Url::parse("ftp://example.com/").unwrap()).await.unwrap_err();
    assert_eq!(err.kind().as_str(), "forbidden_scheme");
    assert_eq!(server.connection_count(), 0);
    assert_eq!(resolver.calls.load(Ordering::SeqCst), 0);

    // Allowed IP literal: delivered, Host is the literal.
    let allowed = EgressClient::with_resolver(allow_loopback_one(), resolver.clone()).unwrap();
    let url = Url::parse(&format!("http://127.0.0.1:{}/x", server.port())).unwrap();
    assert_eq!(post(&allowed, &url).await.unwrap().status(), 200);
    let expected_host = format!("127.0.0.1:{}", server.port());
    assert_eq!(server.seen()[0].host.as_deref(), Some(expected_host.as_str()));
}

#[tokio::test]
async fn redirects_are_returned_not_followed() {
    let target = spawn_http(loopback_listener().await, Reply::Ok);
    let location: &'static str = format!("http://127.0.0.1:{}/", target.port()).leak();
    let server = spawn_http(loopback_listener().await, Reply::Redirect(location));
    let resolver = StaticResolver::one("hooks.internal.test", "127.0.0.1");
    let client = EgressClient::with_resolver(allow_loopback_one(), resolver).unwrap();
    let resp = post(&client, &hook_url("hooks.internal.test", server.port())).await.unwrap();
    assert_eq!(resp.status(), 302);
    assert_eq!(resp.headers().get("location").unwrap(), location);
    assert_eq!(server.seen().len(), 1);
    assert_eq!(target.connection_count(), 0, "redirect target never contacted");
}

/// An endpoint stored with credentials in its URL (refused for new ones since) is sent as
/// it always was: the credentials as Basic auth, neither in the Host header nor in the
/// request line; one without sends no `Authorization`.
#[tokio::test]
async fn credentials_in_a_stored_url_go_as_basic_auth_and_nowhere_else() {
    let server = spawn_http(loopback_listener().await, Reply::Ok);
    let resolver = StaticResolver::one("hooks.internal.test", "127.0.0.1");
    let client = EgressClient::with_resolver(allow_loopback_one(), resolver).unwrap();
    let mut with = hook_url("hooks.internal.test", server.port());
    with.set_username("user").unwrap();
    with.set_password(Some("p@ss")).unwrap();
    assert_eq!(post(&client, &with).await.unwrap().status(), 200);
    assert_eq!(post(&client, &hook_url("hooks.internal.test", server.port())).await.unwrap().status(), 200);
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    let authorization = |s: &Seen| s.headers.iter().find(|(k, _)| k == "authorization").map(|(_, v)| v.clone());
    // base64("user:p@ss")
    assert_eq!(authorization(&seen[0]).as_deref(), Some("Basic dXNlcjpwQHNz"));
    assert_eq!(authorization(&seen[1]), None);
    for s in &seen {
        assert_eq!(s.host.as_deref(), Some(format!("hooks.internal.test:{}", server.port()).as_str()));
        assert!(!s.request_line.contains("user") && !s.request_line.contains("ss@"), "{}", s.request_line);
    }
}

#[tokio::test]
async fn connection_refused_is_connect() {
    let dead_port = {
        let l = loopback_listener().await;
        l.local_addr().unwrap().port()
    };
    let resolver = StaticResolver::one("hooks.internal.test", "127.0.0.1");
    let client = EgressClient::with_resolver(allow_loopback_one(), resolver).unwrap();
    let err = post(&client, &hook_url("hooks.internal.test", dead_port)).await.unwrap_err();
    assert!(matches!(err, SendError::Connect(_)), "{err:?}");
    assert_eq!(err.kind().as_str(), "connect");
    // The cause is in the message; the URL (which may hold secrets) is not.
    let msg = err.to_string();
    assert!(msg.to_lowercase().contains("connection refused"), "{msg}");
    assert!(!msg.contains("/hook"), "{msg}");
}

#[tokio::test]
async fn silent_server_is_timeout() {
    let server = spawn_http(loopback_listener().await, Reply::Hang);
    let resolver = StaticResolver::one("hooks.internal.test", "127.0.0.1");
    let cfg = EgressConfig { request_timeout: Duration::from_millis(300), ..allow_loopback_one() };
    let client = EgressClient::with_resolver(cfg, resolver).unwrap();
    let started = std::time::Instant::now();
    let err = post(&client, &hook_url("hooks.internal.test", server.port())).await.unwrap_err();
    assert!(matches!(err, SendError::Timeout(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(server.seen().len(), 1, "the request was sent, the answer never came");
}

#[tokio::test]
async fn lookup_failure_is_dns() {
    let resolver = Arc::new(StaticResolver::default());
    let client = EgressClient::with_resolver(EgressConfig::default(), resolver).unwrap();
    let err = post(&client, &hook_url("nxdomain.test", 80)).await.unwrap_err();
    assert!(matches!(err, SendError::Dns(_)), "{err:?}");
    assert!(err.to_string().contains("nxdomain.test"), "{err}");

    let empty = SequenceResolver::new(&[&[]]);
    let client = EgressClient::with_resolver(EgressConfig::default(), empty).unwrap();
    let err = post(&client, &hook_url("empty.test", 80)).await.unwrap_err();
    assert!(matches!(err, SendError::Dns(_)), "{err:?}");
}

#[tokio::test]
async fn system_resolver_refuses_localhost() {
    // Real OS lookup of "localhost" answers loopback only: refused before connecting.
    let client = EgressClient::new(EgressConfig::default()).unwrap();
    let err = post(&client, &Url::parse("http://localhost:9/").unwrap()).await.unwrap_err();
    assert!(
        matches!(err, SendError::Refused(Refusal::ForbiddenAddress { class: AddressClass::Loopback, .. })),
        "{err:?}"
    );
}

/// Sets proxy variables for the test's duration and restores them, even on panic.
struct ProxyEnv {
    saved: Vec<(&'static str, Option<std::ffi::OsString>)>,
}

const PROXY_VARS: [&str; 8] =
    ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"];

impl ProxyEnv {
    fn set(proxy: &str) -> Self {
        let saved = PROXY_VARS.iter().map(|&k| (k, std::env::var_os(k))).collect();
        for k in PROXY_VARS {
            // SAFETY: edition 2024 marks env mutation unsafe because other threads may
            // read the environment concurrently. Only this test sets these variables,
            // and every egress client is built with no_proxy(), so concurrent egress
            // tests are unaffected.
            unsafe {
                if k.eq_ignore_ascii_case("no_proxy") {
                    std::env::remove_var(k);
                } else {
                    std::env::set_var(k, proxy);
                }
            }
        }
        Self { saved }
    }
}

impl Drop for ProxyEnv {
    fn drop(&mut self) {
        for (k, v) in self.saved.drain(..) {
            // SAFETY: as in `ProxyEnv::set`.
            unsafe {
                match v {
                    Some(v) => std::env::set_var(k, v),
                    None => std::env::remove_var(k),
                }
            }
        }
    }
}

#[tokio::test]
async fn proxy_environment_is_ignored() {
    let server = spawn_http(loopback_listener().await, Reply::Ok);
    let proxy = spawn_http(loopback_listener().await, Reply::Ok);
    let url = hook_url("hooks.internal.test", server.port());
    // reqwest reads proxy variables when a client is built: keep the process-global
    // change to the two builds, so other tests' clients are not affected.
    let env = ProxyEnv::set(&format!("http://127.0.0.1:{}", proxy.port()));
    let plain = reqwest::Client::builder().build().unwrap();
    let resolver = StaticResolver::one("hooks.internal.test", "127.0.0.1");
    let client = EgressClient::with_resolver(allow_loopback_one(), resolver).unwrap();
    drop(env);

    // Control: a default reqwest client built in that environment does use the
    // proxy, so the environment really was set up to divert requests.
    let resp = plain.post(url.clone()).body("x").send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(proxy.connection_count(), 1);
    let proxied = proxy.seen();
    assert!(proxied[0].request_line.starts_with("POST http://hooks.internal.test:"), "{proxied:?}");

    let resp = post(&client, &url).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(proxy.connection_count(), 1, "egress client never used the proxy");
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].request_line, "POST /hook HTTP/1.1");
}
