//! A PostgreSQL-compatible lexer, enough to find statement structure: identifiers (folded to
//! lower case unless quoted), string literals, numbers, punctuation and operators, with
//! comments and whitespace skipped. Every token keeps its byte span so errors can point at it
//! and rewrites can splice the original text.

use crate::SyntaxError;
use std::borrow::Cow;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tok {
    /// An unquoted word, folded to lower case (keywords are words too).
    Word(String),
    /// A double-quoted identifier, case kept, `""` unescaped.
    Quoted(String),
    /// A single-quoted string literal (also `E'…'` without escapes processed), `''` unescaped.
    Str(String),
    Number(String),
    /// One punctuation character: `( ) , ; . = @ [ ] * :` and the like.
    Punct(char),
    /// Any other operator run (`::`, `<>`, `||`, …).
    Op(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub tok: Tok,
    /// Byte offsets into the statement text.
    pub start: usize,
    pub end: usize,
}

impl Token {
    /// The lower-cased word, if this token is an unquoted word.
    pub fn word(&self) -> Option<&str> {
        match &self.tok {
            Tok::Word(w) => Some(w),
            _ => None,
        }
    }
}

const PUNCT: &str = "(),;.=@[]*:";
const OP_CHARS: &str = "+-*/<>=~!@#%^&|`?:";

pub fn lex(sql: &str) -> Result<Vec<Token>, SyntaxError> {
    let b = sql.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    while i < b.len() {
        let c = b[i];
        let start = i;
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c == b'-' && b.get(i + 1) == Some(&b'-') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            // Nested, as in PostgreSQL.
            let mut depth = 0usize;
            loop {
                if i + 1 >= b.len() {
                    return Err(SyntaxError::at(sql, start, "unterminated /* comment"));
                }
                if b[i] == b'/' && b[i + 1] == b'*' {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b[i + 1] == b'/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if c == b'\'' || ((c == b'e' || c == b'E') && b.get(i + 1) == Some(&b'\'')) {
            if c != b'\'' {
                i += 1;
            }
            let (s, next) = quoted(sql, i, b'\'')?;
            out.push(Token {
                tok: Tok::Str(s),
                start,
                end: next,
            });
            i = next;
        } else if c == b'"' {
            let (s, next) = quoted(sql, i, b'"')?;
            if s.is_empty() {
                return Err(SyntaxError::at(
                    sql,
                    start,
                    "zero-length delimited identifier",
                ));
            }
            out.push(Token {
                tok: Tok::Quoted(s),
                start,
                end: next,
            });
            i = next;
        } else if c == b'$' && b.get(i + 1).is_some_and(|d| d.is_ascii_digit()) {
            i += 1;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Op(sql[start..i].to_string()),
                start,
                end: i,
            });
        } else if c == b'$' {
            // Dollar quoting: $tag$ … $tag$.
            let tag_end = sql[i + 1..]
                .find('$')
                .map(|k| i + 1 + k)
                .ok_or_else(|| SyntaxError::at(sql, start, "unterminated dollar-quoted string"))?;
            let tag = &sql[i..=tag_end];
            if !tag[1..tag.len() - 1]
                .chars()
                .all(|ch| ch.is_alphanumeric() || ch == '_')
            {
                return Err(SyntaxError::at(sql, start, "syntax error at or near \"$\""));
            }
            let body_start = tag_end + 1;
            let close = sql[body_start..]
                .find(tag)
                .ok_or_else(|| SyntaxError::at(sql, start, "unterminated dollar-quoted string"))?;
            let body = sql[body_start..body_start + close].to_string();
            i = body_start + close + tag.len();
            out.push(Token {
                tok: Tok::Str(body),
                start,
                end: i,
            });
        } else if c.is_ascii_alphabetic() || c == b'_' || c >= 0x80 {
            while i < b.len()
                && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'$' || b[i] >= 0x80)
            {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Word(sql[start..i].to_lowercase()),
                start,
                end: i,
            });
        } else if c.is_ascii_digit()
            || (c == b'.' && b.get(i + 1).is_some_and(|d| d.is_ascii_digit()))
        {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.' || b[i] == b'_') {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Number(sql[start..i].to_string()),
                start,
                end: i,
            });
        } else if c == b':' && b.get(i + 1) == Some(&b':') {
            i += 2;
            out.push(Token {
                tok: Tok::Op("::".into()),
                start,
                end: i,
            });
        } else if PUNCT.as_bytes().contains(&c)
            && !(OP_CHARS.as_bytes().contains(&c)
                && b.get(i + 1)
                    .is_some_and(|n| OP_CHARS.as_bytes().contains(n)))
        {
            i += 1;
            out.push(Token {
                tok: Tok::Punct(c as char),
                start,
                end: i,
            });
        } else if OP_CHARS.as_bytes().contains(&c) {
            while i < b.len() && OP_CHARS.as_bytes().contains(&b[i]) {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Op(sql[start..i].to_string()),
                start,
                end: i,
            });
        } else {
            let ch = sql[i..].chars().next().unwrap_or('?');
            return Err(SyntaxError::at(
                sql,
                start,
                &format!("syntax error at or near \"{ch}\""),
            ));
        }
    }
    Ok(out)
}

/// Reads a `q`-quoted run starting at `i` (the opening quote); doubled quotes stand for one.
/// Returns the content and the offset after the closing quote.
fn quoted(sql: &str, i: usize, q: u8) -> Result<(String, usize), SyntaxError> {
    let b = sql.as_bytes();
    let mut j = i + 1;
    let mut s = String::new();
    let mut run = j;
    loop {
        if j >= b.len() {
            let what = if q == b'"' {
                "quoted identifier"
            } else {
                "quoted string"
            };
            return Err(SyntaxError::at(sql, i, &format!("unterminated {what}")));
        }
        if b[j] == q {
            s.push_str(&sql[run..j]);
            if b.get(j + 1) == Some(&q) {
                s.push(q as char);
                j += 2;
                run = j;
                continue;
            }
            return Ok((s, j + 1));
        }
        j += 1;
    }
}

/// The statement a `PREPARE name [(types)] AS statement` prepares or a `DECLARE name …
/// CURSOR … FOR statement` runs, as text; `None` for any other statement. PostgreSQL gives an
/// EXECUTE's or a cursor's query the whole PREPARE or DECLARE as its text, and a statement
/// forwarded to another node must be the inner one.
pub fn prepared_statement(sql: &str) -> Option<&str> {
    let toks = lex(sql).ok()?;
    let mut it = toks.iter().peekable();
    let first = it.next()?.word()?;
    if first == "declare" {
        // DECLARE name [BINARY] [[NO] SCROLL] [ASENSITIVE | INSENSITIVE] CURSOR
        // [{WITH | WITHOUT} HOLD] FOR query: options are words only.
        match &it.next()?.tok {
            Tok::Word(_) | Tok::Quoted(_) => {}
            _ => return None,
        }
        for t in it.by_ref() {
            match t.word()? {
                "for" => return it.next().map(|body| &sql[body.start..]),
                "binary" | "no" | "scroll" | "asensitive" | "insensitive" | "cursor" | "with"
                | "without" | "hold" => {}
                _ => return None,
            }
        }
        return None;
    }
    if first != "prepare" {
        return None;
    }
    match &it.next()?.tok {
        Tok::Word(_) | Tok::Quoted(_) => {}
        _ => return None,
    }
    if matches!(it.peek()?.tok, Tok::Punct('(')) {
        let mut depth = 0usize;
        for t in it.by_ref() {
            match t.tok {
                Tok::Punct('(') => depth += 1,
                Tok::Punct(')') => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    if it.next()?.word()? != "as" {
        return None;
    }
    let body = it.next()?;
    Some(&sql[body.start..])
}

/// The query a statement runs whose text is more than that query, as text: a PREPARE's or a
/// cursor's ([`prepared_statement`]), `COPY (query) TO …`'s, `CREATE [TEMP | UNLOGGED]
/// TABLE … AS query [WITH [NO] DATA]`'s, and `SELECT … INTO [TEMP] [TABLE] name …`'s
/// without its INTO clause; `None` for any other statement. PostgreSQL plans
/// these queries with the whole statement as their source text, and a query sent to another
/// node to run there must be the inner one.
pub fn query_of(sql: &str) -> Option<Cow<'_, str>> {
    if let Some(q) = prepared_statement(sql) {
        return Some(Cow::Borrowed(q));
    }
    let toks = lex(sql).ok()?;
    let mut toks = toks.as_slice();
    while let [rest @ .., last] = toks {
        if matches!(last.tok, Tok::Punct(';')) {
            toks = rest;
        } else {
            break;
        }
    }
    let is_query = |t: &Token| {
        matches!(t.word(), Some("select" | "with" | "values" | "table"))
            || matches!(t.tok, Tok::Punct('('))
    };
    match toks.first()?.word()? {
        "copy" => {
            // COPY ( query ) TO …: the query is what the parentheses hold.
            if !matches!(toks.get(1)?.tok, Tok::Punct('(')) {
                return None;
            }
            let close = 1 + matching_paren(&toks[1..])?;
            if close < 3 || toks.get(close + 1)?.word() != Some("to") || !is_query(&toks[2]) {
                return None;
            }
            Some(Cow::Borrowed(&sql[toks[2].start..toks[close - 1].end]))
        }
        "create" => {
            // CREATE [GLOBAL | LOCAL] [TEMP | TEMPORARY | UNLOGGED] TABLE …: not a view or a
            // materialized view (those keep their query).
            let mut i = 1;
            while matches!(
                toks.get(i)?.word(),
                Some("global" | "local" | "temp" | "temporary" | "unlogged")
            ) {
                i += 1;
            }
            if toks.get(i)?.word() != Some("table") {
                return None;
            }
            // The first AS outside parentheses (a column list, WITH (…) options) starts the
            // query; a name cannot be an unquoted AS.
            let mut depth = 0usize;
            let as_at = loop {
                i += 1;
                match &toks.get(i)?.tok {
                    Tok::Punct('(') => depth += 1,
                    Tok::Punct(')') => depth = depth.checked_sub(1)?,
                    Tok::Word(w) if depth == 0 && w == "as" => break i,
                    _ => {}
                }
            };
            let mut body = toks.get(as_at + 1..)?;
            if !is_query(body.first()?) {
                // AS EXECUTE runs a prepared statement, which is no query text.
                return None;
            }
            let words: Vec<Option<&str>> = body.iter().rev().take(3).map(Token::word).collect();
            if words.starts_with(&[Some("data"), Some("no"), Some("with")]) {
                body = &body[..body.len() - 3];
            } else if words.starts_with(&[Some("data"), Some("with")]) {
                body = &body[..body.len() - 2];
            }
            Some(Cow::Borrowed(&sql[body.first()?.start..body.last()?.end]))
        }
        "select" | "with" => {
            // SELECT … INTO [TEMPORARY | TEMP | UNLOGGED] [TABLE] name …: the INTO clause,
            // outside parentheses, names the table to create; the rest is the query.
            // A WITH's main statement may be an INSERT INTO or a MERGE INTO instead: no
            // SELECT INTO then.
            let mut depth = 0usize;
            let into = toks.iter().position(|t| {
                match &t.tok {
                    Tok::Punct('(') => depth += 1,
                    Tok::Punct(')') => depth = depth.saturating_sub(1),
                    Tok::Word(w) if depth == 0 => {
                        return matches!(
                            w.as_str(),
                            "into" | "insert" | "update" | "delete" | "merge"
                        )
                    }
                    _ => {}
                }
                false
            })?;
            if toks[into].word() != Some("into") {
                return None;
            }
            let mut i = into + 1;
            while matches!(
                toks.get(i)?.word(),
                Some("global" | "local" | "temp" | "temporary" | "unlogged" | "table")
            ) {
                i += 1;
            }
            // The table's name: one or more identifiers joined by dots.
            loop {
                if !matches!(toks.get(i)?.tok, Tok::Word(_) | Tok::Quoted(_)) {
                    return None;
                }
                i += 1;
                match toks.get(i) {
                    Some(t) if matches!(t.tok, Tok::Punct('.')) => i += 1,
                    _ => break,
                }
            }
            let end = toks.get(i).map_or(sql.len(), |t| t.start);
            let last = toks.last()?.end;
            Some(Cow::Owned(format!(
                "{}{}",
                &sql[toks[0].start..toks[into].start],
                &sql[end..last.max(end)]
            )))
        }
        _ => None,
    }
}

/// The index of the `)` closing the `(` that `toks` starts with.
fn matching_paren(toks: &[Token]) -> Option<usize> {
    let mut depth = 0usize;
    for (i, t) in toks.iter().enumerate() {
        match t.tok {
            Tok::Punct('(') => depth += 1,
            Tok::Punct(')') => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// The text of an INSERT's `ON CONFLICT …` clause as written, to carry it to the INSERT that
/// writes the statement's rows for partitions leased on another node: from byte `start` of
/// `sql` (the parser's location of its ON) to the statement's end, or, with `returning_at`
/// (the parser's location of the RETURNING list's first item), to the RETURNING keyword
/// before it. `None` when the clause uses a parameter (`$1`): that INSERT has parameters of
/// its own.
pub fn on_conflict_clause(sql: &str, start: usize, returning_at: Option<usize>) -> Option<&str> {
    let end = returning_at.unwrap_or(sql.len()).min(sql.len());
    let toks = lex(sql.get(start..end)?).ok()?;
    let mut toks = toks.as_slice();
    while let [rest @ .., last] = toks {
        if matches!(last.tok, Tok::Punct(';')) {
            toks = rest;
        } else {
            break;
        }
    }
    if returning_at.is_some() {
        match toks {
            [rest @ .., last] if last.word() == Some("returning") => toks = rest,
            _ => return None,
        }
    }
    let (first, last) = (toks.first()?, toks.last()?);
    if first.word() != Some("on")
        || toks
            .iter()
            .any(|t| matches!(&t.tok, Tok::Op(o) if o.starts_with('$')))
    {
        return None;
    }
    Some(&sql[start + first.start..start + last.end])
}

#[cfg(test)]
mod on_conflict_tests {
    use super::on_conflict_clause;

    #[test]
    fn the_clause_runs_to_the_end_or_to_returning() {
        let sql =
            "INSERT INTO t AS x VALUES (1, 'a') ON CONFLICT (id) DO UPDATE SET v = excluded.v;";
        let at = sql.find("ON CONFLICT").unwrap();
        assert_eq!(
            on_conflict_clause(sql, at, None),
            Some("ON CONFLICT (id) DO UPDATE SET v = excluded.v")
        );
        let sql = "insert into t values (1) on conflict do nothing\n returning id, 'returning'";
        let at = sql.find("on conflict").unwrap();
        let ret = sql.find("id, 'ret").unwrap();
        assert_eq!(
            on_conflict_clause(sql, at, Some(ret)),
            Some("on conflict do nothing")
        );
    }

    #[test]
    fn keywords_inside_strings_and_comments_do_not_end_it() {
        let sql = "INSERT INTO t VALUES (1) ON CONFLICT (id) DO UPDATE SET v = 'RETURNING' /* RETURNING */ RETURNING *";
        let at = sql.find("ON CONFLICT").unwrap();
        let ret = sql.rfind('*').unwrap();
        assert_eq!(
            on_conflict_clause(sql, at, Some(ret)),
            Some("ON CONFLICT (id) DO UPDATE SET v = 'RETURNING'")
        );
    }

    #[test]
    fn a_clause_with_parameters_cannot_travel() {
        let sql = "INSERT INTO t VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET v = $2";
        let at = sql.find("ON CONFLICT").unwrap();
        assert_eq!(on_conflict_clause(sql, at, None), None);
        // A dollar-quoted string is no parameter.
        let sql = "INSERT INTO t VALUES (1) ON CONFLICT (id) DO UPDATE SET v = $$x$$";
        let at = sql.find("ON CONFLICT").unwrap();
        assert!(on_conflict_clause(sql, at, None).is_some());
    }

    #[test]
    fn a_location_that_is_not_the_clause_gives_nothing() {
        assert_eq!(
            on_conflict_clause("INSERT INTO t VALUES (1)", 7, None),
            None
        );
        assert_eq!(on_conflict_clause("INSERT", 99, None), None);
    }
}

#[cfg(test)]
mod prepared_tests {
    use super::prepared_statement;

    #[test]
    fn a_prepare_yields_its_inner_statement() {
        assert_eq!(
            prepared_statement("PREPARE q(int) AS SELECT * FROM t WHERE id = $1 FOR UPDATE"),
            Some("SELECT * FROM t WHERE id = $1 FOR UPDATE")
        );
        assert_eq!(
            prepared_statement(
                "prepare \"Q\" (numeric(10, 2), text[]) as\n  INSERT INTO t VALUES ($1, $2)"
            ),
            Some("INSERT INTO t VALUES ($1, $2)")
        );
        assert_eq!(
            prepared_statement("/* c */ PREPARE q AS UPDATE t SET a = 'as'"),
            Some("UPDATE t SET a = 'as'")
        );
    }

    #[test]
    fn a_cursor_declaration_yields_its_query() {
        assert_eq!(
            prepared_statement("DECLARE c NO SCROLL CURSOR WITH HOLD FOR SELECT id FROM t"),
            Some("SELECT id FROM t")
        );
        assert_eq!(
            prepared_statement("declare \"C\" cursor for\n  select 1"),
            Some("select 1")
        );
        assert_eq!(prepared_statement("DECLARE c CURSOR FOR"), None);
        assert_eq!(prepared_statement("DECLARE c TABLE FOR SELECT 1"), None);
    }

    #[test]
    fn other_statements_are_not_prepares() {
        assert_eq!(prepared_statement("SELECT 1"), None);
        assert_eq!(prepared_statement("PREPARE"), None);
        assert_eq!(prepared_statement("PREPARE q(int"), None);
        assert_eq!(prepared_statement("PREPARE TRANSACTION 'x'"), None);
    }
}

#[cfg(test)]
mod query_of_tests {
    fn query_of(sql: &str) -> Option<String> {
        super::query_of(sql).map(|q| q.into_owned())
    }

    #[test]
    fn a_copy_of_a_query_yields_the_query() {
        assert_eq!(
            query_of("COPY (SELECT id, f(x) FROM t WHERE s = ')') TO STDOUT WITH (FORMAT csv);"),
            Some("SELECT id, f(x) FROM t WHERE s = ')'".into())
        );
        assert_eq!(
            query_of("copy ( (select 1) union all (select 2) ) to stdout"),
            Some("(select 1) union all (select 2)".into())
        );
        assert_eq!(
            query_of("COPY (WITH w AS (SELECT 1) SELECT * FROM w) TO '/tmp/x'"),
            Some("WITH w AS (SELECT 1) SELECT * FROM w".into())
        );
    }

    #[test]
    fn a_create_table_as_yields_its_query_without_the_data_clause() {
        assert_eq!(
            query_of("CREATE TABLE c AS SELECT id FROM t"),
            Some("SELECT id FROM t".into())
        );
        assert_eq!(
            query_of(
                "create unlogged table if not exists s.c (a, b) with (fillfactor = 70) as \n  table t with no data;"
            ),
            Some("table t".into())
        );
        assert_eq!(
            query_of("CREATE TEMP TABLE c AS WITH x AS (SELECT 1 AS a) SELECT a FROM x WITH DATA"),
            Some("WITH x AS (SELECT 1 AS a) SELECT a FROM x".into())
        );
        assert_eq!(
            query_of("CREATE TABLE \"as\" AS VALUES (1, 'as')"),
            Some("VALUES (1, 'as')".into())
        );
    }

    #[test]
    fn statements_that_are_their_query_or_run_none_yield_nothing() {
        assert_eq!(query_of("SELECT 1"), None);
        assert_eq!(query_of("COPY t TO STDOUT"), None);
        assert_eq!(query_of("COPY t (a, b) FROM STDIN"), None);
        assert_eq!(query_of("CREATE TABLE c AS EXECUTE q(1)"), None);
        assert_eq!(query_of("CREATE TABLE c (a int)"), None);
        assert_eq!(query_of("CREATE MATERIALIZED VIEW v AS SELECT 1"), None);
        assert_eq!(query_of("CREATE VIEW v AS SELECT 1"), None);
        assert_eq!(query_of("COPY (SELECT 1"), None);
    }

    #[test]
    fn a_select_into_yields_the_select_without_its_into_clause() {
        assert_eq!(
            query_of("SELECT id, v INTO TEMP TABLE s.\"T\" FROM t WHERE v IN (SELECT 1);"),
            Some("SELECT id, v FROM t WHERE v IN (SELECT 1)".into())
        );
        assert_eq!(
            query_of("WITH w AS (SELECT 1 AS a) SELECT a INTO c FROM w"),
            Some("WITH w AS (SELECT 1 AS a) SELECT a FROM w".into())
        );
        assert_eq!(query_of("select 1 into c"), Some("select 1 ".into()));
        assert_eq!(query_of("SELECT a FROM (SELECT 1 AS a) x"), None);
        assert_eq!(
            query_of("WITH x AS (SELECT 1 AS a) INSERT INTO t SELECT a FROM x"),
            None
        );
        assert_eq!(
            query_of("WITH x AS (SELECT 1 AS a) MERGE INTO t USING x ON t.a = x.a WHEN MATCHED THEN DELETE"),
            None
        );
        assert_eq!(
            query_of("WITH d AS (DELETE FROM t RETURNING a) INSERT INTO u SELECT a FROM d"),
            None
        );
        assert_eq!(query_of("SELECT a FROM t FOR UPDATE"), None);
        assert_eq!(query_of("SELECT 1 INTO"), None);
    }

    #[test]
    fn prepares_and_cursors_still_yield_theirs() {
        assert_eq!(
            query_of("DECLARE c CURSOR FOR SELECT 1"),
            Some("SELECT 1".into())
        );
    }
}
