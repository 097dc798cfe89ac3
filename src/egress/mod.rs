//! SSRF-safe egress (placeholder; the real module lands with issue 5).
