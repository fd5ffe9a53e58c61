//! `ALTER … CONFIGURE ZONE USING field = value, …`: fields set by hand over a derived zone
//! configuration (CockroachDB's zone configurations, with the multi-region rules' protection).
//!
//! A database's derived configurations are the declarations' (regions, survival goal,
//! localities); overrides are kept apart, per target, and laid over them wherever a
//! configuration is derived — placement, leases and `SHOW ZONE CONFIGURATION` alike — so a
//! later region or locality change re-derives everything and the overrides still apply.
//! Targets inherit as in CockroachDB: the database's overrides, then the table's, then a
//! partition's.
//!
//! In a multi-region database the fields the declarations derive are protected (CockroachDB's
//! `override_multi_region_zone_config`); sizes and GC TTL may always be set.

use crate::ddl::{DdlError, INVALID_PARAMETER_VALUE};
use crate::{Constraints, ZoneConfig, ZoneConfigError};
use mr_meta::{DatabaseConfig, TableLocality, ZoneScope};
use std::collections::{BTreeMap, BTreeSet};

/// One target's overrides: field → value, as CockroachDB prints it in `SHOW ZONE
/// CONFIGURATION` (constraints without their quotes).
pub use mr_meta::ZoneFields as Fields;

/// The fields a multi-region database derives, which only an override may change.
pub const PROTECTED: [&str; 6] = [
    "global_reads",
    "num_replicas",
    "num_voters",
    "constraints",
    "voter_constraints",
    "lease_preferences",
];

/// The fields a multi-region database leaves as they are.
const UNPROTECTED: [&str; 3] = ["range_min_bytes", "range_max_bytes", "gc.ttlseconds"];

/// CockroachDB's smallest `range_max_bytes`.
const MIN_RANGE_MAX_BYTES: u64 = 64 << 10;

fn invalid(message: String) -> DdlError {
    DdlError {
        sqlstate: INVALID_PARAMETER_VALUE,
        message,
        hint: None,
    }
}

fn unsupported(message: String) -> DdlError {
    DdlError {
        sqlstate: "0A000",
        message,
        hint: None,
    }
}

/// `field = value` as written (a number, a string's contents, `true`/`false`), checked and
/// put in the form `SHOW ZONE CONFIGURATION` prints; the field's name lower-cased.
pub fn normalize(field: &str, value: &str) -> Result<(String, String), DdlError> {
    let field = field_name(field)?;
    let number = || -> Result<u64, DdlError> {
        value
            .trim()
            .parse::<u64>()
            .map_err(|_| invalid(format!("invalid value for {field}: {value:?}")))
    };
    let v = match field.as_str() {
        "num_replicas" | "num_voters" => {
            let n = number()?;
            if n == 0 {
                return Err(invalid(if field == "num_replicas" {
                    "at least one replica is required".into()
                } else {
                    "at least one voting replica is required".into()
                }));
            }
            n.to_string()
        }
        "gc.ttlseconds" | "range_min_bytes" | "range_max_bytes" => {
            let n = number()?;
            if field == "gc.ttlseconds" && n == 0 {
                return Err(invalid("gc.ttlseconds must be at least 1".into()));
            }
            if field == "range_max_bytes" && n < MIN_RANGE_MAX_BYTES {
                return Err(invalid(format!(
                    "range_max_bytes {n} less than minimum allowed {MIN_RANGE_MAX_BYTES}"
                )));
            }
            n.to_string()
        }
        "global_reads" => match value.trim().to_ascii_lowercase().as_str() {
            "true" | "on" => "true".into(),
            "false" | "off" => "false".into(),
            _ => {
                return Err(invalid(format!(
                    "invalid value for global_reads: {value:?}"
                )))
            }
        },
        "lease_preferences" => {
            let regions = lease_preferences(value)?;
            let items: Vec<String> = regions.iter().map(|r| format!("[+region={r}]")).collect();
            format!("[{}]", items.join(", "))
        }
        _ => constraints(value)?.to_crdb(),
    };
    Ok((field, v))
}

/// A field's name, lower-cased, if it is one of CockroachDB's zone configuration fields.
pub fn field_name(field: &str) -> Result<String, DdlError> {
    let field = field.to_ascii_lowercase();
    if !PROTECTED.contains(&field.as_str()) && !UNPROTECTED.contains(&field.as_str()) {
        return Err(invalid(format!("unknown zone config field: {field:?}")));
    }
    Ok(field)
}

/// `+region=a` → `a`; other tiers and prohibitive constraints are not placement this
/// cluster knows.
fn region_of(item: &str) -> Result<String, DdlError> {
    let item = item.trim();
    match item.strip_prefix("+region=") {
        Some(r) if !r.is_empty() => Ok(r.trim().to_string()),
        _ => Err(unsupported(format!(
            "constraint {item:?} is not supported: only +region=<region> constraints place replicas here"
        ))),
    }
}

/// `[+region=a, …]` (every replica in those regions; `[]`: anywhere) or `{+region=a: n, …}`
/// (at least `n` in each).
fn constraints(value: &str) -> Result<Constraints, DdlError> {
    let v = value.trim();
    let bad = || invalid(format!("invalid constraints: {value:?}"));
    if let Some(inner) = v.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
        let regions: Vec<String> = inner
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(region_of)
            .collect::<Result<_, _>>()?;
        return Ok(if regions.is_empty() {
            Constraints::PerRegion(BTreeMap::new())
        } else {
            Constraints::All(regions)
        });
    }
    if let Some(inner) = v.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
        let mut m = BTreeMap::new();
        for item in inner.split(',').filter(|s| !s.trim().is_empty()) {
            let (c, n) = item.rsplit_once(':').ok_or_else(bad)?;
            let n: u32 = n.trim().parse().map_err(|_| bad())?;
            m.insert(region_of(c)?, n);
        }
        return Ok(Constraints::PerRegion(m));
    }
    Err(bad())
}

/// `[[+region=a], [+region=b]]`: the lease's regions in order of preference.
fn lease_preferences(value: &str) -> Result<Vec<String>, DdlError> {
    let v = value.trim();
    let inner = v
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .ok_or_else(|| invalid(format!("invalid lease_preferences: {value:?}")))?;
    let mut out = vec![];
    for part in inner.split(']') {
        let part = part.trim().trim_start_matches(',').trim();
        if part.is_empty() {
            continue;
        }
        let item = part
            .strip_prefix('[')
            .ok_or_else(|| invalid(format!("invalid lease_preferences: {value:?}")))?;
        if item.contains(',') {
            return Err(unsupported(
                "lease preferences with more than one constraint are not supported".into(),
            ));
        }
        out.push(region_of(item)?);
    }
    Ok(out)
}

/// The regions `fields` name (in constraints and lease preferences).
pub fn regions_named(fields: &Fields) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (f, v) in fields {
        match f.as_str() {
            "constraints" | "voter_constraints" => match constraints(v) {
                Ok(Constraints::All(rs)) => out.extend(rs),
                Ok(Constraints::PerRegion(m)) => out.extend(m.into_keys()),
                Err(_) => {}
            },
            "lease_preferences" => out.extend(lease_preferences(v).unwrap_or_default()),
            _ => {}
        }
    }
    out
}

/// Refuses fields a multi-region database derives, unless `allowed`
/// (`override_multi_region_zone_config`); `fields` as [`normalize`] named them.
pub fn check_protected<'a>(
    fields: impl IntoIterator<Item = &'a String>,
    multi_region: bool,
    allowed: bool,
) -> Result<(), DdlError> {
    if !multi_region || allowed {
        return Ok(());
    }
    for f in fields {
        if PROTECTED.contains(&f.as_str()) {
            return Err(DdlError {
                sqlstate: "42P17",
                message: format!(
                    "attempting to modify protected field \"{f}\" of a multi-region zone configuration"
                ),
                hint: Some(
                    "to override this error, SET override_multi_region_zone_config = true and reissue the command"
                        .into(),
                ),
            });
        }
    }
    Ok(())
}

/// Lays `fields` (normalized) over `zc`, then checks the result holds together.
pub fn apply(zc: &mut ZoneConfig, fields: &Fields) -> Result<(), DdlError> {
    for (f, v) in fields {
        let n = || v.parse::<u64>().unwrap_or_default();
        match f.as_str() {
            "num_replicas" => {
                zc.num_replicas = n() as u32;
                // Without a voter count of its own (CockroachDB's default configuration),
                // every replica votes.
                if zc.home_region.is_empty() && !fields.contains_key("num_voters") {
                    zc.num_voters = zc.num_replicas;
                }
            }
            "num_voters" => zc.num_voters = n() as u32,
            "gc.ttlseconds" => zc.gc_ttl_seconds = n(),
            "range_min_bytes" => zc.range_min_bytes = n(),
            "range_max_bytes" => zc.range_max_bytes = n(),
            "global_reads" => zc.global_reads = v == "true",
            "constraints" => zc.constraints = constraints(v)?,
            "voter_constraints" => zc.voter_constraints = constraints(v)?,
            "lease_preferences" => zc.lease_preferences = lease_preferences(v)?,
            _ => {}
        }
    }
    if zc.num_voters > zc.num_replicas {
        return Err(invalid(format!(
            "num_voters ({}) cannot be greater than num_replicas ({})",
            zc.num_voters, zc.num_replicas
        )));
    }
    if zc.range_min_bytes >= zc.range_max_bytes {
        return Err(invalid(format!(
            "range_min_bytes {} must be less than range_max_bytes {}",
            zc.range_min_bytes, zc.range_max_bytes
        )));
    }
    Ok(())
}

/// The fields that apply to one range of `schema.table`: the database's, then the table's,
/// then its partition's (`partition`: the region of a REGIONAL BY ROW partition).
pub fn for_range(
    zones: &[(ZoneScope, Fields)],
    schema: &str,
    table: &str,
    partition: Option<&str>,
) -> Fields {
    let mut out = Fields::new();
    for want in 0..3 {
        for (scope, fields) in zones {
            let rank = match scope {
                ZoneScope::Database => 0,
                ZoneScope::Table { .. } if scope.is_of(schema, table) => 1,
                ZoneScope::Partition { region, .. }
                    if scope.is_of(schema, table) && Some(region.as_str()) == partition =>
                {
                    2
                }
                _ => continue,
            };
            if rank == want {
                out.extend(fields.iter().map(|(f, v)| (f.clone(), v.clone())));
            }
        }
    }
    out
}

/// [`crate::table_ranges`] with the database's overrides laid over each range's derived
/// configuration. Overrides that no longer fit what is derived now (`num_voters` above a
/// re-derived `num_replicas`) leave that range's derived configuration as it is.
pub fn table_ranges(
    db: Option<&DatabaseConfig>,
    locality: Option<&TableLocality>,
    zones: &[(ZoneScope, Fields)],
    schema: &str,
    table: &str,
) -> Result<Vec<(Option<String>, ZoneConfig)>, ZoneConfigError> {
    let mut ranges = crate::table_ranges(db, locality)?;
    if zones.is_empty() {
        return Ok(ranges);
    }
    for (partition, zc) in &mut ranges {
        let fields = for_range(zones, schema, table, partition.as_deref());
        let mut overridden = zc.clone();
        if !fields.is_empty() && apply(&mut overridden, &fields).is_ok() {
            *zc = overridden;
        }
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(pairs: &[(&str, &str)]) -> Fields {
        pairs
            .iter()
            .map(|(f, v)| normalize(f, v).unwrap())
            .collect()
    }

    #[test]
    fn values_take_the_form_cockroachdb_prints() {
        assert_eq!(
            normalize("NUM_REPLICAS", " 5").unwrap(),
            ("num_replicas".into(), "5".into())
        );
        assert_eq!(
            normalize("constraints", "[+region=a,+region=b]").unwrap().1,
            "[+region=a, +region=b]"
        );
        assert_eq!(
            normalize("voter_constraints", "{+region=a:2}").unwrap().1,
            "{+region=a: 2}"
        );
        assert_eq!(normalize("constraints", "[]").unwrap().1, "{}");
        assert_eq!(
            normalize("lease_preferences", "[[+region=b],[+region=a]]")
                .unwrap()
                .1,
            "[[+region=b], [+region=a]]"
        );
        assert_eq!(normalize("global_reads", "ON").unwrap().1, "true");
    }

    #[test]
    fn bad_values_are_refused_with_a_reason() {
        let e = |f: &str, v: &str| normalize(f, v).unwrap_err();
        assert_eq!(
            e("num_replica", "3").message,
            "unknown zone config field: \"num_replica\""
        );
        assert_eq!(
            e("num_replicas", "0").message,
            "at least one replica is required"
        );
        assert_eq!(e("num_voters", "x").sqlstate, INVALID_PARAMETER_VALUE);
        assert_eq!(e("constraints", "[+zone=a]").sqlstate, "0A000");
        assert_eq!(
            e("constraints", "+region=a").sqlstate,
            INVALID_PARAMETER_VALUE
        );
        assert!(e("range_max_bytes", "100").message.contains("minimum"));
        assert_eq!(
            e("lease_preferences", "[[+region=a, +region=b]]").sqlstate,
            "0A000"
        );
    }

    #[test]
    fn protected_fields_need_the_override_in_multi_region_databases() {
        let gc = vec!["gc.ttlseconds".to_string()];
        let voters = vec!["num_voters".to_string()];
        assert!(check_protected(&gc, true, false).is_ok());
        let e = check_protected(&voters, true, false).unwrap_err();
        assert_eq!(
            e.message,
            "attempting to modify protected field \"num_voters\" of a multi-region zone configuration"
        );
        assert!(check_protected(&voters, true, true).is_ok());
        assert!(check_protected(&voters, false, false).is_ok());
    }

    #[test]
    fn overrides_lay_over_the_derived_configuration() {
        let mut zc = crate::allocate::cluster_default();
        apply(&mut zc, &fields(&[("num_replicas", "5")])).unwrap();
        assert_eq!((zc.num_replicas, zc.num_voters), (5, 5));
        apply(
            &mut zc,
            &fields(&[
                ("num_voters", "3"),
                ("gc.ttlseconds", "600"),
                ("constraints", "{+region=a: 1}"),
                ("lease_preferences", "[[+region=a]]"),
            ]),
        )
        .unwrap();
        assert_eq!((zc.num_replicas, zc.num_voters), (5, 3));
        assert_eq!(zc.gc_ttl_seconds, 600);
        assert_eq!(zc.lease_preferences, vec!["a".to_string()]);
        assert!(zc.fields().contains(&"gc.ttlseconds = 600".to_string()));
        let e = apply(&mut zc, &fields(&[("num_voters", "7")])).unwrap_err();
        assert_eq!(
            e.message,
            "num_voters (7) cannot be greater than num_replicas (5)"
        );
        // Database, then table, then partition; other tables' fields do not apply.
        let scope = |t: &str, r: Option<&str>| match r {
            Some(r) => ZoneScope::Partition {
                schema: "public".into(),
                table: t.into(),
                region: r.into(),
            },
            None => ZoneScope::Table {
                schema: "public".into(),
                table: t.into(),
            },
        };
        let zones = vec![
            (scope("users", Some("a")), fields(&[("num_voters", "5")])),
            (
                ZoneScope::Database,
                fields(&[("num_voters", "1"), ("gc.ttlseconds", "9")]),
            ),
            (scope("users", None), fields(&[("num_voters", "3")])),
            (scope("rides", None), fields(&[("num_voters", "4")])),
        ];
        let got = for_range(&zones, "public", "users", Some("a"));
        assert_eq!(got, fields(&[("num_voters", "5"), ("gc.ttlseconds", "9")]));
        let got = for_range(&zones, "public", "users", Some("b"));
        assert_eq!(got["num_voters"], "3");
        assert_eq!(
            regions_named(&fields(&[
                ("constraints", "[+region=b]"),
                ("lease_preferences", "[[+region=c]]")
            ])),
            BTreeSet::from(["b".to_string(), "c".to_string()])
        );
    }
}
