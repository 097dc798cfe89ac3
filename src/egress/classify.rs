//! Pure classification of IP addresses against the IANA special-purpose registries.
//!
//! Anything that is not plainly a globally routed unicast address is forbidden: the
//! gateway POSTs to addresses its users chose, so a class we do not recognise as
//! public must not be reachable by default. For IPv6 that means everything outside
//! global unicast `2000::/3` is forbidden, so future IANA assignments there fail closed.
//!
//! Embedded IPv4: `::ffff:0:0/96` (IPv4-mapped) and `64:ff9b::/96` (NAT64 well-known
//! prefix) are classified by the IPv4 address they carry. The mapped form is just
//! another spelling of the IPv4 destination, and on an IPv6-only host with DNS64 every
//! IPv4-only webhook receiver arrives as `64:ff9b::a.b.c.d`: forbidding those wholesale
//! would break delivery there, while classifying the embedded address still refuses
//! `::ffff:127.0.0.1` or `64:ff9b::a9fe:a9fe` with the class of the address they hide.
//! The local-use NAT64 prefix `64:ff9b:1::/48` puts the IPv4 address at an
//! operator-chosen position that cannot be decoded reliably, so it is forbidden whole.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// What an address is, in the sense of the IANA special-purpose registries.
///
/// Only [`AddressClass::Public`] is allowed by default; every other variant names
/// the reason an address is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddressClass {
    /// Globally routed unicast: the only class allowed without an allow-list entry.
    Public,
    /// `0.0.0.0/8` ("this network") and `::`.
    Unspecified,
    /// `127.0.0.0/8` and `::1`.
    Loopback,
    /// RFC 1918: `10/8`, `172.16/12`, `192.168/16`.
    Private,
    /// Shared address space for carrier-grade NAT, `100.64.0.0/10`.
    Cgnat,
    /// `169.254.0.0/16` (cloud metadata lives here) and `fe80::/10`.
    LinkLocal,
    /// `224.0.0.0/4` and `ff00::/8`.
    Multicast,
    /// `255.255.255.255`.
    Broadcast,
    /// `240.0.0.0/4` and all IPv6 space outside `2000::/3` not named otherwise.
    Reserved,
    /// `198.18.0.0/15` and `2001:2::/48`.
    Benchmarking,
    /// TEST-NET-1/2/3, `2001:db8::/32` and `3fff::/20`.
    Documentation,
    /// IETF protocol assignments: `192.0.0.0/24` and `2001::/23`.
    ProtocolAssignment,
    /// Teredo, `2001::/32`: tunnels to an IPv4 address we would not see.
    Teredo,
    /// AS112 DNS sinks: `192.31.196.0/24`, `192.175.48.0/24`, `2620:4f:8000::/48`.
    As112,
    /// Automatic Multicast Tunneling relay anycast, `192.52.193.0/24`.
    Amt,
    /// 6to4: the relay anycast `192.88.99.0/24` and `2002::/16`, which embeds IPv4.
    SixToFour,
    /// Unique local addresses, `fc00::/7` (e.g. the AWS metadata `fd00:ec2::254`).
    UniqueLocal,
    /// Deprecated site-local, `fec0::/10`.
    SiteLocal,
    /// Discard-only, `100::/64`.
    DiscardOnly,
    /// Deprecated IPv4-compatible IPv6, `::/96` (other than `::` and `::1`).
    Ipv4Compatible,
    /// Local-use NAT64 prefix `64:ff9b:1::/48`, whose embedding we cannot decode.
    Nat64Local,
    /// The returned-to-IANA 6bone test network, `3ffe::/16`.
    SixBone,
}

impl AddressClass {
    /// True for every class except [`AddressClass::Public`].
    pub fn is_forbidden(self) -> bool {
        self != AddressClass::Public
    }

    /// Stable kebab-case name, used in refusals shown to API users and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            AddressClass::Public => "public",
            AddressClass::Unspecified => "unspecified",
            AddressClass::Loopback => "loopback",
            AddressClass::Private => "private",
            AddressClass::Cgnat => "cgnat",
            AddressClass::LinkLocal => "link-local",
            AddressClass::Multicast => "multicast",
            AddressClass::Broadcast => "broadcast",
            AddressClass::Reserved => "reserved",
            AddressClass::Benchmarking => "benchmarking",
            AddressClass::Documentation => "documentation",
            AddressClass::ProtocolAssignment => "protocol-assignment",
            AddressClass::Teredo => "teredo",
            AddressClass::As112 => "as112",
            AddressClass::Amt => "amt",
            AddressClass::SixToFour => "6to4",
            AddressClass::UniqueLocal => "unique-local",
            AddressClass::SiteLocal => "site-local",
            AddressClass::DiscardOnly => "discard-only",
            AddressClass::Ipv4Compatible => "ipv4-compatible",
            AddressClass::Nat64Local => "nat64-local",
            AddressClass::SixBone => "6bone",
        }
    }
}

impl fmt::Display for AddressClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Classifies `ip` by the IANA special-purpose registries (see the module docs for
/// how addresses with an embedded IPv4 address are treated).
pub fn classify(ip: IpAddr) -> AddressClass {
    match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

/// IPv4 special-purpose blocks, most specific first where they overlap.
const V4_TABLE: &[(u32, u8, AddressClass)] = &[
    (0x0000_0000, 8, AddressClass::Unspecified),         // 0.0.0.0/8
    (0x0a00_0000, 8, AddressClass::Private),             // 10.0.0.0/8
    (0x6440_0000, 10, AddressClass::Cgnat),              // 100.64.0.0/10
    (0x7f00_0000, 8, AddressClass::Loopback),            // 127.0.0.0/8
    (0xa9fe_0000, 16, AddressClass::LinkLocal),          // 169.254.0.0/16
    (0xac10_0000, 12, AddressClass::Private),            // 172.16.0.0/12
    (0xc000_0000, 24, AddressClass::ProtocolAssignment), // 192.0.0.0/24
    (0xc000_0200, 24, AddressClass::Documentation),      // 192.0.2.0/24
    (0xc01f_c400, 24, AddressClass::As112),              // 192.31.196.0/24
    (0xc034_c100, 24, AddressClass::Amt),                // 192.52.193.0/24
    (0xc058_6300, 24, AddressClass::SixToFour),          // 192.88.99.0/24
    (0xc0a8_0000, 16, AddressClass::Private),            // 192.168.0.0/16
    (0xc0af_3000, 24, AddressClass::As112),              // 192.175.48.0/24
    (0xc612_0000, 15, AddressClass::Benchmarking),       // 198.18.0.0/15
    (0xc633_6400, 24, AddressClass::Documentation),      // 198.51.100.0/24
    (0xcb00_7100, 24, AddressClass::Documentation),      // 203.0.113.0/24
    (0xe000_0000, 4, AddressClass::Multicast),           // 224.0.0.0/4
    (0xffff_ffff, 32, AddressClass::Broadcast),          // 255.255.255.255/32
    (0xf000_0000, 4, AddressClass::Reserved),            // 240.0.0.0/4
];

/// IPv6 blocks checked after the embedded-IPv4 prefixes, most specific first.
/// Anything that falls through and lies outside `2000::/3` is `Reserved`.
const V6_TABLE: &[(u128, u8, AddressClass)] = &[
    (0x0064_ff9b_0001 << 80, 48, AddressClass::Nat64Local), // 64:ff9b:1::/48
    (0, 96, AddressClass::Ipv4Compatible),                  // ::/96
    (0x0100 << 112, 64, AddressClass::DiscardOnly),         // 100::/64
    (0xfe80 << 112, 10, AddressClass::LinkLocal),           // fe80::/10
    (0xfec0 << 112, 10, AddressClass::SiteLocal),           // fec0::/10
    (0xfc00 << 112, 7, AddressClass::UniqueLocal),          // fc00::/7
    (0xff00 << 112, 8, AddressClass::Multicast),            // ff00::/8
    (0x2001_0000 << 96, 32, AddressClass::Teredo),          // 2001::/32
    (0x2001_0002_0000 << 80, 48, AddressClass::Benchmarking), // 2001:2::/48
    (0x2001_0000 << 96, 23, AddressClass::ProtocolAssignment), // 2001::/23
    (0x2001_0db8 << 96, 32, AddressClass::Documentation),   // 2001:db8::/32
    (0x2002 << 112, 16, AddressClass::SixToFour),           // 2002::/16
    (0x2620_004f_8000 << 80, 48, AddressClass::As112),      // 2620:4f:8000::/48
    (0x3ffe << 112, 16, AddressClass::SixBone),             // 3ffe::/16
    (0x3fff << 112, 20, AddressClass::Documentation),       // 3fff::/20
];

fn classify_v4(ip: Ipv4Addr) -> AddressClass {
    let bits = u32::from(ip);
    V4_TABLE
        .iter()
        .find(|&&(net, len, _)| prefix_match_u32(bits, net, len))
        .map_or(AddressClass::Public, |&(_, _, class)| class)
}

fn classify_v6(ip: Ipv6Addr) -> AddressClass {
    let bits = u128::from(ip);
    if bits == 0 {
        return AddressClass::Unspecified;
    }
    if bits == 1 {
        return AddressClass::Loopback;
    }
    // ::ffff:0:0/96 and 64:ff9b::/96: the low 32 bits are the IPv4 destination.
    if prefix_match_u128(bits, 0xffff << 32, 96) || prefix_match_u128(bits, 0x0064_ff9b << 96, 96) {
        // Truncation to the low 32 bits is exactly the embedded address.
        return classify_v4(Ipv4Addr::from(bits as u32));
    }
    if let Some(&(_, _, class)) = V6_TABLE.iter().find(|&&(net, len, _)| prefix_match_u128(bits, net, len)) {
        return class;
    }
    if !prefix_match_u128(bits, 0x2000 << 112, 3) {
        return AddressClass::Reserved;
    }
    AddressClass::Public
}

fn prefix_match_u32(addr: u32, net: u32, len: u8) -> bool {
    let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
    addr & mask == net & mask
}

fn prefix_match_u128(addr: u128, net: u128, len: u8) -> bool {
    let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
    addr & mask == net & mask
}
