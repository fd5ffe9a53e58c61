//! Recursive descent over the token list. Each entry point decides early whether the statement
//! is one of ours; once it is, anything unexpected is a syntax error at that token.

use crate::ast::*;
use crate::lex::{lex, Tok, Token};
use crate::SyntaxError;

pub fn parse(sql: &str) -> Result<Option<Statement>, SyntaxError> {
    // Text our lexer cannot read is PostgreSQL's to judge (it knows more literal forms); the
    // statements we handle never need them.
    let Ok(mut toks) = lex(sql) else {
        return Ok(None);
    };
    while matches!(
        toks.last(),
        Some(Token {
            tok: Tok::Punct(';'),
            ..
        })
    ) {
        toks.pop();
    }
    let mut p = Parser { sql, toks, pos: 0 };
    p.statement()
}

struct Parser<'a> {
    sql: &'a str,
    toks: Vec<Token>,
    pos: usize,
}

type R<T> = Result<T, SyntaxError>;

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<&Token> {
        self.toks.get(self.pos)
    }

    fn peek_word(&self) -> Option<&str> {
        self.peek().and_then(Token::word)
    }

    fn peek_word_at(&self, ahead: usize) -> Option<&str> {
        self.toks.get(self.pos + ahead).and_then(Token::word)
    }

    fn eat(&mut self, w: &str) -> bool {
        if self.peek_word() == Some(w) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn eat_punct(&mut self, c: char) -> bool {
        if matches!(self.peek(), Some(Token { tok: Tok::Punct(p), .. }) if *p == c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// A syntax error at the current token (or at the end), worded as PostgreSQL words it.
    fn error(&self) -> SyntaxError {
        match self.peek() {
            Some(t) => {
                let text = &self.sql[t.start..t.end];
                SyntaxError::at(
                    self.sql,
                    t.start,
                    &format!("syntax error at or near \"{text}\""),
                )
            }
            None => SyntaxError::at(
                self.sql,
                self.sql.trim_end().len(),
                "syntax error at end of input",
            ),
        }
    }

    fn expect(&mut self, w: &str) -> R<()> {
        if self.eat(w) {
            Ok(())
        } else {
            Err(self.error())
        }
    }

    /// `IF EXISTS` (or, with `not`, `IF NOT EXISTS`) if present.
    fn if_exists(&mut self, not: bool) -> R<bool> {
        if !self.eat("if") {
            return Ok(false);
        }
        if not {
            self.expect("not")?;
        }
        self.expect("exists")?;
        Ok(true)
    }

    fn end(&self) -> R<()> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(self.error()),
        }
    }

    /// A name: an unquoted word (lower-cased) or a quoted identifier.
    fn ident(&mut self) -> R<String> {
        let name = match self.peek().map(|t| &t.tok) {
            Some(Tok::Word(w)) => w.clone(),
            Some(Tok::Quoted(q)) => q.clone(),
            _ => return Err(self.error()),
        };
        self.pos += 1;
        Ok(name)
    }

    /// A region name: an identifier or, as CockroachDB also accepts, a string literal.
    fn region(&mut self) -> R<String> {
        if let Some(Token {
            tok: Tok::Str(s), ..
        }) = self.peek()
        {
            let s = s.clone();
            self.pos += 1;
            if s.is_empty() {
                return Err(SyntaxError::at(
                    self.sql,
                    self.toks[self.pos - 1].start,
                    "region name must not be empty",
                ));
            }
            return Ok(s);
        }
        self.ident()
    }

    fn object_name(&mut self) -> R<ObjectName> {
        let mut parts = vec![self.ident()?];
        while self.eat_punct('.') {
            parts.push(self.ident()?);
        }
        if parts.len() > 3 {
            return Err(SyntaxError::at(
                self.sql,
                self.toks[self.pos - 1].start,
                "improper qualified name (too many dotted names)",
            ));
        }
        Ok(ObjectName(parts))
    }

    fn statement(&mut self) -> R<Option<Statement>> {
        match self.peek_word() {
            Some("create") => self.create(),
            Some("alter") => self.alter(),
            Some("show") => self.show(),
            Some("set") | Some("reset")
                if self.peek_word_at(1) == Some("cluster")
                    && self.peek_word_at(2) == Some("setting") =>
            {
                self.cluster_setting()
            }
            _ => Ok(None),
        }
    }

    /// A cluster setting's dotted name (`server.time_until_store_dead`).
    fn setting_name(&mut self) -> R<String> {
        let mut name = self.ident()?;
        while self.eat_punct('.') {
            name.push('.');
            name.push_str(&self.ident()?);
        }
        Ok(name)
    }

    /// `SET CLUSTER SETTING name {= | TO} value` / `RESET CLUSTER SETTING name`.
    fn cluster_setting(&mut self) -> R<Option<Statement>> {
        let reset = self.peek_word() == Some("reset");
        self.pos += 3;
        let name = self.setting_name()?;
        let value = if reset {
            None
        } else {
            if !self.eat_punct('=') {
                self.expect("to")?;
            }
            let value = match self.peek().map(|t| t.tok.clone()) {
                Some(Tok::Word(w)) if w == "default" => None,
                Some(Tok::Str(s)) => Some(s),
                Some(Tok::Number(n)) => Some(n),
                Some(Tok::Word(w)) => Some(w),
                Some(Tok::Op(o)) if o == "-" => {
                    self.pos += 1;
                    match self.peek().map(|t| t.tok.clone()) {
                        Some(Tok::Number(n)) => Some(format!("-{n}")),
                        _ => return Err(self.error()),
                    }
                }
                _ => return Err(self.error()),
            };
            self.pos += 1;
            value
        };
        self.end()?;
        Ok(Some(Statement::SetClusterSetting { name, value }))
    }

    fn create(&mut self) -> R<Option<Statement>> {
        self.pos += 1;
        if self.eat("database") {
            return self.create_database();
        }
        let save = self.pos;
        for w in ["global", "local"] {
            self.eat(w);
        }
        for w in ["temp", "temporary", "unlogged"] {
            self.eat(w);
        }
        if self.eat("table") {
            return self.create_table();
        }
        self.pos = save;
        if matches!(self.peek_word(), Some("index" | "unique" | "inverted")) {
            return Ok(crate::table::create_index(self.sql.trim_end())?
                .map(|statements| Statement::CreateIndex { statements }));
        }
        Ok(None)
    }

    fn create_database(&mut self) -> R<Option<Statement>> {
        let if_not_exists = self.if_exists(true)?;
        let name = self.ident()?;
        let (mut primary_region, mut regions, mut survival, mut placement, mut secondary_region) =
            (None, Vec::new(), None, None, None);
        let mut ours = false;
        while self.peek().is_some() {
            let before = self.pos;
            match self.peek_word() {
                Some("primary") if primary_region.is_none() => {
                    self.pos += 1;
                    self.expect("region")?;
                    self.eat_punct('=');
                    primary_region = Some(self.region()?);
                }
                Some("regions") if regions.is_empty() => {
                    self.pos += 1;
                    self.eat_punct('=');
                    regions.push(self.region()?);
                    while self.eat_punct(',') {
                        regions.push(self.region()?);
                    }
                }
                Some("survive") if survival.is_none() => {
                    self.pos += 1;
                    self.eat_punct('=');
                    survival = Some(self.survival_goal()?);
                }
                Some("placement") if placement.is_none() => {
                    self.pos += 1;
                    placement = Some(self.placement()?);
                }
                Some("secondary") if secondary_region.is_none() => {
                    self.pos += 1;
                    self.expect("region")?;
                    self.eat_punct('=');
                    secondary_region = Some(self.region()?);
                }
                // PostgreSQL's own options: the statement is PostgreSQL's unless it mixes them
                // with ours, which no translation could keep.
                _ if !ours => return Ok(None),
                _ => return Err(self.error()),
            }
            ours = ours || self.pos > before;
        }
        // `IF NOT EXISTS` alone is CockroachDB's too: PostgreSQL has no such form.
        if !ours && !if_not_exists {
            return Ok(None);
        }
        Ok(Some(Statement::CreateDatabase {
            name,
            if_not_exists,
            primary_region,
            regions,
            survival,
            placement,
            secondary_region,
        }))
    }

    fn survival_goal(&mut self) -> R<SurvivalGoal> {
        let goal = if self.eat("region") {
            SurvivalGoal::Region
        } else if self.eat("zone") {
            SurvivalGoal::Zone
        } else {
            return Err(self.error());
        };
        self.expect("failure")?;
        Ok(goal)
    }

    fn placement(&mut self) -> R<Placement> {
        if self.eat("restricted") {
            Ok(Placement::Restricted)
        } else if self.eat("default") {
            Ok(Placement::Default)
        } else {
            Err(self.error())
        }
    }

    fn alter(&mut self) -> R<Option<Statement>> {
        self.pos += 1;
        let configure = self
            .toks
            .windows(2)
            .any(|w| w[0].word() == Some("configure") && w[1].word() == Some("zone"));
        if configure
            && matches!(
                self.peek_word(),
                Some("table" | "database" | "index" | "partition" | "range")
            )
        {
            return self.configure_zone();
        }
        if self.eat("database") {
            return self.alter_database();
        }
        if self.eat("table") {
            return self.alter_table();
        }
        Ok(None)
    }

    fn alter_database(&mut self) -> R<Option<Statement>> {
        let database = self.ident()?;
        let stmt = match (self.peek_word(), self.peek_word_at(1)) {
            (Some("set"), Some("primary")) | (Some("primary"), _) => {
                self.eat("set");
                self.expect("primary")?;
                self.expect("region")?;
                self.eat_punct('=');
                Statement::AlterDatabasePrimaryRegion {
                    database,
                    region: self.region()?,
                }
            }
            (Some("set"), Some("secondary")) => {
                self.pos += 2;
                self.expect("region")?;
                self.eat_punct('=');
                Statement::AlterDatabaseSecondaryRegion {
                    database,
                    region: Some(self.region()?),
                }
            }
            (Some("drop"), Some("secondary")) => {
                self.pos += 2;
                self.expect("region")?;
                Statement::AlterDatabaseSecondaryRegion {
                    database,
                    region: None,
                }
            }
            (Some("add"), Some("region")) => {
                self.pos += 2;
                let if_not_exists = self.if_exists(true)?;
                Statement::AlterDatabaseAddRegion {
                    database,
                    region: self.region()?,
                    if_not_exists,
                }
            }
            (Some("drop"), Some("region")) => {
                self.pos += 2;
                let if_exists = self.if_exists(false)?;
                Statement::AlterDatabaseDropRegion {
                    database,
                    region: self.region()?,
                    if_exists,
                }
            }
            (Some("survive"), _) => {
                self.pos += 1;
                self.eat_punct('=');
                Statement::AlterDatabaseSurvival {
                    database,
                    goal: self.survival_goal()?,
                }
            }
            (Some("placement"), _) => {
                self.pos += 1;
                Statement::AlterDatabasePlacement {
                    database,
                    placement: self.placement()?,
                }
            }
            _ => return Ok(None),
        };
        self.end()?;
        Ok(Some(stmt))
    }

    fn alter_table(&mut self) -> R<Option<Statement>> {
        let start = self.pos;
        let if_exists = self.if_exists(false)?;
        let table = self.object_name()?;
        if self.peek_word() == Some("set") && self.peek_word_at(1) == Some("locality") {
            self.pos += 2;
            let locality = self.locality()?;
            self.end()?;
            return Ok(Some(Statement::AlterTableSetLocality {
                table,
                locality,
                if_exists,
            }));
        }
        if self.peek_word() == Some("alter")
            && self.peek_word_at(1) == Some("primary")
            && self.peek_word_at(2) == Some("key")
        {
            self.pos += 3;
            return self.alter_primary_key(table);
        }
        self.pos = start;
        let computed = self.rewrite_computed()?;
        let text = computed.as_deref().unwrap_or(self.sql.trim_end());
        let types = crate::table::alter_table_type_edits(text, false);
        if types.is_empty() {
            return Ok(computed.map(|sql| Statement::Rewritten { sql }));
        }
        Ok(Some(Statement::Rewritten {
            sql: crate::table::apply_edits(text, types),
        }))
    }

    /// `ALTER target CONFIGURE ZONE {USING field = value [, …] | DISCARD}`, after ALTER.
    fn configure_zone(&mut self) -> R<Option<Statement>> {
        let target = self.zone_target()?;
        self.expect("configure")?;
        self.expect("zone")?;
        if self.eat("discard") {
            self.end()?;
            return Ok(Some(Statement::ConfigureZone {
                target,
                fields: None,
            }));
        }
        self.expect("using")?;
        let mut fields = vec![];
        loop {
            let name = self.setting_name()?;
            if !self.eat_punct('=') {
                return Err(self.error());
            }
            let value = if self.peek_word() == Some("copy") {
                self.pos += 1;
                self.expect("from")?;
                self.expect("parent")?;
                None
            } else {
                let v = match self.peek().map(|t| t.tok.clone()) {
                    Some(Tok::Number(n)) => n,
                    Some(Tok::Str(s)) => s,
                    Some(Tok::Word(w)) if w != "using" => w,
                    _ => return Err(self.error()),
                };
                self.pos += 1;
                Some(v)
            };
            fields.push((name, value));
            if !self.eat_punct(',') {
                break;
            }
        }
        self.end()?;
        Ok(Some(Statement::ConfigureZone {
            target,
            fields: Some(fields),
        }))
    }

    /// `ALTER TABLE t ALTER PRIMARY KEY USING COLUMNS (a [ASC | DESC], …) [USING HASH …]`,
    /// after `PRIMARY KEY`.
    fn alter_primary_key(&mut self, table: ObjectName) -> R<Option<Statement>> {
        self.expect("using")?;
        self.expect("columns")?;
        if !self.eat_punct('(') {
            return Err(self.error());
        }
        let mut columns = vec![];
        loop {
            columns.push(self.ident()?);
            if !self.eat("asc") {
                self.eat("desc");
            }
            if self.eat_punct(')') {
                break;
            }
            if !self.eat_punct(',') {
                return Err(self.error());
            }
        }
        let mut bucket_count = None;
        if let Some((buckets, next)) = crate::table::hash_sharded(self.sql, &self.toks, self.pos)? {
            bucket_count = Some(buckets);
            self.pos = next;
        }
        self.end()?;
        Ok(Some(Statement::AlterPrimaryKey {
            table,
            columns,
            bucket_count,
        }))
    }

    /// After the word LOCALITY.
    fn locality(&mut self) -> R<Locality> {
        if self.eat("global") {
            return Ok(Locality::Global);
        }
        self.expect("regional")?;
        if self.eat("by") {
            if self.eat("row") {
                let column = if self.eat("as") {
                    Some(self.ident()?)
                } else {
                    None
                };
                return Ok(Locality::RegionalByRow { column });
            }
            self.expect("table")?;
        }
        let region = if self.eat("in") {
            if self.peek_word() == Some("primary") && self.peek_word_at(1) == Some("region") {
                self.pos += 2;
                None
            } else {
                Some(self.region()?)
            }
        } else {
            None
        };
        Ok(Locality::RegionalByTable { region })
    }

    fn create_table(&mut self) -> R<Option<Statement>> {
        self.if_exists(true)?;
        let name_from = self.peek().map_or(0, |t| t.start);
        let table = self.object_name()?;
        let name_to = self.toks[self.pos - 1].end;
        let open_at = self.peek().map(|t| t.start);
        // LOCALITY at parenthesis depth 0, after the column list.
        let mut depth = 0i32;
        let mut locality_at = None;
        for (i, t) in self.toks.iter().enumerate().skip(self.pos) {
            match &t.tok {
                Tok::Punct('(') => depth += 1,
                Tok::Punct(')') => depth -= 1,
                Tok::Word(w) if w == "locality" && depth == 0 => {
                    locality_at = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let (body_end, locality) = match locality_at {
            Some(i) => {
                self.pos = i + 1;
                let l = self.locality()?;
                self.end()?;
                (self.toks[i].start, Some(l))
            }
            None => (self.sql.len(), None),
        };
        let body = self.sql[..body_end].trim_end();
        let computed = self.rewrite_computed_in(body)?;
        let text = computed.as_deref().unwrap_or(body);
        // The element list starts where it did: the computed columns' rewrite is inside it.
        let elements = match open_at {
            Some(at) => crate::table::rewrite_elements(
                text,
                at,
                &self.sql[name_from..name_to],
                table.0.last().map_or("", String::as_str),
            )?,
            None => None,
        };
        if locality.is_none() && computed.is_none() && elements.is_none() {
            return Ok(None);
        }
        let (sql, indexes) = match elements {
            Some(r) => (r.sql, r.indexes),
            None => (text.to_string(), vec![]),
        };
        Ok(Some(Statement::CreateTable {
            table,
            sql,
            locality,
            indexes,
        }))
    }

    fn rewrite_computed(&self) -> R<Option<String>> {
        self.rewrite_computed_in(self.sql.trim_end())
    }

    /// CockroachDB's computed column `c t AS (expr) STORED` as PostgreSQL's
    /// `c t GENERATED ALWAYS AS (expr) STORED`, within `text` (a prefix of the statement).
    fn rewrite_computed_in(&self, text: &str) -> R<Option<String>> {
        let toks: Vec<&Token> = self.toks.iter().filter(|t| t.end <= text.len()).collect();
        let mut out = String::new();
        let mut copied = 0;
        for (i, t) in toks.iter().enumerate() {
            if t.word() != Some("as") || i == 0 || toks[i - 1].word() == Some("always") {
                continue;
            }
            if !matches!(toks.get(i + 1).map(|t| &t.tok), Some(Tok::Punct('('))) {
                continue;
            }
            // The matching parenthesis, then STORED or VIRTUAL.
            let mut depth = 0i32;
            let mut close = None;
            for (j, u) in toks.iter().enumerate().skip(i + 1) {
                match u.tok {
                    Tok::Punct('(') => depth += 1,
                    Tok::Punct(')') => {
                        depth -= 1;
                        if depth == 0 {
                            close = Some(j);
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let Some(close) = close else { continue };
            match toks.get(close + 1).and_then(|t| t.word()) {
                Some("stored") => {
                    out.push_str(&text[copied..t.start]);
                    out.push_str("GENERATED ALWAYS AS");
                    copied = t.end;
                }
                // PostgreSQL 15 has no virtual generated columns: stored, a VIRTUAL column
                // reads the same (it takes space, and cannot be the region column's source).
                Some("virtual") => {
                    out.push_str(&text[copied..t.start]);
                    out.push_str("GENERATED ALWAYS AS");
                    out.push_str(&text[t.end..toks[close + 1].start]);
                    out.push_str("STORED");
                    copied = toks[close + 1].end;
                }
                _ => {}
            }
        }
        if copied == 0 {
            return Ok(None);
        }
        out.push_str(&text[copied..]);
        Ok(Some(out))
    }

    fn show(&mut self) -> R<Option<Statement>> {
        self.pos += 1;
        let stmt = match self.peek_word() {
            Some("regions") => {
                self.pos += 1;
                let which = if self.eat("from") {
                    if self.eat("cluster") {
                        ShowRegions::Cluster
                    } else if self.eat("database") {
                        ShowRegions::Database(if self.peek().is_some() {
                            Some(self.ident()?)
                        } else {
                            None
                        })
                    } else if self.eat("all") {
                        self.expect("databases")?;
                        ShowRegions::AllDatabases
                    } else {
                        return Err(self.error());
                    }
                } else {
                    ShowRegions::All
                };
                Statement::ShowRegions(which)
            }
            Some("survival") => {
                self.pos += 1;
                self.expect("goal")?;
                let database = if self.eat("from") {
                    self.expect("database")?;
                    if self.peek().is_some() {
                        Some(self.ident()?)
                    } else {
                        None
                    }
                } else {
                    None
                };
                Statement::ShowSurvivalGoal { database }
            }
            Some("all") if self.peek_word_at(1) == Some("zone") => {
                self.pos += 2;
                self.expect("configurations")?;
                Statement::ShowZoneConfigurations
            }
            Some("zone") => {
                self.pos += 1;
                if self.eat("configurations") {
                    Statement::ShowZoneConfigurations
                } else {
                    self.expect("configuration")?;
                    let target = if self.eat("from") || self.eat("for") {
                        self.zone_target()?
                    } else {
                        ZoneTarget::Default
                    };
                    Statement::ShowZoneConfiguration(target)
                }
            }
            Some("locality") => {
                self.pos += 1;
                Statement::ShowLocality
            }
            Some("ranges") => {
                self.pos += 1;
                let from = if self.eat("from") {
                    if self.eat("table") {
                        RangesFrom::Table(self.object_name()?)
                    } else {
                        self.expect("database")?;
                        RangesFrom::Database(self.ident()?)
                    }
                } else {
                    RangesFrom::CurrentDatabase
                };
                Statement::ShowRanges(from)
            }
            Some("databases") => {
                self.pos += 1;
                Statement::ShowDatabases
            }
            Some("enums") => {
                self.pos += 1;
                Statement::ShowEnums
            }
            Some("sequences") => {
                self.pos += 1;
                Statement::ShowSequences
            }
            Some("cluster") if self.peek_word_at(1) == Some("setting") => {
                self.pos += 2;
                Statement::ShowClusterSetting {
                    name: self.setting_name()?,
                }
            }
            Some("cluster") if self.peek_word_at(1) == Some("settings") => {
                self.pos += 2;
                Statement::ShowClusterSettings
            }
            Some("all") if self.peek_word_at(1) == Some("cluster") => {
                self.pos += 2;
                self.expect("settings")?;
                Statement::ShowClusterSettings
            }
            Some("create") => {
                self.pos += 1;
                if self.eat("database") {
                    Statement::ShowCreate(CreateTarget::Database(self.ident()?))
                } else {
                    self.eat("table");
                    Statement::ShowCreate(CreateTarget::Table(self.object_name()?))
                }
            }
            Some("indexes" | "index" | "keys") if self.peek_word_at(1) == Some("from") => {
                self.pos += 2;
                Statement::ShowIndexes {
                    table: self.object_name()?,
                }
            }
            Some("partitions") => {
                self.pos += 1;
                self.expect("from")?;
                let from = if self.eat("table") {
                    PartitionsFrom::Table(self.object_name()?)
                } else if self.eat("database") {
                    PartitionsFrom::Database(self.ident()?)
                } else {
                    self.expect("index")?;
                    let (table, index) = self.table_at_index()?;
                    PartitionsFrom::Index { table, index }
                };
                Statement::ShowPartitions(from)
            }
            Some("tables") => {
                self.pos += 1;
                let from = if self.eat("from") {
                    Some(self.object_name()?)
                } else {
                    None
                };
                Statement::ShowTables { from }
            }
            _ => return Ok(None),
        };
        self.end()?;
        Ok(Some(stmt))
    }

    fn zone_target(&mut self) -> R<ZoneTarget> {
        if self.eat("range") {
            self.expect("default")?;
            return Ok(ZoneTarget::Default);
        }
        if self.eat("database") {
            return Ok(ZoneTarget::Database(self.ident()?));
        }
        if self.eat("table") {
            return Ok(ZoneTarget::Table(self.object_name()?));
        }
        if self.eat("index") {
            let (table, index) = self.table_at_index()?;
            return Ok(ZoneTarget::Index { table, index });
        }
        if self.eat("partition") {
            let partition = self.region()?;
            self.expect("of")?;
            if self.eat("table") {
                return Ok(ZoneTarget::Partition {
                    partition,
                    table: self.object_name()?,
                    index: None,
                });
            }
            self.expect("index")?;
            let (table, index) = self.table_at_index()?;
            return Ok(ZoneTarget::Partition {
                partition,
                table,
                index: Some(index),
            });
        }
        Err(self.error())
    }

    /// `table@index`.
    fn table_at_index(&mut self) -> R<(ObjectName, String)> {
        let table = self.object_name()?;
        if !self.eat_punct('@') {
            return Err(self.error());
        }
        Ok((table, self.ident()?))
    }
}
