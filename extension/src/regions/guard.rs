//! The region type belongs to the region DDL: a client's `DROP TYPE`/`DROP DOMAIN`,
//! `ALTER DOMAIN`, `ALTER TYPE`, rename or `SET SCHEMA` of `crdb_internal_region` is refused
//! with CockroachDB's errors (its owner may still change, as CockroachDB allows). The region
//! DDL itself changes the type through SPI, never at top level, so it is not affected.

use super::{catalog, replicate::list_ptrs, spi, REGION_TYPE};
use crate::error::{MrError, OrRaise};
use mr_zoneconfig::ddl::DdlError;
use pgrx::pg_sys;

/// What a client's top-level statement does to a type, if it names one.
enum TypeChange {
    Drop(Vec<*mut pg_sys::TypeName>),
    Alter(*mut pg_sys::List),
}

/// Refuses a client's statement that drops or alters the region type.
///
/// # Safety
/// `pstmt` is the PlannedStmt PostgreSQL is about to run at top level.
#[allow(unsafe_code)]
pub(crate) unsafe fn refuse_region_type_change(pstmt: &pg_sys::PlannedStmt) {
    use pg_sys::NodeTag::*;
    use pg_sys::ObjectType::{OBJECT_DOMAIN, OBJECT_DOMCONSTRAINT, OBJECT_TYPE};
    let node = pstmt.utilityStmt;
    if node.is_null() {
        return;
    }
    // SAFETY: the caller's contract; each cast follows the node's own tag, and the lists
    // hold what the grammar puts there (TypeNames for DROP TYPE/DOMAIN, qualified names as
    // String lists otherwise).
    let change = unsafe {
        match (*node).type_ {
            T_DropStmt => {
                let s = &*(node as *mut pg_sys::DropStmt);
                if s.removeType != OBJECT_TYPE && s.removeType != OBJECT_DOMAIN {
                    return;
                }
                TypeChange::Drop(list_ptrs(s.objects).map(|t| t.cast()).collect())
            }
            T_AlterDomainStmt => {
                TypeChange::Alter((*(node as *mut pg_sys::AlterDomainStmt)).typeName)
            }
            T_AlterTypeStmt => TypeChange::Alter((*(node as *mut pg_sys::AlterTypeStmt)).typeName),
            T_AlterEnumStmt => TypeChange::Alter((*(node as *mut pg_sys::AlterEnumStmt)).typeName),
            T_RenameStmt => {
                let s = &*(node as *mut pg_sys::RenameStmt);
                if ![OBJECT_TYPE, OBJECT_DOMAIN, OBJECT_DOMCONSTRAINT].contains(&s.renameType) {
                    return;
                }
                TypeChange::Alter(s.object.cast())
            }
            T_AlterObjectSchemaStmt => {
                let s = &*(node as *mut pg_sys::AlterObjectSchemaStmt);
                if s.objectType != OBJECT_TYPE && s.objectType != OBJECT_DOMAIN {
                    return;
                }
                TypeChange::Alter(s.object.cast())
            }
            _ => return,
        }
    };
    let Some(region_type) = spi::one(
        "SELECT pg_catalog.to_regtype($1)::oid::text",
        vec![REGION_TYPE.into()],
    )
    .and_then(|o| o.parse::<u32>().ok())
    .map(pg_sys::Oid::from) else {
        return;
    };
    // SAFETY: TypeNames and name lists from the statement; a missing type is InvalidOid.
    let names_it = |t: *mut pg_sys::TypeName| unsafe {
        !t.is_null() && pg_sys::LookupTypeNameOid(std::ptr::null_mut(), t, true) == region_type
    };
    let (dropped, altered) = match change {
        TypeChange::Drop(types) => (types.into_iter().any(names_it), false),
        // SAFETY: as above; a qualified name list becomes a TypeName to look up.
        TypeChange::Alter(names) => (false, unsafe {
            !names.is_null() && names_it(pg_sys::makeTypeNameFromNameList(names))
        }),
    };
    let name = REGION_TYPE.trim_start_matches("public.");
    let refusal = if dropped {
        DdlError {
            sqlstate: "2BP01",
            message: format!("\"{name}\" is a multi-region enum and cannot be modified directly"),
            hint: Some(format!(
                "try ALTER DATABASE {} DROP REGION <region>",
                spi::ident(&catalog::database_name())
            )),
        }
    } else if altered {
        DdlError {
            sqlstate: "42809",
            message: format!(
                "\"{name}\" is a multi-region enum and can't be modified using the alter type command"
            ),
            hint: Some("try adding/removing the region using ALTER DATABASE".to_string()),
        }
    } else {
        return;
    };
    Err::<(), _>(MrError::Ddl(refusal)).or_raise()
}
