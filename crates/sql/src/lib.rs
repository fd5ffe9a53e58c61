//! CockroachDB's multi-region statements, parsed into a typed AST.
//!
//! Shared by the native door (`multiregion.execute(text)`) and pgmr's SQL gateway: both hand a
//! statement to [`parse`], which answers
//!
//! * `Ok(Some(statement))` for a multi-region statement (region and survival DDL, locality DDL,
//!   the SHOW forms), or a statement PostgreSQL would reject only for CockroachDB syntax this
//!   crate rewrites (`CREATE TABLE … LOCALITY …`, computed columns `AS (expr) STORED`);
//! * `Ok(None)` for anything else: PostgreSQL's to run as it is;
//! * `Err(SyntaxError)` for a statement that starts as one of ours but is malformed, with
//!   the character position PostgreSQL would report.
//!
//! It never panics, whatever the input (a fuzz-style test in `tests/` holds it to that).

mod ast;
mod lex;
mod parse;
mod star;
mod table;
mod translate;

pub use ast::*;
pub use lex::{on_conflict_clause, prepared_statement};
pub use parse::parse;
pub use star::is_star_reference;
pub use translate::{
    ident, literal, show_columns, translate, translate_one, txn_effects, Column, Outcome, Present,
    Translation, TxnEffect, Upsert,
};

/// A syntax error at a character position (1-based, in characters as PostgreSQL counts them).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} at character {position}")]
pub struct SyntaxError {
    pub message: String,
    pub position: usize,
}

impl SyntaxError {
    fn at(sql: &str, byte: usize, message: &str) -> SyntaxError {
        let byte = byte.min(sql.len());
        let mut b = byte;
        while !sql.is_char_boundary(b) {
            b -= 1;
        }
        SyntaxError {
            message: message.to_string(),
            position: sql[..b].chars().count() + 1,
        }
    }
}

/// PostgreSQL's duplicate-key detail (`Key (crdb_region, id)=(us-east1, 1) already exists.`)
/// without its leading `column` and that column's value, as CockroachDB reports a key whose
/// region prefix is implicit. `None` unless the key starts with `column` and has more. The
/// first value is found exactly only because a region name never holds `", "`.
pub fn key_detail_without(detail: &str, column: &str) -> Option<String> {
    let rest = detail.strip_prefix("Key (")?;
    let quoted = format!("\"{}\"", column.replace('"', "\"\""));
    let rest = rest
        .strip_prefix(&format!("{column}, "))
        .or_else(|| rest.strip_prefix(&format!("{quoted}, ")))?;
    let (columns, values) = rest.split_once(")=(")?;
    let (_, values) = values.split_once(", ")?;
    Some(format!("Key ({columns})=({values}"))
}

#[cfg(test)]
mod tests {
    use super::key_detail_without;

    #[test]
    fn the_region_prefix_leaves_a_duplicate_keys_detail() {
        assert_eq!(
            key_detail_without(
                "Key (crdb_region, id)=(us-east1, 1) already exists.",
                "crdb_region"
            )
            .as_deref(),
            Some("Key (id)=(1) already exists.")
        );
        assert_eq!(
            key_detail_without(
                "Key (\"Region\", city, id)=(us-west1, a, b, 7) already exists.",
                "Region"
            )
            .as_deref(),
            Some("Key (city, id)=(a, b, 7) already exists.")
        );
        assert_eq!(
            key_detail_without("Key (id)=(1) already exists.", "crdb_region"),
            None
        );
        assert_eq!(
            key_detail_without(
                "Key (crdb_region)=(us-east1) already exists.",
                "crdb_region"
            ),
            None
        );
    }
}
