//! Helpers shared by the verifier tests.

use http::{HeaderMap, HeaderName, HeaderValue};

use super::{Kind, Locator, SourceSpec, VerifyError};

/// A header map from name/value pairs (test input, so unwrap is fine).
pub(crate) fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_str(value).unwrap());
    }
    map
}

/// A spec of `kind` with these secrets and everything else defaulted.
pub(crate) fn spec(kind: Kind, secrets: &[&str]) -> SourceSpec {
    SourceSpec {
        kind,
        secrets: secrets.iter().map(|s| (*s).to_owned()).collect(),
        tolerance_secs: None,
        dedupe: Locator::default(),
        event_type: Locator::default(),
        ordering_key: Locator::default(),
        hmac: None,
    }
}

/// A locator reading a header.
pub(crate) fn header_locator(name: &str) -> Locator {
    Locator { header: Some(name.to_owned()), json_pointer: None }
}

/// A locator reading a JSON pointer.
pub(crate) fn pointer_locator(pointer: &str) -> Locator {
    Locator { header: None, json_pointer: Some(pointer.to_owned()) }
}

/// The error's code, so assertions read as the variant they expect.
pub(crate) fn code<T: std::fmt::Debug>(result: Result<T, VerifyError>) -> &'static str {
    match result {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.code().as_str(),
    }
}
