//! Parameters written straight into PostgreSQL's binary wire format, where sqlx's generic
//! encoding costs more than the value: a `bigint[]` of an ingest batch's search terms
//! (about 80 a webhook) went through sqlx's per-element length patching and checks, about
//! a twentieth of ingest's instructions (bench/PROFILE.md).

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgTypeInfo};
use sqlx::{Encode, Postgres, Type};

/// A `bigint[]` parameter (one dimension, no nulls): what `&[i64]` binds as, written in
/// one pass.
#[derive(Debug, Clone, Copy)]
pub struct Int8Array<'a>(pub &'a [i64]);

/// `int8`'s type oid, the element type the array names.
const INT8_OID: u32 = 20;
/// Bytes of an element on the wire: its length, then its 8 bytes.
const ELEMENT_BYTES: usize = 4 + 8;
/// Bytes before the elements: dimensions, flags, element type, length, lower bound.
const HEADER_BYTES: usize = 5 * 4;

impl Type<Postgres> for Int8Array<'_> {
    fn type_info() -> PgTypeInfo {
        <Vec<i64> as Type<Postgres>>::type_info()
    }
}

impl Encode<'_, Postgres> for Int8Array<'_> {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        let len = i32::try_from(self.0.len()).map_err(|_| format!("a bigint[] of {} elements", self.0.len()))?;
        buf.reserve(self.size_hint());
        buf.extend_from_slice(&1_i32.to_be_bytes()); // dimensions
        buf.extend_from_slice(&0_i32.to_be_bytes()); // flags: no nulls
        buf.extend_from_slice(&INT8_OID.to_be_bytes());
        buf.extend_from_slice(&len.to_be_bytes());
        buf.extend_from_slice(&1_i32.to_be_bytes()); // lower bound
        for value in self.0 {
            buf.extend_from_slice(&8_i32.to_be_bytes());
            buf.extend_from_slice(&value.to_be_bytes());
        }
        Ok(IsNull::No)
    }

    fn size_hint(&self) -> usize {
        HEADER_BYTES + ELEMENT_BYTES * self.0.len()
    }
}
