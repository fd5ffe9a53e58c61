//! `ALTER … CONFIGURE ZONE`: overrides laid over the zone configurations the declarations
//! derive (`mr_zoneconfig::overrides`), kept in the meta group with the schema change that
//! sets them — at commit, so a rolled-back transaction sets none — and applied wherever a
//! configuration is derived: placement and leases (pgmr's range manager) and `SHOW ZONE
//! CONFIGURATION`.
//!
//! Targets are the database, a table and a REGIONAL BY ROW table's region partition; an
//! index's rows are in its table's ranges here, so an index has no configuration of its own,
//! and `RANGE default` is the cluster's (CockroachDB's defaults, not settable yet).

use super::spi::{self, rows};
use super::{catalog, require_database_owner, require_table_owner, resolve_table, Effect};
use crate::error::MrError;
use mr_meta::{TableLocality, ZoneChange, ZoneScope};
use mr_sql::ZoneTarget;
use mr_zoneconfig::ddl::DdlError;
use mr_zoneconfig::overrides::{self, Fields};

fn unsupported(message: String, hint: &str) -> MrError {
    MrError::Ddl(DdlError {
        sqlstate: "0A000",
        message,
        hint: Some(hint.to_string()),
    })
}

/// The scope a target names in this database, after checking the caller may configure it.
fn scope(target: &ZoneTarget) -> Result<ZoneScope, MrError> {
    let name_of = |relid: pgrx::pg_sys::Oid| -> (String, String) {
        let r = rows(
            "SELECT n.nspname::text, c.relname::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
            vec![relid.into()],
        );
        let r = r.into_iter().next().unwrap_or_default();
        let get = |i: usize| r.get(i).cloned().flatten().unwrap_or_default();
        (get(0), get(1))
    };
    let object = |t: &mr_sql::ObjectName| {
        t.0.iter()
            .map(|p| spi::ident(p))
            .collect::<Vec<_>>()
            .join(".")
    };
    match target {
        ZoneTarget::Database(d) => {
            let current = catalog::database_name();
            if *d != current {
                return Err(MrError::OtherDatabase {
                    database: d.clone(),
                    current,
                });
            }
            require_database_owner(d)?;
            Ok(ZoneScope::Database)
        }
        ZoneTarget::Table(t) => {
            let relid = resolve_table(&object(t))?;
            require_table_owner(relid)?;
            let (schema, table) = name_of(relid);
            Ok(ZoneScope::Table { schema, table })
        }
        ZoneTarget::Partition {
            partition,
            table,
            index: None,
        } => {
            let relid = resolve_table(&object(table))?;
            require_table_owner(relid)?;
            let (schema, name) = name_of(relid);
            let rbr = matches!(
                catalog::locality(relid).locality,
                TableLocality::RegionalByRow { .. }
            );
            let regions = catalog::load(false).0.map(|c| c.regions).unwrap_or_default();
            if !rbr || !regions.contains(partition) {
                return Err(MrError::Ddl(DdlError {
                    sqlstate: "42704",
                    message: format!("partition \"{partition}\" does not exist on table \"{name}\""),
                    hint: Some(
                        "a REGIONAL BY ROW table has one partition per region of its database"
                            .into(),
                    ),
                }));
            }
            Ok(ZoneScope::Partition {
                schema,
                table: name,
                region: partition.clone(),
            })
        }
        ZoneTarget::Index { .. } | ZoneTarget::Partition { index: Some(_), .. } => {
            Err(unsupported(
                "zone configurations of indexes are not supported".into(),
                "an index's rows are in its table's ranges here: configure the table (or its partition) instead",
            ))
        }
        ZoneTarget::Default => Err(unsupported(
            "ALTER RANGE default CONFIGURE ZONE is not supported".into(),
            "configure a database or a table instead",
        )),
    }
}

/// The overrides in force for this database: the meta group's, then this transaction's.
pub(super) fn current() -> Result<Vec<(ZoneScope, Fields)>, MrError> {
    let mut zones = if crate::gucs::sidecar_socket().is_some() {
        crate::sidecar::zone_overrides(&catalog::database_name())?
    } else {
        vec![]
    };
    for c in super::replicate::pending_zones() {
        zones.retain(|(s, _)| s != &c.scope);
        if let Some(f) = c.fields {
            zones.push((c.scope, f));
        }
    }
    Ok(zones)
}

/// `ALTER target CONFIGURE ZONE {USING … | DISCARD}` on the node where it was typed.
pub(super) fn configure(
    target: &ZoneTarget,
    fields: Option<&[(String, Option<String>)]>,
    effect: &mut Effect,
) -> Result<(), MrError> {
    if crate::gucs::sidecar_socket().is_none() {
        return Err(unsupported(
            "CONFIGURE ZONE needs pgmr".into(),
            "zone configurations place replicas: run this on a node of a pg_multiregion cluster",
        ));
    }
    let scope = scope(target)?;
    let zones = current()?;
    let mut merged: Fields = zones
        .iter()
        .find(|(s, _)| s == &scope)
        .map(|(_, f)| f.clone())
        .unwrap_or_default();
    let (config, _) = catalog::load(false);
    match fields {
        None => merged.clear(),
        Some(fields) => {
            let names: Vec<String> = fields.iter().map(|(f, _)| f.to_ascii_lowercase()).collect();
            overrides::check_protected(
                &names,
                config.is_some(),
                crate::gucs::override_multi_region_zone_config(),
            )?;
            for (field, value) in fields {
                match value {
                    Some(v) => {
                        let (f, v) = overrides::normalize(field, v)?;
                        merged.insert(f, v);
                    }
                    // COPY FROM PARENT: the scope inherits the field again.
                    None => {
                        merged.remove(&overrides::field_name(field)?);
                    }
                }
            }
        }
    }
    // Regions the constraints name must be the database's (or, without regions, the
    // cluster's), as CockroachDB requires constraints to match some node.
    let known = match &config {
        Some(c) => c.regions.clone(),
        None => super::cluster_regions()?,
    };
    if let Some(r) = overrides::regions_named(&merged)
        .into_iter()
        .find(|r| !known.contains(r))
    {
        return Err(MrError::Ddl(DdlError {
            sqlstate: "22023",
            message: format!(
                "constraint \"+region={r}\" matches no existing nodes within the cluster - did you enter it correctly?"
            ),
            hint: None,
        }));
    }
    // The result must hold together on every range it reaches.
    let mut scoped = zones;
    scoped.retain(|(s, _)| s != &scope);
    scoped.push((scope.clone(), merged.clone()));
    check_applies(config.as_ref(), &scope, &scoped)?;
    let change = ZoneChange {
        scope,
        fields: Some(merged).filter(|m| !m.is_empty()),
    };
    effect.zones.push(change);
    effect.changed = true;
    Ok(())
}

/// Every range the scope reaches takes the overrides without contradiction.
fn check_applies(
    config: Option<&mr_meta::DatabaseConfig>,
    scope: &ZoneScope,
    zones: &[(ZoneScope, Fields)],
) -> Result<(), MrError> {
    let check = |locality: Option<&TableLocality>, schema: &str, table: &str| {
        let ranges = mr_zoneconfig::table_ranges(config, locality)
            .map_err(|e| MrError::Sidecar(e.to_string()))?;
        for (partition, zc) in ranges {
            let fields = overrides::for_range(zones, schema, table, partition.as_deref());
            let mut zc = zc;
            overrides::apply(&mut zc, &fields)?;
        }
        Ok::<(), MrError>(())
    };
    match scope {
        ZoneScope::Table { schema, table } | ZoneScope::Partition { schema, table, .. } => {
            let relid = resolve_table(&format!("{}.{}", spi::ident(schema), spi::ident(table)))?;
            check(Some(&catalog::locality(relid).locality), schema, table)
        }
        ZoneScope::Database => {
            let mut zc = match config {
                Some(c) => mr_zoneconfig::zone_config(c, mr_zoneconfig::Target::Database)
                    .map_err(|e| MrError::Sidecar(e.to_string()))?,
                None => mr_zoneconfig::allocate::cluster_default(),
            };
            overrides::apply(&mut zc, &overrides::for_range(zones, "", "", None))?;
            Ok(())
        }
    }
}
