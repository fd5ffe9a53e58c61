//! The SQL functions, all in the schema `multiregion`.
//!
//! This is the SQL edge: functions here return plain values to PostgreSQL and raise every
//! [`crate::error::MrError`] as a PostgreSQL error with its SQLSTATE and hint.

mod crdb;
pub(crate) mod meta;
mod node;
pub(crate) mod rowid;

use crate::error::MrError;
use pgrx::prelude::*;

/// Declares the schema `multiregion` to pgrx, whose script then begins with
/// `CREATE SCHEMA IF NOT EXISTS multiregion`; the functions name it with `schema = ...`.
///
/// The schema is created by the script rather than named in the control file: only then is it
/// a member of the extension, so that `DROP EXTENSION` drops it too. PostgreSQL 15.2+ refuses
/// `IF NOT EXISTS` on a schema that exists but is not the extension's, so a `multiregion`
/// schema made by someone else is never adopted.
#[pg_schema]
mod multiregion {
    use pgrx::prelude::*;

    /// The BEFORE INSERT trigger that keeps rows for partitions leased elsewhere out of a
    /// statement that collects them ([`crate::moved`]).
    #[pg_trigger]
    fn route_row<'a>(
        trigger: &'a pgrx::PgTrigger<'a>,
    ) -> Result<Option<PgHeapTuple<'a, pgrx::AllocatedByPostgres>>, PgHeapTupleError> {
        crate::moved::route_row(trigger)
    }
}

/// pgmr's unsigned counters and ids as `int8`, refusing a value that would wrap.
fn bigint(field: &'static str, value: u64) -> Result<i64, MrError> {
    i64::try_from(value).map_err(|_| out_of_range(field, value))
}

fn out_of_range(field: &'static str, value: impl Into<u64>) -> MrError {
    MrError::OutOfRange {
        field,
        value: value.into(),
    }
}

/// Unix milliseconds as a `timestamptz`, as `to_timestamp(ms / 1000.0)` would give it.
/// PostgreSQL counts microseconds from 2000-01-01, which is this many ms after the Unix epoch.
fn timestamptz(field: &'static str, ms: u64) -> Result<TimestampWithTimeZone, MrError> {
    const PG_EPOCH_UNIX_MS: i64 = 946_684_800_000;
    bigint(field, ms)?
        .checked_sub(PG_EPOCH_UNIX_MS)
        .and_then(|ms| ms.checked_mul(1000))
        .and_then(|micros| TimestampWithTimeZone::try_from(micros).ok())
        .ok_or_else(|| out_of_range(field, ms))
}
