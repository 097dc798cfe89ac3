//! SSRF-safe egress: the only way the gateway sends HTTP to user-supplied URLs.
//!
//! The gateway POSTs webhooks to URLs its users typed, with the network position of the
//! gateway: a confused deputy. This module makes sure such a request can only reach an
//! address that policy allows:
//!
//! * [`check_url`](EgressClient::check_url) / [`check_url_static`] refuse bad schemes and
//!   IP-literal hosts in forbidden ranges; reqwest never asks a resolver about IP
//!   literals, so this static check is the only gate for them.
//! * For host names, reqwest's connector asks our resolver once per new connection; it
//!   classifies every address and fails the lookup if any is forbidden. The connector
//!   then connects only to the addresses that passed, so there is no second resolution
//!   a DNS-rebinding attacker could answer differently.
//! * The URL is left untouched, so the Host header, TLS SNI and certificate verification
//!   all use the original host name.
//! * No redirects are followed (a 3xx goes back to the caller) and no proxy is taken
//!   from the environment: either would send the request somewhere we did not check.
//!
//! Policy: an address is allowed iff it is inside the operator allow-list or
//! [`classify`] says [`AddressClass::Public`].

pub mod classify;

pub use classify::{AddressClass, classify};
