//! The SQL functions, all in the schema `multiregion`.
//!
//! This is the SQL edge: functions here return plain values to PostgreSQL and raise every
//! [`crate::error::MrError`] as a PostgreSQL error with its SQLSTATE and hint.

mod node;

use pgrx::prelude::*;

/// Declares the schema `multiregion` to pgrx, whose script then begins with
/// `CREATE SCHEMA IF NOT EXISTS multiregion`; the functions name it with `schema = ...`.
///
/// The schema is created by the script rather than named in the control file: only then is it
/// a member of the extension, so that `DROP EXTENSION` drops it too. PostgreSQL 15.2+ refuses
/// `IF NOT EXISTS` on a schema that exists but is not the extension's, so a `multiregion`
/// schema made by someone else is never adopted.
#[pg_schema]
mod multiregion {}
