//! The translator on CockroachDB's statements: the MovR tutorial's Step 5 verbatim, every
//! form of the region, survival and locality DDL and the SHOW statements, what it leaves to
//! PostgreSQL, syntax errors with positions, and no panic on any input.

use mr_sql::*;

fn ok(sql: &str) -> Statement {
    parse(sql)
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .unwrap_or_else(|| panic!("{sql}: not recognized"))
}

fn name(parts: &[&str]) -> ObjectName {
    ObjectName(parts.iter().map(|p| p.to_string()).collect())
}

#[test]
fn the_movr_tutorial_step_5_parses_verbatim() {
    assert_eq!(
        ok(r#"ALTER DATABASE movr PRIMARY REGION "us-east1";"#),
        Statement::AlterDatabasePrimaryRegion {
            database: "movr".into(),
            region: "us-east1".into()
        }
    );
    assert_eq!(
        ok(r#"ALTER DATABASE movr ADD REGION "europe-west1";"#),
        Statement::AlterDatabaseAddRegion {
            database: "movr".into(),
            region: "europe-west1".into(),
            if_not_exists: false
        }
    );
    assert_eq!(
        ok("ALTER TABLE promo_codes SET locality GLOBAL;"),
        Statement::AlterTableSetLocality {
            table: name(&["promo_codes"]),
            locality: Locality::Global,
            if_exists: false
        }
    );
    // A plain PostgreSQL statement in the middle of the tutorial is PostgreSQL's.
    assert_eq!(
        parse(
            "ALTER TABLE user_promo_codes\n  ADD CONSTRAINT user_promo_codes_code_fk\n    FOREIGN KEY (code)\n    REFERENCES promo_codes (code)\n    ON UPDATE CASCADE;"
        ),
        Ok(None)
    );
    let computed = "ALTER TABLE rides ADD COLUMN region crdb_internal_region AS (\n  CASE WHEN city = 'amsterdam' THEN 'europe-west1'\n       WHEN city = 'new york' THEN 'us-east1'\n  END\n) STORED;";
    match ok(computed) {
        Statement::Rewritten { sql } => assert_eq!(
            sql,
            "ALTER TABLE rides ADD COLUMN region crdb_internal_region GENERATED ALWAYS AS (\n  CASE WHEN city = 'amsterdam' THEN 'europe-west1'\n       WHEN city = 'new york' THEN 'us-east1'\n  END\n) STORED;"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        parse("ALTER TABLE rides ALTER COLUMN REGION SET NOT NULL;"),
        Ok(None)
    );
    assert_eq!(
        ok(r#"ALTER TABLE rides SET LOCALITY REGIONAL BY ROW AS "region";"#),
        Statement::AlterTableSetLocality {
            table: name(&["rides"]),
            locality: Locality::RegionalByRow {
                column: Some("region".into())
            },
            if_exists: false
        }
    );
}

#[test]
fn every_database_form() {
    assert_eq!(
        ok(
            r#"CREATE DATABASE IF NOT EXISTS movr PRIMARY REGION "us-east1" REGIONS "us-west1", 'europe-west1' SURVIVE REGION FAILURE"#
        ),
        Statement::CreateDatabase {
            name: "movr".into(),
            if_not_exists: true,
            primary_region: Some("us-east1".into()),
            regions: vec!["us-west1".into(), "europe-west1".into()],
            survival: Some(SurvivalGoal::Region),
            placement: None,
            secondary_region: None,
        }
    );
    assert!(matches!(
        ok("create database d primary region = r1 regions = r2 placement restricted"),
        Statement::CreateDatabase {
            placement: Some(Placement::Restricted),
            ..
        }
    ));
    assert_eq!(parse("CREATE DATABASE plain"), Ok(None));
    assert_eq!(
        parse("CREATE DATABASE plain TEMPLATE template0 ENCODING 'UTF8'"),
        Ok(None)
    );
    assert!(parse("CREATE DATABASE d PRIMARY REGION r TEMPLATE template0").is_err());
    let alter = |s: &str| ok(&format!("ALTER DATABASE movr {s}"));
    assert!(matches!(
        alter("SET PRIMARY REGION us_east"),
        Statement::AlterDatabasePrimaryRegion { .. }
    ));
    assert!(matches!(
        alter(r#"ADD REGION IF NOT EXISTS "x""#),
        Statement::AlterDatabaseAddRegion {
            if_not_exists: true,
            ..
        }
    ));
    assert!(matches!(
        alter(r#"DROP REGION IF EXISTS "x""#),
        Statement::AlterDatabaseDropRegion {
            if_exists: true,
            ..
        }
    ));
    assert_eq!(
        alter("SURVIVE ZONE FAILURE"),
        Statement::AlterDatabaseSurvival {
            database: "movr".into(),
            goal: SurvivalGoal::Zone
        }
    );
    assert!(matches!(
        alter("PLACEMENT DEFAULT"),
        Statement::AlterDatabasePlacement {
            placement: Placement::Default,
            ..
        }
    ));
    assert!(matches!(
        alter(r#"SET SECONDARY REGION "us-west1""#),
        Statement::AlterDatabaseSecondaryRegion {
            region: Some(_),
            ..
        }
    ));
    assert!(matches!(
        alter("DROP SECONDARY REGION"),
        Statement::AlterDatabaseSecondaryRegion { region: None, .. }
    ));
    // PostgreSQL's ALTER DATABASE forms pass through.
    assert_eq!(
        parse("ALTER DATABASE movr SET work_mem TO '64MB'"),
        Ok(None)
    );
    assert_eq!(parse("ALTER DATABASE movr RENAME TO movr2"), Ok(None));
}

#[test]
fn set_locality_keeps_if_exists() {
    assert_eq!(
        ok("ALTER TABLE IF EXISTS missing SET LOCALITY GLOBAL"),
        Statement::AlterTableSetLocality {
            table: name(&["missing"]),
            locality: Locality::Global,
            if_exists: true
        }
    );
}

#[test]
fn every_locality_form() {
    let set = |l: &str| match ok(&format!("ALTER TABLE s.t SET LOCALITY {l}")) {
        Statement::AlterTableSetLocality {
            table,
            locality,
            if_exists: false,
        } => {
            assert_eq!(table, name(&["s", "t"]));
            locality
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(set("GLOBAL"), Locality::Global);
    assert_eq!(
        set("REGIONAL BY TABLE"),
        Locality::RegionalByTable { region: None }
    );
    assert_eq!(
        set("REGIONAL BY TABLE IN PRIMARY REGION"),
        Locality::RegionalByTable { region: None }
    );
    assert_eq!(
        set(r#"REGIONAL BY TABLE IN "us-west1""#),
        Locality::RegionalByTable {
            region: Some("us-west1".into())
        }
    );
    assert_eq!(
        set(r#"REGIONAL IN "us-west1""#),
        Locality::RegionalByTable {
            region: Some("us-west1".into())
        }
    );
    assert_eq!(
        set("REGIONAL BY ROW"),
        Locality::RegionalByRow { column: None }
    );
    assert_eq!(
        set("regional by row as Home"),
        Locality::RegionalByRow {
            column: Some("home".into())
        }
    );
}

#[test]
fn create_table_with_locality_and_computed_columns() {
    match ok(
        r#"CREATE TABLE users (id UUID PRIMARY KEY, city STRING, r crdb_internal_region AS (CASE WHEN city = 'rome' THEN 'europe-west1' END) STORED) LOCALITY REGIONAL BY ROW AS r;"#,
    ) {
        Statement::CreateTable {
            table,
            sql,
            locality,
            indexes,
        } => {
            assert!(indexes.is_empty());
            assert_eq!(table, name(&["users"]));
            assert_eq!(
                sql,
                "CREATE TABLE users (id UUID PRIMARY KEY, city text, r crdb_internal_region GENERATED ALWAYS AS (CASE WHEN city = 'rome' THEN 'europe-west1' END) STORED)"
            );
            assert_eq!(
                locality,
                Some(Locality::RegionalByRow {
                    column: Some("r".into())
                })
            );
        }
        other => panic!("{other:?}"),
    }
    match ok("create table if not exists promo (code text primary key) locality global") {
        Statement::CreateTable { sql, locality, .. } => {
            assert_eq!(
                sql,
                "create table if not exists promo (code text primary key)"
            );
            assert_eq!(locality, Some(Locality::Global));
        }
        other => panic!("{other:?}"),
    }
    // PostgreSQL's own generated columns and plain tables are left alone.
    assert_eq!(
        parse("CREATE TABLE t (a int, b int GENERATED ALWAYS AS (a * 2) STORED)"),
        Ok(None)
    );
    assert_eq!(parse("CREATE TABLE t AS SELECT 1 AS (x)"), Ok(None));
    assert_eq!(parse("CREATE TABLE t (a int)"), Ok(None));
    // A column named locality is not the clause.
    assert_eq!(parse("CREATE TABLE t (locality text)"), Ok(None));
    // VIRTUAL is stored (PostgreSQL 15 has no virtual generated columns).
    match ok("CREATE TABLE t (a int, b int AS (a) VIRTUAL)") {
        Statement::CreateTable { sql, .. } => assert_eq!(
            sql,
            "CREATE TABLE t (a int, b int GENERATED ALWAYS AS (a) STORED)"
        ),
        other => panic!("{other:?}"),
    }
}

/// The MovR tutorial's schema as CockroachDB prints it (`cockroach workload init movr`).
#[test]
fn cockroach_table_elements_become_postgresql_statements() {
    let Statement::CreateTable {
        table,
        sql,
        locality,
        indexes,
    } = ok(r#"CREATE TABLE public.vehicles (
        id UUID NOT NULL,
        city STRING NOT NULL,
        type STRING NULL,
        owner_id UUID NULL,
        creation_time TIMESTAMP NULL,
        status STRING(10) NULL,
        ext JSONB NULL,
        seats INT NOT NULL DEFAULT 4,
        photo BYTES NULL,
        secret STRING NOT VISIBLE NULL,
        CONSTRAINT "primary" PRIMARY KEY (city ASC, id DESC),
        CONSTRAINT fk_city_ref_users FOREIGN KEY (city, owner_id) REFERENCES users(city, id),
        INDEX vehicles_auto_index_fk_city_ref_users (city ASC, owner_id ASC),
        UNIQUE INDEX vehicles_by_status (status) STORING (type) WHERE status IS NOT NULL,
        INVERTED INDEX (ext),
        FAMILY "primary" (id, city, type, owner_id, creation_time, status, ext)
    )"#)
    else {
        panic!("not CREATE TABLE");
    };
    assert_eq!(table, name(&["public", "vehicles"]));
    assert_eq!(locality, None);
    let squeezed = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(
        squeezed,
        "CREATE TABLE public.vehicles (id UUID NOT NULL, city text NOT NULL, type text NULL, \
         owner_id UUID NULL, creation_time TIMESTAMP NULL, status varchar(10) NULL, \
         ext JSONB NULL, seats INT NOT NULL DEFAULT 4, photo bytea NULL, \
         secret text NULL, CONSTRAINT \"vehicles_pkey\" PRIMARY KEY (city , id ), \
         CONSTRAINT fk_city_ref_users FOREIGN KEY (city, owner_id) REFERENCES users(city, id))"
    );
    assert_eq!(
        indexes,
        [
            "CREATE INDEX vehicles_auto_index_fk_city_ref_users ON public.vehicles (city ASC, owner_id ASC)",
            "CREATE UNIQUE INDEX vehicles_by_status ON public.vehicles (status) INCLUDE (type) WHERE status IS NOT NULL",
            "CREATE INDEX ON public.vehicles USING gin (ext)",
        ]
    );
    // Malformed inline indexes are syntax errors at the offending token.
    let e = parse("CREATE TABLE t (a STRING, INDEX (a) USING btree)").unwrap_err();
    assert!(e.message.contains("USING HASH"), "{e:?}");
    assert_eq!(e.position, 37);
    let e = parse("CREATE TABLE t (a STRING, INDEX i (a) b)").unwrap_err();
    assert_eq!(e.message, "syntax error at or near \"b\"");
    // Columns PostgreSQL lets be named index or family stay columns.
    assert_eq!(
        parse("CREATE TABLE t (index int, family text, x int, index2 varchar(10))"),
        Ok(None)
    );
    match ok("CREATE TABLE t (index varchar(10), family STRING, INDEX (index))") {
        Statement::CreateTable { sql, indexes, .. } => {
            assert_eq!(sql, "CREATE TABLE t (index varchar(10), family text)");
            assert_eq!(indexes, ["CREATE INDEX ON t (index)"]);
        }
        other => panic!("{other:?}"),
    }
    match ok("CREATE TABLE t (a STRING, b STRING, UNIQUE WITHOUT INDEX (a), CONSTRAINT u UNIQUE WITHOUT INDEX (b))") {
        Statement::CreateTable { sql, .. } => assert_eq!(
            sql,
            "CREATE TABLE t (a text, b text, UNIQUE  (a), CONSTRAINT u UNIQUE  (b))"
        ),
        other => panic!("{other:?}"),
    }
    // INT and SERIAL keep PostgreSQL's meaning here (the gateway gives them CockroachDB's);
    // PostgreSQL's own statements are left alone.
    assert_eq!(
        parse("CREATE TABLE t (a int PRIMARY KEY, b serial, c smallint)"),
        Ok(None)
    );
    assert_eq!(
        parse("CREATE TABLE t (a int8, CONSTRAINT c UNIQUE (a), CHECK (a > 0))"),
        Ok(None)
    );
}

#[test]
fn every_show_form() {
    assert_eq!(ok("SHOW REGIONS"), Statement::ShowRegions(ShowRegions::All));
    assert_eq!(
        ok("SHOW REGIONS FROM CLUSTER"),
        Statement::ShowRegions(ShowRegions::Cluster)
    );
    assert_eq!(
        ok("SHOW REGIONS FROM DATABASE"),
        Statement::ShowRegions(ShowRegions::Database(None))
    );
    assert_eq!(
        ok("show regions from database movr;"),
        Statement::ShowRegions(ShowRegions::Database(Some("movr".into())))
    );
    assert_eq!(
        ok("SHOW REGIONS FROM ALL DATABASES"),
        Statement::ShowRegions(ShowRegions::AllDatabases)
    );
    assert_eq!(
        ok("SHOW SURVIVAL GOAL"),
        Statement::ShowSurvivalGoal { database: None }
    );
    assert_eq!(
        ok("SHOW SURVIVAL GOAL FROM DATABASE movr"),
        Statement::ShowSurvivalGoal {
            database: Some("movr".into())
        }
    );
    assert_eq!(
        ok("SHOW ZONE CONFIGURATIONS"),
        Statement::ShowZoneConfigurations
    );
    assert_eq!(
        ok("SHOW ALL ZONE CONFIGURATIONS"),
        Statement::ShowZoneConfigurations
    );
    assert_eq!(
        ok("SHOW ZONE CONFIGURATION FROM RANGE default"),
        Statement::ShowZoneConfiguration(ZoneTarget::Default)
    );
    assert_eq!(
        ok("SHOW ZONE CONFIGURATION FROM DATABASE movr"),
        Statement::ShowZoneConfiguration(ZoneTarget::Database("movr".into()))
    );
    assert_eq!(
        ok("SHOW ZONE CONFIGURATION FROM TABLE movr.public.users"),
        Statement::ShowZoneConfiguration(ZoneTarget::Table(name(&["movr", "public", "users"])))
    );
    assert_eq!(
        ok(r#"SHOW ZONE CONFIGURATION FROM PARTITION "us-east1" OF INDEX users@users_pkey"#),
        Statement::ShowZoneConfiguration(ZoneTarget::Partition {
            partition: "us-east1".into(),
            table: name(&["users"]),
            index: Some("users_pkey".into())
        })
    );
    assert_eq!(ok("SHOW LOCALITY"), Statement::ShowLocality);
    assert_eq!(
        ok("SHOW TABLES FROM movr"),
        Statement::ShowTables {
            from: Some(name(&["movr"]))
        }
    );
    assert_eq!(
        ok("SHOW RANGES"),
        Statement::ShowRanges(RangesFrom::CurrentDatabase)
    );
    assert_eq!(
        ok("show ranges from table public.\"Users\""),
        Statement::ShowRanges(RangesFrom::Table(name(&["public", "Users"])))
    );
    assert_eq!(
        ok("SHOW RANGES FROM DATABASE movr;"),
        Statement::ShowRanges(RangesFrom::Database("movr".into()))
    );
    assert!(parse("SHOW RANGES FROM INDEX t@i").is_err());
    // PostgreSQL's SHOW is PostgreSQL's.
    assert_eq!(parse("SHOW search_path"), Ok(None));
    assert_eq!(parse("SELECT 1"), Ok(None));
}

#[test]
fn malformed_statements_are_syntax_errors_with_positions() {
    let err = parse("ALTER DATABASE movr ADD REGION").unwrap_err();
    assert_eq!(err.message, "syntax error at end of input");
    assert_eq!(err.position, 31);
    let err = parse("ALTER DATABASE movr SURVIVE CITY FAILURE").unwrap_err();
    assert_eq!(err.message, "syntax error at or near \"CITY\"");
    assert_eq!(err.position, 29);
    let err = parse("ALTER TABLE t SET LOCALITY REGIONAL BY COLUMN").unwrap_err();
    assert_eq!(err.message, "syntax error at or near \"COLUMN\"");
    let err = parse("SHOW REGIONS FROM somewhere").unwrap_err();
    assert_eq!(err.position, 19);
    // Positions count characters, not bytes.
    let err = parse("ALTER DATABASE \"zürich\" ADD REGION 'r' extra").unwrap_err();
    assert_eq!(err.position, 40);
    assert_eq!(
        err.to_string(),
        "syntax error at or near \"extra\" at character 40"
    );
    assert!(parse("ALTER DATABASE movr ADD REGION ''").is_err());
}

/// Whatever the input — random bytes, truncated and spliced statements — the parser answers
/// without panicking.
#[test]
fn no_input_makes_it_panic() {
    let seeds = [
        r#"ALTER DATABASE movr PRIMARY REGION "us-east1";"#,
        r#"CREATE TABLE t (a int, r crdb_internal_region AS (CASE WHEN a = 1 THEN 'x' END) STORED) LOCALITY REGIONAL BY ROW AS r"#,
        "SHOW ZONE CONFIGURATION FROM PARTITION \"p\" OF INDEX a.b@c",
        "ALTER TABLE t SET LOCALITY REGIONAL BY TABLE IN PRIMARY REGION",
        "CREATE DATABASE d PRIMARY REGION r REGIONS a, b SURVIVE ZONE FAILURE PLACEMENT DEFAULT",
        "select $1::text, $$dollar$$, e'x', /* c /* n */ */ 'it''s' -- tail",
    ];
    let pieces = [
        "(", ")", "\"", "'", "$", "$$", "/*", "*/", "--", ";", "@", ".", ",", "=", "AS",
        "LOCALITY", "REGION", "ü", "\u{0}", "\n", "STORED", "VIRTUAL", "IN", "BY", "ROW",
    ];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    };
    for seed in seeds {
        let chars: Vec<char> = seed.chars().collect();
        for cut in 0..=chars.len() {
            let s: String = chars[..cut].iter().collect();
            let _ = parse(&s);
        }
    }
    for _ in 0..20_000 {
        let seed: Vec<char> = seeds[next(seeds.len())].chars().collect();
        let mut s: String = seed[..next(seed.len() + 1)].iter().collect();
        for _ in 0..next(4) {
            s.push_str(pieces[next(pieces.len())]);
            s.push(' ');
        }
        let rest: String = seed[next(seed.len() + 1)..].iter().collect();
        s.push_str(&rest);
        let _ = parse(&s);
        let bytes: Vec<u8> = (0..next(40)).map(|_| next(256) as u8).collect();
        let _ = parse(&String::from_utf8_lossy(&bytes));
    }
}

#[test]
fn cluster_settings_and_more_show_forms() {
    let set = |name: &str, value: Option<&str>| Statement::SetClusterSetting {
        name: name.into(),
        value: value.map(String::from),
    };
    assert_eq!(
        ok("SET CLUSTER SETTING server.time_until_store_dead = '5m0s'"),
        set("server.time_until_store_dead", Some("5m0s"))
    );
    assert_eq!(
        ok("set cluster setting multiregion.replication.enabled to true"),
        set("multiregion.replication.enabled", Some("true"))
    );
    assert_eq!(
        ok("SET CLUSTER SETTING kv.closed_timestamp.target_duration = -1"),
        set("kv.closed_timestamp.target_duration", Some("-1"))
    );
    assert_eq!(ok("SET CLUSTER SETTING a.b = DEFAULT"), set("a.b", None));
    assert_eq!(ok("RESET CLUSTER SETTING a.b;"), set("a.b", None));
    assert!(parse("SET CLUSTER SETTING a.b").is_err());
    assert!(parse("SET CLUSTER SETTING a.b = 1 2").is_err());
    assert_eq!(
        ok("SHOW CLUSTER SETTING a.b"),
        Statement::ShowClusterSetting { name: "a.b".into() }
    );
    assert_eq!(
        ok("SHOW ALL CLUSTER SETTINGS"),
        Statement::ShowClusterSettings
    );
    assert_eq!(ok("SHOW CLUSTER SETTINGS"), Statement::ShowClusterSettings);
    assert_eq!(ok("SHOW SEQUENCES"), Statement::ShowSequences);
    assert_eq!(ok("SHOW DATABASES"), Statement::ShowDatabases);
    assert_eq!(ok("SHOW ENUMS"), Statement::ShowEnums);
    // PostgreSQL's own SET and SHOW stay PostgreSQL's.
    assert_eq!(parse("SET search_path = public"), Ok(None));
    assert_eq!(parse("SHOW search_path"), Ok(None));
}

#[test]
fn show_create_database_text_parses_back_to_the_same_configuration() {
    use mr_meta::{DatabaseConfig, Placement};
    let config = DatabaseConfig {
        database: "movr".into(),
        primary_region: "us-east1".into(),
        regions: ["europe-west1", "us-east1", "us-west1"]
            .map(String::from)
            .into(),
        survival: SurvivalGoal::Region,
        placement: Placement::Default,
        secondary_region: Some("us-west1".into()),
    };
    let text = mr_zoneconfig::ddl::create_database_sql("movr", Some(&config));
    assert_eq!(
        text,
        "CREATE DATABASE movr PRIMARY REGION \"us-east1\" \
         REGIONS = \"europe-west1\", \"us-east1\", \"us-west1\" \
         SECONDARY REGION \"us-west1\" SURVIVE REGION FAILURE"
    );
    let Statement::CreateDatabase {
        name,
        primary_region,
        regions,
        survival,
        secondary_region,
        placement,
        ..
    } = ok(&text)
    else {
        panic!("not CREATE DATABASE: {text}");
    };
    assert_eq!(name, "movr");
    assert_eq!(primary_region.as_deref(), Some("us-east1"));
    assert_eq!(regions, ["europe-west1", "us-east1", "us-west1"]);
    assert_eq!(survival, Some(SurvivalGoal::Region));
    assert_eq!(secondary_region.as_deref(), Some("us-west1"));
    assert_eq!(placement, None);
    assert_eq!(
        mr_zoneconfig::ddl::create_database_sql("plain", None),
        "CREATE DATABASE plain"
    );
}

#[test]
fn show_create_indexes_and_partitions_forms() {
    let t = |s: &str| ObjectName(s.split('.').map(String::from).collect());
    assert_eq!(
        ok("SHOW CREATE TABLE public.users"),
        Statement::ShowCreate(CreateTarget::Table(t("public.users")))
    );
    assert_eq!(
        ok("SHOW CREATE users"),
        Statement::ShowCreate(CreateTarget::Table(t("users")))
    );
    assert_eq!(
        ok("SHOW CREATE DATABASE movr"),
        Statement::ShowCreate(CreateTarget::Database("movr".into()))
    );
    for form in ["INDEXES", "INDEX", "KEYS"] {
        assert_eq!(
            ok(&format!("SHOW {form} FROM users")),
            Statement::ShowIndexes { table: t("users") }
        );
    }
    assert_eq!(
        ok("SHOW PARTITIONS FROM TABLE users"),
        Statement::ShowPartitions(PartitionsFrom::Table(t("users")))
    );
    assert_eq!(
        ok("SHOW PARTITIONS FROM DATABASE movr"),
        Statement::ShowPartitions(PartitionsFrom::Database("movr".into()))
    );
    assert_eq!(
        ok("SHOW PARTITIONS FROM INDEX users@users_pkey"),
        Statement::ShowPartitions(PartitionsFrom::Index {
            table: t("users"),
            index: "users_pkey".into()
        })
    );
    // PostgreSQL's SHOW of a setting stays PostgreSQL's.
    assert!(matches!(mr_sql::parse("SHOW keys"), Ok(None)));
}

const SHARD16: &str = "int4 NOT NULL GENERATED ALWAYS AS \
    ((pg_catalog.hash_record(ROW(\"ts\")) & 2147483647) % 16) STORED";

#[test]
fn hash_sharded_keys_get_cockroachdbs_shard_column() {
    let create = |sql: &str| match ok(sql) {
        Statement::CreateTable { sql, indexes, .. } => (sql, indexes),
        other => panic!("{other:?}"),
    };
    let (sql, indexes) =
        create("CREATE TABLE events (ts TIMESTAMPTZ, v STRING, INDEX (ts) USING HASH)");
    assert_eq!(
        sql,
        format!(
            "CREATE TABLE events (ts TIMESTAMPTZ, v text, \"crdb_internal_ts_shard_16\" {SHARD16})"
        )
    );
    assert_eq!(
        indexes,
        ["CREATE INDEX ON events (ts) INCLUDE (\"crdb_internal_ts_shard_16\")"]
    );
    // A bucket count both ways, STORING merged with the shard, a primary key sharded.
    let (sql, indexes) = create(
        "CREATE TABLE e (id INT8, a INT8, b INT8, \
         PRIMARY KEY (id ASC) USING HASH WITH (bucket_count = 8), \
         INDEX ab (a, b DESC) USING HASH WITH BUCKET_COUNT = 4 STORING (id))",
    );
    assert!(
        sql.contains("PRIMARY KEY (id ) INCLUDE (\"crdb_internal_id_shard_8\")"),
        "{sql}"
    );
    assert!(sql.contains("\"crdb_internal_id_shard_8\" int4 NOT NULL GENERATED ALWAYS AS ((pg_catalog.hash_record(ROW(\"id\")) & 2147483647) % 8) STORED"), "{sql}");
    assert!(sql.contains("\"crdb_internal_a_b_shard_4\" int4"), "{sql}");
    assert_eq!(
        indexes,
        ["CREATE INDEX ab ON e (a, b DESC) INCLUDE (id, \"crdb_internal_a_b_shard_4\")"]
    );
    // A column's own PRIMARY KEY USING HASH becomes a table constraint.
    let (sql, _) = create("CREATE TABLE c (id UUID PRIMARY KEY USING HASH, v INT8)");
    assert!(
        sql.contains("PRIMARY KEY (id) INCLUDE (\"crdb_internal_id_shard_16\")"),
        "{sql}"
    );
    assert!(sql.starts_with("CREATE TABLE c (id UUID , v INT8"), "{sql}");
    // Bucket counts CockroachDB refuses.
    for bad in ["1", "4096"] {
        let e = parse(&format!(
            "CREATE TABLE t (a INT8, INDEX (a) USING HASH WITH (bucket_count = {bad}))"
        ))
        .unwrap_err();
        assert_eq!(e.sqlstate, "22023");
        assert_eq!(
            e.message,
            format!("hash sharded index bucket count must be in range [2, 2048], got {bad}")
        );
    }
    let e = parse("CREATE TABLE t (a INT8, INDEX (a) USING HASH WITH (buckets = 2))").unwrap_err();
    assert_eq!(
        (e.sqlstate, e.message.as_str()),
        ("42601", "syntax error at or near \"buckets\"")
    );
}

#[test]
fn cockroachdb_create_index_forms_become_postgresql_statements() {
    let stmts = |sql: &str| match ok(sql) {
        Statement::CreateIndex { statements } => statements,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        stmts("CREATE INDEX ON events (ts) USING HASH"),
        [
            format!("ALTER TABLE events ADD COLUMN IF NOT EXISTS \"crdb_internal_ts_shard_16\" {SHARD16}"),
            "CREATE INDEX ON events (ts) INCLUDE (\"crdb_internal_ts_shard_16\")".to_string(),
        ]
    );
    assert_eq!(
        stmts("CREATE INVERTED INDEX IF NOT EXISTS docs_idx ON public.docs (body)"),
        ["CREATE INDEX IF NOT EXISTS docs_idx ON public.docs USING gin (body)"]
    );
    assert_eq!(
        stmts("CREATE UNIQUE INDEX CONCURRENTLY u ON t (a DESC) STORING (b, c) WHERE a > 0"),
        ["CREATE UNIQUE INDEX u ON t (a DESC) INCLUDE (b, c) WHERE a > 0"]
    );
    // PostgreSQL's own CREATE INDEX statements are left alone.
    for sql in [
        "CREATE INDEX ON t (a)",
        "CREATE INDEX CONCURRENTLY i ON t USING gin (doc) WITH (fastupdate = off)",
        "CREATE UNIQUE INDEX i ON ONLY t (a) INCLUDE (b) NULLS NOT DISTINCT",
        "CREATE INDEX i ON t USING hash (a)",
        "CREATE INDEX i ON t ((lower(name))) TABLESPACE fast WHERE x IS NOT NULL",
    ] {
        assert_eq!(parse(sql), Ok(None), "{sql}");
    }
    let e = parse("CREATE INVERTED INDEX ON (a)").unwrap_err();
    assert_eq!(e.message, "syntax error at or near \"(\"");
}

#[test]
fn alter_primary_key_using_columns() {
    assert_eq!(
        ok("ALTER TABLE users ALTER PRIMARY KEY USING COLUMNS (city ASC, id DESC)"),
        Statement::AlterPrimaryKey {
            table: ObjectName(vec!["users".into()]),
            columns: vec!["city".into(), "id".into()],
            bucket_count: None,
        }
    );
    assert_eq!(
        ok("ALTER TABLE s.t ALTER PRIMARY KEY USING COLUMNS (\"Id\") USING HASH WITH (bucket_count = 8)"),
        Statement::AlterPrimaryKey {
            table: ObjectName(vec!["s".into(), "t".into()]),
            columns: vec!["Id".into()],
            bucket_count: Some(8),
        }
    );
    let e = parse("ALTER TABLE t ALTER PRIMARY KEY USING COLUMNS ()").unwrap_err();
    assert_eq!(e.message, "syntax error at or near \")\"");
    let e = parse("ALTER TABLE t ALTER PRIMARY KEY (a)").unwrap_err();
    assert_eq!(e.message, "syntax error at or near \"(\"");
    // PostgreSQL's own primary key changes are left alone.
    assert_eq!(parse("ALTER TABLE t ADD PRIMARY KEY (a)"), Ok(None));
    assert_eq!(parse("ALTER TABLE t DROP CONSTRAINT t_pkey"), Ok(None));
}

#[test]
fn configure_zone_forms() {
    let f = |pairs: &[(&str, Option<&str>)]| {
        Some(
            pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.map(str::to_string)))
                .collect::<Vec<_>>(),
        )
    };
    assert_eq!(
        ok("ALTER TABLE movr.public.users CONFIGURE ZONE USING num_replicas = 5, gc.ttlseconds = 600, constraints = '[+region=us-east1]', global_reads = true"),
        Statement::ConfigureZone {
            target: ZoneTarget::Table(name(&["movr", "public", "users"])),
            fields: f(&[
                ("num_replicas", Some("5")),
                ("gc.ttlseconds", Some("600")),
                ("constraints", Some("[+region=us-east1]")),
                ("global_reads", Some("true")),
            ]),
        }
    );
    assert_eq!(
        ok("ALTER DATABASE movr CONFIGURE ZONE DISCARD"),
        Statement::ConfigureZone {
            target: ZoneTarget::Database("movr".into()),
            fields: None,
        }
    );
    assert_eq!(
        ok("ALTER PARTITION \"us-west1\" OF TABLE users CONFIGURE ZONE USING num_voters = COPY FROM PARENT"),
        Statement::ConfigureZone {
            target: ZoneTarget::Partition {
                partition: "us-west1".into(),
                table: name(&["users"]),
                index: None,
            },
            fields: f(&[("num_voters", None)]),
        }
    );
    assert!(matches!(
        ok("ALTER RANGE default CONFIGURE ZONE USING num_replicas = 5"),
        Statement::ConfigureZone {
            target: ZoneTarget::Default,
            ..
        }
    ));
    assert!(matches!(
        ok("ALTER INDEX users@users_pkey CONFIGURE ZONE USING gc.ttlseconds = 1"),
        Statement::ConfigureZone {
            target: ZoneTarget::Index { .. },
            ..
        }
    ));
    let e = parse("ALTER TABLE t CONFIGURE ZONE USING num_replicas 5").unwrap_err();
    assert_eq!(e.message, "syntax error at or near \"5\"");
    let e = parse("ALTER TABLE t CONFIGURE ZONE").unwrap_err();
    assert_eq!(e.message, "syntax error at end of input");
    // A table or column named like the words is PostgreSQL's.
    assert_eq!(
        parse("ALTER TABLE zone ADD COLUMN configure int8"),
        Ok(None)
    );
}

#[test]
fn an_unnamed_unique_index_is_named_as_cockroachdb_names_it() {
    match ok("CREATE TABLE t (a STRING, b INT8, UNIQUE INDEX (a, b DESC), INDEX (b))") {
        Statement::CreateTable { indexes, .. } => assert_eq!(
            indexes,
            [
                "CREATE UNIQUE INDEX \"t_a_b_key\" ON t (a, b DESC)",
                "CREATE INDEX ON t (b)",
            ]
        ),
        other => panic!("{other:?}"),
    }
}
