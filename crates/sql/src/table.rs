//! CockroachDB's `CREATE TABLE` elements that PostgreSQL's grammar rejects, rewritten into
//! PostgreSQL's: inline `INDEX` / `UNIQUE INDEX` / `INVERTED INDEX` become `CREATE INDEX`
//! statements run after the table, `FAMILY` goes (PostgreSQL stores a row together), `ASC` /
//! `DESC` leave key constraints (PostgreSQL's have no order; a B-tree scans both ways), a
//! primary key named `"primary"` takes PostgreSQL's per-table name (index names are per schema
//! in PostgreSQL), `NOT VISIBLE` goes (PostgreSQL cannot hide a column from `*`), `UNIQUE
//! WITHOUT INDEX` is a unique constraint (PostgreSQL's needs its index), `AS (…) VIRTUAL`
//! columns are stored (parse.rs), and CockroachDB's type names take PostgreSQL's (`STRING` →
//! `text`, `STRING(n)` → `varchar(n)`, `BYTES` → `bytea`). Through the gateway only (the
//! CockroachDB door; [`cockroach_integers`]) `INT`/`INTEGER`/`INT64` are `int8` — CockroachDB's
//! integers are 8 bytes unless sized, and `unique_rowid()` keys need them — and `SERIAL` in all
//! its sizes is `int8 NOT NULL DEFAULT multiregion.unique_rowid()`, as CockroachDB's default
//! `serial_normalization = rowid` makes it (IDs made on the node that inserts, not drawn from
//! a counter the whole cluster shares). `multiregion.execute()` keeps PostgreSQL's meaning of
//! those names: its statements are PostgreSQL's plus the multi-region clauses.

use crate::lex::{lex, Tok, Token};
use crate::SyntaxError;

/// A table's body rewritten, and the index statements to run after it.
pub(crate) struct Rewritten {
    pub sql: String,
    pub indexes: Vec<String>,
}

fn is_punct(t: Option<&Token>, c: char) -> bool {
    matches!(t.map(|t| &t.tok), Some(Tok::Punct(p)) if *p == c)
}

/// The index of the parenthesis closing the one at `open`.
fn closing(toks: &[Token], open: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (j, t) in toks.iter().enumerate().skip(open) {
        match t.tok {
            Tok::Punct('(') => depth += 1,
            Tok::Punct(')') => {
                depth -= 1;
                if depth == 0 {
                    return Some(j);
                }
            }
            _ => {}
        }
    }
    None
}

/// Rewrites the element list of `CREATE TABLE` in `sql` (the statement up to any LOCALITY
/// clause), whose `(` starts at byte `open_at`; `table_sql` is the table's name as written.
/// `None` when nothing needed rewriting (or the statement has no element list).
pub(crate) fn rewrite_elements(
    sql: &str,
    open_at: usize,
    table_sql: &str,
    table_name: &str,
) -> Result<Option<Rewritten>, SyntaxError> {
    rewrite(sql, open_at, table_sql, table_name)
}

fn rewrite(
    sql: &str,
    open_at: usize,
    table_sql: &str,
    table_name: &str,
) -> Result<Option<Rewritten>, SyntaxError> {
    let Ok(toks) = lex(sql) else {
        return Ok(None);
    };
    let Some(open) = toks.iter().position(|t| t.start == open_at) else {
        return Ok(None);
    };
    if !is_punct(toks.get(open), '(') {
        return Ok(None);
    }
    let Some(close) = closing(&toks, open) else {
        return Ok(None);
    };
    // Elements: token ranges between depth-1 commas.
    let mut elements = vec![];
    let (mut depth, mut from) = (0i32, open + 1);
    for (j, t) in toks.iter().enumerate().take(close).skip(open + 1) {
        match t.tok {
            Tok::Punct('(') => depth += 1,
            Tok::Punct(')') => depth -= 1,
            Tok::Punct(',') if depth == 0 => {
                elements.push(from..j);
                from = j + 1;
            }
            _ => {}
        }
    }
    elements.push(from..close);
    let mut changed = false;
    let mut kept = vec![];
    let mut indexes = vec![];
    // Shard columns of hash-sharded keys, as column definitions.
    let mut shards: Vec<String> = vec![];
    for range in elements {
        let el = &toks[range.clone()];
        if el.is_empty() {
            kept.push(String::new());
            continue;
        }
        let text = &sql[el[0].start..el[el.len() - 1].end];
        let w = |i: usize| el.get(i).and_then(Token::word);
        let list_after_name = |at: usize| list_after_name(el, at);
        let index_at = match (w(0), w(1)) {
            (Some("index"), _) => Some((false, false, 1)),
            (Some("unique"), Some("index")) => Some((true, false, 2)),
            (Some("inverted"), Some("index")) => Some((false, true, 2)),
            _ => None,
        }
        .filter(|(_, _, at)| list_after_name(*at));
        if let Some((unique, inverted, at)) = index_at {
            let (index, shard) =
                index_statement(sql, el, at, unique, inverted, (table_sql, table_name))?;
            indexes.push(index);
            shards.extend(shard);
            changed = true;
            continue;
        }
        if w(0) == Some("family") && list_after_name(1) {
            changed = true;
            continue;
        }
        let mut edits: Vec<(usize, usize, String)> = vec![];
        // `CONSTRAINT name PRIMARY KEY (…)`, `PRIMARY KEY (…)`, `UNIQUE (…)`.
        let mut key_at = None;
        if w(0) == Some("constraint") {
            let named_primary = matches!(
                el.get(1).map(|t| &t.tok),
                Some(Tok::Word(n) | Tok::Quoted(n)) if n == "primary"
            );
            if named_primary && w(2) == Some("primary") {
                edits.push((
                    el[1].start,
                    el[1].end,
                    crate::translate::ident(&format!("{table_name}_pkey")),
                ));
            }
            key_at = match (w(2), w(3), w(4)) {
                (Some("primary"), Some("key"), _) => Some(4),
                (Some("unique"), Some("without"), Some("index")) => {
                    edits.push((el[3].start, el[4].end, String::new()));
                    Some(5)
                }
                (Some("unique"), _, _) => Some(3),
                _ => None,
            };
        } else if let (Some("primary"), Some("key")) = (w(0), w(1)) {
            key_at = Some(2);
        } else if w(0) == Some("unique") && is_punct(el.get(1), '(') {
            key_at = Some(1);
        } else if let (Some("unique"), Some("without"), Some("index")) = (w(0), w(1), w(2)) {
            // CockroachDB's unique constraint without an index of its own (for REGIONAL BY
            // ROW tables): PostgreSQL's needs one; a REGIONAL BY ROW table keeps it unique
            // across regions through a key table.
            edits.push((el[1].start, el[2].end, String::new()));
            key_at = Some(3);
        }
        if let Some(k) = key_at.filter(|k| is_punct(el.get(*k), '(')) {
            let end = closing(el, k).unwrap_or(el.len() - 1);
            for t in &el[k..end] {
                if matches!(t.word(), Some("asc" | "desc")) {
                    edits.push((t.start, t.end, String::new()));
                }
            }
            if let Some((buckets, next)) = hash_sharded(sql, el, end + 1)? {
                let shard = Shard::new(key_columns(&el[k..=end]), buckets);
                let last = el[next - 1].end;
                edits.push((
                    el[end].end,
                    last,
                    format!(" INCLUDE ({})", shard.quoted_name()),
                ));
                shards.push(shard.definition());
            }
        } else if key_at.is_none()
            && w(0) != Some("constraint")
            && w(0) != Some("check")
            && w(0) != Some("foreign")
            && w(0) != Some("exclude")
            && w(0) != Some("like")
        {
            // A column: its type name, then anything `NOT VISIBLE`.
            edits.extend(type_edit(el, 1, false));
            // `PRIMARY KEY USING HASH`: a table constraint, which can include the shard.
            for (i, t) in el.iter().enumerate() {
                if t.word() == Some("primary") && el.get(i + 1).and_then(Token::word) == Some("key")
                {
                    if let Some((buckets, next)) = hash_sharded(sql, el, i + 2)? {
                        let column = &sql[el[0].start..el[0].end];
                        let name = match &el[0].tok {
                            Tok::Word(n) | Tok::Quoted(n) => n.clone(),
                            _ => column.to_string(),
                        };
                        let shard = Shard::new(vec![name], buckets);
                        edits.push((t.start, el[next - 1].end, String::new()));
                        shards.push(shard.definition());
                        shards.push(format!(
                            "PRIMARY KEY ({column}) INCLUDE ({})",
                            shard.quoted_name()
                        ));
                    }
                }
            }
            for (i, t) in el.iter().enumerate() {
                if t.word() == Some("not") && el.get(i + 1).and_then(Token::word) == Some("visible")
                {
                    edits.push((t.start, el[i + 1].end, String::new()));
                }
            }
        }
        if edits.is_empty() {
            kept.push(text.to_string());
            continue;
        }
        changed = true;
        let (base, end) = (el[0].start, el[el.len() - 1].end);
        let edits = edits.into_iter().map(|(s, e, r)| (s - base, e - base, r));
        kept.push(apply_edits(&sql[base..end], edits.collect()));
    }
    if !changed {
        return Ok(None);
    }
    shards.dedup();
    let mut seen = std::collections::HashSet::new();
    kept.extend(shards.into_iter().filter(|s| seen.insert(s.clone())));
    let body: Vec<String> = kept.into_iter().filter(|k| !k.trim().is_empty()).collect();
    Ok(Some(Rewritten {
        sql: format!(
            "{}{}{}",
            &sql[..toks[open].end],
            body.join(", "),
            &sql[toks[close].start..]
        ),
        indexes,
    }))
}

/// The edit giving a column type at `el[at]` PostgreSQL's spelling of what CockroachDB means
/// by it, if the two differ.
///
/// `integers`: also CockroachDB's integers (the gateway's dialect only, see
/// [`cockroach_integers`]); PostgreSQL's names that mean something else there are left to
/// PostgreSQL's meaning otherwise.
pub(crate) fn type_edit(el: &[Token], at: usize, integers: bool) -> Option<(usize, usize, String)> {
    let t = el.get(at)?;
    let sized = is_punct(el.get(at + 1), '(');
    let new = match t.word()? {
        "string" if sized => "varchar",
        "string" => "text",
        "bytes" => "bytea",
        "int" | "integer" | "int64" if integers && !sized => "int8",
        "serial" | "serial2" | "serial4" | "serial8" | "smallserial" | "bigserial" if integers => {
            "int8 NOT NULL DEFAULT multiregion.unique_rowid()"
        }
        _ => return None,
    };
    Some((t.start, t.end, new.to_string()))
}

/// `ALTER TABLE`'s column types in CockroachDB's meaning (`ADD [COLUMN] [IF NOT EXISTS] c
/// type`, `ALTER [COLUMN] c [SET DATA] TYPE type`), as edits of `sql`.
pub(crate) fn alter_table_type_edits(sql: &str, integers: bool) -> Vec<(usize, usize, String)> {
    let Ok(toks) = lex(sql) else {
        return vec![];
    };
    let w = |i: usize| toks.get(i).and_then(Token::word);
    let mut edits = vec![];
    let mut depth = 0i32;
    for (i, t) in toks.iter().enumerate() {
        match t.tok {
            Tok::Punct('(') => depth += 1,
            Tok::Punct(')') => depth -= 1,
            _ => {}
        }
        if depth != 0 {
            continue;
        }
        // A column name followed by its type: after ADD, and after ALTER … TYPE.
        if w(i) == Some("add") {
            let mut k = i + 1;
            if w(k) == Some("column") {
                k += 1;
            }
            if matches!(
                w(k),
                Some("constraint" | "primary" | "unique" | "check" | "foreign" | "exclude")
            ) {
                continue;
            }
            if (w(k), w(k + 1), w(k + 2)) == (Some("if"), Some("not"), Some("exists")) {
                k += 3;
            }
            if let Some(e) = type_edit(&toks, k + 1, integers) {
                edits.push(e);
            }
        } else if w(i) == Some("type") {
            let name_before = match (w(i.wrapping_sub(1)), w(i.wrapping_sub(2))) {
                (Some("data"), Some("set")) => i.checked_sub(3),
                _ => i.checked_sub(1),
            };
            let is_alter_column = name_before.is_some_and(|n| {
                matches!(
                    toks.get(n).map(|t| &t.tok),
                    Some(Tok::Word(_) | Tok::Quoted(_))
                ) && (w(n.wrapping_sub(1)) == Some("alter")
                    || (w(n.wrapping_sub(1)) == Some("column")
                        && w(n.wrapping_sub(2)) == Some("alter")))
            });
            if is_alter_column {
                if let Some(e) = type_edit(&toks, i + 1, integers) {
                    edits.push(e);
                }
            }
        }
    }
    edits
}

/// `sql` with `edits` (byte ranges and their replacements, not overlapping) applied.
pub(crate) fn apply_edits(sql: &str, mut edits: Vec<(usize, usize, String)>) -> String {
    edits.sort_by_key(|e| e.0);
    let mut out = String::new();
    let mut copied = 0;
    for (s, e, r) in edits {
        if s < copied {
            continue;
        }
        out.push_str(&sql[copied..s]);
        out.push_str(&r);
        copied = e;
    }
    out.push_str(&sql[copied..]);
    out
}

/// `[UNIQUE | INVERTED] INDEX [name] (keys) [STORING | COVERING | INCLUDE (cols)] [WHERE pred]`
/// as `CREATE INDEX`; `at` is the token after `INDEX`.
fn index_statement(
    sql: &str,
    el: &[Token],
    mut at: usize,
    unique: bool,
    inverted: bool,
    (table_sql, table_name): (&str, &str),
) -> Result<(String, Option<String>), SyntaxError> {
    let error = |t: Option<&Token>, msg: &str| match t {
        Some(t) => SyntaxError::at(sql, t.start, msg),
        None => SyntaxError::at(sql, el[el.len() - 1].end, msg),
    };
    let mut name = String::new();
    if matches!(
        el.get(at).map(|t| &t.tok),
        Some(Tok::Word(_) | Tok::Quoted(_))
    ) {
        name = format!("{} ", &sql[el[at].start..el[at].end]);
        at += 1;
    }
    if !is_punct(el.get(at), '(') {
        let near = el.get(at).map(|t| &sql[t.start..t.end]).unwrap_or("");
        return Err(error(
            el.get(at),
            &format!("syntax error at or near \"{near}\""),
        ));
    }
    let close = closing(el, at).ok_or_else(|| error(None, "syntax error at end of input"))?;
    // An unnamed unique index is named as CockroachDB names it (PostgreSQL would say `_idx`).
    if unique && name.is_empty() {
        let columns = key_columns(&el[at..=close]);
        if !columns.is_empty() {
            name = format!(
                "{} ",
                crate::translate::ident(&format!("{table_name}_{}_key", columns.join("_")))
            );
        }
    }
    let head = format!(
        "CREATE {}INDEX {name}ON {table_sql}{} ",
        if unique { "UNIQUE " } else { "" },
        if inverted { " USING gin" } else { "" }
    );
    let tail = index_tail(sql, el, at, close)?;
    Ok((
        format!("{head}{}", tail.sql),
        tail.shard.map(|s| s.definition()),
    ))
}

/// What follows an index's column list in CockroachDB (`el[open..=close]` is the list):
/// `[USING HASH [WITH BUCKET_COUNT = n]] [STORING | COVERING | INCLUDE (cols)] [WITH
/// (bucket_count = n)] [WHERE pred]`, as PostgreSQL's `(keys) [INCLUDE (…)] [WHERE …]`.
struct IndexTail {
    sql: String,
    shard: Option<Shard>,
}

fn index_tail(
    sql: &str,
    el: &[Token],
    open: usize,
    close: usize,
) -> Result<IndexTail, SyntaxError> {
    let error = |t: Option<&Token>, msg: &str| match t {
        Some(t) => SyntaxError::at(sql, t.start, msg),
        None => SyntaxError::at(sql, el[el.len() - 1].end, msg),
    };
    let keys = &sql[el[open].start..el[close].end];
    let mut i = close + 1;
    let mut shard = None;
    if let Some((buckets, next)) = hash_sharded(sql, el, i)? {
        shard = Some(Shard::new(key_columns(&el[open..=close]), buckets));
        i = next;
    }
    let mut include = vec![];
    if matches!(
        el.get(i).and_then(Token::word),
        Some("storing" | "covering" | "include")
    ) {
        if !is_punct(el.get(i + 1), '(') {
            return Err(error(el.get(i + 1), "syntax error: expected a column list"));
        }
        let c = closing(el, i + 1).ok_or_else(|| error(None, "syntax error at end of input"))?;
        include.push(sql[el[i + 2].start..el[c].start].trim().to_string());
        i = c + 1;
    }
    if let Some(shard) = &mut shard {
        if let Some((buckets, next)) = bucket_count_parameter(sql, el, i)? {
            shard.buckets = buckets;
            i = next;
        }
        include.push(shard.quoted_name());
    }
    if el.get(i).and_then(Token::word) == Some("using") {
        return Err(error(
            el.get(i),
            "syntax error: index methods other than USING HASH are not supported here",
        ));
    }
    let mut s = keys.to_string();
    if !include.is_empty() {
        s.push_str(&format!(" INCLUDE ({})", include.join(", ")));
    }
    if el.get(i).and_then(Token::word) == Some("where") {
        s.push_str(&format!(" {}", &sql[el[i].start..el[el.len() - 1].end]));
        i = el.len();
    }
    if let Some(t) = el.get(i) {
        return Err(error(
            Some(t),
            &format!("syntax error at or near \"{}\"", &sql[t.start..t.end]),
        ));
    }
    Ok(IndexTail { sql: s, shard })
}

/// CockroachDB's default bucket count (`sql.defaults.default_hash_sharded_index_bucket_count`).
const DEFAULT_BUCKETS: u32 = 16;

/// The shard column CockroachDB adds for a hash-sharded key: named as CockroachDB names it,
/// stored, its value a hash of the key's columns modulo the bucket count. PostgreSQL keeps the
/// index ordered by the key as written and only includes the shard: its planner cannot add
/// the shard predicate CockroachDB's optimizer adds (a `(shard, key)` index would serve no
/// lookup by the key), and a range here is a whole table or partition, so spreading
/// sequential keys over key spans — sharding's purpose — does not arise.
pub struct Shard {
    columns: Vec<String>,
    buckets: u32,
}

impl Shard {
    pub fn new(columns: Vec<String>, buckets: u32) -> Shard {
        Shard { columns, buckets }
    }

    /// `crdb_internal_<columns>_shard_<buckets>`.
    pub fn name(&self) -> String {
        format!(
            "crdb_internal_{}_shard_{}",
            self.columns.join("_"),
            self.buckets
        )
    }

    pub fn quoted_name(&self) -> String {
        crate::translate::ident(&self.name())
    }

    /// `hash_record` is immutable (each column's own hash function), as a stored generated
    /// column requires; masked to 31 bits so the remainder is never negative.
    pub fn definition(&self) -> String {
        let columns: Vec<String> = self
            .columns
            .iter()
            .map(|c| crate::translate::ident(c))
            .collect();
        format!(
            "{} int4 NOT NULL GENERATED ALWAYS AS ((pg_catalog.hash_record(ROW({})) & 2147483647) % {}) STORED",
            self.quoted_name(),
            columns.join(", "),
            self.buckets
        )
    }
}

/// The column names of a key list `( a [ASC|DESC], "B" … )`, as PostgreSQL folds them.
fn key_columns(list: &[Token]) -> Vec<String> {
    let mut out = vec![];
    let mut expect_name = true;
    let mut depth = 0;
    for t in list {
        match &t.tok {
            Tok::Punct('(') => {
                depth += 1;
                if depth > 1 {
                    expect_name = false;
                }
            }
            Tok::Punct(')') => depth -= 1,
            Tok::Punct(',') if depth == 1 => expect_name = true,
            Tok::Word(w) | Tok::Quoted(w) if expect_name && depth == 1 => {
                out.push(w.clone());
                expect_name = false;
            }
            _ => {}
        }
    }
    out
}

/// `USING HASH [WITH BUCKET_COUNT = n] [WITH (bucket_count = n)]` at `el[i]`: the bucket count
/// and the token after the clause, or `None` when `el[i]` does not start one.
pub(crate) fn hash_sharded(
    sql: &str,
    el: &[Token],
    i: usize,
) -> Result<Option<(u32, usize)>, SyntaxError> {
    let w = |k: usize| el.get(k).and_then(Token::word);
    if (w(i), w(i + 1)) != (Some("using"), Some("hash")) {
        return Ok(None);
    }
    let mut k = i + 2;
    let mut buckets = DEFAULT_BUCKETS;
    if (w(k), w(k + 1)) == (Some("with"), Some("bucket_count")) {
        if !is_punct(el.get(k + 2), '=') {
            return Err(syntax_at(sql, el, k + 2));
        }
        buckets = bucket_number(sql, el, k + 3)?;
        k += 4;
    }
    if let Some((b, next)) = bucket_count_parameter(sql, el, k)? {
        buckets = b;
        k = next;
    }
    Ok(Some((buckets, k)))
}

/// `WITH (bucket_count = n)` at `el[i]`.
fn bucket_count_parameter(
    sql: &str,
    el: &[Token],
    i: usize,
) -> Result<Option<(u32, usize)>, SyntaxError> {
    let w = |k: usize| el.get(k).and_then(Token::word);
    if w(i) != Some("with") || !is_punct(el.get(i + 1), '(') {
        return Ok(None);
    }
    if w(i + 2) != Some("bucket_count") {
        return Err(syntax_at(sql, el, i + 2));
    }
    if !is_punct(el.get(i + 3), '=') {
        return Err(syntax_at(sql, el, i + 3));
    }
    let buckets = bucket_number(sql, el, i + 4)?;
    if !is_punct(el.get(i + 5), ')') {
        return Err(syntax_at(sql, el, i + 5));
    }
    Ok(Some((buckets, i + 6)))
}

fn bucket_number(sql: &str, el: &[Token], i: usize) -> Result<u32, SyntaxError> {
    let Some(Tok::Number(n)) = el.get(i).map(|t| &t.tok) else {
        return Err(syntax_at(sql, el, i));
    };
    match n.parse::<u32>() {
        Ok(b) if (2..=2048).contains(&b) => Ok(b),
        _ => Err(SyntaxError::with_code(
            sql,
            el[i].start,
            &format!("hash sharded index bucket count must be in range [2, 2048], got {n}"),
            "22023",
        )),
    }
}

fn syntax_at(sql: &str, el: &[Token], i: usize) -> SyntaxError {
    match el.get(i) {
        Some(t) => SyntaxError::at(
            sql,
            t.start,
            &format!("syntax error at or near \"{}\"", &sql[t.start..t.end]),
        ),
        None => SyntaxError::at(sql, sql.len(), "syntax error at end of input"),
    }
}

/// CockroachDB's `CREATE [UNIQUE | INVERTED] INDEX [CONCURRENTLY] [IF NOT EXISTS] [name] ON t
/// [USING method] (keys) [USING HASH …] [STORING (…)] [WHERE …]` as PostgreSQL's statements
/// (the shard column first, if hash-sharded); `None` when PostgreSQL takes it as it is.
/// `CONCURRENTLY` goes from a statement rewritten: it runs inside the transaction that
/// replicates it (CockroachDB accepts the word and changes nothing by it).
pub(crate) fn create_index(sql: &str) -> Result<Option<Vec<String>>, SyntaxError> {
    let Ok(toks) = lex(sql) else {
        return Ok(None);
    };
    let w = |k: usize| toks.get(k).and_then(Token::word);
    let mut i = 1;
    let unique = w(i) == Some("unique");
    let inverted = w(i) == Some("inverted");
    if unique || inverted {
        i += 1;
    }
    if w(i) != Some("index") {
        return Ok(None);
    }
    i += 1;
    if w(i) == Some("concurrently") {
        i += 1;
    }
    let mut if_not_exists = "";
    if (w(i), w(i + 1), w(i + 2)) == (Some("if"), Some("not"), Some("exists")) {
        if_not_exists = "IF NOT EXISTS ";
        i += 3;
    }
    let mut name = String::new();
    if w(i) != Some("on") {
        let t = toks.get(i).ok_or_else(|| syntax_at(sql, &toks, i))?;
        name = format!("{} ", &sql[t.start..t.end]);
        i += 1;
    }
    if w(i) != Some("on") {
        return Err(syntax_at(sql, &toks, i));
    }
    i += 1;
    let only = w(i) == Some("only");
    if only {
        i += 1;
    }
    let table_from = i;
    while i < toks.len() && !is_punct(toks.get(i), '(') && w(i) != Some("using") {
        i += 1;
    }
    if i == table_from || i >= toks.len() {
        return Err(syntax_at(sql, &toks, i));
    }
    let table = &sql[toks[table_from].start..toks[i - 1].end];
    let mut method = String::new();
    if w(i) == Some("using") {
        let t = toks
            .get(i + 1)
            .ok_or_else(|| syntax_at(sql, &toks, i + 1))?;
        method = format!("USING {} ", &sql[t.start..t.end]);
        i += 2;
    }
    if !is_punct(toks.get(i), '(') {
        return Err(syntax_at(sql, &toks, i));
    }
    let close = closing(&toks, i).ok_or_else(|| syntax_at(sql, &toks, toks.len()))?;
    // Only CockroachDB's own clauses make the statement ours: PostgreSQL's (`INCLUDE`,
    // `WITH (fillfactor = …)`, `TABLESPACE`, `NULLS NOT DISTINCT`) stay PostgreSQL's.
    let crdb_tail = toks[close + 1..].iter().enumerate().any(|(k, t)| {
        matches!(t.word(), Some("storing" | "covering"))
            || (t.word() == Some("using")
                && toks.get(close + 2 + k).and_then(Token::word) == Some("hash"))
    });
    if !inverted && !crdb_tail {
        return Ok(None);
    }
    if inverted {
        method = "USING gin ".into();
    }
    let tail = if crdb_tail {
        index_tail(sql, &toks, i, close)?
    } else {
        IndexTail {
            sql: sql[toks[i].start..].trim_end().to_string(),
            shard: None,
        }
    };
    let mut out = vec![];
    if let Some(shard) = &tail.shard {
        out.push(format!(
            "ALTER TABLE {}{table} ADD COLUMN IF NOT EXISTS {}",
            if only { "ONLY " } else { "" },
            shard.definition()
        ));
    }
    out.push(format!(
        "CREATE {}INDEX {if_not_exists}{name}ON {}{table} {method}{}",
        if unique { "UNIQUE " } else { "" },
        if only { "ONLY " } else { "" },
        tail.sql
    ));
    Ok(Some(out))
}

/// The gateway's CockroachDB integers in `CREATE TABLE`'s column definitions and `ALTER
/// TABLE`'s `ADD COLUMN` / `ALTER COLUMN … TYPE` (see the module's comment); `None` when the
/// statement has none.
pub(crate) fn cockroach_integers(sql: &str) -> Option<String> {
    let toks = lex(sql).ok()?;
    let w = |i: usize| toks.get(i).and_then(Token::word);
    let edits = match w(0)? {
        "alter" if w(1) == Some("table") => alter_table_type_edits(sql, true),
        "create" => {
            let table = (1..4).find(|&i| w(i) == Some("table"))?;
            let open = (table + 1..toks.len())
                .find(|&i| is_punct(toks.get(i), '(') || w(i) == Some("as"))
                .filter(|&i| is_punct(toks.get(i), '('))?;
            let close = closing(&toks, open)?;
            let mut edits = vec![];
            let (mut depth, mut from) = (0i32, open + 1);
            for j in open + 1..=close {
                match toks[j].tok {
                    Tok::Punct('(') => depth += 1,
                    Tok::Punct(')') if depth > 0 => depth -= 1,
                    Tok::Punct(',' | ')') if depth == 0 => {
                        let el = &toks[from..j];
                        let column = is_column(el);
                        if column {
                            edits.extend(type_edit(el, 1, true));
                        }
                        from = j + 1;
                    }
                    _ => {}
                }
            }
            edits
        }
        _ => return None,
    };
    (!edits.is_empty()).then(|| apply_edits(sql, edits))
}

/// Whether a `CREATE TABLE` element is a column definition (`index int` is; `INDEX (a)`,
/// `INDEX i (a)` and constraints are not; a type's modifiers are numbers: `index varchar(10)`).
fn is_column(el: &[Token]) -> bool {
    if !matches!(
        el.first().map(|t| &t.tok),
        Some(Tok::Word(_) | Tok::Quoted(_))
    ) {
        return false;
    }
    let list_after_name = |at: usize| list_after_name(el, at);
    match el[0].word() {
        Some("constraint" | "primary" | "unique" | "check" | "foreign" | "exclude" | "like") => {
            false
        }
        Some("index" | "family") => !list_after_name(1),
        Some("inverted") if el.get(1).and_then(Token::word) == Some("index") => !list_after_name(2),
        _ => true,
    }
}

/// Whether `el[at]` starts `[name] (column list)`. `INDEX` and `FAMILY` are also PostgreSQL
/// column names (`index int`, `family text`): an element is one of CockroachDB's only with a
/// column list after its optional name (`index varchar(10)` is a column: a type's modifiers
/// are numbers).
fn list_after_name(el: &[Token], at: usize) -> bool {
    let k = if matches!(
        el.get(at).map(|t| &t.tok),
        Some(Tok::Word(_) | Tok::Quoted(_))
    ) {
        at + 1
    } else {
        at
    };
    is_punct(el.get(k), '(') && !matches!(el.get(k + 1).map(|t| &t.tok), Some(Tok::Number(_)))
}
