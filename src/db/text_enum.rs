//! [`text_enum!`]: an enum stored as one of a few `text` values.

/// Declare how an enum is stored in a `text` column: its `as_str` and the sqlx `Type`,
/// `Encode`, `Decode` and array impls, as PostgreSQL's built-in `text` type.
///
/// sqlx's derive (`#[sqlx(type_name = "text")]`) declares the type by name, and sqlx then
/// looks its OID up on every new connection with a named prepared statement of its own,
/// which a transaction pooler leaves on a server connection another client reuses
/// (`prepared statement "sqlx_s_1" already exists`). The built-in type needs no look-up.
///
/// A stored value that is none of the variants' names fails to decode, with the value and
/// the type in the error.
macro_rules! text_enum {
    ($ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// The stored name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( $ty::$variant => $name, )+
                }
            }
        }

        impl sqlx::Type<sqlx::Postgres> for $ty {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::Type<sqlx::Postgres>>::type_info()
            }

            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <&str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }

        impl sqlx::postgres::PgHasArrayType for $ty {
            fn array_type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::postgres::PgHasArrayType>::array_type_info()
            }
        }

        impl<'q> sqlx::Encode<'q, sqlx::Postgres> for $ty {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<'q, sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }

        impl<'r> sqlx::Decode<'r, sqlx::Postgres> for $ty {
            fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
                match <&str as sqlx::Decode<'r, sqlx::Postgres>>::decode(value)? {
                    $( $name => Ok($ty::$variant), )+
                    other => Err(format!("{:?} is not a stored {}", other, stringify!($ty)).into()),
                }
            }
        }
    };
}

pub(crate) use text_enum;
