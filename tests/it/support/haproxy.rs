//! The distribution's HAProxy, started by a test in front of gateway processes, with
//! health checks on `/readyz`: the load balancer of a rolling deploy. Installed by
//! `.ci/run` where missing.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running HAProxy; stopped on drop.
pub struct HaProxy {
    child: Child,
    /// Where clients connect.
    pub addr: SocketAddr,
    dir: PathBuf,
}

fn binary() -> PathBuf {
    ["/usr/sbin/haproxy", "/usr/bin/haproxy", "/usr/local/sbin/haproxy"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("haproxy is not installed (apt install haproxy; .ci/run installs it)")
}

impl HaProxy {
    /// HTTP load balancing over `servers`, each checked with `GET /readyz` every
    /// `check_ms`, taken out after `fall` failed checks and back after `rise` good ones.
    /// No retry on another server and no redispatch: a request sent to a server that fails
    /// it is an error the client sees, as with balancers that do not retry.
    pub fn start(servers: &[SocketAddr], check_ms: u64, fall: u32, rise: u32) -> HaProxy {
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port();
        let dir = std::env::temp_dir().join(format!("wg-haproxy-{port}"));
        std::fs::create_dir_all(&dir).expect("haproxy dir");
        let backends: String = servers
            .iter()
            .enumerate()
            .map(|(i, s)| format!("    server gw{i} {s} check inter {check_ms} fall {fall} rise {rise}\n"))
            .collect();
        let config = format!(
            "global\n    maxconn 2000\n\
             defaults\n    mode http\n    timeout connect 2s\n    timeout client 30s\n    timeout server 30s\n    retries 0\n    option http-keep-alive\n\
             frontend webhooks\n    bind 127.0.0.1:{port}\n    default_backend gateways\n\
             backend gateways\n    balance roundrobin\n    option httpchk GET /readyz\n    http-check expect status 200\n{backends}"
        );
        let path = dir.join("haproxy.cfg");
        std::fs::write(&path, config).expect("haproxy.cfg");
        let log = std::fs::File::create(dir.join("haproxy.log")).expect("haproxy log");
        let child = Command::new(binary())
            .args(["-db", "-f"])
            .arg(&path)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("start haproxy");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(Instant::now() < deadline, "haproxy did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        HaProxy { child, addr, dir }
    }
}

impl Drop for HaProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
