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
        // HAProxy cannot listen on port 0 and say which port it got, so a port is picked by
        // binding and releasing it: another process can take it meanwhile. A start counts
        // only once HAProxy itself listens there (its socket, by /proc), and one whose port
        // was taken tries another.
        for _ in 0..5 {
            if let Some(started) = HaProxy::start_once(servers, check_ms, fall, rise) {
                return started;
            }
        }
        panic!("haproxy did not start on any of 5 ports");
    }

    fn start_once(servers: &[SocketAddr], check_ms: u64, fall: u32, rise: u32) -> Option<HaProxy> {
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
        let mut proxy = HaProxy { child, addr, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if proxy.child.try_wait().expect("haproxy's state").is_some() {
                let log = std::fs::read_to_string(proxy.dir.join("haproxy.log")).unwrap_or_default();
                assert!(log.contains("bind"), "haproxy exited at start: {log}");
                return None; // its port was taken: dropped, and another is tried
            }
            if listens_on(proxy.child.id(), port) {
                return Some(proxy);
            }
            assert!(Instant::now() < deadline, "haproxy did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Whether process `pid` holds the socket listening on 127.0.0.1:`port` (by
/// `/proc/net/tcp`'s inode of that listener and the process's open files).
fn listens_on(pid: u32, port: u16) -> bool {
    const LISTEN: &str = "0A";
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let local = format!("0100007F:{port:04X}");
    let Some(inode) = table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&LISTEN))
            .then(|| fields.get(9).map(|i| i.to_string()))?
    }) else {
        return false;
    };
    let socket = format!("socket:[{inode}]");
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.flatten()
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target.as_os_str() == socket.as_str()))
        })
        .unwrap_or(false)
}

impl Drop for HaProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
