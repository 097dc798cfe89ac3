//! Pure policy tests: classification table, properties, static URL checks.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use proptest::prelude::*;
use url::Url;

use super::AddressClass::{self, *};
use super::{Refusal, SendError, check_addr, check_url_static, classify};

/// Every forbidden range with the class of its first and of its last address (they
/// differ only where a more specific range sits at an edge).
const FORBIDDEN: &[(&str, AddressClass, AddressClass)] = &[
    ("0.0.0.0/8", Unspecified, Unspecified),
    ("10.0.0.0/8", Private, Private),
    ("100.64.0.0/10", Cgnat, Cgnat),
    ("127.0.0.0/8", Loopback, Loopback),
    ("169.254.0.0/16", LinkLocal, LinkLocal),
    ("172.16.0.0/12", Private, Private),
    ("192.0.0.0/24", ProtocolAssignment, ProtocolAssignment),
    ("192.0.2.0/24", Documentation, Documentation),
    ("192.31.196.0/24", As112, As112),
    ("192.52.193.0/24", Amt, Amt),
    ("192.88.99.0/24", SixToFour, SixToFour),
    ("192.168.0.0/16", Private, Private),
    ("192.175.48.0/24", As112, As112),
    ("198.18.0.0/15", Benchmarking, Benchmarking),
    ("198.51.100.0/24", Documentation, Documentation),
    ("203.0.113.0/24", Documentation, Documentation),
    ("224.0.0.0/4", Multicast, Multicast),
    ("240.0.0.0/4", Reserved, Broadcast),
    ("255.255.255.255/32", Broadcast, Broadcast),
    ("::/128", Unspecified, Unspecified),
    ("::1/128", Loopback, Loopback),
    ("::/96", Unspecified, Ipv4Compatible),
    ("::2/127", Ipv4Compatible, Ipv4Compatible),
    ("64:ff9b:1::/48", Nat64Local, Nat64Local),
    ("100::/64", DiscardOnly, DiscardOnly),
    ("fe80::/10", LinkLocal, LinkLocal),
    ("fec0::/10", SiteLocal, SiteLocal),
    ("fc00::/7", UniqueLocal, UniqueLocal),
    ("ff00::/8", Multicast, Multicast),
    ("2001::/23", Teredo, ProtocolAssignment),
    ("2001::/32", Teredo, Teredo),
    ("2001:2::/48", Benchmarking, Benchmarking),
    ("2001:db8::/32", Documentation, Documentation),
    ("2002::/16", SixToFour, SixToFour),
    ("2620:4f:8000::/48", As112, As112),
    ("3ffe::/16", SixBone, SixBone),
    ("3fff::/20", Documentation, Documentation),
    // Outside global unicast 2000::/3: unassigned or special, all reserved.
    ("4000::/3", Reserved, Reserved),
    ("1000::/4", Reserved, Reserved),
];

/// Ranges whose every address must be forbidden; the embedded-IPv4 prefixes are
/// covered by the mapped/NAT64 properties below instead.
fn forbidden_nets() -> Vec<IpNet> {
    FORBIDDEN.iter().map(|(n, _, _)| n.parse().unwrap()).collect()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn both_edges_of_every_forbidden_range() {
    for &(net, first, last) in FORBIDDEN {
        let net: IpNet = net.parse().unwrap();
        assert_eq!(classify(net.network()), first, "first address of {net}");
        assert_eq!(classify(net.broadcast()), last, "last address of {net}");
        assert!(first.is_forbidden() && last.is_forbidden());
    }
}

#[test]
fn embedded_ipv4_is_classified_by_the_embedded_address() {
    let cases = [
        ("::ffff:127.0.0.1", Loopback),
        ("::ffff:0.0.0.0", Unspecified),
        ("::ffff:255.255.255.255", Broadcast),
        ("::ffff:169.254.169.254", LinkLocal),
        ("::ffff:10.1.2.3", Private),
        ("64:ff9b::", Unspecified),
        ("64:ff9b::ffff:ffff", Broadcast),
        ("64:ff9b::7f00:1", Loopback),
        ("64:ff9b::a9fe:a9fe", LinkLocal),
        ("64:ff9b::c0a8:101", Private),
        // Documented choice: public embedded addresses are public (DNS64, mapped AAAA).
        ("::ffff:8.8.8.8", Public),
        ("64:ff9b::808:808", Public),
        // Next to the /96s: not decodable, outside 2000::/3, so reserved.
        ("::1:ffff:7f00:1", Reserved),
        ("::ffff:0:7f00:1", Reserved),
        ("64:ff9b::1:7f00:1", Reserved),
        ("64:ff9a:ffff:ffff:ffff:ffff:ffff:ffff", Reserved),
        // IPv4-compatible (deprecated) does not get the embedded treatment.
        ("::8.8.8.8", Ipv4Compatible),
        ("::127.0.0.1", Ipv4Compatible),
    ];
    for (addr, class) in cases {
        assert_eq!(classify(ip(addr)), class, "{addr}");
    }
}

#[test]
fn named_addresses_and_public_neighbours() {
    let forbidden = [
        ("169.254.169.254", LinkLocal),
        ("fd00:ec2::254", UniqueLocal),
        ("192.0.0.9", ProtocolAssignment),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", Teredo),
    ];
    for (addr, class) in forbidden {
        assert_eq!(classify(ip(addr)), class, "{addr}");
    }
    let public = [
        "8.8.8.8",
        "1.1.1.1",
        "2606:4700:4700::1111",
        "100.63.255.255",
        "100.128.0.0",
        "172.15.255.255",
        "172.32.0.0",
        "198.17.255.255",
        "198.20.0.0",
        "1.0.0.0",
        "9.255.255.255",
        "11.0.0.0",
        "126.255.255.255",
        "128.0.0.0",
        "169.253.255.255",
        "169.255.0.0",
        "192.0.1.255",
        "192.0.3.0",
        "192.167.255.255",
        "192.169.0.0",
        "198.51.99.255",
        "203.0.114.0",
        "223.255.255.255",
        "2000::",
        "2001:200::",
        "2001:db7:ffff:ffff:ffff:ffff:ffff:ffff",
        "2001:db9::",
        "2003::",
        "2620:4f:7fff:ffff:ffff:ffff:ffff:ffff",
        "2620:4f:8001::",
        "3ffd:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        "3fff:1000::",
        "3fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
    ];
    for addr in public {
        assert_eq!(classify(ip(addr)), Public, "{addr}");
        assert!(check_addr(ip(addr), &[]).is_ok(), "{addr}");
    }
}

#[test]
fn class_display_names() {
    assert_eq!(LinkLocal.to_string(), "link-local");
    assert_eq!(Loopback.to_string(), "loopback");
    assert_eq!(Private.to_string(), "private");
    let refusal = check_addr(ip("169.254.169.254"), &[]).unwrap_err();
    assert_eq!(refusal.to_string(), "forbidden_address: 169.254.169.254 is link-local");
    assert_eq!(refusal.kind().as_str(), "forbidden_address");
}

/// A uniformly random address inside `net`.
fn pick(net: IpNet, r: u128) -> IpAddr {
    match net {
        IpNet::V4(n) => {
            let host = u32::from(n.hostmask()) & (r as u32);
            IpAddr::V4(Ipv4Addr::from(u32::from(n.network()) | host))
        }
        IpNet::V6(n) => {
            let host = u128::from(n.hostmask()) & r;
            IpAddr::V6(Ipv6Addr::from(u128::from(n.network()) | host))
        }
    }
}

proptest! {
    #![proptest_config(crate::props::config(2000))]

    #[test]
    fn nothing_inside_a_forbidden_range_is_public(idx in any::<prop::sample::Index>(), r in any::<u128>()) {
        let nets = forbidden_nets();
        let net = nets[idx.index(nets.len())];
        let addr = pick(net, r);
        prop_assert!(classify(addr).is_forbidden(), "{} in {} classified public", addr, net);
        prop_assert!(check_addr(addr, &[]).is_err());
    }

    #[test]
    fn embedded_forbidden_ipv4_stays_forbidden(idx in any::<prop::sample::Index>(), r in any::<u128>()) {
        let v4_nets: Vec<IpNet> = forbidden_nets().into_iter().filter(|n| matches!(n, IpNet::V4(_))).collect();
        let net = v4_nets[idx.index(v4_nets.len())];
        let IpAddr::V4(v4) = pick(net, r) else { unreachable!() };
        let class = classify(IpAddr::V4(v4));
        let mapped = IpAddr::V6(v4.to_ipv6_mapped());
        let nat64 = IpAddr::V6(Ipv6Addr::from((0x0064_ff9b_u128 << 96) | u128::from(u32::from(v4))));
        prop_assert_eq!(classify(mapped), class);
        prop_assert_eq!(classify(nat64), class);
        prop_assert!(check_addr(mapped, &[]).is_err());
        prop_assert!(check_addr(nat64, &[]).is_err());
    }

    #[test]
    fn classification_agrees_across_spellings(bits in any::<u32>()) {
        // Any IPv4 address and its mapped form get the same class.
        let v4 = Ipv4Addr::from(bits);
        prop_assert_eq!(classify(IpAddr::V4(v4)), classify(IpAddr::V6(v4.to_ipv6_mapped())));
    }

    #[test]
    fn allow_list_covers_exactly_its_network(prefix in 9u8..=32, r in any::<u32>(), r2 in any::<u32>()) {
        // A random sub-network of 10.0.0.0/8 (private, so refused unless allowed).
        let base = IpNet::V4(ipnet::Ipv4Net::new(Ipv4Addr::from(0x0a00_0000 | (r & 0x00ff_ffff)), prefix).unwrap().trunc());
        let allow = [base];
        let inside = pick(base, u128::from(r2));
        prop_assert_eq!(check_addr(inside, &allow), Ok(()));
        if let IpAddr::V4(v4) = inside {
            prop_assert_eq!(check_addr(IpAddr::V6(v4.to_ipv6_mapped()), &allow), Ok(()));
        }
        let IpNet::V4(b) = base else { unreachable!() };
        let below = u32::from(b.network()).wrapping_sub(1);
        let above = u32::from(b.broadcast()).wrapping_add(1);
        for outside in [below, above] {
            let addr = IpAddr::V4(Ipv4Addr::from(outside));
            if (outside >> 24) == 10 {
                prop_assert_eq!(
                    check_addr(addr, &allow),
                    Err(Refusal::ForbiddenAddress { addr, class: Private })
                );
            }
        }
    }
}

fn url(s: &str) -> Url {
    Url::parse(s).unwrap()
}

fn refused_as(s: &str, addr: &str, class: AddressClass) {
    assert_eq!(check_url_static(&url(s), &[], false), Err(Refusal::ForbiddenAddress { addr: ip(addr), class }), "{s}");
}

#[test]
fn static_url_checks() {
    // url normalises decimal and hex IPv4 spellings to Host::Ipv4.
    refused_as("http://2130706433/", "127.0.0.1", Loopback);
    refused_as("http://0x7f.1/", "127.0.0.1", Loopback);
    refused_as("http://017700000001/", "127.0.0.1", Loopback);
    refused_as("http://127.1/", "127.0.0.1", Loopback);
    refused_as("http://127.0.0.1./", "127.0.0.1", Loopback);
    refused_as("http://[::ffff:127.0.0.1]/", "::ffff:127.0.0.1", Loopback);
    refused_as("http://[::1]:8080/", "::1", Loopback);
    refused_as("http://169.254.169.254/latest/meta-data", "169.254.169.254", LinkLocal);
    // The userinfo does not confuse the parser: the host is 127.0.0.1.
    refused_as("http://user@127.0.0.1/", "127.0.0.1", Loopback);
    refused_as("http://8.8.8.8@127.0.0.1/", "127.0.0.1", Loopback);
    refused_as("http://[fd00:ec2::254]/", "fd00:ec2::254", UniqueLocal);
    refused_as("https://0.0.0.0/", "0.0.0.0", Unspecified);

    let static_check = |s: &str, allow: &[IpNet], https_only| check_url_static(&url(s), allow, https_only);
    assert_eq!(static_check("ftp://x/", &[], false), Err(Refusal::Scheme("ftp".into())));
    assert_eq!(static_check("file:///etc/passwd", &[], false), Err(Refusal::Scheme("file".into())));
    assert_eq!(static_check("gopher://x/", &[], false), Err(Refusal::Scheme("gopher".into())));
    assert!(matches!(static_check("http://example.com/", &[], true), Err(Refusal::Scheme(_))));
    assert_eq!(static_check("https://example.com/", &[], true), Ok(()));
    assert_eq!(static_check("http://example.com/hook", &[], false), Ok(()));
    assert_eq!(static_check("http://8.8.8.8/", &[], false), Ok(()));
    assert_eq!(static_check("http://[2606:4700:4700::1111]/", &[], false), Ok(()));

    let allow: Vec<IpNet> = vec!["127.0.0.1/32".parse().unwrap()];
    assert_eq!(static_check("http://127.0.0.1:8080/", &allow, false), Ok(()));
    assert_eq!(static_check("http://[::ffff:127.0.0.1]:8080/", &allow, false), Ok(()));
    assert_eq!(
        static_check("http://127.0.0.2:8080/", &allow, false),
        Err(Refusal::ForbiddenAddress { addr: ip("127.0.0.2"), class: Loopback })
    );
    assert_eq!(
        static_check("http://127.0.0.1:8080/", &allow, true),
        Err(Refusal::Scheme("http (only https is allowed)".into()))
    );
}

#[test]
fn refusal_and_send_error_kinds() {
    let addr = SendError::Refused(Refusal::ForbiddenAddress { addr: ip("10.0.0.1"), class: Private });
    assert_eq!(addr.kind().as_str(), "forbidden_address");
    assert_eq!(addr.to_string(), "forbidden_address: 10.0.0.1 is private");
    assert_eq!(SendError::Refused(Refusal::Scheme("ftp".into())).kind().as_str(), "forbidden_scheme");
    assert_eq!(SendError::Refused(Refusal::InvalidUrl("x".into())).kind().as_str(), "invalid_url");
    assert_eq!(SendError::Dns(String::new()).kind().as_str(), "dns");
    assert_eq!(SendError::Timeout(String::new()).kind().as_str(), "timeout");
    assert_eq!(SendError::Connect(String::new()).kind().as_str(), "connect");
    assert_eq!(SendError::Tls(String::new()).kind().as_str(), "tls");
    assert_eq!(SendError::Other(String::new()).kind().as_str(), "other");
}
