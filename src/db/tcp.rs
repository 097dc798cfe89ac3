//! TCP keepalive and `TCP_USER_TIMEOUT` on the connections to PostgreSQL (Linux), so a
//! connection whose network path died fails within about 20-25 s, whatever it is doing,
//! instead of waiting out the kernel's retransmissions (about 15 minutes by default).
//!
//! - `TCP_USER_TIMEOUT` ([`USER_TIMEOUT`]): data sent and not acknowledged for this long
//!   ends the connection (a statement or a commit sent into a partition).
//! - Keepalive ([`KEEPALIVE_IDLE`], [`KEEPALIVE_INTERVAL`], [`KEEPALIVE_PROBES`]): a
//!   connection with nothing in flight (idle in the pool, `LISTEN`ing, waiting for a
//!   result) probes its path, and fails when the probes go unanswered.
//!
//! These are libpq's `keepalives*` and `tcp_user_timeout` settings. A healthy server's
//! kernel acknowledges data and probes at once, however long a statement runs, so neither
//! can end a slow but healthy call.
//!
//! Measured in a private network namespace with its loopback taken down under an open
//! connection: a `SELECT` on a pooled connection failed after 20.4 s ("Connection timed
//! out"); the same on a connection without these options was still waiting after 90 s.
//!
//! sqlx opens its sockets itself and exposes none of them, so after it opens a
//! connection, [`harden`] looks through this process's open descriptors
//! (`/proc/self/fd`) for TCP sockets connected to the database's address and port and
//! sets the options on them. A socket that leads to that same address and port for
//! another reason gets them too, which does no harm; a descriptor closed and reused
//! between the check and the setting gets them (or refuses them, if it is not a socket)
//! just as harmlessly. Connections through a Unix socket are left alone. Elsewhere than
//! Linux this does nothing: a dead path is noticed when the operating system gives up.

use std::net::IpAddr;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;

/// Idle time before the first keepalive probe.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// Time between keepalive probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered probes before the connection is dropped.
pub const KEEPALIVE_PROBES: u32 = 3;
/// Longest that sent data may stay unacknowledged.
pub const USER_TIMEOUT: Duration = Duration::from_secs(20);

/// Where the database connections go: what [`harden`] looks for.
#[derive(Debug, Clone)]
pub struct Target {
    port: u16,
    /// The server's address when the URL names it by address; by port only otherwise.
    ip: Option<IpAddr>,
    unix: bool,
}

impl Target {
    /// The server `options` connect to.
    pub fn of(options: &PgConnectOptions) -> Target {
        let host = options.get_host();
        Target {
            port: options.get_port(),
            ip: host.trim_matches(['[', ']']).parse().ok(),
            unix: options.get_socket().is_some() || host.starts_with('/'),
        }
    }

    /// Port only (any address).
    pub fn port(port: u16) -> Target {
        Target { port, ip: None, unix: false }
    }

    fn matches(&self, peer: std::net::SocketAddr) -> bool {
        let same_ip = |ip: IpAddr| match (ip, peer.ip()) {
            (a, b) if a == b => true,
            (IpAddr::V4(a), IpAddr::V6(b)) => b.to_ipv4_mapped() == Some(a),
            _ => false,
        };
        peer.port() == self.port && self.ip.is_none_or(same_ip)
    }
}

/// The options as read back from one socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// `SO_KEEPALIVE`.
    pub keepalive: bool,
    /// `TCP_KEEPIDLE`, seconds.
    pub idle_secs: u32,
    /// `TCP_KEEPINTVL`, seconds.
    pub interval_secs: u32,
    /// `TCP_KEEPCNT`.
    pub probes: u32,
    /// `TCP_USER_TIMEOUT`, milliseconds.
    pub user_timeout_ms: u32,
}

impl Applied {
    /// What [`harden`] sets.
    pub fn wanted() -> Applied {
        Applied {
            keepalive: true,
            idle_secs: KEEPALIVE_IDLE.as_secs() as u32,
            interval_secs: KEEPALIVE_INTERVAL.as_secs() as u32,
            probes: KEEPALIVE_PROBES,
            user_timeout_ms: USER_TIMEOUT.as_millis() as u32,
        }
    }
}

/// Set the options on every TCP socket of this process connected to `target`; returns
/// how many it set them on (0 off Linux).
pub fn harden(target: &Target) -> usize {
    if target.unix {
        return 0;
    }
    let mut hardened = 0;
    for fd in sys::sockets_to(target) {
        if sys::set(fd, Applied::wanted()) {
            hardened += 1;
        }
    }
    hardened
}

/// The options of every TCP socket of this process connected to `target` (for tests and
/// diagnostics; empty off Linux).
pub fn inspect(target: &Target) -> Vec<Applied> {
    sys::sockets_to(target).into_iter().filter_map(sys::get).collect()
}

#[cfg(target_os = "linux")]
mod sys {
    use std::mem::{size_of, zeroed};
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

    use libc::{c_int, c_void, socklen_t};

    use super::{Applied, Target};

    /// Descriptors of this process that are TCP sockets connected to `target`.
    pub fn sockets_to(target: &Target) -> Vec<c_int> {
        let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
            tracing::debug!("cannot list /proc/self/fd; database sockets keep the system's TCP settings");
            return Vec::new();
        };
        dir.flatten()
            .filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse::<c_int>().ok()))
            .filter(|&fd| is_stream(fd) && peer(fd).is_some_and(|p| target.matches(p)))
            .collect()
    }

    fn getopt(fd: c_int, level: c_int, name: c_int) -> Option<c_int> {
        let mut value: c_int = 0;
        let mut len = size_of::<c_int>() as socklen_t;
        // SAFETY: the kernel writes at most `len` bytes into `value`; on a descriptor that
        // is not a socket (or no longer open) it fails and writes nothing.
        let rc = unsafe { libc::getsockopt(fd, level, name, (&raw mut value).cast::<c_void>(), &raw mut len) };
        (rc == 0).then_some(value)
    }

    fn setopt(fd: c_int, level: c_int, name: c_int, value: c_int) -> bool {
        // SAFETY: the kernel reads `size_of::<c_int>()` bytes from `value`; on a descriptor
        // that is not a socket it fails and changes nothing.
        let rc = unsafe {
            libc::setsockopt(fd, level, name, (&raw const value).cast::<c_void>(), size_of::<c_int>() as socklen_t)
        };
        rc == 0
    }

    fn is_stream(fd: c_int) -> bool {
        getopt(fd, libc::SOL_SOCKET, libc::SO_TYPE) == Some(libc::SOCK_STREAM)
    }

    fn peer(fd: c_int) -> Option<SocketAddr> {
        // SAFETY: an all-zero sockaddr_storage is a valid value.
        let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
        let mut len = size_of::<libc::sockaddr_storage>() as socklen_t;
        // SAFETY: the kernel writes at most `len` bytes into `storage`, which is large
        // enough for any address; it fails on anything but a connected socket.
        let rc = unsafe { libc::getpeername(fd, (&raw mut storage).cast::<libc::sockaddr>(), &raw mut len) };
        if rc != 0 {
            return None;
        }
        match c_int::from(storage.ss_family) {
            libc::AF_INET => {
                // SAFETY: the family says the storage holds a sockaddr_in.
                let a = unsafe { &*(&raw const storage).cast::<libc::sockaddr_in>() };
                let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(a.sin_port)))
            }
            libc::AF_INET6 => {
                // SAFETY: the family says the storage holds a sockaddr_in6.
                let a = unsafe { &*(&raw const storage).cast::<libc::sockaddr_in6>() };
                Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(a.sin6_addr.s6_addr)), u16::from_be(a.sin6_port)))
            }
            _ => None,
        }
    }

    pub fn set(fd: c_int, want: Applied) -> bool {
        let int = |v: u32| c_int::try_from(v).unwrap_or(c_int::MAX);
        setopt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, c_int::from(want.keepalive))
            && setopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, int(want.idle_secs))
            && setopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, int(want.interval_secs))
            && setopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, int(want.probes))
            && setopt(fd, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, int(want.user_timeout_ms))
    }

    pub fn get(fd: c_int) -> Option<Applied> {
        let uint = |v: c_int| u32::try_from(v).unwrap_or(0);
        Some(Applied {
            keepalive: getopt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE)? != 0,
            idle_secs: uint(getopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE)?),
            interval_secs: uint(getopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL)?),
            probes: uint(getopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT)?),
            user_timeout_ms: uint(getopt(fd, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT)?),
        })
    }
}

#[cfg(not(target_os = "linux"))]
mod sys {
    use super::{Applied, Target};

    pub fn sockets_to(_target: &Target) -> Vec<i32> {
        Vec::new()
    }

    pub fn set(_fd: i32, _want: Applied) -> bool {
        false
    }

    pub fn get(_fd: i32) -> Option<Applied> {
        None
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn sockets_to_the_target_get_the_options_and_others_do_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let other = std::net::TcpListener::bind("127.0.0.1:0").expect("other listener");
        let port = listener.local_addr().expect("addr").port();
        let _to_target = std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let _to_other = std::net::TcpStream::connect(other.local_addr().expect("addr")).expect("connect other");

        let target = Target { port, ip: Some("127.0.0.1".parse().expect("ip")), unix: false };
        assert_eq!(harden(&target), 1);
        assert_eq!(inspect(&target), vec![Applied::wanted()]);
        let untouched = inspect(&Target::port(other.local_addr().expect("addr").port()));
        assert_eq!(untouched.len(), 1);
        assert!(!untouched[0].keepalive);
        assert_eq!(untouched[0].user_timeout_ms, 0);

        // Another address on that port: not ours.
        let elsewhere = Target { port, ip: Some("10.0.0.1".parse().expect("ip")), unix: false };
        assert!(inspect(&elsewhere).is_empty());
    }
}
