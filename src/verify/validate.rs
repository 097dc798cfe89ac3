//! Checks of a [`SourceSpec`] when a source is created or changed, and the secret
//! fingerprint the API shows instead of a secret.

use http::HeaderName;
use sha2::{Digest, Sha256};

use super::{Kind, Locator, SourceSpec, standard};

/// Why a source spec is refused: the offending field (`secrets[1]`, `hmac.prefix`, ...)
/// and the reason. Displayed as `field: reason`; it never contains a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct SpecError {
    /// The field, as the API names it.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

fn refuse(field: impl Into<String>, reason: impl Into<String>) -> Result<(), SpecError> {
    Err(SpecError { field: field.into(), reason: reason.into() })
}

/// A source spec that passed [`ValidSpec::parse`]: the only form the database takes
/// (`store::sources`), so a misconfigured source is refused at creation (HTTP 422 naming
/// the field) instead of refusing every webhook later. `S` is the form of its secrets, as
/// in [`SourceSpec`]: sealing keeps a spec valid ([`ValidSpec::sealed`]), since the checks
/// are on the plaintext and sealing changes no secret's plaintext.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidSpec<S = String>(SourceSpec<S>);

impl ValidSpec {
    /// Check `spec` ([`validate_spec`]) and keep it as valid.
    pub fn parse(spec: SourceSpec) -> Result<ValidSpec, SpecError> {
        validate_spec(&spec)?;
        Ok(ValidSpec(spec))
    }

    /// The same valid spec with each secret sealed by `seal` (its index and plaintext).
    pub fn sealed<E>(
        self,
        mut seal: impl FnMut(usize, &str) -> Result<crate::secrets::Sealed, E>,
    ) -> Result<ValidSpec<crate::secrets::Sealed>, E> {
        let sealed = self.0.secrets.iter().enumerate().map(|(i, s)| seal(i, s)).collect::<Result<Vec<_>, E>>()?;
        Ok(ValidSpec(self.0.with_secrets(sealed)))
    }
}

impl<S> ValidSpec<S> {
    /// The spec.
    pub fn spec(&self) -> &SourceSpec<S> {
        &self.0
    }
}

/// Check a spec before it is stored (through [`ValidSpec::parse`]).
pub fn validate_spec(spec: &SourceSpec) -> Result<(), SpecError> {
    let kind = spec.kind.as_str();
    if spec.kind.needs_secret() {
        if spec.secrets.is_empty() {
            return refuse("secrets", format!("kind {kind} needs at least one secret"));
        }
        // An empty entry would be skipped at verification, so it is a mistake here:
        // probably an unset variable in the operator's script.
        if let Some(i) = spec.secrets.iter().position(|s| s.trim().is_empty()) {
            return refuse(format!("secrets[{i}]"), "must not be empty");
        }
    }
    if spec.kind == Kind::StandardWebhooks
        && let Some(i) = spec.secrets.iter().position(|s| standard::decode_secret(s).is_none())
    {
        return refuse(format!("secrets[{i}]"), "kind standard-webhooks needs whsec_<base64> (or plain base64)");
    }
    match (&spec.hmac, spec.kind) {
        (None, Kind::Hmac) => {
            return refuse(
                "hmac",
                "kind hmac needs hmac settings ({\"header\": ..., \"algorithm\": ..., \"encoding\": ..., \
                 \"prefix\": ...})",
            );
        }
        (Some(scheme), Kind::Hmac) => {
            if !valid_header_name(&scheme.header) {
                return refuse("hmac.header", "not a valid HTTP header name");
            }
            if let Some(prefix) = &scheme.prefix
                && !valid_prefix(prefix)
            {
                return refuse(
                    "hmac.prefix",
                    "must be visible ASCII (spaces allowed inside) and not start with whitespace: no signature \
                     header could carry it",
                );
            }
        }
        (Some(_), _) => {
            // Settings that would be silently ignored hide a wrong `kind`.
            return refuse("hmac", format!("only used by kind hmac, not {kind}"));
        }
        (None, _) => {}
    }
    check_locator("dedupe", &spec.dedupe)?;
    check_locator("event_type", &spec.event_type)?;
    check_locator("ordering_key", &spec.ordering_key)?;
    if spec.tolerance_secs == Some(0) {
        return refuse("tolerance_secs", "must be greater than 0");
    }
    Ok(())
}

fn check_locator(field: &str, locator: &Locator) -> Result<(), SpecError> {
    if let Some(header) = &locator.header
        && !valid_header_name(header)
    {
        return refuse(format!("{field}.header"), "not a valid HTTP header name");
    }
    if let Some(pointer) = &locator.json_pointer
        && !pointer.is_empty()
        && !pointer.starts_with('/')
    {
        return refuse(format!("{field}.json_pointer"), "must be empty or start with \"/\" (RFC 6901)");
    }
    Ok(())
}

/// A prefix a header value can carry: verification reads the value as visible ASCII (tab
/// allowed) with the surrounding whitespace trimmed, so a prefix with any other byte, or
/// one that starts with whitespace, could never match and the source would refuse every
/// webhook.
fn valid_prefix(prefix: &str) -> bool {
    prefix.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b)) && !prefix.starts_with([' ', '\t'])
}

fn valid_header_name(name: &str) -> bool {
    !name.is_empty() && HeaderName::from_bytes(name.as_bytes()).is_ok()
}

/// A short, stable fingerprint of a secret for the API to show instead of the secret:
/// `sha256:` and the first 8 hex digits of the SHA-256 of the secret string as entered.
///
/// Enough for an operator to tell which secret is which during a rotation
/// (`printf %s "$SECRET" | sha256sum | cut -c1-8`), too short to confirm a guess of a
/// well-chosen secret: 32 bits match about one candidate in four billion.
pub fn secret_fingerprint(secret: &str) -> String {
    let digest = hex::encode(Sha256::digest(secret.as_bytes()));
    format!("sha256:{}", &digest[..8])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::test_util::{header_locator, pointer_locator, spec};
    use crate::verify::{HmacAlgorithm, HmacScheme, SignatureEncoding};

    fn scheme() -> HmacScheme {
        HmacScheme {
            header: "X-Signature".to_owned(),
            algorithm: HmacAlgorithm::Sha256,
            encoding: SignatureEncoding::Hex,
            prefix: None,
        }
    }

    fn err(spec: &SourceSpec) -> String {
        validate_spec(spec).expect_err("spec should be refused").to_string()
    }

    /// Only a spec that passes the checks becomes a `ValidSpec`, and sealing it keeps
    /// everything but the secrets' form.
    #[test]
    fn only_a_valid_spec_parses_and_sealing_keeps_it() {
        let refused = ValidSpec::parse(spec(Kind::Stripe, &[])).expect_err("no secret");
        assert_eq!(refused.field, "secrets");
        let valid = ValidSpec::parse(spec(Kind::Stripe, &["whsec_abc", "whsec_def"])).expect("valid");
        let keyring = crate::secrets::Keyring::default();
        let sealed = valid
            .clone()
            .sealed(|_, secret| keyring.seal(crate::secrets::Place::SourceSecret, secret))
            .expect("sealed");
        assert_eq!(sealed.spec().kind, Kind::Stripe);
        assert_eq!(sealed.spec().secrets.len(), 2);
        let opened = keyring.open_all(crate::secrets::Place::SourceSecret, &sealed.spec().secrets).expect("opens");
        assert_eq!(opened, valid.spec().secrets);
    }

    #[test]
    fn valid_specs_pass() {
        assert_eq!(validate_spec(&spec(Kind::Stripe, &["whsec_abc"])), Ok(()));
        assert_eq!(validate_spec(&spec(Kind::None, &[])), Ok(()));
        assert_eq!(validate_spec(&spec(Kind::Internal, &[])), Ok(()));
        assert_eq!(
            validate_spec(&spec(
                Kind::StandardWebhooks,
                &["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]
            )),
            Ok(())
        );
        let mut hmac = spec(Kind::Hmac, &["s"]);
        hmac.hmac = Some(scheme());
        hmac.dedupe = header_locator("X-Request-Id");
        hmac.event_type = pointer_locator("/type");
        hmac.tolerance_secs = Some(60);
        assert_eq!(validate_spec(&hmac), Ok(()));
    }

    #[test]
    fn secrets_are_required_for_signing_kinds() {
        for kind in [Kind::Stripe, Kind::Github, Kind::Shopify, Kind::Slack, Kind::StandardWebhooks] {
            let message = err(&spec(kind, &[]));
            assert_eq!(message, format!("secrets: kind {} needs at least one secret", kind.as_str()));
        }
        assert_eq!(err(&spec(Kind::Github, &["ok", ""])), "secrets[1]: must not be empty");
    }

    #[test]
    fn standard_webhooks_secrets_must_decode() {
        let message = err(&spec(Kind::StandardWebhooks, &["whsec_not base64!"]));
        assert!(message.starts_with("secrets[0]: "), "{message}");
        assert!(!message.contains("not base64!"), "the secret leaked: {message}");
        assert!(err(&spec(Kind::StandardWebhooks, &["whsec_"])).starts_with("secrets[0]"));
    }

    #[test]
    fn hmac_settings_belong_to_kind_hmac() {
        assert!(err(&spec(Kind::Hmac, &["s"])).starts_with("hmac: "));
        let mut bad_header = spec(Kind::Hmac, &["s"]);
        bad_header.hmac = Some(HmacScheme { header: "X Signature".to_owned(), ..scheme() });
        assert!(err(&bad_header).starts_with("hmac.header: "));
        // A prefix no header value could start with: non-ASCII, or leading whitespace
        // (trimmed from every header value). Found by verify::tests_props.
        for prefix in ["\u{ab09}", "sha256=\u{e9}", " sha256=", "\tv1="] {
            let mut unsendable = spec(Kind::Hmac, &["s"]);
            unsendable.hmac = Some(HmacScheme { prefix: Some(prefix.to_owned()), ..scheme() });
            assert!(err(&unsendable).starts_with("hmac.prefix: "), "{prefix:?}");
        }
        for prefix in ["", "sha256=", "SHA512 ", "v1, sig="] {
            let mut fine = spec(Kind::Hmac, &["s"]);
            fine.hmac = Some(HmacScheme { prefix: Some(prefix.to_owned()), ..scheme() });
            assert_eq!(validate_spec(&fine), Ok(()), "{prefix:?}");
        }
        let mut stray = spec(Kind::Github, &["s"]);
        stray.hmac = Some(scheme());
        assert!(err(&stray).starts_with("hmac: "));
    }

    #[test]
    fn locators_and_tolerance_are_checked() {
        let mut s = spec(Kind::Github, &["s"]);
        s.dedupe = pointer_locator("data/id");
        assert!(err(&s).starts_with("dedupe.json_pointer: "));
        s.dedupe = pointer_locator("");
        assert_eq!(validate_spec(&s), Ok(()));
        s.event_type = header_locator("bad header");
        assert!(err(&s).starts_with("event_type.header: "));
        s.event_type = Locator::default();
        s.tolerance_secs = Some(0);
        assert_eq!(err(&s), "tolerance_secs: must be greater than 0");
    }

    #[test]
    fn fingerprint_is_a_short_prefixed_hash() {
        // printf %s 'whsec_test_stripe_one' | sha256sum | cut -c1-8
        assert_eq!(secret_fingerprint("whsec_test_stripe_one"), "sha256:c5597d39");
        assert_ne!(secret_fingerprint("a"), secret_fingerprint("b"));
        assert!(!secret_fingerprint("whsec_test_stripe_one").contains("whsec"));
    }
}
