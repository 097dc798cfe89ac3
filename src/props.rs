//! Case counts of the property tests (test builds only), in one place.
//!
//! Each property runs a bounded number of cases in `cargo test`, chosen so that it takes
//! at most a few seconds on a 2-core machine. `PROPTEST_CASES=<n>` replaces every one of
//! these defaults for a longer run (docs/testing.md): an explicit
//! `ProptestConfig::with_cases` would silently ignore it, so properties take their
//! configuration from [`config`].

use proptest::test_runner::Config;

/// `PROPTEST_CASES` when it is set to a number, else `default`.
pub(crate) fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

/// proptest's default configuration with [`cases`]`(default)` cases.
pub(crate) fn config(default: u32) -> Config {
    Config { cases: cases(default), ..Config::default() }
}
