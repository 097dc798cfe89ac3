//! Unit tests of the keyring: sealing, opening, places, rotation, the cache.
use super::*;

/// A stored value as the database would hand it back.
fn stored(text: &str) -> Sealed {
    Sealed::from_stored(text.to_owned())
}

fn ring() -> Keyring {
    Keyring::new(Key::generate(), Vec::new())
}

#[test]
fn a_sealed_value_opens_where_it_was_sealed_and_looks_like_nothing_it_holds() {
    let keyring = ring();
    let id = keyring.current_key_id().unwrap().to_owned();
    for place in [Place::EndpointSecret, Place::SourceSecret] {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let a = keyring.seal(place, secret).unwrap();
        let b = keyring.seal(place, secret).unwrap();
        assert!(a.as_stored().starts_with(&format!("enc:v1:{id}:")), "{a:?}");
        assert_ne!(a, b, "a fresh nonce per value");
        assert!(!a.as_stored().contains("MfKQ9r8G"), "{a:?}");
        assert_eq!(keyring.open(place, &a).unwrap(), secret);
        // A fresh keyring with the same key (no cache) decrypts too.
        assert_eq!(
            Keyring::new(keyring.inner.as_ref().unwrap().current.clone(), vec![]).open(place, &b).unwrap(),
            secret
        );
        assert_eq!(key_id_of(a.as_stored()), Some(id.as_str()));
        assert!(keyring.is_current(&a));
    }
}

#[test]
fn plaintext_passes_through_with_or_without_a_key() {
    for keyring in [Keyring::default(), ring()] {
        let plain = stored("plain-secret");
        assert!(matches!(keyring.open(Place::SourceSecret, &plain), Ok(Cow::Borrowed("plain-secret"))));
    }
    let plain = Keyring::default();
    assert_eq!(plain.seal(Place::SourceSecret, "plain-secret").unwrap(), stored("plain-secret"));
    assert!(plain.is_current(&stored("plain-secret")));
    assert!(!ring().is_current(&stored("plain-secret")));
    assert_eq!(key_id_of("plain-secret"), None);
    for keyring in [Keyring::default(), ring()] {
        assert_eq!(keyring.seal(Place::SourceSecret, "enc:v1:looks-encrypted"), Err(SecretError::ReservedPrefix));
    }
}

#[test]
fn a_tampered_value_is_refused() {
    let keyring = ring();
    let sealed = keyring.seal(Place::SourceSecret, "a-github-secret").unwrap();
    let (head, payload) = sealed.as_stored().rsplit_once(':').unwrap();
    let mut bytes = STANDARD.decode(payload).unwrap();
    // Every byte matters: nonce, ciphertext and tag.
    for i in [0, NONCE_BYTES, bytes.len() - 1] {
        bytes[i] ^= 1;
        let tampered = stored(&format!("{head}:{}", STANDARD.encode(&bytes)));
        bytes[i] ^= 1;
        // A fresh keyring: the cache holds the genuine value, not this one.
        let fresh = Keyring::new(keyring.inner.as_ref().unwrap().current.clone(), vec![]);
        for k in [&keyring, &fresh] {
            let err = k.open(Place::SourceSecret, &tampered).unwrap_err();
            assert!(matches!(err, SecretError::Rejected { .. }), "byte {i}: {err}");
        }
    }
    // Truncated, not base64, no payload, a malformed key id.
    let cut = &sealed.as_stored()[..sealed.as_stored().len() - 30];
    for bad in [cut, "enc:v1:", "enc:v1:0011aabb", "enc:v1:0011aabb:!!!", "enc:v1:XYZ:AAAA", "enc:v1:0011aabb:AAAA"] {
        assert!(keyring.open(Place::SourceSecret, &stored(bad)).is_err(), "{bad}");
    }
    assert_eq!(
        keyring.open(Place::SourceSecret, &stored("enc:v1:0011aabb:AAAA")),
        Err(SecretError::UnknownKey("0011aabb".into()))
    );
}

#[test]
fn a_value_moved_to_the_other_column_is_refused() {
    let keyring = ring();
    let endpoint = keyring.seal(Place::EndpointSecret, "whsec_c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0").unwrap();
    let source = keyring.seal(Place::SourceSecret, "source-secret").unwrap();
    // Cached under its own place already (seal remembers): the other place still refuses.
    assert!(matches!(keyring.open(Place::SourceSecret, &endpoint), Err(SecretError::Rejected { .. })));
    assert!(matches!(keyring.open(Place::EndpointSecret, &source), Err(SecretError::Rejected { .. })));
    assert!(keyring.open(Place::EndpointSecret, &endpoint).is_ok());
    // Relabelled with another key's id: that key does not authenticate it either.
    let other = Key::generate();
    let both = Keyring::new(other.clone(), vec![keyring.inner.as_ref().unwrap().current.clone()]);
    let relabelled = stored(&source.as_stored().replacen(keyring.current_key_id().unwrap(), other.id(), 1));
    assert!(matches!(both.open(Place::SourceSecret, &relabelled), Err(SecretError::Rejected { .. })));
    assert!(both.open(Place::SourceSecret, &source).is_ok());
}

#[test]
fn previous_keys_open_and_only_the_current_one_seals() {
    let old = Key::generate();
    let new = Key::generate();
    let before = Keyring::new(old.clone(), vec![]);
    let stored = before.seal(Place::EndpointSecret, "whsec_old").unwrap();
    let rotating = Keyring::new(new.clone(), vec![old.clone(), new.clone(), old.clone()]);
    assert_eq!(rotating.previous_key_ids(), [old.id()], "duplicates and the current key dropped");
    assert_eq!(rotating.open(Place::EndpointSecret, &stored).unwrap(), "whsec_old");
    assert!(!rotating.is_current(&stored));
    assert!(
        rotating.seal(Place::EndpointSecret, "x").unwrap().as_stored().starts_with(&format!("enc:v1:{}:", new.id()))
    );
    let after = Keyring::new(new.clone(), vec![]);
    assert_eq!(after.open(Place::EndpointSecret, &stored), Err(SecretError::UnknownKey(old.id().to_owned())));
    assert_eq!(Keyring::default().open(Place::EndpointSecret, &stored), Err(SecretError::NoKey(old.id().to_owned())));
}

#[test]
fn keys_are_32_bytes_of_base64_and_errors_never_show_them() {
    let bytes = [7u8; KEY_BYTES];
    let text = encode_key(&bytes);
    let key = Key::from_base64(&format!("  {text}\n")).unwrap();
    assert_eq!(key.id(), &hex::encode(Sha256::digest(bytes))[..8]);
    assert_eq!(Key::from_base64(text.trim_end_matches('=')).unwrap().id(), key.id(), "padding optional");
    let short = STANDARD.encode([7u8; 31]);
    for bad in [short.as_str(), "not base64 at all!", ""] {
        let err = Key::from_base64(bad).unwrap_err().to_string();
        assert!(err.contains("32 bytes in base64"), "{err}");
        assert!(bad.is_empty() || !err.contains(bad), "{err}");
    }
    assert!(format!("{key:?}").contains(key.id()));
    assert!(!format!("{:?}", Keyring::new(key, vec![])).contains(&text));
}

#[test]
fn keyring_settings_are_checked() {
    let text = encode_key(&[1u8; KEY_BYTES]);
    assert!(!keyring_from(None, None, &[], &[]).unwrap().encrypts());
    assert!(keyring_from(Some(&text), None, &[], &[]).unwrap().encrypts());
    let err = keyring_from(None, None, std::slice::from_ref(&text), &[]).unwrap_err();
    assert!(err.contains("needs a current"), "{err}");
    let err = keyring_from(Some(&text), Some(std::path::Path::new("/nonexistent")), &[], &[]).unwrap_err();
    assert!(err.contains("not both"), "{err}");
    let err = keyring_from(None, Some(std::path::Path::new("/nonexistent/key")), &[], &[]).unwrap_err();
    assert!(err.starts_with("secrets-key-file: cannot read /nonexistent/key"), "{err}");
    let err = keyring_from(Some(&text), None, &["short".into()], &[]).unwrap_err();
    assert!(err.starts_with("secrets-key-previous (entry 1): must be 32 bytes"), "{err}");
    let err = keyring_from(Some(&text), None, &[], &["/nonexistent/old".into()]).unwrap_err();
    assert!(err.starts_with("secrets-key-previous-file: cannot read /nonexistent/old"), "{err}");
}

#[test]
fn the_cache_is_bounded() {
    let keyring = ring();
    let fresh = Keyring::new(keyring.inner.as_ref().unwrap().current.clone(), vec![]);
    let values: Vec<Sealed> =
        (0..=MAX_CACHED).map(|i| keyring.seal(Place::SourceSecret, &format!("s{i}")).unwrap()).collect();
    assert!(keyring.cached(Place::SourceSecret) <= MAX_CACHED);
    for (i, v) in values.iter().enumerate() {
        assert_eq!(fresh.open(Place::SourceSecret, v).unwrap(), format!("s{i}"));
    }
    assert_eq!(fresh.cached(Place::SourceSecret), 1, "cleared at the bound, then one more");
    assert_eq!(fresh.cached(Place::EndpointSecret), 0);
}

/// What a claim pays to open an endpoint's secrets (current + one previous): run with
/// `cargo test --release --lib secrets::tests::cost -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn cost_of_opening_a_claims_secrets() {
    use std::time::Instant;
    const N: u32 = 100_000;
    let keyring = ring();
    let secrets = [
        keyring.seal(Place::EndpointSecret, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap(),
        keyring.seal(Place::EndpointSecret, "whsec_c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0").unwrap(),
    ];
    let plain = Keyring::default();
    let plaintext = [stored("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), stored("whsec_c2VjcmV0")];
    let time = |label: &str, f: &mut dyn FnMut()| {
        let start = Instant::now();
        for _ in 0..N {
            f();
        }
        println!("{label}: {:.0} ns per claim", start.elapsed().as_nanos() as f64 / f64::from(N));
    };
    time("no key (plaintext)", &mut || {
        for s in &plaintext {
            std::hint::black_box(plain.open(Place::EndpointSecret, s).unwrap());
        }
    });
    time("key, cached", &mut || {
        for s in &secrets {
            std::hint::black_box(keyring.open(Place::EndpointSecret, s).unwrap());
        }
    });
    let current = keyring.inner.as_ref().unwrap().current.clone();
    time("key, uncached (decrypt both)", &mut || {
        let cold = Keyring::new(current.clone(), vec![]);
        for s in &secrets {
            std::hint::black_box(cold.open(Place::EndpointSecret, s).unwrap());
        }
    });
    time("seal one (write path)", &mut || {
        std::hint::black_box(keyring.seal(Place::SourceSecret, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap());
    });
}
