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
pub use lex::{on_conflict_clause, prepared_statement, query_of};
pub use parse::parse;
pub use star::is_star_reference;
pub use table::Shard;
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
    /// `42601` for what does not parse; another SQLSTATE for a value the grammar allows but
    /// CockroachDB refuses as it reads it (a bucket count out of range: `22023`).
    pub sqlstate: &'static str,
}

impl SyntaxError {
    fn at(sql: &str, byte: usize, message: &str) -> SyntaxError {
        SyntaxError::with_code(sql, byte, message, "42601")
    }

    fn with_code(sql: &str, byte: usize, message: &str, sqlstate: &'static str) -> SyntaxError {
        let byte = byte.min(sql.len());
        let mut b = byte;
        while !sql.is_char_boundary(b) {
            b -= 1;
        }
        SyntaxError {
            message: message.to_string(),
            position: sql[..b].chars().count() + 1,
            sqlstate,
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

/// `text` with each double-quoted name that `rename` knows replaced by its new name (names
/// with embedded quotes are left alone).
pub fn rename_quoted(text: &str, rename: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('"') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('"') else { break };
        let name = &after[..close];
        out.push_str(&rest[..=open]);
        out.push_str(&rename(name).unwrap_or_else(|| name.to_string()));
        out.push('"');
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::{key_detail_without, rename_quoted};

    #[test]
    fn quoted_names_are_renamed_and_the_rest_kept() {
        let keys = |n: &str| (n == "accounts_accounts_email_key").then(|| "accounts".to_string());
        assert_eq!(
            rename_quoted(
                "Key (email)=(zz@x) is not present in table \"accounts_accounts_email_key\".",
                keys
            ),
            "Key (email)=(zz@x) is not present in table \"accounts\"."
        );
        assert_eq!(
            rename_quoted(
                "update or delete on table \"accounts_accounts_email_key\" violates foreign key \
                 constraint \"notes_email_fkey\" on table \"notes\"",
                keys
            ),
            "update or delete on table \"accounts\" violates foreign key constraint \
             \"notes_email_fkey\" on table \"notes\""
        );
        assert_eq!(rename_quoted("odd \"quote", keys), "odd \"quote");
    }

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

/// A column type as CockroachDB's `SHOW CREATE TABLE` spells it, from PostgreSQL's
/// `format_type` (`text` → `STRING`, `bigint` → `INT8`, `character varying(10)` →
/// `VARCHAR(10)`, arrays too); a type CockroachDB has no name of its own for is kept.
pub fn crdb_type_name(pg: &str) -> String {
    if let Some(element) = pg.strip_suffix("[]") {
        return format!("{}[]", crdb_type_name(element));
    }
    let (base, modifier) = match pg.find('(') {
        Some(i) if pg.ends_with(')') => (&pg[..i], &pg[i..]),
        _ => (pg, ""),
    };
    let name = match base {
        "text" => "STRING",
        "bigint" => "INT8",
        "integer" => "INT4",
        "smallint" => "INT2",
        "boolean" => "BOOL",
        "double precision" => "FLOAT8",
        "real" => "FLOAT4",
        "numeric" => "DECIMAL",
        "bytea" => "BYTES",
        "character varying" => "VARCHAR",
        "character" => "CHAR",
        "timestamp without time zone" => "TIMESTAMP",
        "timestamp with time zone" => "TIMESTAMPTZ",
        "time without time zone" => "TIME",
        "time with time zone" => "TIMETZ",
        "uuid" | "jsonb" | "json" | "date" | "interval" | "inet" | "bit" | "oid" => {
            return format!("{}{modifier}", base.to_uppercase());
        }
        _ => return pg.to_string(),
    };
    format!("{name}{modifier}")
}

#[cfg(test)]
mod type_names {
    use super::crdb_type_name;

    #[test]
    fn postgresql_types_take_cockroachdb_names() {
        for (pg, crdb) in [
            ("text", "STRING"),
            ("bigint", "INT8"),
            ("integer", "INT4"),
            ("character varying", "VARCHAR"),
            ("character varying(10)", "VARCHAR(10)"),
            ("numeric(10,2)", "DECIMAL(10,2)"),
            ("timestamp without time zone", "TIMESTAMP"),
            ("timestamp(3) with time zone", "timestamp(3) with time zone"),
            ("uuid", "UUID"),
            ("jsonb", "JSONB"),
            ("text[]", "STRING[]"),
            ("bytea", "BYTES"),
            ("public.crdb_internal_region", "public.crdb_internal_region"),
            ("mood", "mood"),
        ] {
            assert_eq!(crdb_type_name(pg), crdb, "{pg}");
        }
    }
}
