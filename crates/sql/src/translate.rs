//! What pgmr's SQL gateway does to a query string before PostgreSQL sees it.
//!
//! Statements PostgreSQL's parser would reject but CockroachDB accepts become PostgreSQL
//! statements that reach the mechanism the native door uses (`multiregion.execute`); every
//! other statement passes byte for byte. Errors found here are raised *by PostgreSQL*
//! (`multiregion.raise_error`), in the statement's place, so that the transaction state the
//! client sees is always PostgreSQL's own: a rejected statement inside `BEGIN` aborts the
//! transaction exactly as a PostgreSQL error would.

use crate::lex::{lex, Tok, Token};
use crate::{parse, CreateTarget, ObjectName, ShowRegions, Statement};

/// How the gateway presents one statement's result to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Present {
    /// As PostgreSQL reports it.
    AsIs,
    /// A statement the gateway rewrote: its command tag becomes `tag` (keeping a row count if
    /// PostgreSQL's tag has one and `keep_count`), and an error loses the context and position
    /// fields, which describe the rewritten text rather than the client's.
    Rewritten {
        tag: Option<String>,
        keep_count: bool,
    },
}

impl Present {
    fn tag(tag: &str) -> Present {
        Present::Rewritten {
            tag: Some(tag.to_string()),
            keep_count: false,
        }
    }
    const ERROR: Present = Present::Rewritten {
        tag: None,
        keep_count: false,
    };

    /// The command tag to send for PostgreSQL's `pg_tag`.
    pub fn command_tag(&self, pg_tag: &str) -> String {
        match self {
            Present::Rewritten {
                tag: Some(t),
                keep_count: true,
            } => match pg_tag.rsplit_once(' ') {
                Some((_, n)) if n.bytes().all(|b| b.is_ascii_digit()) => format!("{t} {n}"),
                _ => t.clone(),
            },
            Present::Rewritten { tag: Some(t), .. } => t.clone(),
            _ => pg_tag.to_string(),
        }
    }
}

/// What to do with one query string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing to change: send it as it is.
    Unchanged,
    /// Send the assembled text instead; present each statement's result as listed, in order.
    Rewritten(Translation),
    /// `USE db` (or `SET database = db`), alone in the query: switch the session's database.
    Use(String),
    /// `CREATE DATABASE … PRIMARY REGION …`, alone in the query: create the database with
    /// `create` (PostgreSQL's statement, which cannot run inside a function), then run
    /// `configure` (the client's statement) through `multiregion.execute` connected to it.
    CreateDatabase {
        name: String,
        create: String,
        configure: String,
        /// `IF NOT EXISTS`: an existing database is a notice, not an error.
        if_not_exists: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Translation {
    pieces: Vec<Piece>,
    /// One per statement PostgreSQL will run, in order.
    pub presents: Vec<Present>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Upsert(Upsert),
}

impl Translation {
    /// The `UPSERT` statements whose tables must be looked up before [`Translation::assemble`].
    pub fn upserts(&self) -> impl Iterator<Item = &Upsert> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Upsert(u) => Some(u),
            Piece::Text(_) => None,
        })
    }

    /// The text to send. `columns` answers, for each upsert's table, its columns (or why it
    /// cannot be upserted into, which becomes that statement's error).
    pub fn assemble(
        &self,
        mut columns: impl FnMut(&ObjectName) -> Result<Vec<Column>, String>,
    ) -> String {
        let mut out = String::new();
        for p in &self.pieces {
            match p {
                Piece::Text(t) => out.push_str(t),
                Piece::Upsert(u) => match columns(&u.table).and_then(|c| u.to_insert(&c)) {
                    Ok(sql) => out.push_str(&sql),
                    Err(message) => out.push_str(&raise("0A000", &message, None)),
                },
            }
        }
        out
    }
}

/// A column of a table an `UPSERT` writes, as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub primary_key: bool,
    /// Computed (`GENERATED ALWAYS AS … STORED`): never written directly.
    pub generated: bool,
    /// Left out of `SELECT *` (REGIONAL BY ROW's `crdb_region`).
    pub hidden: bool,
    /// The region column of a REGIONAL BY ROW table: in PostgreSQL's primary key (the
    /// partitions need it), not in CockroachDB's, which is unique across regions.
    pub region: bool,
}

/// `UPSERT INTO t [AS a] [(cols)] source [RETURNING …]`, split where the `ON CONFLICT` clause
/// of the equivalent `INSERT` goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upsert {
    pub table: ObjectName,
    /// `INSERT INTO t [AS a] [(cols)] source`.
    head: String,
    columns: Option<Vec<String>>,
    /// ` RETURNING …` or empty.
    returning: String,
}

impl Upsert {
    /// CockroachDB's UPSERT: insert, or on a primary-key conflict overwrite the columns the
    /// statement names (every writable column when it names none). A REGIONAL BY ROW table's
    /// key leaves out its region column: the extension then finds the row in whichever
    /// region holds it (`multiregion.conflict_region`).
    fn to_insert(&self, table: &[Column]) -> Result<String, String> {
        let name = self.table.0.join(".");
        let mut key: Vec<&Column> = table
            .iter()
            .filter(|c| c.primary_key && !c.region)
            .collect();
        if key.is_empty() {
            key = table.iter().filter(|c| c.primary_key).collect();
        }
        if key.is_empty() {
            return Err(format!(
                "UPSERT needs a primary key: table \"{name}\" has none"
            ));
        }
        let targets: Vec<&str> = match &self.columns {
            Some(cols) => cols.iter().map(String::as_str).collect(),
            None => table
                .iter()
                .filter(|c| !c.generated && !c.hidden)
                .map(|c| c.name.as_str())
                .collect(),
        };
        let set: Vec<String> = targets
            .iter()
            .filter(|t| !key.iter().any(|k| k.name == **t))
            .map(|t| format!("{c} = excluded.{c}", c = ident(t)))
            .collect();
        let conflict = key
            .iter()
            .map(|k| ident(&k.name))
            .collect::<Vec<_>>()
            .join(", ");
        // With only key columns named, CockroachDB leaves the row as it is but still counts
        // it: a no-op update does the same.
        let set = if set.is_empty() {
            vec![format!("{c} = excluded.{c}", c = ident(&key[0].name))]
        } else {
            set
        };
        let action = format!("DO UPDATE SET {}", set.join(", "));
        Ok(format!(
            "{} ON CONFLICT ({conflict}) {action}{}",
            self.head, self.returning
        ))
    }
}

/// Words at least one of which every statement this module rewrites contains (`[SHOW …]`,
/// `USE`, `UPSERT`, `… DATABASE …`, `LOCALITY`, computed `… STORED`, `AS OF SYSTEM TIME`):
/// text with none of them is PostgreSQL's, and is passed on without being lexed.
const TRIGGERS: &[&[u8]] = &[
    b"show",
    b"use",
    b"upsert",
    b"rehoming",
    b"database",
    b"locality",
    b"stored",
    b"system",
    b"cluster",
    b"table",
    b"index",
    b"zone",
];

fn may_need_translation(sql: &str) -> bool {
    let b = sql.as_bytes();
    TRIGGERS
        .iter()
        .any(|t| b.windows(t.len()).any(|w| w.eq_ignore_ascii_case(t)))
}

/// Translates one simple-protocol query string (several statements allowed).
pub fn translate(sql: &str) -> Outcome {
    if !may_need_translation(sql) {
        return Outcome::Unchanged;
    }
    let Ok(toks) = lex(sql) else {
        return Outcome::Unchanged;
    };
    // SQL-standard function bodies (`BEGIN ATOMIC … END`) hold semicolons this splitter does
    // not track; such strings are PostgreSQL's alone.
    if toks
        .windows(2)
        .any(|w| w[0].word() == Some("begin") && w[1].word() == Some("atomic"))
    {
        return Outcome::Unchanged;
    }
    let stmts: Vec<&[Token]> = toks
        .split(|t| t.tok == Tok::Punct(';'))
        .filter(|s| !s.is_empty())
        .collect();
    let mut pieces = Vec::new();
    let mut presents = Vec::new();
    let mut copied = 0;
    let mut changed = false;
    let alone = stmts.len() == 1;
    for st in &stmts {
        let (start, end) = (st[0].start, st[st.len() - 1].end);
        let text = &sql[start..end];
        let action = statement(text, alone);
        let piece = match action {
            Action::Keep => {
                presents.push(Present::AsIs);
                continue;
            }
            Action::Use(db) => return Outcome::Use(db),
            Action::CreateDatabase {
                name,
                create,
                if_not_exists,
            } => {
                return Outcome::CreateDatabase {
                    name,
                    create,
                    configure: text.to_string(),
                    if_not_exists,
                }
            }
            Action::Replace(new, present) => {
                presents.push(present);
                Piece::Text(new)
            }
            Action::Upsert(u) => {
                presents.push(Present::Rewritten {
                    tag: None,
                    keep_count: false,
                });
                Piece::Upsert(u)
            }
        };
        changed = true;
        pieces.push(Piece::Text(sql[copied..start].to_string()));
        pieces.push(piece);
        copied = end;
    }
    if !changed {
        return Outcome::Unchanged;
    }
    pieces.push(Piece::Text(sql[copied..].to_string()));
    Outcome::Rewritten(Translation { pieces, presents })
}

/// Translates one extended-protocol statement (a Parse message): the same rewrites, with the
/// statements that must stand alone in a simple query refused.
pub fn translate_one(sql: &str) -> Outcome {
    match translate(sql) {
        Outcome::Use(_) => refused(
            "USE",
            "send USE as a simple query (psql, or your driver's non-prepared execute)",
        ),
        Outcome::CreateDatabase { .. } => refused(
            "CREATE DATABASE with regions",
            "send it as a simple query, or create the database first and then run ALTER DATABASE … PRIMARY REGION",
        ),
        other => other,
    }
}

/// `CREATE DATABASE … PRIMARY REGION …`: refused as CockroachDB refuses it, before anything
/// is created; else the gateway creates the database, then configures it from inside.
fn create_database(s: Statement, alone: bool) -> Action {
    let Statement::CreateDatabase {
        name,
        if_not_exists,
        primary_region,
        regions,
        survival,
        ..
    } = s
    else {
        unreachable!("called for CREATE DATABASE only")
    };
    if let Err(e) =
        mr_zoneconfig::ddl::check_create_database(primary_region.as_deref(), &regions, survival)
    {
        return Action::Replace(
            raise(e.sqlstate, &e.message, e.hint.as_deref()),
            Present::ERROR,
        );
    }
    if !alone {
        return Action::Replace(
            raise(
                "25001",
                "CREATE DATABASE cannot be executed within a multi-statement query",
                Some("send CREATE DATABASE … PRIMARY REGION … as a query of its own"),
            ),
            Present::ERROR,
        );
    }
    Action::CreateDatabase {
        create: format!("CREATE DATABASE {}", ident(&name)),
        name,
        if_not_exists,
    }
}

/// CockroachDB's session variables that the extension keeps as `multiregion.` settings.
const SESSION_VARIABLES: &[&str] = &["enable_auto_rehoming", "override_multi_region_zone_config"];

/// `SET [SESSION | LOCAL] v …`, `RESET v`, `SHOW v` of one of [`SESSION_VARIABLES`], as the
/// extension's setting.
fn session_variable(text: &str, toks: &[Token]) -> Option<Action> {
    let first = toks.first()?.word()?;
    let mut at = 1;
    if first == "set" && matches!(toks.get(1).and_then(Token::word), Some("session" | "local")) {
        at = 2;
    }
    let t = toks.get(at)?;
    let name = t.word().filter(|n| SESSION_VARIABLES.contains(n))?;
    if matches!(toks.get(at + 1).map(|t| &t.tok), Some(Tok::Punct('.'))) {
        return None;
    }
    if first == "show" {
        if toks.len() != 2 {
            return None;
        }
        return Some(Action::Replace(
            format!("SELECT pg_catalog.current_setting('multiregion.{name}') AS {name}"),
            Present::tag("SHOW"),
        ));
    }
    Some(Action::Replace(
        format!("{}multiregion.{name}{}", &text[..t.start], &text[t.end..]),
        Present::AsIs,
    ))
}

fn refused(what: &str, hint: &str) -> Outcome {
    Outcome::Rewritten(Translation {
        pieces: vec![Piece::Text(raise(
            "0A000",
            &format!("{what} is not supported in a prepared statement"),
            Some(hint),
        ))],
        presents: vec![Present::ERROR],
    })
}

enum Action {
    Keep,
    Replace(String, Present),
    Upsert(Upsert),
    Use(String),
    CreateDatabase {
        name: String,
        create: String,
        if_not_exists: bool,
    },
}

fn statement(text: &str, alone: bool) -> Action {
    // Offsets are into the whole query; the statement's own tokens have local ones.
    let Ok(toks) = lex(text) else {
        return Action::Keep;
    };
    let w: Vec<Option<&str>> = toks.iter().map(|t| t.word()).collect();
    if w.windows(4)
        .any(|x| x == [Some("as"), Some("of"), Some("system"), Some("time")])
    {
        return Action::Replace(
            raise(
                "0A000",
                "unimplemented: AS OF SYSTEM TIME is not supported yet",
                Some("historical and follower reads are not implemented in this release; run the statement without AS OF SYSTEM TIME to read current data"),
            ),
            Present::ERROR,
        );
    }
    match w.first().copied().flatten() {
        Some("use") => {
            return match database_name(&toks[1..]) {
                Some(db) => use_database(db, alone),
                None => syntax_error(text, &toks, 1.min(toks.len())),
            }
        }
        Some("set")
            if w.get(1) == Some(&Some("database"))
                && (matches!(toks.get(2).map(|t| &t.tok), Some(Tok::Punct('=')))
                    || w.get(2) == Some(&Some("to"))) =>
        {
            return match database_name(&toks[3..]) {
                Some(db) => use_database(db, alone),
                None => syntax_error(text, &toks, 3.min(toks.len())),
            };
        }
        Some("upsert") => return upsert(text, &toks),
        Some("show") if w.get(1) == Some(&Some("database")) && toks.len() == 2 => {
            return Action::Replace(
                "SELECT pg_catalog.current_database()::text AS database".into(),
                Present::tag("SHOW"),
            )
        }
        Some("set" | "reset" | "show") => {
            if let Some(action) = session_variable(text, &toks) {
                return action;
            }
        }
        _ => {}
    }
    // CockroachDB's integer types, which PostgreSQL would take for its own (4 bytes, a
    // sequence): the gateway's statements mean CockroachDB's.
    let integers = crate::table::cockroach_integers(text);
    let text = integers.as_deref().unwrap_or(text);
    match parse(text) {
        Err(e) => Action::Replace(raise(e.sqlstate, &e.message, None), Present::ERROR),
        Ok(Some(s @ Statement::CreateDatabase { .. })) => create_database(s, alone),
        Ok(Some(s)) => match show_select(text, &s) {
            Some(select) => Action::Replace(select, show_present(&s)),
            None => Action::Replace(
                format!("CALL multiregion.exec({})", literal(text)),
                Present::tag(s.tag()),
            ),
        },
        Ok(None) if integers.is_some() => Action::Replace(text.to_string(), Present::AsIs),
        Ok(None) => match bracket_shows(text, &toks) {
            Some(new) => Action::Replace(
                new,
                Present::Rewritten {
                    tag: None,
                    keep_count: false,
                },
            ),
            None => Action::Keep,
        },
    }
}

fn use_database(db: String, alone: bool) -> Action {
    if alone {
        Action::Use(db)
    } else {
        Action::Replace(
            raise(
                "25001",
                "USE cannot be combined with other statements in one query",
                Some("send USE as a query of its own"),
            ),
            Present::ERROR,
        )
    }
}

/// A lone identifier (or string) naming a database.
fn database_name(toks: &[Token]) -> Option<String> {
    match toks {
        [Token {
            tok: Tok::Word(w), ..
        }] => Some(w.clone()),
        [Token {
            tok: Tok::Quoted(q) | Tok::Str(q),
            ..
        }] => Some(q.clone()),
        _ => None,
    }
}

fn syntax_error(text: &str, toks: &[Token], at: usize) -> Action {
    let near = toks
        .get(at)
        .map(|t| format!("syntax error at or near \"{}\"", &text[t.start..t.end]))
        .unwrap_or_else(|| "syntax error at end of input".into());
    Action::Replace(raise("42601", &near, None), Present::ERROR)
}

fn upsert(text: &str, toks: &[Token]) -> Action {
    let mut i = 1;
    if toks.get(i).and_then(|t| t.word()) != Some("into") {
        return syntax_error(text, toks, i);
    }
    i += 1;
    // The table name: a dotted sequence of identifiers.
    let mut table = Vec::new();
    loop {
        match toks.get(i).map(|t| &t.tok) {
            Some(Tok::Word(w)) => table.push(w.clone()),
            Some(Tok::Quoted(q)) => table.push(q.clone()),
            _ => return syntax_error(text, toks, i),
        }
        i += 1;
        if toks.get(i).map(|t| &t.tok) == Some(&Tok::Punct('.')) {
            i += 1;
        } else {
            break;
        }
    }
    if toks.get(i).and_then(|t| t.word()) == Some("as") {
        i += 2;
    }
    let mut columns = None;
    if toks.get(i).map(|t| &t.tok) == Some(&Tok::Punct('(')) {
        // A column list, unless the parenthesis opens the source (`(SELECT …)`).
        let first = toks.get(i + 1).and_then(|t| t.word());
        if !matches!(first, Some("select" | "values" | "with")) {
            let mut cols = Vec::new();
            i += 1;
            loop {
                match toks.get(i).map(|t| &t.tok) {
                    Some(Tok::Word(w)) => cols.push(w.clone()),
                    Some(Tok::Quoted(q)) => cols.push(q.clone()),
                    _ => return syntax_error(text, toks, i),
                }
                i += 1;
                match toks.get(i).map(|t| &t.tok) {
                    Some(Tok::Punct(',')) => i += 1,
                    Some(Tok::Punct(')')) => {
                        i += 1;
                        break;
                    }
                    _ => return syntax_error(text, toks, i),
                }
            }
            columns = Some(cols);
        }
    }
    if i >= toks.len() {
        return syntax_error(text, toks, i);
    }
    // RETURNING at parenthesis depth 0 ends the source.
    let mut depth = 0i32;
    let mut returning = None;
    for (j, t) in toks.iter().enumerate().skip(i) {
        match &t.tok {
            Tok::Punct('(') | Tok::Punct('[') => depth += 1,
            Tok::Punct(')') | Tok::Punct(']') => depth -= 1,
            Tok::Word(w) if depth == 0 && w == "returning" => {
                returning = Some(j);
                break;
            }
            Tok::Word(w)
                if depth == 0
                    && w == "on"
                    && toks.get(j + 1).and_then(|t| t.word()) == Some("conflict") =>
            {
                return Action::Replace(
                    raise(
                        "42601",
                        "UPSERT cannot have an ON CONFLICT clause",
                        Some("use INSERT … ON CONFLICT instead"),
                    ),
                    Present::ERROR,
                );
            }
            _ => {}
        }
    }
    let (source_end, returning) = match returning {
        Some(j) => (toks[j].start, format!(" {}", &text[toks[j].start..])),
        None => (text.len(), String::new()),
    };
    let head = format!("INSERT {}", text[toks[1].start..source_end].trim_end());
    Action::Upsert(Upsert {
        table: ObjectName(table),
        head,
        columns,
        returning,
    })
}

/// Words that may follow a table reference in FROM and so are not its alias.
const NOT_ALIAS: &[&str] = &[
    "where",
    "join",
    "inner",
    "left",
    "right",
    "full",
    "cross",
    "natural",
    "on",
    "using",
    "group",
    "order",
    "limit",
    "offset",
    "having",
    "union",
    "intersect",
    "except",
    "window",
    "for",
    "fetch",
    "returning",
    "into",
    "set",
    "values",
    "tablesample",
    "with",
];

/// `[SHOW …]` used as a table (`SELECT region FROM [SHOW REGIONS]`) becomes a subquery.
fn bracket_shows(text: &str, toks: &[Token]) -> Option<String> {
    let mut out = String::new();
    let mut copied = 0;
    let mut i = 0;
    while i + 1 < toks.len() {
        if toks[i].tok != Tok::Punct('[') || toks[i + 1].word() != Some("show") {
            i += 1;
            continue;
        }
        let mut depth = 0i32;
        let close = (i..toks.len()).find(|&j| {
            match toks[j].tok {
                Tok::Punct('[') => depth += 1,
                Tok::Punct(']') => depth -= 1,
                _ => {}
            }
            depth == 0
        })?;
        let inner = &text[toks[i + 1].start..toks[close - 1].end];
        let select = match parse(inner) {
            Ok(Some(s)) => show_select(inner, &s).unwrap_or_else(|| {
                raise_select("0A000", &format!("{} cannot be used as a table", s.tag()))
            }),
            Ok(None) => setting_select(&toks[i + 2..close])?,
            Err(e) => raise_select("42601", &e.message),
        };
        out.push_str(&text[copied..toks[i].start]);
        out.push('(');
        out.push_str(&select);
        out.push(')');
        let aliased = match toks.get(close + 1).map(|t| &t.tok) {
            Some(Tok::Word(w)) => !NOT_ALIAS.contains(&w.as_str()),
            Some(Tok::Quoted(_)) => true,
            _ => false,
        };
        if !aliased {
            out.push_str(" AS \"show\"");
        }
        copied = toks[close].end;
        i = close + 1;
    }
    if copied == 0 {
        return None;
    }
    out.push_str(&text[copied..]);
    Some(out)
}

/// `SHOW name` (a setting) as a one-row query, for use inside brackets.
fn setting_select(toks: &[Token]) -> Option<String> {
    match toks {
        [Token {
            tok: Tok::Word(w), ..
        }] if w == "database" => {
            Some("SELECT pg_catalog.current_database()::text AS database".into())
        }
        [Token {
            tok: Tok::Word(w) | Tok::Quoted(w),
            ..
        }] => Some(format!(
            "SELECT pg_catalog.current_setting({}) AS {}",
            literal(w),
            ident(w)
        )),
        _ => None,
    }
}

fn raise_select(sqlstate: &str, message: &str) -> String {
    format!(
        "SELECT NULL::text AS error FROM {} AS r",
        raise(sqlstate, message, None).trim_start_matches("SELECT ")
    )
}

/// The columns (name, PostgreSQL type) of a SHOW statement's result, as CockroachDB names
/// them; `None` for a statement without rows.
pub fn show_columns(stmt: &Statement) -> Option<&'static [(&'static str, &'static str)]> {
    Some(match stmt {
        Statement::ShowRegions(ShowRegions::Cluster) => &[("region", "text"), ("zones", "text[]")],
        Statement::ShowRegions(ShowRegions::Database(_)) => &[
            ("database", "text"),
            ("region", "text"),
            ("primary", "boolean"),
            ("secondary", "boolean"),
            ("zones", "text[]"),
        ],
        Statement::ShowRegions(ShowRegions::All) => &[
            ("region", "text"),
            ("zones", "text[]"),
            ("database_names", "text[]"),
            ("primary_region_of", "text[]"),
            ("secondary_region_of", "text[]"),
        ],
        Statement::ShowRegions(ShowRegions::AllDatabases) => &[
            ("database_name", "text"),
            ("regions", "text[]"),
            ("primary_region", "text"),
            ("secondary_region", "text"),
        ],
        Statement::ShowSurvivalGoal { .. } => &[("database", "text"), ("survival_goal", "text")],
        Statement::ShowZoneConfiguration(_) | Statement::ShowZoneConfigurations => {
            &[("target", "text"), ("raw_config_sql", "text")]
        }
        Statement::ShowLocality => &[("locality", "text")],
        Statement::ShowRanges(_) => &[
            ("range_id", "bigint"),
            ("database_name", "text"),
            ("schema_name", "text"),
            ("table_name", "text"),
            ("partition", "text"),
            ("lease_holder", "bigint"),
            ("lease_holder_region", "text"),
            ("voting_replicas", "bigint[]"),
            ("non_voting_replicas", "bigint[]"),
            ("replica_regions", "text[]"),
            ("generation", "bigint"),
        ],
        Statement::ShowDatabases => &[
            ("database_name", "text"),
            ("owner", "text"),
            ("primary_region", "text"),
            ("secondary_region", "text"),
            ("regions", "text[]"),
            ("survival_goal", "text"),
        ],
        Statement::ShowEnums => &[
            ("schema", "text"),
            ("name", "text"),
            ("values", "text[]"),
            ("owner", "text"),
        ],
        Statement::ShowSequences => &[("sequence_schema", "text"), ("sequence_name", "text")],
        Statement::ShowClusterSettings => &[("variable", "text"), ("value", "text")],
        Statement::ShowCreate(CreateTarget::Table(_)) => {
            &[("table_name", "text"), ("create_statement", "text")]
        }
        Statement::ShowCreate(CreateTarget::Database(_)) => {
            &[("database_name", "text"), ("create_statement", "text")]
        }
        Statement::ShowIndexes { .. } => &[
            ("table_name", "text"),
            ("index_name", "text"),
            ("non_unique", "boolean"),
            ("seq_in_index", "bigint"),
            ("column_name", "text"),
            ("definition", "text"),
            ("direction", "text"),
            ("storing", "boolean"),
            ("implicit", "boolean"),
            ("visible", "boolean"),
        ],
        Statement::ShowPartitions(_) => &[
            ("database_name", "text"),
            ("table_name", "text"),
            ("partition_name", "text"),
            ("parent_partition", "text"),
            ("column_names", "text"),
            ("index_name", "text"),
            ("partition_value", "text"),
            ("zone_config", "text"),
            ("full_zone_config", "text"),
        ],
        Statement::ShowTables { .. } => &[
            ("schema_name", "text"),
            ("table_name", "text"),
            ("type", "text"),
            ("owner", "text"),
            ("estimated_row_count", "bigint"),
            ("locality", "text"),
        ],
        _ => return None,
    })
}

/// CockroachDB's command tag for a SHOW statement's result: its statement tag and the row
/// count, except for the one-word `SHOW` of a session variable (`SHOW LOCALITY`), which has
/// none (since v22.2).
fn show_present(stmt: &Statement) -> Present {
    match stmt {
        Statement::ShowLocality => Present::tag("SHOW"),
        s => Present::Rewritten {
            tag: Some(s.tag().to_string()),
            keep_count: true,
        },
    }
}

/// A SHOW statement as a typed query over `multiregion.execute`, which returns each row as a
/// JSON object: the same result over the simple and the extended protocol (where a Describe
/// must know the columns before anything runs).
fn show_select(text: &str, stmt: &Statement) -> Option<String> {
    if let Statement::ShowClusterSetting { name } = stmt {
        // One column, named after the setting, as CockroachDB names it.
        return Some(format!(
            "SELECT s.* FROM multiregion.execute({}) WITH ORDINALITY AS e(j, n), \
             pg_catalog.json_to_record(e.j) AS s({} text) ORDER BY e.n",
            literal(text),
            ident(name)
        ));
    }
    let cols = show_columns(stmt)?;
    let defs = cols
        .iter()
        .map(|(n, t)| format!("{} {t}", ident(n)))
        .collect::<Vec<_>>()
        .join(", ");
    Some(format!(
        "SELECT s.* FROM multiregion.execute({}) WITH ORDINALITY AS e(j, n), \
         pg_catalog.json_to_record(e.j) AS s({defs}) ORDER BY e.n",
        literal(text)
    ))
}

/// `SELECT multiregion.raise_error(…)`: PostgreSQL raises the error, so it aborts the
/// transaction like any other.
fn raise(sqlstate: &str, message: &str, hint: Option<&str>) -> String {
    format!(
        "SELECT multiregion.raise_error({}, {}, {})",
        literal(sqlstate),
        literal(message),
        hint.map(literal).unwrap_or_else(|| "NULL".into())
    )
}

/// A string literal that reads the same whatever `standard_conforming_strings` is.
pub fn literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 3);
    out.push_str("E'");
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("''"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// An identifier, always quoted.
pub fn ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// What a statement does to the transaction state the gateway must recreate when it restarts
/// an idle reader's transaction (see pgmr's gateway): its savepoints, or state it cannot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnEffect {
    Savepoint(String),
    Release(String),
    RollbackTo(String),
    /// Transaction-scoped state a restart would lose: cursors, `SET LOCAL`, explicit and
    /// advisory locks, `PREPARE TRANSACTION`.
    Opaque,
}

const TXN_TRIGGERS: &[&[u8]] = &[
    b"savepoint",
    b"release",
    b"rollback",
    b"declare",
    b"local",
    b"lock",
    b"prepare",
];

/// The transaction effects of a query string's statements, in order.
pub fn txn_effects(sql: &str) -> Vec<TxnEffect> {
    let b = sql.as_bytes();
    if !TXN_TRIGGERS
        .iter()
        .any(|t| b.windows(t.len()).any(|w| w.eq_ignore_ascii_case(t)))
    {
        return Vec::new();
    }
    let Ok(toks) = lex(sql) else {
        return vec![TxnEffect::Opaque];
    };
    let name = |t: Option<&Token>| match t.map(|t| &t.tok) {
        Some(Tok::Word(w) | Tok::Quoted(w)) => Some(w.clone()),
        _ => None,
    };
    let mut out = Vec::new();
    for st in toks.split(|t| t.tok == Tok::Punct(';')) {
        let w: Vec<Option<&str>> = st.iter().map(|t| t.word()).collect();
        let at = |i: usize| w.get(i).copied().flatten();
        let effect = match at(0) {
            Some("savepoint") => name(st.get(1)).map(TxnEffect::Savepoint),
            Some("release") => {
                let i = if at(1) == Some("savepoint") { 2 } else { 1 };
                name(st.get(i)).map(TxnEffect::Release)
            }
            Some("rollback") => {
                let mut i = 1;
                if matches!(at(i), Some("work" | "transaction")) {
                    i += 1;
                }
                if at(i) == Some("to") {
                    i += 1;
                    if at(i) == Some("savepoint") {
                        i += 1;
                    }
                    name(st.get(i)).map(TxnEffect::RollbackTo)
                } else {
                    None
                }
            }
            Some("declare" | "lock" | "prepare") => Some(TxnEffect::Opaque),
            Some("set") if at(1) == Some("local") => Some(TxnEffect::Opaque),
            _ if w.iter().flatten().any(|x| x.contains("advisory")) => Some(TxnEffect::Opaque),
            _ => None,
        };
        out.extend(effect);
    }
    out
}
