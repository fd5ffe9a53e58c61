//! Every error the extension raises, with its SQLSTATE and hint.
//!
//! Code below the SQL edge returns [`MrError`]; only the edge (SQL functions, `_PG_init`, the GUC
//! check hook) turns it into a PostgreSQL error, through [`MrError::report`]. Keeping message,
//! SQLSTATE and hint in one place keeps them consistent and reviewable against the regression
//! tests' expected output.

use mr_topology::LocalityError;
use mr_wire::framing::FrameError;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

#[derive(Debug, thiserror::Error)]
pub enum MrError {
    /// `_PG_init` ran outside `shared_preload_libraries` (e.g. from `CREATE EXTENSION`).
    #[error("pg_multiregion must be loaded via shared_preload_libraries")]
    NotPreloaded,
    #[error("invalid value for parameter \"multiregion.locality\": {0}")]
    InvalidLocality(#[source] LocalityError),
    /// The server encoding let through bytes that are not UTF-8; localities are ASCII.
    #[error("invalid value for parameter \"multiregion.locality\": the value is not valid UTF-8")]
    LocalityNotUtf8,
    #[error("no region is configured for this node")]
    NoLocality,
    #[error("multiregion.sidecar_socket is not set")]
    SocketNotSet,
    #[error("could not reach the pgmr sidecar at \"{path}\": {source}")]
    Unreachable {
        path: String,
        source: std::io::Error,
    },
    #[error("the pgmr sidecar at \"{path}\" did not answer within {timeout_ms} ms")]
    Timeout { path: String, timeout_ms: u128 },
    #[error("lost the connection to the pgmr sidecar at \"{path}\": {source}")]
    Broken { path: String, source: FrameError },
    /// Only reachable if the interrupt check stops returning through PostgreSQL's own error.
    #[error("the call to the pgmr sidecar was interrupted")]
    Interrupted,
    /// pgmr understood the request but could not serve it.
    #[error("the pgmr sidecar could not serve the request: {0}")]
    Sidecar(String),
    /// pgmr gave up on the request before changing anything (e.g. no meta leader in time), so
    /// the client may simply send it again: a serialization failure by PostgreSQL's rules.
    #[error("{0}")]
    Retryable(String),
    /// This node's turn for transactions over several nodes stayed with another one for as
    /// long as this one may wait (ARCHITECTURE.md §8.5, "Isolation").
    #[error("could not serialize access: this node's turn for transactions over several nodes was held by another one for {wait_ms} ms")]
    TurnBusy { wait_ms: u64 },
    /// Another transaction over several nodes committed on this node after this one's
    /// snapshot here: ordered after it here, this one may be ordered before it elsewhere.
    #[error("could not serialize access: another transaction over several nodes committed on this node after this transaction began here")]
    TurnTaken,
    /// A metadata write may or may not have committed, e.g. the leader was lost after
    /// proposing it; the client must look before it tries again.
    #[error("{0}")]
    Ambiguous(String),
    /// `SET CLUSTER SETTING` changes every node, so it is reserved to superusers.
    #[error("only superusers are allowed to SET CLUSTER SETTING")]
    NotSuperuser,
    #[error("the name of a cluster setting must not be NULL or empty")]
    SettingNameMissing,
    #[error("the pgmr sidecar answered a {request} request with a {response} response")]
    UnexpectedResponse {
        request: &'static str,
        response: &'static str,
    },
    #[error("the pgmr sidecar sent {field} = {value}, which is out of range")]
    OutOfRange { field: &'static str, value: u64 },
    #[error("the pgmr sidecar sent event {id} with info that is not JSON: {reason}")]
    MalformedEventInfo { id: u64, reason: String },
    /// A region or locality statement refused by the rules, with CockroachDB's text.
    #[error("{0}")]
    Ddl(mr_zoneconfig::ddl::DdlError),
    #[error("must be owner of {kind} {name}")]
    NotOwner { kind: &'static str, name: String },
    #[error("cannot change database \"{database}\" from database \"{current}\"")]
    OtherDatabase { database: String, current: String },
    #[error("relation \"{0}\" does not exist")]
    NoSuchTable(String),
    #[error("invalid {what} {value:?}: expected {expected}")]
    BadArgument {
        what: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("{message} at character {position}")]
    Syntax {
        message: String,
        position: usize,
        sqlstate: &'static str,
    },
    #[error("CREATE DATABASE {name} cannot run inside a function")]
    CreateDatabaseInFunction { name: String, exists: bool },
    #[error("database \"{0}\" already exists")]
    DatabaseExists(String),
    #[error(
        "could not remove enum value \"{region}\" as it is being used by \"{table}\" in row: {row}"
    )]
    RegionInUse {
        region: String,
        table: String,
        row: String,
    },
    #[error("cannot change the locality of table {table}: {reason}")]
    CannotRebuild { table: String, reason: String },
    #[error("column \"{column}\" of relation \"{table}\" does not exist")]
    NoSuchColumn { table: String, column: String },
    #[error("cannot use column \"{column}\" for REGIONAL BY ROW table as it does not have the crdb_internal_region type")]
    RegionColumnType { column: String },
    #[error(
        "cannot use column \"{column}\" for REGIONAL BY ROW table as it may contain NULL values"
    )]
    RegionColumnNullable { table: String, column: String },
    #[error("cannot write directly to computed column \"{column}\"")]
    WriteComputedColumn { column: String },
    #[error("{0} is not supported in a database replicated by pg_multiregion")]
    NotReplicable(&'static str),
    #[error("schema change {got} cannot apply on top of version {have}")]
    SchemaGap { have: i64, got: i64 },
    #[error("malformed schema change: {0}")]
    BadChange(String),
    /// A replicated write that cannot be served on this node as things are.
    #[error("{message}")]
    WriteNotServed { message: String, hint: String },
    /// `multiregion.post_restore()` cannot adopt a dump's declarations here.
    #[error("{message}")]
    RestoreRefused { message: String, hint: String },
    /// A COPY TO of a table whose rows this node holds no replica of.
    #[error("cannot COPY from table {table}: this node holds no replica of its range {range_id}")]
    CopyNotHeld { table: String, range_id: u64 },
    /// A transaction's replicated changes would not fit one Raft entry.
    #[error("the transaction's replicated changes ({bytes} bytes) exceed the limit of {limit} bytes for one transaction")]
    WriteSetTooLarge { bytes: usize, limit: usize },
    /// A statement forwarded to another node failed there: PostgreSQL's error, as is.
    #[error("{}", .0.message)]
    Remote(mr_wire::local::SqlError),
    /// A replicated write was requested inside PREPARE TRANSACTION.
    #[error("PREPARE TRANSACTION is not supported for transactions that write replicated tables")]
    PrepareReplicated,
    /// A schema change was made inside PREPARE TRANSACTION.
    #[error("PREPARE TRANSACTION is not supported for transactions that change the schema")]
    PrepareSchemaChange,
    /// A statement would run on another node in a transaction whose schema changes that node
    /// has not seen yet.
    #[error("this transaction changed the schema, and node {node}, which leases the rows this statement touches, sees the change only when it commits")]
    SchemaChangePending { node: u64 },
    /// A schema change that reshapes a replicated table after this transaction ran
    /// statements on other nodes: rows it wrote there under the old schema would follow the
    /// change (docs/ARCHITECTURE.md §8.6).
    #[error("a schema change of replicated table {table} cannot follow statements this transaction ran on other nodes")]
    DdlAfterRemoteStatements { table: String },
    /// `nextval` past a sequence's bound (PostgreSQL's text).
    #[error("nextval: reached {} value of sequence \"{sequence}\" ({limit})", if *.ascending { "maximum" } else { "minimum" })]
    SequenceLimit {
        sequence: String,
        limit: i64,
        ascending: bool,
    },
    #[error("\"{0}\" is not a sequence")]
    NotASequence(String),
    #[error("permission denied for sequence {0}")]
    SequencePermission(String),
    /// A UNIQUE index added to a REGIONAL BY ROW table over rows whose key repeats across
    /// regions (PostgreSQL's text for a unique index that cannot be built).
    #[error("could not create unique index \"{index}\"")]
    DuplicateKey { index: String, key: String },
    /// Changes to a global key table asked for by a role that may not write its table.
    #[error("permission denied for table {table}")]
    KeyChangesNotPermitted { table: String },
}

/// PostgreSQL's encoding of a five-character SQLSTATE (MAKE_SQLSTATE).
fn make_sqlstate(code: &str) -> PgSqlErrorCode {
    let b = code.as_bytes();
    let v = (0..5).fold(0i32, |acc, i| {
        acc | ((((b.get(i).copied().unwrap_or(b'0')) - b'0') as i32 & 0x3F) << (6 * i))
    });
    PgSqlErrorCode::from(v)
}

impl MrError {
    pub fn sqlstate(&self) -> PgSqlErrorCode {
        use PgSqlErrorCode::*;
        match self {
            MrError::NotPreloaded | MrError::NoLocality | MrError::SocketNotSet => {
                ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE
            }
            // What PostgreSQL itself reports for a GUC value refused by a check hook.
            MrError::InvalidLocality(_) | MrError::LocalityNotUtf8 => {
                ERRCODE_INVALID_PARAMETER_VALUE
            }
            MrError::Unreachable { .. } => ERRCODE_SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
            MrError::Timeout { .. } | MrError::Broken { .. } => ERRCODE_CONNECTION_FAILURE,
            MrError::Interrupted => ERRCODE_QUERY_CANCELED,
            MrError::Sidecar(_) => ERRCODE_SYSTEM_ERROR,
            MrError::WriteSetTooLarge { .. } => ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            MrError::WriteNotServed { .. }
            | MrError::PrepareReplicated
            | MrError::PrepareSchemaChange
            | MrError::SchemaChangePending { .. }
            | MrError::DdlAfterRemoteStatements { .. } => ERRCODE_FEATURE_NOT_SUPPORTED,
            MrError::Remote(e) => sqlstate_of(&e.code),
            MrError::Retryable(_) | MrError::TurnBusy { .. } | MrError::TurnTaken => {
                ERRCODE_T_R_SERIALIZATION_FAILURE
            }
            MrError::Ambiguous(_) => ERRCODE_T_R_STATEMENT_COMPLETION_UNKNOWN,
            MrError::NotSuperuser => ERRCODE_INSUFFICIENT_PRIVILEGE,
            MrError::SettingNameMissing => ERRCODE_INVALID_PARAMETER_VALUE,
            MrError::UnexpectedResponse { .. }
            | MrError::OutOfRange { .. }
            | MrError::MalformedEventInfo { .. } => ERRCODE_INTERNAL_ERROR,
            MrError::Ddl(e) => make_sqlstate(e.sqlstate),
            MrError::NotOwner { .. } | MrError::KeyChangesNotPermitted { .. } => {
                ERRCODE_INSUFFICIENT_PRIVILEGE
            }
            MrError::OtherDatabase { .. } | MrError::CreateDatabaseInFunction { .. } => {
                ERRCODE_FEATURE_NOT_SUPPORTED
            }
            MrError::NoSuchTable(_) => ERRCODE_UNDEFINED_TABLE,
            MrError::SequenceLimit { .. } => ERRCODE_SEQUENCE_GENERATOR_LIMIT_EXCEEDED,
            MrError::NotASequence(_) => ERRCODE_WRONG_OBJECT_TYPE,
            MrError::SequencePermission(_) => ERRCODE_INSUFFICIENT_PRIVILEGE,
            MrError::BadArgument { .. } => ERRCODE_INVALID_PARAMETER_VALUE,
            MrError::Syntax { sqlstate, .. } => sqlstate_of(sqlstate),
            MrError::DatabaseExists(_) => ERRCODE_DUPLICATE_DATABASE,
            MrError::RegionInUse { .. } => ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST,
            MrError::CannotRebuild { .. } => ERRCODE_FEATURE_NOT_SUPPORTED,
            MrError::NoSuchColumn { .. } => ERRCODE_UNDEFINED_COLUMN,
            MrError::RegionColumnType { .. } => ERRCODE_DATATYPE_MISMATCH,
            MrError::RegionColumnNullable { .. } => ERRCODE_INVALID_TABLE_DEFINITION,
            MrError::WriteComputedColumn { .. } => ERRCODE_GENERATED_ALWAYS,
            MrError::DuplicateKey { .. } => ERRCODE_UNIQUE_VIOLATION,
            MrError::NotReplicable(_) => ERRCODE_FEATURE_NOT_SUPPORTED,
            MrError::RestoreRefused { .. } => ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            MrError::CopyNotHeld { .. } => ERRCODE_FEATURE_NOT_SUPPORTED,
            MrError::SchemaGap { .. } | MrError::BadChange(_) => ERRCODE_INTERNAL_ERROR,
        }
    }

    /// The hint, including those built from the error's own values.
    pub fn full_hint(&self) -> Option<String> {
        match self {
            MrError::Ddl(e) => e.hint.clone(),
            MrError::WriteNotServed { hint, .. } => Some(hint.clone()),
            MrError::RestoreRefused { hint, .. } => Some(hint.clone()),
            MrError::CopyNotHeld { .. } => Some(
                "Run the COPY (or pg_dump) on a node that holds a replica of every range of the table (voting_replicas or non_voting_replicas in multiregion.ranges), or use COPY (SELECT …) TO.".into(),
            ),
            MrError::DdlAfterRemoteStatements { .. } => Some(
                "Run the schema change in a transaction of its own, or before the statements on rows leased by other nodes.".into(),
            ),
            MrError::SchemaChangePending { .. } => Some(
                "Commit the schema change first, or run this statement on the leaseholder's node (lease_holder in multiregion.ranges).".into(),
            ),
            MrError::OtherDatabase { database, .. } => Some(format!(
                "connect to database {database} and run the statement there"
            )),
            MrError::CreateDatabaseInFunction { name, exists: true } => Some(format!(
                "connect to database {name} and run this statement there: it configures the \
                 database's regions"
            )),
            MrError::CreateDatabaseInFunction { name, exists: false } => Some(format!(
                "run CREATE DATABASE {name} first, connect to it, and run this statement there: it \
                 configures the database's regions"
            )),
            MrError::RegionColumnNullable { table, column } => Some(format!(
                "add the NOT NULL constraint first using ALTER TABLE {table} ALTER COLUMN {column} SET NOT NULL"
            )),
            MrError::RegionInUse { table, region, .. } => Some(format!(
                "move or delete the rows of {table} in region \"{region}\" first"
            )),
            MrError::NotReplicable(what) => Some(format!(
                "every node runs the statement inside a transaction: use {} without CONCURRENTLY",
                what.trim_end_matches(" CONCURRENTLY")
            )),
            MrError::WriteComputedColumn { column } => Some(format!(
                "\"{column}\" is computed from other columns: leave it out, or set it to DEFAULT"
            )),
            _ => self.hint().map(str::to_string),
        }
    }

    pub fn hint(&self) -> Option<&'static str> {
        match self {
            MrError::NotPreloaded => Some(
                "Add pg_multiregion to shared_preload_libraries in postgresql.conf and restart \
                 the server; \"pgmr start\" does this for you.",
            ),
            MrError::InvalidLocality(e) => Some(e.hint()),
            MrError::LocalityNotUtf8 => Some(
                "Use comma-separated key=value tiers of ASCII letters, digits, '-', '_' or '.', \
                 e.g. region=us-east1,zone=us-east1-b.",
            ),
            MrError::NoLocality => Some(
                "Set multiregion.locality in postgresql.conf, e.g. \
                 'region=us-east1,zone=us-east1-b', and restart; \"pgmr start\" sets it from \
                 --locality.",
            ),
            MrError::SocketNotSet => Some(
                "This server is not managed by pgmr: start the node with \"pgmr start\", which \
                 sets multiregion.sidecar_socket.",
            ),
            MrError::Unreachable { .. } => Some(
                "Is pgmr running on this node? \"pgmr start\" supervises this server and listens \
                 on multiregion.sidecar_socket.",
            ),
            MrError::Timeout { .. } => Some(
                "pgmr may be overloaded or stuck: check its log, or raise \
                 multiregion.sidecar_timeout.",
            ),
            MrError::Broken { .. } => Some("pgmr may have restarted: check its log on this node."),
            MrError::UnexpectedResponse { .. }
            | MrError::OutOfRange { .. }
            | MrError::MalformedEventInfo { .. } => Some(
                "pgmr and the pg_multiregion extension may be from different releases; install \
                 matching versions.",
            ),
            MrError::Retryable(_) => Some("Nothing was changed; retry the statement."),
            MrError::TurnBusy { .. } | MrError::TurnTaken => Some("Retry the transaction."),
            MrError::Ambiguous(_) => {
                Some("The change may or may not have been applied; check before retrying.")
            }
            MrError::WriteSetTooLarge { .. } => Some(
                "Split the transaction into smaller ones (bulk loads in batches of a few thousand \
                 rows).",
            ),
            MrError::SettingNameMissing => Some(
                "Pass the setting's name first and its value second; a NULL value resets the \
                 setting.",
            ),
            _ => None,
        }
    }

    /// Reports this error at `level`. At `ERROR` and above it does not return: pgrx unwinds the
    /// Rust stack and hands the error to PostgreSQL.
    #[track_caller]
    pub fn report(&self, level: PgLogLevel) {
        if let MrError::Remote(e) = self {
            let mut report =
                ErrorReport::new(sqlstate_of(&e.code), e.message.clone(), function_name!());
            if let Some(d) = &e.detail {
                report = report.set_detail(d.clone());
            }
            if let Some(h) = &e.hint {
                report = report.set_hint(h.clone());
            }
            report.report(level);
            return;
        }
        let mut report = ErrorReport::new(self.sqlstate(), self.to_string(), function_name!());
        if let MrError::DuplicateKey { key, .. } = self {
            report = report.set_detail(format!("Key {key} is duplicated."));
        }
        if let Some(hint) = self.full_hint() {
            report = report.set_hint(hint);
        }
        report.report(level);
    }

    /// Raises this error as a PostgreSQL `ERROR`, aborting the current statement.
    #[track_caller]
    pub fn raise(self) -> ! {
        self.report(PgLogLevel::ERROR);
        unreachable!("an ERROR report does not return")
    }
}

/// PostgreSQL's code for a five-character SQLSTATE (MAKE_SQLSTATE); anything malformed is
/// an internal error.
fn sqlstate_of(code: &str) -> PgSqlErrorCode {
    let b = code.as_bytes();
    if b.len() != 5 || !b.iter().all(u8::is_ascii_alphanumeric) {
        return PgSqlErrorCode::ERRCODE_INTERNAL_ERROR;
    }
    let six = |c: u8| ((c.wrapping_sub(b'0')) & 0x3F) as i32;
    let v = (0..5).fold(0i32, |acc, i| acc + (six(b[i]) << (6 * i)));
    PgSqlErrorCode::from(v)
}

/// Ends a fallible computation at the SQL edge: the value, or the error raised to PostgreSQL.
pub trait OrRaise<T> {
    fn or_raise(self) -> T;
}

impl<T> OrRaise<T> for Result<T, MrError> {
    #[track_caller]
    fn or_raise(self) -> T {
        match self {
            Ok(value) => value,
            Err(e) => e.raise(),
        }
    }
}
