//! The region DDL's rules: every refusal with CockroachDB's SQLSTATE, and what each accepted
//! statement does to the configuration.

use mr_meta::{DatabaseConfig, Placement, SurvivalGoal, TableLocality};
use mr_zoneconfig::ddl::{self, Change, DdlError};
use std::collections::BTreeSet;

fn cluster() -> BTreeSet<String> {
    ["europe-west1", "us-east1", "us-west1"]
        .map(String::from)
        .into()
}

fn db(regions: &[&str]) -> DatabaseConfig {
    DatabaseConfig {
        database: "movr".into(),
        primary_region: regions[0].into(),
        regions: regions.iter().map(|r| r.to_string()).collect(),
        survival: SurvivalGoal::Zone,
        placement: Placement::Default,
        secondary_region: None,
    }
}

fn set(c: Result<Change, DdlError>) -> DatabaseConfig {
    match c {
        Ok(Change::Set(d)) => d,
        other => panic!("expected a new configuration, got {other:?}"),
    }
}

fn refused(c: Result<Change, DdlError>) -> DdlError {
    c.expect_err("expected a refusal")
}

#[test]
fn the_first_primary_region_makes_the_database_multi_region_with_zone_survival() {
    let d = set(ddl::set_primary_region(
        None,
        "movr",
        &cluster(),
        "us-east1",
    ));
    assert_eq!(d, db(&["us-east1"]));
}

#[test]
fn an_unknown_region_is_refused_with_the_valid_ones_as_hint() {
    let e = refused(ddl::set_primary_region(None, "movr", &cluster(), "mars"));
    assert_eq!(e.sqlstate, "42602");
    assert_eq!(e.message, r#"region "mars" does not exist"#);
    assert_eq!(
        e.hint.as_deref(),
        Some("valid regions: europe-west1, us-east1, us-west1")
    );
    let e = refused(ddl::add_region(
        Some(&db(&["us-east1"])),
        "movr",
        &cluster(),
        "mars",
        true,
    ));
    assert_eq!(e.sqlstate, "42602");
}

#[test]
fn the_primary_region_must_already_be_a_database_region_once_there_is_one() {
    let e = refused(ddl::set_primary_region(
        Some(&db(&["us-east1"])),
        "movr",
        &cluster(),
        "us-west1",
    ));
    assert_eq!(
        e.message,
        r#"region "us-west1" has not been added to the database"#
    );
    let d = set(ddl::set_primary_region(
        Some(&db(&["us-east1", "us-west1"])),
        "movr",
        &cluster(),
        "us-west1",
    ));
    assert_eq!(d.primary_region, "us-west1");
}

#[test]
fn adding_a_region_needs_a_primary_region_and_a_new_region() {
    let e = refused(ddl::add_region(None, "movr", &cluster(), "us-east1", false));
    assert_eq!(e.sqlstate, "42P12");
    let e = refused(ddl::add_region(
        Some(&db(&["us-east1"])),
        "movr",
        &cluster(),
        "us-east1",
        false,
    ));
    assert_eq!(
        (e.sqlstate, e.message.as_str()),
        ("42710", r#"region "us-east1" already added to database"#)
    );
    assert!(matches!(
        ddl::add_region(
            Some(&db(&["us-east1"])),
            "movr",
            &cluster(),
            "us-east1",
            true
        ),
        Ok(Change::Skip(_))
    ));
    let d = set(ddl::add_region(
        Some(&db(&["us-east1"])),
        "movr",
        &cluster(),
        "us-west1",
        false,
    ));
    assert_eq!(d.regions.len(), 2);
}

#[test]
fn the_primary_region_is_dropped_only_as_the_last_region() {
    let e = refused(ddl::drop_region(
        Some(&db(&["us-east1", "us-west1"])),
        "movr",
        "us-east1",
        false,
        &[],
    ));
    assert_eq!(e.message, r#"cannot drop region "us-east1""#);
    assert!(e
        .hint
        .unwrap()
        .starts_with("You must designate another region as the primary region"));
    assert_eq!(
        ddl::drop_region(Some(&db(&["us-east1"])), "movr", "us-east1", false, &[]),
        Ok(Change::Unset)
    );
}

#[test]
fn the_secondary_region_cannot_be_dropped() {
    let mut d = db(&["us-east1", "us-west1"]);
    d.secondary_region = Some("us-west1".into());
    let e = refused(ddl::drop_region(Some(&d), "movr", "us-west1", false, &[]));
    assert!(e.hint.unwrap().contains("DROP SECONDARY REGION"));
}

#[test]
fn region_survival_needs_three_regions_before_and_after_a_drop() {
    let e = refused(ddl::set_survival(
        Some(&db(&["us-east1", "us-west1"])),
        "movr",
        SurvivalGoal::Region,
    ));
    assert_eq!(e.sqlstate, "42602");
    assert_eq!(
        e.message,
        "at least 3 regions are required for surviving a region failure"
    );
    assert_eq!(
        e.hint.as_deref(),
        Some("you must add additional regions to the database using ALTER DATABASE movr ADD REGION <region_name>")
    );
    let mut d = set(ddl::set_survival(
        Some(&db(&["us-east1", "us-west1", "europe-west1"])),
        "movr",
        SurvivalGoal::Region,
    ));
    assert_eq!(
        refused(ddl::drop_region(Some(&d), "movr", "us-west1", false, &[])).sqlstate,
        "42602"
    );
    d.regions.insert("asia".into());
    assert!(ddl::drop_region(Some(&d), "movr", "us-west1", false, &[]).is_ok());
}

#[test]
fn restricted_placement_and_region_survival_exclude_each_other() {
    let three = db(&["us-east1", "us-west1", "europe-west1"]);
    let restricted = set(ddl::set_placement(
        Some(&three),
        "movr",
        Placement::Restricted,
    ));
    let e = refused(ddl::set_survival(
        Some(&restricted),
        "movr",
        SurvivalGoal::Region,
    ));
    assert_eq!(e.sqlstate, "22023");
    let region = set(ddl::set_survival(
        Some(&three),
        "movr",
        SurvivalGoal::Region,
    ));
    assert_eq!(
        refused(ddl::set_placement(
            Some(&region),
            "movr",
            Placement::Restricted
        ))
        .sqlstate,
        "22023"
    );
    assert!(ddl::set_placement(Some(&region), "movr", Placement::Default).is_ok());
}

#[test]
fn a_region_that_homes_a_table_cannot_be_dropped() {
    let e = refused(ddl::drop_region(
        Some(&db(&["us-east1", "us-west1"])),
        "movr",
        "us-west1",
        false,
        &["users".into()],
    ));
    assert_eq!(e.sqlstate, "2BP01");
    assert_eq!(
        e.message,
        r#"could not remove enum value "us-west1" as it is the home region for table "users""#
    );
}

#[test]
fn dropping_a_missing_region_errors_or_skips() {
    let d = db(&["us-east1"]);
    assert_eq!(
        refused(ddl::drop_region(Some(&d), "movr", "us-west1", false, &[])).sqlstate,
        "42704"
    );
    assert!(matches!(
        ddl::drop_region(Some(&d), "movr", "us-west1", true, &[]),
        Ok(Change::Skip(_))
    ));
}

#[test]
fn secondary_region_rules() {
    let d = db(&["us-east1", "us-west1"]);
    assert!(refused(ddl::set_secondary_region(
        Some(&d),
        "movr",
        Some("us-east1"),
        false
    ))
    .message
    .contains("primary"));
    assert!(refused(ddl::set_secondary_region(
        Some(&d),
        "movr",
        Some("europe-west1"),
        false
    ))
    .message
    .contains("not been added"));
    let s = set(ddl::set_secondary_region(
        Some(&d),
        "movr",
        Some("us-west1"),
        false,
    ));
    assert_eq!(s.secondary_region.as_deref(), Some("us-west1"));
    assert!(matches!(
        ddl::set_secondary_region(Some(&d), "movr", None, true),
        Ok(Change::Skip(_))
    ));
    assert_eq!(
        refused(ddl::set_secondary_region(Some(&d), "movr", None, false)).sqlstate,
        "42704"
    );
}

#[test]
fn locality_needs_a_multi_region_database_and_a_database_region() {
    let e = ddl::check_locality(None, "movr", &TableLocality::Global).unwrap_err();
    assert_eq!(
        e.message,
        "cannot set LOCALITY on a table in a database that is not multi-region enabled"
    );
    let d = db(&["us-east1"]);
    let e = ddl::check_locality(
        Some(&d),
        "movr",
        &TableLocality::RegionalByTable {
            region: Some("us-west1".into()),
        },
    )
    .unwrap_err();
    assert_eq!(e.sqlstate, "42602");
    assert_eq!(
        ddl::locality_sql(&TableLocality::RegionalByRow {
            column: "crdb_region".into()
        }),
        "REGIONAL BY ROW"
    );
    assert_eq!(
        ddl::locality_sql(&TableLocality::RegionalByRow {
            column: "region".into()
        }),
        r#"REGIONAL BY ROW AS "region""#
    );
}

#[test]
fn create_database_refuses_regions_or_survival_without_a_primary_region_and_repeated_regions() {
    let regions = |rs: &[&str]| rs.iter().map(|r| r.to_string()).collect::<Vec<_>>();
    let e = ddl::check_create_database(None, &[], Some(SurvivalGoal::Region)).unwrap_err();
    assert_eq!(
        (e.sqlstate, e.message.as_str()),
        (
            "42P12",
            "PRIMARY REGION must be specified when using SURVIVE"
        )
    );
    let e = ddl::check_create_database(None, &regions(&["us-east1"]), None).unwrap_err();
    assert_eq!(
        (e.sqlstate, e.message.as_str()),
        (
            "42P12",
            "PRIMARY REGION must be specified if REGIONS are specified"
        )
    );
    let e = ddl::check_create_database(
        Some("us-east1"),
        &regions(&["us-west1", "europe-west1", "us-west1"]),
        None,
    )
    .unwrap_err();
    assert_eq!(
        (e.sqlstate, e.message.as_str()),
        ("42602", "region \"us-west1\" defined multiple times")
    );
    // The primary region may also be listed among the regions, as CockroachDB allows.
    ddl::check_create_database(
        Some("us-east1"),
        &regions(&["us-east1", "us-west1"]),
        Some(SurvivalGoal::Zone),
    )
    .unwrap();
    ddl::check_create_database(None, &[], None).unwrap();
}
