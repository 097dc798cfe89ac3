//! A TLS front for PostgreSQL, as a managed database that requires encryption is seen
//! from its clients: it answers PostgreSQL's `SSLRequest` with `S`, completes a TLS
//! handshake with a certificate of a throw-away CA (for `localhost` and `127.0.0.1`), and
//! relays the decrypted protocol to a plain server. A client that does not ask for TLS is
//! refused, as `hostssl`-only `pg_hba.conf` or RDS's `rds.force_ssl` refuse it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// PostgreSQL's `SSLRequest`: length 8, code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// A running front; stops accepting when dropped.
pub struct TlsFront {
    /// Where clients connect.
    pub addr: SocketAddr,
    /// The CA that signed its certificate, as a PEM file (a client's `sslrootcert`).
    pub ca_file: PathBuf,
    handshakes: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsFront {
    /// Listen on a free loopback port in front of the plain server at `upstream`.
    pub async fn start(upstream: SocketAddr) -> TlsFront {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "database test CA");
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().expect("server key");
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).expect("server params");
        params.subject_alt_names.push(SanType::IpAddress("127.0.0.1".parse().expect("ip")));
        let leaf = params.signed_by(&key, &issuer).expect("server certificate");
        let ca_file = std::env::temp_dir().join(format!("wg-db-ca-{}.pem", uuid::Uuid::new_v4().simple()));
        std::fs::write(&ca_file, ca_cert.pem()).expect("write the CA");

        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain: Vec<CertificateDer<'static>> = vec![leaf.der().clone(), ca_cert.der().clone()];
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(chain, PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())))
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));

        let listener = TcpListener::bind("127.0.0.1:0").await.expect("front listener");
        let addr = listener.local_addr().expect("front address");
        let (handshakes, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (done, turned_away) = (handshakes.clone(), refused.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let (acceptor, done, turned_away) = (acceptor.clone(), done.clone(), turned_away.clone());
                tokio::spawn(async move {
                    let mut first = [0u8; 8];
                    if client.read_exact(&mut first).await.is_err() {
                        return;
                    }
                    if first != SSL_REQUEST {
                        // A plain startup: refused as a server that requires TLS refuses it.
                        turned_away.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    if client.write_all(b"S").await.is_err() {
                        return;
                    }
                    let Ok(mut tls) = acceptor.accept(client).await else { return };
                    done.fetch_add(1, Ordering::Relaxed);
                    let Ok(mut server) = TcpStream::connect(upstream).await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
                });
            }
        });
        TlsFront { addr, ca_file, handshakes, refused, task }
    }

    /// `url` (a plain server's) leading here instead, with `params` added to its query.
    pub fn url_for(&self, url: &str, params: &str) -> String {
        let mut url = url::Url::parse(url).expect("a database URL");
        url.set_host(Some(&self.addr.ip().to_string())).expect("host");
        url.set_port(Some(self.addr.port())).expect("port");
        let query = match url.query() {
            Some(q) if !q.is_empty() => format!("{q}&{params}"),
            _ => params.to_owned(),
        };
        url.set_query(Some(&query));
        url.to_string()
    }

    /// TLS sessions completed so far.
    pub fn handshakes(&self) -> u64 {
        self.handshakes.load(Ordering::Relaxed)
    }

    /// Connections that did not ask for TLS, refused.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.ca_file);
    }
}
