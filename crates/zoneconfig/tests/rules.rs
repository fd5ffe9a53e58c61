//! The paper's §3.3 rules, checked for every locality × survival goal × placement × region
//! count, and CockroachDB's printed form for the MovR database.

use mr_meta::{DatabaseConfig, Placement, SurvivalGoal, TableLocality};
use mr_zoneconfig::*;
use std::collections::{BTreeMap, BTreeSet};

const REGIONS: [&str; 5] = [
    "us-east1",
    "europe-west1",
    "us-west1",
    "asia-east1",
    "us-central1",
];

fn db(
    n: usize,
    survival: SurvivalGoal,
    placement: Placement,
    secondary: Option<&str>,
) -> DatabaseConfig {
    DatabaseConfig {
        database: "movr".into(),
        primary_region: "us-east1".into(),
        regions: REGIONS[..n].iter().map(|r| r.to_string()).collect(),
        survival,
        placement,
        secondary_region: secondary.map(str::to_string),
    }
}

/// One target with its expected home region and whether it is REGIONAL (so affected by
/// PLACEMENT RESTRICTED).
struct Case {
    name: String,
    target: TargetOwned,
    home: String,
    regional: bool,
}

/// Every target that exists in a database with these regions.
fn targets(d: &DatabaseConfig) -> Vec<Case> {
    let case = |name: &str, target, home: &str, regional| Case {
        name: name.to_string(),
        target,
        home: home.to_string(),
        regional,
    };
    let rbr = TableLocality::RegionalByRow {
        column: "crdb_region".into(),
    };
    let mut v = vec![
        case("database", TargetOwned::Database, "us-east1", false),
        case(
            "global",
            TargetOwned::Table(TableLocality::Global),
            "us-east1",
            false,
        ),
        case(
            "rbt primary",
            TargetOwned::Table(TableLocality::RegionalByTable { region: None }),
            "us-east1",
            true,
        ),
        case("rbr table", TargetOwned::Table(rbr), "us-east1", true),
    ];
    for r in &d.regions {
        let rbt = TableLocality::RegionalByTable {
            region: Some(r.clone()),
        };
        v.push(case(
            &format!("rbt in {r}"),
            TargetOwned::Table(rbt),
            r,
            true,
        ));
        v.push(case(
            &format!("partition {r}"),
            TargetOwned::Partition(r.clone()),
            r,
            true,
        ));
    }
    v
}

enum TargetOwned {
    Database,
    Table(TableLocality),
    Partition(String),
}

fn config(d: &DatabaseConfig, t: &TargetOwned) -> Result<ZoneConfig, ZoneConfigError> {
    match t {
        TargetOwned::Database => zone_config(d, Target::Database),
        TargetOwned::Table(l) => zone_config(d, Target::Table(l)),
        TargetOwned::Partition(r) => zone_config(d, Target::Partition { region: r }),
    }
}

fn counts(c: &Constraints) -> BTreeMap<String, u32> {
    match c {
        Constraints::PerRegion(m) => m.clone(),
        Constraints::All(rs) => rs.iter().map(|r| (r.clone(), u32::MAX)).collect(),
    }
}

#[test]
fn every_locality_survival_placement_and_region_count_follows_the_rules() {
    let mut checked = 0;
    for n in 1..=5 {
        for survival in [SurvivalGoal::Zone, SurvivalGoal::Region] {
            for placement in [Placement::Default, Placement::Restricted] {
                for secondary in [None, Some("us-west1")] {
                    let d = db(n, survival, placement, secondary);
                    let regions: BTreeSet<String> = d.regions.clone();
                    for Case {
                        name,
                        target: t,
                        home,
                        regional,
                    } in targets(&d)
                    {
                        let what = format!("{name}, {n} regions, {survival:?}, {placement:?}, secondary {secondary:?}");
                        let got = config(&d, &t);
                        checked += 1;
                        if survival == SurvivalGoal::Region && n < 3 {
                            assert_eq!(
                                got,
                                Err(ZoneConfigError::TooFewRegionsForRegionSurvival),
                                "{what}"
                            );
                            continue;
                        }
                        if survival == SurvivalGoal::Region && placement == Placement::Restricted {
                            assert_eq!(
                                got,
                                Err(ZoneConfigError::RestrictedWithRegionSurvival),
                                "{what}"
                            );
                            continue;
                        }
                        let z = got.unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert_eq!(z.home_region, home, "{what}");
                        assert_eq!(
                            z.lease_preferences[0], home,
                            "{what}: lease in the home region"
                        );
                        let sec = secondary.filter(|s| *s != home && regions.contains(*s));
                        assert_eq!(
                            z.lease_preferences.get(1).map(String::as_str),
                            sec,
                            "{what}"
                        );
                        assert_eq!(
                            z.global_reads,
                            matches!(t, TargetOwned::Table(TableLocality::Global)),
                            "{what}"
                        );
                        assert!(z.num_replicas >= z.num_voters, "{what}");
                        let n = n as u32;
                        match survival {
                            SurvivalGoal::Zone => {
                                assert_eq!(z.num_voters, 3, "{what}");
                                assert_eq!(
                                    z.voter_constraints,
                                    Constraints::All(vec![home.clone()]),
                                    "{what}: voters at home"
                                );
                                if placement == Placement::Restricted && regional {
                                    assert_eq!(z.num_replicas, 3, "{what}: nothing outside home");
                                    assert_eq!(
                                        z.constraints,
                                        Constraints::All(vec![home.clone()]),
                                        "{what}"
                                    );
                                } else {
                                    assert_eq!(
                                        z.num_replicas,
                                        3 + (n - 1),
                                        "{what}: a non-voter per other region"
                                    );
                                }
                            }
                            SurvivalGoal::Region => {
                                assert_eq!(z.num_voters, 5, "{what}");
                                assert_eq!(z.num_replicas, 5.max(2 + (n - 1)), "{what}");
                                let v = counts(&z.voter_constraints);
                                assert_eq!(v.get(&home), Some(&2), "{what}: two voters at home");
                                if let Some(s) = sec {
                                    assert_eq!(v.get(s), Some(&2), "{what}: two at the secondary");
                                }
                                assert!(v.values().sum::<u32>() <= z.num_voters, "{what}");
                            }
                        }
                        if !(placement == Placement::Restricted
                            && regional
                            && survival == SurvivalGoal::Zone)
                        {
                            let c = counts(&z.constraints);
                            let covered: BTreeSet<String> = c.keys().cloned().collect();
                            assert_eq!(covered, regions, "{what}: a replica in every region");
                            assert!(c.values().all(|k| *k == 1), "{what}");
                            assert!(c.values().sum::<u32>() <= z.num_replicas, "{what}");
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 300, "{checked}");
}

#[test]
fn regions_outside_the_database_are_refused() {
    let d = db(3, SurvivalGoal::Zone, Placement::Default, None);
    let mars = TableLocality::RegionalByTable {
        region: Some("mars".into()),
    };
    assert_eq!(
        zone_config(&d, Target::Table(&mars)),
        Err(ZoneConfigError::UnknownRegion {
            region: "mars".into()
        })
    );
    assert_eq!(
        zone_config(&d, Target::Partition { region: "mars" }),
        Err(ZoneConfigError::UnknownRegion {
            region: "mars".into()
        })
    );
    let mut empty = d.clone();
    empty.regions.clear();
    assert_eq!(
        zone_config(&empty, Target::Database),
        Err(ZoneConfigError::NoRegions)
    );
}

/// What CockroachDB prints for the MovR tutorial's database (3 regions, ZONE survival,
/// primary us-east1) and for its GLOBAL `promo_codes` and a `users` partition.
#[test]
fn movr_prints_as_cockroachdb_does() {
    let d = db(3, SurvivalGoal::Zone, Placement::Default, None);
    let z = zone_config(&d, Target::Database).unwrap();
    assert_eq!(
        z.raw_config_sql("DATABASE movr"),
        "ALTER DATABASE movr CONFIGURE ZONE USING\n\
         \trange_min_bytes = 134217728,\n\
         \trange_max_bytes = 536870912,\n\
         \tgc.ttlseconds = 90000,\n\
         \tnum_replicas = 5,\n\
         \tnum_voters = 3,\n\
         \tconstraints = '{+region=europe-west1: 1, +region=us-east1: 1, +region=us-west1: 1}',\n\
         \tvoter_constraints = '[+region=us-east1]',\n\
         \tlease_preferences = '[[+region=us-east1]]'"
    );
    let g = zone_config(&d, Target::Table(&TableLocality::Global)).unwrap();
    assert!(g
        .raw_config_sql("TABLE movr.public.promo_codes")
        .contains("\tglobal_reads = true,\n"));
    let p = zone_config(&d, Target::Partition { region: "us-west1" }).unwrap();
    let sql = p.raw_config_sql("PARTITION \"us-west1\" OF INDEX movr.public.users@users_pkey");
    assert!(
        sql.contains("voter_constraints = '[+region=us-west1]'"),
        "{sql}"
    );
    assert!(
        sql.ends_with("lease_preferences = '[[+region=us-west1]]'"),
        "{sql}"
    );

    let r = db(
        3,
        SurvivalGoal::Region,
        Placement::Default,
        Some("us-west1"),
    );
    let z = zone_config(&r, Target::Database).unwrap();
    assert_eq!(
        z.voter_constraints.to_crdb(),
        "{+region=us-east1: 2, +region=us-west1: 2}"
    );
    assert_eq!(
        z.lease_preferences_crdb(),
        "[[+region=us-east1], [+region=us-west1]]"
    );
}
