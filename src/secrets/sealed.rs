//! [`Sealed`]: a secret in its stored form.

/// A secret as the database holds it: encrypted under a key of the keyring
/// (`enc:v1:<key id>:...`), or, on a gateway without a key, the plaintext itself. Only
/// [`Keyring::seal`](super::Keyring::seal) makes one from a plaintext and only
/// [`Keyring::open`](super::Keyring::open) turns one back, so a stored secret cannot be
/// used as a signing key by mistake, nor a plaintext stored unsealed. Its `Debug` shows
/// the key id, never the value.
#[derive(Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Sealed(String);

impl Sealed {
    /// A value read from the database as it is stored (the re-encryption and the start-up
    /// check read raw columns).
    pub fn from_stored(stored: String) -> Sealed {
        Sealed(stored)
    }

    /// Wrap what the keyring produced (only `Keyring::seal` calls this).
    pub(super) fn new(stored: String) -> Sealed {
        Sealed(stored)
    }

    /// The stored text, to write it or to compare stored forms.
    pub fn as_stored(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Sealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match super::key_id_of(&self.0) {
            Some(key_id) => write!(f, "Sealed(key {key_id})"),
            None => f.write_str("Sealed(plaintext, not shown)"),
        }
    }
}

impl sqlx::Type<sqlx::Postgres> for Sealed {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <String as sqlx::Type<sqlx::Postgres>>::type_info()
    }

    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        <String as sqlx::Type<sqlx::Postgres>>::compatible(ty)
    }
}

impl sqlx::postgres::PgHasArrayType for Sealed {
    fn array_type_info() -> sqlx::postgres::PgTypeInfo {
        <String as sqlx::postgres::PgHasArrayType>::array_type_info()
    }
}

impl<'q> sqlx::Encode<'q, sqlx::Postgres> for Sealed {
    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <&str as sqlx::Encode<'q, sqlx::Postgres>>::encode(self.0.as_str(), buf)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for Sealed {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        Ok(Sealed(<String as sqlx::Decode<'r, sqlx::Postgres>>::decode(value)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_value() {
        let plain = Sealed::from_stored("whsec_very-secret".into());
        assert!(!format!("{plain:?}").contains("very-secret"));
        let encrypted = Sealed::from_stored("enc:v1:0123abcd:AAAA".into());
        assert!(format!("{encrypted:?}").contains("0123abcd"));
    }
}
