//! The gateway's translator: what each CockroachDB form becomes, that PostgreSQL's own
//! statements pass byte for byte, and (property tests) that no input makes it panic.

use mr_sql::*;
use proptest::prelude::*;

fn rewritten(sql: &str) -> Translation {
    match translate(sql) {
        Outcome::Rewritten(t) => t,
        other => panic!("{sql}: {other:?}"),
    }
}

fn text(sql: &str) -> String {
    rewritten(sql).assemble(|_| Err("no catalog".into()))
}

fn col(name: &str, primary_key: bool) -> Column {
    Column {
        name: name.into(),
        primary_key,
        generated: false,
        hidden: false,
        region: false,
    }
}

#[test]
fn postgresql_statements_pass_unchanged() {
    for sql in [
        "SELECT 1",
        "SELECT a[1] FROM t; UPDATE t SET v = 'AS OF' WHERE k = $1",
        "SHOW search_path",
        "SET search_path = public",
        "CREATE TABLE t (id bigint PRIMARY KEY, v text GENERATED ALWAYS AS (upper(k)) STORED)",
        "CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC; SELECT 1; END",
        "COPY t FROM STDIN",
        "",
        "   ;;  ",
        "SELECT 'unterminated",
    ] {
        assert_eq!(translate(sql), Outcome::Unchanged, "{sql}");
    }
}

#[test]
fn region_ddl_becomes_a_call_with_cockroachdbs_tag() {
    let t = rewritten(r#"ALTER DATABASE movr PRIMARY REGION "us-east1""#);
    assert_eq!(
        t.assemble(|_| unreachable!()),
        r#"CALL multiregion.exec(E'ALTER DATABASE movr PRIMARY REGION "us-east1"')"#
    );
    assert_eq!(
        t.presents[0].command_tag("CALL"),
        "ALTER DATABASE PRIMARY REGION"
    );
    let t = rewritten("ALTER TABLE t SET LOCALITY GLOBAL");
    assert_eq!(
        t.presents[0].command_tag("CALL"),
        "ALTER TABLE SET LOCALITY"
    );
}

#[test]
fn show_statements_become_typed_queries_keeping_the_row_count() {
    let t = rewritten("SHOW REGIONS FROM DATABASE");
    let sql = t.assemble(|_| unreachable!());
    assert!(
        sql.contains("multiregion.execute(E'SHOW REGIONS FROM DATABASE')"),
        "{sql}"
    );
    assert!(sql.contains(r#""primary" boolean"#), "{sql}");
    assert_eq!(t.presents[0].command_tag("SELECT 3"), "SHOW REGIONS 3");
    assert_eq!(
        rewritten("SHOW LOCALITY").presents[0].command_tag("SELECT 1"),
        "SHOW"
    );
}

#[test]
fn bracketed_show_is_a_subquery_with_an_alias_when_none_is_given() {
    let sql = text("SELECT region FROM [SHOW REGIONS]");
    assert!(
        sql.starts_with("SELECT region FROM (SELECT s.* FROM"),
        "{sql}"
    );
    assert!(sql.ends_with(r#") AS "show""#), "{sql}");
    let sql = text("SELECT r.region FROM [SHOW REGIONS FROM CLUSTER] r WHERE true");
    assert!(sql.ends_with(") r WHERE true"), "{sql}");
    let sql = text("SELECT * FROM [SHOW REGIONS] WHERE region = 'x'");
    assert!(sql.ends_with(r#") AS "show" WHERE region = 'x'"#), "{sql}");
    let sql = text("SELECT * FROM [SHOW timezone]");
    assert!(
        sql.contains("pg_catalog.current_setting(E'timezone')"),
        "{sql}"
    );
    assert_eq!(
        rewritten("SELECT 1 FROM [SHOW REGIONS]").presents[0].command_tag("SELECT 1"),
        "SELECT 1"
    );
}

#[test]
fn upsert_is_insert_on_conflict_on_the_primary_key() {
    let t = rewritten("UPSERT INTO s.t (k, v) VALUES ($1, $2) RETURNING *");
    assert_eq!(
        t.upserts().next().unwrap().table,
        ObjectName(vec!["s".into(), "t".into()])
    );
    let cols = [col("k", true), col("v", false), col("w", false)];
    assert_eq!(
        t.assemble(|_| Ok(cols.to_vec())),
        r#"INSERT INTO s.t (k, v) VALUES ($1, $2) ON CONFLICT ("k") DO UPDATE SET "v" = excluded."v" RETURNING *"#
    );
    // Without a column list, every writable visible column is overwritten.
    let mut all = cols.to_vec();
    all.push(Column {
        generated: true,
        ..col("g", false)
    });
    all.push(Column {
        hidden: true,
        ..col("crdb_region", false)
    });
    assert_eq!(
        text_with("UPSERT INTO t VALUES (1, 'a', 'b')", &all),
        r#"INSERT INTO t VALUES (1, 'a', 'b') ON CONFLICT ("k") DO UPDATE SET "v" = excluded."v", "w" = excluded."w""#
    );
    // Only key columns: the row is kept as it is, and counted.
    assert_eq!(
        text_with("UPSERT INTO t (k) SELECT 1", &cols),
        r#"INSERT INTO t (k) SELECT 1 ON CONFLICT ("k") DO UPDATE SET "k" = excluded."k""#
    );
    assert!(text_with("UPSERT INTO t VALUES (1)", &[col("v", false)]).contains("raise_error"));
    // REGIONAL BY ROW: the region column is in PostgreSQL's key, not in CockroachDB's.
    let rbr = [
        col("id", true),
        col("v", false),
        Column {
            hidden: true,
            region: true,
            ..col("crdb_region", true)
        },
    ];
    assert_eq!(
        text_with("UPSERT INTO t (id, v) VALUES (1, 'a')", &rbr),
        r#"INSERT INTO t (id, v) VALUES (1, 'a') ON CONFLICT ("id") DO UPDATE SET "v" = excluded."v""#
    );
    assert_eq!(
        text_with("UPSERT INTO t (crdb_region, id) VALUES ('r', 1)", &rbr),
        r#"INSERT INTO t (crdb_region, id) VALUES ('r', 1) ON CONFLICT ("id") DO UPDATE SET "crdb_region" = excluded."crdb_region""#
    );
    assert!(text("UPSERT t VALUES (1)").contains("42601"));
}

fn text_with(sql: &str, cols: &[Column]) -> String {
    rewritten(sql).assemble(|_| Ok(cols.to_vec()))
}

#[test]
fn as_of_system_time_is_refused_in_every_position() {
    for sql in [
        "SELECT * FROM t AS OF SYSTEM TIME '-10s'",
        "BEGIN AS OF SYSTEM TIME '-10s'",
        "SET TRANSACTION AS OF SYSTEM TIME follower_read_timestamp()",
        "select * from t as of system time with_max_staleness('10s')",
    ] {
        let sql = text(sql);
        assert!(
            sql.starts_with("SELECT multiregion.raise_error(E'0A000'"),
            "{sql}"
        );
    }
    assert_eq!(translate("SELECT 'AS OF SYSTEM TIME'"), Outcome::Unchanged);
}

#[test]
fn use_switches_database_only_alone() {
    assert_eq!(translate("USE movr"), Outcome::Use("movr".into()));
    assert_eq!(translate(r#"USE "My DB";"#), Outcome::Use("My DB".into()));
    assert_eq!(
        translate("SET database = movr"),
        Outcome::Use("movr".into())
    );
    assert_eq!(
        translate("set database to 'movr'"),
        Outcome::Use("movr".into())
    );
    assert!(text("SELECT 1; USE movr").contains("25001"));
    assert!(matches!(translate_one("USE movr"), Outcome::Rewritten(_)));
}

#[test]
fn create_database_with_regions_is_created_then_configured() {
    assert_eq!(
        translate(r#"CREATE DATABASE "Mr" PRIMARY REGION "us-east1" REGIONS "us-west1""#),
        Outcome::CreateDatabase {
            name: "Mr".into(),
            create: r#"CREATE DATABASE "Mr""#.into(),
            configure: r#"CREATE DATABASE "Mr" PRIMARY REGION "us-east1" REGIONS "us-west1""#
                .into(),
            if_not_exists: false,
        }
    );
    assert_eq!(translate("CREATE DATABASE plain"), Outcome::Unchanged);
    // PostgreSQL has no IF NOT EXISTS for databases; CockroachDB does.
    assert_eq!(
        translate("CREATE DATABASE IF NOT EXISTS plain"),
        Outcome::CreateDatabase {
            name: "plain".into(),
            create: r#"CREATE DATABASE "plain""#.into(),
            configure: "CREATE DATABASE IF NOT EXISTS plain".into(),
            if_not_exists: true,
        }
    );
}

#[test]
fn create_database_refused_by_cockroachdbs_rules_creates_nothing() {
    for (sql, sqlstate) in [
        ("CREATE DATABASE d SURVIVE REGION FAILURE", "42P12"),
        (r#"CREATE DATABASE d REGIONS "us-east1""#, "42P12"),
        (
            r#"CREATE DATABASE d PRIMARY REGION "us-east1" REGIONS "us-west1", "us-west1""#,
            "42602",
        ),
    ] {
        // An error raised in place of the statement: no CREATE DATABASE reaches PostgreSQL.
        let out = text(sql);
        assert!(out.contains(sqlstate), "{sql}: {out}");
        assert!(!out.contains("CREATE DATABASE d\""), "{sql}: {out}");
    }
}

#[test]
fn literals_survive_any_quoting_setting() {
    assert_eq!(literal(r"it's a \ test"), r"E'it''s a \\ test'");
    assert_eq!(ident(r#"a"b"#), r#""a""b""#);
    let sql = text(r#"ALTER DATABASE "it's" PRIMARY REGION 'a\b'"#);
    assert!(
        sql.contains(r#"E'ALTER DATABASE "it''s" PRIMARY REGION ''a\\b'''"#),
        "{sql}"
    );
}

#[test]
fn text_between_statements_is_kept() {
    let sql = "SELECT 1 /* one */;\n SHOW LOCALITY ; -- two\nSELECT 'x;y'";
    let out = text(sql);
    assert!(out.starts_with("SELECT 1 /* one */;\n SELECT"), "{out}");
    assert!(out.ends_with(" ; -- two\nSELECT 'x;y'"), "{out}");
    assert_eq!(rewritten(sql).presents.len(), 3);
}

const WORDS: &[&str] = &[
    "SHOW",
    "REGIONS",
    "FROM",
    "DATABASE",
    "CLUSTER",
    "ALL",
    "DATABASES",
    "UPSERT",
    "INTO",
    "USE",
    "SET",
    "AS",
    "OF",
    "SYSTEM",
    "TIME",
    "CREATE",
    "TABLE",
    "LOCALITY",
    "REGIONAL",
    "BY",
    "ROW",
    "GLOBAL",
    "ALTER",
    "PRIMARY",
    "REGION",
    "ADD",
    "DROP",
    "SURVIVE",
    "ZONE",
    "FAILURE",
    "IN",
    "RETURNING",
    "VALUES",
    "SELECT",
    "BEGIN",
    "ATOMIC",
    "END",
    "STORED",
    "ON",
    "CONFLICT",
    "SURVIVAL",
    "GOAL",
    "CONFIGURATION",
    "TABLES",
    "IF",
    "EXISTS",
    "NOT",
    "[",
    "]",
    "(",
    ")",
    ";",
    ",",
    ".",
    "=",
    "*",
    "'s'",
    "'it''s'",
    "\"Q\"",
    "\"\"",
    "$$d$$",
    "$1",
    "1",
    "E'\\''",
    "--c\n",
    "/*",
    "*/",
    "'",
    "\"",
    "$",
    "$a$",
    "::",
    "é",
    "\u{0}",
    "crdb_region",
    "t",
    "movr",
    "\"us-east1\"",
];

fn soup() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(WORDS), 0..40).prop_map(|w| w.join(" "))
}

fn check(sql: &str) {
    let columns = [
        vec![],
        vec![col("k", true)],
        vec![col("k", true), col("v", false)],
    ];
    for o in [translate(sql), translate_one(sql)] {
        if let Outcome::Rewritten(t) = o {
            for c in &columns {
                let _ = t.assemble(|_| Ok(c.clone()));
            }
            let _ = t.assemble(|_| Err("x".into()));
            for p in &t.presents {
                let _ = p.command_tag("SELECT 3");
                let _ = p.command_tag("");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn no_panic_on_arbitrary_text(sql in any::<String>()) {
        check(&sql);
    }

    #[test]
    fn no_panic_on_cockroachdb_token_soup(sql in soup()) {
        check(&sql);
    }

    /// Statements built only from words CockroachDB's forms do not use are PostgreSQL's, and
    /// reach it byte for byte.
    #[test]
    fn postgresql_only_text_is_never_touched(
        parts in prop::collection::vec(prop::sample::select(&[
            "SELECT", "INSERT", "UPDATE", "t", "x", "1", "'a'", "(", ")", ",", ";", "WHERE",
            "=", "FROM", "VALUES", "AS", "OF", "TIME", "\"Q\"", "--c\n", "ARRAY", "[", "]",
        ][..]), 0..30)
    ) {
        let sql = parts.join(" ");
        prop_assert_eq!(translate(&sql), Outcome::Unchanged);
    }
}

#[test]
fn transaction_effects_follow_savepoints_and_flag_what_a_restart_would_lose() {
    use TxnEffect::*;
    assert_eq!(txn_effects("SELECT 1; UPDATE t SET v = 1"), vec![]);
    assert_eq!(
        txn_effects(
            "SAVEPOINT cockroach_restart; RELEASE SAVEPOINT cockroach_restart; \
             rollback to savepoint \"A\"; ROLLBACK TRANSACTION TO b; release c; ROLLBACK"
        ),
        vec![
            Savepoint("cockroach_restart".into()),
            Release("cockroach_restart".into()),
            RollbackTo("A".into()),
            RollbackTo("b".into()),
            Release("c".into())
        ]
    );
    for opaque in [
        "DECLARE c CURSOR FOR SELECT 1",
        "SET LOCAL statement_timeout = 1",
        "LOCK TABLE t",
        "SELECT pg_advisory_xact_lock(1)",
        "PREPARE TRANSACTION 'x'",
    ] {
        assert_eq!(txn_effects(opaque), vec![Opaque], "{opaque}");
    }
}

#[test]
fn cockroachdb_session_variables_are_the_extensions_settings() {
    let sql = |s: &str| rewritten(s).assemble(|_| unreachable!());
    assert_eq!(
        sql("SET override_multi_region_zone_config = true"),
        "SET multiregion.override_multi_region_zone_config = true"
    );
    assert_eq!(
        sql("SET SESSION enable_auto_rehoming TO on"),
        "SET SESSION multiregion.enable_auto_rehoming TO on"
    );
    assert_eq!(
        sql("RESET override_multi_region_zone_config"),
        "RESET multiregion.override_multi_region_zone_config"
    );
    assert_eq!(
        sql("SHOW enable_auto_rehoming"),
        "SELECT pg_catalog.current_setting('multiregion.enable_auto_rehoming') AS enable_auto_rehoming"
    );
    assert_eq!(
        translate("SET multiregion.enable_auto_rehoming = on"),
        Outcome::Unchanged
    );
}

/// Through the gateway, CockroachDB's integers: `INT` is 8 bytes and `SERIAL` is
/// `unique_rowid()`; `multiregion.execute()` keeps PostgreSQL's meaning (statements.rs).
#[test]
fn gateway_integers_are_eight_bytes_and_serial_is_unique_rowid() {
    let sql = |s: &str| rewritten(s).assemble(|_| unreachable!());
    let rowid = "int8 NOT NULL DEFAULT multiregion.unique_rowid()";
    assert_eq!(
        sql("CREATE TABLE t (a INT PRIMARY KEY, b INTEGER, c INT4, d INT[], e INT64)"),
        "CREATE TABLE t (a int8 PRIMARY KEY, b int8, c INT4, d int8[], e int8)"
    );
    assert_eq!(
        sql("CREATE TABLE t (id SERIAL PRIMARY KEY, n SMALLSERIAL, b bigserial)"),
        format!("CREATE TABLE t (id {rowid} PRIMARY KEY, n {rowid}, b {rowid})")
    );
    // Columns named like types or like CockroachDB's elements keep their names.
    assert_eq!(
        sql("CREATE TABLE t (serial INT, index int, CONSTRAINT c CHECK (serial::int > 0))"),
        "CREATE TABLE t (serial int8, index int8, CONSTRAINT c CHECK (serial::int > 0))"
    );
    // With a multi-region part, the extension gets the converted text.
    let s = sql("CREATE TABLE t (id INT PRIMARY KEY, v STRING) LOCALITY GLOBAL");
    assert!(
        s.contains("(id int8 PRIMARY KEY, v text) LOCALITY GLOBAL"),
        "{s}"
    );
    assert_eq!(
        sql("ALTER TABLE t ADD COLUMN a INT, ADD b SERIAL, ADD IF NOT EXISTS c INTEGER"),
        format!("ALTER TABLE t ADD COLUMN a int8, ADD b {rowid}, ADD IF NOT EXISTS c int8")
    );
    assert_eq!(
        sql("ALTER TABLE t ALTER COLUMN a TYPE INT, ALTER b SET DATA TYPE int4"),
        "ALTER TABLE t ALTER COLUMN a TYPE int8, ALTER b SET DATA TYPE int4"
    );
    // Constraints, defaults, explicit sizes and CREATE TABLE AS are left alone.
    for s in [
        "ALTER TABLE t ADD CONSTRAINT c CHECK (a::int > 0)",
        "ALTER TABLE t ADD PRIMARY KEY (a)",
        "ALTER TABLE t ALTER COLUMN a SET DEFAULT 1",
        "ALTER TABLE t ALTER COLUMN a TYPE int4",
        "CREATE TABLE t AS SELECT 1::int AS a",
        "CREATE TABLE t (a int8, b bigint)",
    ] {
        assert_eq!(translate(s), Outcome::Unchanged, "{s}");
    }
}
