//! CockroachDB's `CREATE TABLE` elements that PostgreSQL's grammar rejects, rewritten into
//! PostgreSQL's: inline `INDEX` / `UNIQUE INDEX` / `INVERTED INDEX` become `CREATE INDEX`
//! statements run after the table, `FAMILY` goes (PostgreSQL stores a row together), `ASC` /
//! `DESC` leave key constraints (PostgreSQL's have no order; a B-tree scans both ways), a
//! primary key named `"primary"` takes PostgreSQL's per-table name (index names are per schema
//! in PostgreSQL), `NOT VISIBLE` goes (PostgreSQL cannot hide a column from `*`), `UNIQUE
//! WITHOUT INDEX` is a unique constraint (PostgreSQL's needs its index), `AS (…) VIRTUAL`
//! columns are stored (parse.rs), and CockroachDB's type names take PostgreSQL's (`STRING` →
//! `text`, `STRING(n)` → `varchar(n)`, `BYTES` → `bytea`). `INT` keeps PostgreSQL's meaning
//! (4 bytes, not CockroachDB's 8): the same text means the same through either door.

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
    for range in elements {
        let el = &toks[range.clone()];
        if el.is_empty() {
            kept.push(String::new());
            continue;
        }
        let text = &sql[el[0].start..el[el.len() - 1].end];
        let w = |i: usize| el.get(i).and_then(Token::word);
        // `INDEX` and `FAMILY` are also PostgreSQL column names (`index int`, `family text`):
        // an element is one of CockroachDB's only with a column list after its optional name
        // (`index varchar(10)` is a column: a type's modifiers are numbers).
        let list_after_name = |at: usize| {
            let k = if matches!(
                el.get(at).map(|t| &t.tok),
                Some(Tok::Word(_) | Tok::Quoted(_))
            ) {
                at + 1
            } else {
                at
            };
            is_punct(el.get(k), '(')
                && !matches!(el.get(k + 1).map(|t| &t.tok), Some(Tok::Number(_)))
        };
        let index_at = match (w(0), w(1)) {
            (Some("index"), _) => Some((false, false, 1)),
            (Some("unique"), Some("index")) => Some((true, false, 2)),
            (Some("inverted"), Some("index")) => Some((false, true, 2)),
            _ => None,
        }
        .filter(|(_, _, at)| list_after_name(*at));
        if let Some((unique, inverted, at)) = index_at {
            indexes.push(index_statement(sql, el, at, unique, inverted, table_sql)?);
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
        } else if key_at.is_none()
            && w(0) != Some("constraint")
            && w(0) != Some("check")
            && w(0) != Some("foreign")
            && w(0) != Some("exclude")
            && w(0) != Some("like")
        {
            // A column: its type name, then anything `NOT VISIBLE`.
            if let Some(t) = el.get(1) {
                let sized = is_punct(el.get(2), '(');
                let new = match t.word() {
                    Some("string") if sized => Some("varchar"),
                    Some("string") => Some("text"),
                    Some("bytes") => Some("bytea"),
                    _ => None,
                };
                if let Some(new) = new {
                    edits.push((t.start, t.end, new.to_string()));
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
        let base = el[0].start;
        let mut out = String::new();
        let mut copied = base;
        edits.sort_by_key(|e| e.0);
        for (s, e, r) in edits {
            if s < copied {
                continue;
            }
            out.push_str(&sql[copied..s]);
            out.push_str(&r);
            copied = e;
        }
        out.push_str(&sql[copied..el[el.len() - 1].end]);
        kept.push(out);
    }
    if !changed {
        return Ok(None);
    }
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

/// `[UNIQUE | INVERTED] INDEX [name] (keys) [STORING | COVERING | INCLUDE (cols)] [WHERE pred]`
/// as `CREATE INDEX`; `at` is the token after `INDEX`.
fn index_statement(
    sql: &str,
    el: &[Token],
    mut at: usize,
    unique: bool,
    inverted: bool,
    table_sql: &str,
) -> Result<String, SyntaxError> {
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
    let keys = &sql[el[at].start..el[close].end];
    let mut s = format!(
        "CREATE {}INDEX {name}ON {table_sql}{} {keys}",
        if unique { "UNIQUE " } else { "" },
        if inverted { " USING gin" } else { "" }
    );
    let mut i = close + 1;
    if matches!(
        el.get(i).and_then(Token::word),
        Some("storing" | "covering" | "include")
    ) {
        if !is_punct(el.get(i + 1), '(') {
            return Err(error(el.get(i + 1), "syntax error: expected a column list"));
        }
        let c = closing(el, i + 1).ok_or_else(|| error(None, "syntax error at end of input"))?;
        s.push_str(&format!(" INCLUDE {}", &sql[el[i + 1].start..el[c].end]));
        i = c + 1;
    }
    if el.get(i).and_then(Token::word) == Some("using") {
        return Err(error(
            el.get(i),
            "hash-sharded and other index methods are not supported in CREATE TABLE",
        ));
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
    Ok(s)
}
