//! HTTPS through a pinned address: SNI, Host and certificate checks use the name.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;
use ipnet::IpNet;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use url::Url;

use super::test_support::{Reply, StaticResolver, loopback_listener, spawn_https};
use super::{EgressClient, EgressConfig, SendError};

const NAME: &str = "hooks.example.test";

/// A throw-away CA generated per test.
struct TestCa {
    cert: rcgen::Certificate,
    issuer: Issuer<'static, KeyPair>,
}

/// A server certificate chain and its key.
struct ServerCert {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl TestCa {
    fn new() -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, "egress test CA");
        let cert = params.self_signed(&key).unwrap();
        Self { cert, issuer: Issuer::new(params, key) }
    }

    fn root(&self) -> reqwest::Certificate {
        reqwest::Certificate::from_pem(self.cert.pem().as_bytes()).unwrap()
    }

    fn server_cert(&self, name: &str) -> ServerCert {
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec![name.to_owned()]).unwrap().signed_by(&key, &self.issuer).unwrap();
        ServerCert {
            chain: vec![leaf.der().clone(), self.cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        }
    }
}

fn acceptor(cert: ServerCert) -> tokio_rustls::TlsAcceptor {
    // Explicit ring provider: the one reqwest's rustls-tls feature compiles in, so no
    // process-wide default has to be installed.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(cert.chain, cert.key)
        .unwrap();
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

fn client_trusting(ca: &TestCa, https_only: bool) -> EgressClient {
    let cfg = EgressConfig {
        allow: vec!["127.0.0.1/32".parse::<IpNet>().unwrap()],
        extra_root_certs: vec![ca.root()],
        https_only,
        ..EgressConfig::default()
    };
    EgressClient::with_resolver(cfg, StaticResolver::one(NAME, "127.0.0.1")).unwrap()
}

#[tokio::test]
async fn pinned_https_keeps_sni_host_and_verification() {
    let ca = TestCa::new();
    let server = spawn_https(loopback_listener().await, Reply::Ok, acceptor(ca.server_cert(NAME)));
    let client = client_trusting(&ca, true);
    let url = Url::parse(&format!("https://{NAME}:{}/hook", server.port())).unwrap();

    let resp = client.post(&url, HeaderMap::new(), Bytes::from_static(b"{}")).await.unwrap();
    assert_eq!(resp.status(), 200);
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].sni.as_deref(), Some(NAME), "SNI is the URL host, not the IP");
    let expected_host = format!("{NAME}:{}", server.port());
    assert_eq!(seen[0].host.as_deref(), Some(expected_host.as_str()));
    assert_eq!(seen[0].body, b"{}");

    // https_only: the same destination over http is refused before any lookup.
    let http_url = Url::parse(&format!("http://{NAME}:{}/hook", server.port())).unwrap();
    let err = client.post(&http_url, HeaderMap::new(), Bytes::new()).await.unwrap_err();
    assert_eq!(err.kind().as_str(), "forbidden_scheme");
}

#[tokio::test]
async fn certificate_for_another_name_is_tls_error() {
    // Same trusted CA, wrong name: only the name check can fail the handshake.
    let ca = TestCa::new();
    let cert = ca.server_cert("other.example.test");
    let server = spawn_https(loopback_listener().await, Reply::Ok, acceptor(cert));
    let client = client_trusting(&ca, false);
    let url = Url::parse(&format!("https://{NAME}:{}/hook", server.port())).unwrap();
    let err = client.post(&url, HeaderMap::new(), Bytes::new()).await.unwrap_err();
    assert!(matches!(err, SendError::Tls(_)), "{err:?}");
    assert_eq!(err.kind().as_str(), "tls");
    assert!(server.connection_count() >= 1, "the handshake was attempted");
    assert!(server.seen().is_empty());
}

#[tokio::test]
async fn untrusted_ca_is_tls_error() {
    let ca = TestCa::new();
    let server = spawn_https(loopback_listener().await, Reply::Ok, acceptor(ca.server_cert(NAME)));
    // Trusts a different CA than the one that signed the server certificate.
    let client = client_trusting(&TestCa::new(), false);
    let url = Url::parse(&format!("https://{NAME}:{}/hook", server.port())).unwrap();
    let err = client.post(&url, HeaderMap::new(), Bytes::new()).await.unwrap_err();
    assert!(matches!(err, SendError::Tls(_)), "{err:?}");
    assert!(server.seen().is_empty());
}
