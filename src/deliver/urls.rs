//! Endpoint URLs parsed once per URL, not once per attempt: parsing (with the host's IDNA
//! processing) was 5.7 % of the gateway's CPU in the delivery drain's profile
//! (bench/PROFILE.md), for the same few strings over and over.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use url::Url;

/// Most parsed URLs kept; past it the cache starts over (a deployment has far fewer
/// endpoints, so this only bounds memory against a churn of URLs).
const MAX_CACHED: usize = 10_000;

/// Parsed URLs keyed by their text. Cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct UrlCache {
    parsed: Arc<Mutex<HashMap<Box<str>, Url>>>,
}

impl UrlCache {
    /// `text` parsed, as [`Url::parse`] would: from the cache when it was parsed before.
    /// Errors are not cached (an endpoint with an unparsable URL is dead-lettered once).
    pub fn parse(&self, text: &str) -> Result<Url, url::ParseError> {
        if let Some(url) = self.lock().get(text) {
            return Ok(url.clone());
        }
        let url = Url::parse(text)?;
        let mut parsed = self.lock();
        if parsed.len() >= MAX_CACHED {
            parsed.clear();
        }
        parsed.insert(text.into(), url.clone());
        Ok(url)
    }

    /// URLs held (tests).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether nothing is held (tests).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Box<str>, Url>> {
        // A panic while holding the lock leaves a map of complete entries: still usable.
        self.parsed.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_cached_url_is_the_url_parse_gives_and_errors_are_not_kept() {
        let cache = UrlCache::default();
        for text in ["https://example.com/hook?a=1", "http://bücher.example:8080/p%20q", "https://[::1]/x"] {
            let first = cache.parse(text).unwrap();
            let again = cache.parse(text).unwrap();
            assert_eq!(first, Url::parse(text).unwrap());
            assert_eq!(again, first);
        }
        assert_eq!(cache.len(), 3);
        assert!(cache.parse("not a url").is_err());
        assert!(cache.parse("not a url").is_err());
        assert_eq!(cache.len(), 3, "errors are not cached");
    }

    #[test]
    fn the_cache_is_bounded() {
        let cache = UrlCache::default();
        for i in 0..MAX_CACHED + 5 {
            cache.parse(&format!("https://example.com/{i}")).unwrap();
        }
        assert!(cache.len() <= MAX_CACHED);
        assert!(!cache.is_empty());
    }

    proptest! {
        #[test]
        fn any_text_parses_through_the_cache_as_it_does_directly(text in "\\PC{0,40}", prefix in prop::sample::select(vec!["", "http://", "https://", "https://a.b/"])) {
            let cache = UrlCache::default();
            let text = format!("{prefix}{text}");
            let direct = Url::parse(&text);
            prop_assert_eq!(cache.parse(&text), direct.clone());
            prop_assert_eq!(cache.parse(&text), direct);
        }
    }
}
