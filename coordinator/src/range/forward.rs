//! Forwarded transactions: statements on rows leased by another node run in that node's
//! PostgreSQL (ARCHITECTURE.md §9).
//!
//! The origin backend's extension sends each step (begin, savepoints, one statement, finish)
//! through its pgmr to the leaseholder's pgmr, which runs it in a session it keeps for that
//! transaction: a pooled connection to its own PostgreSQL, inside `BEGIN`, with the origin's
//! settings, each statement run by `multiregion.remote_exec` as the origin's role. The
//! leaseholder's commit is then an ordinary local commit there, replicated through the
//! range's Raft group like any other.
//!
//! Sessions end with the transaction (commit or rollback from the origin), when their origin
//! backend is gone (the origin's pgmr checks its backends and keeps the others alive), or
//! after [`IDLE_LIMIT`] without a keepalive (the origin node died): a remote transaction
//! never holds its locks for long after its client is gone.

use super::Ranges;
use mr_wire::local::{Finish, ForwardRequest, LocalResponse, SqlError};
use mr_wire::peer::{PeerRequest, PeerResponse};
use sqlx::postgres::{PgConnection, PgDatabaseError};
use sqlx::{ConnectOptions, Connection, Row};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const APPLICATION_NAME: &str = "pgmr forwarded transaction";
/// How long a forwarded transaction waits for this node to apply the origin's schema version.
const SCHEMA_WAIT: Duration = Duration::from_secs(10);
/// A remote session without a keepalive from its origin for this long is rolled back.
const IDLE_LIMIT: Duration = Duration::from_secs(30);
/// How often the origin checks its backends and sends keepalives.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(10);
/// Idle connections kept per database for the next forwarded transaction.
const POOL_PER_DATABASE: usize = 8;
/// How long a forwarded step may take, end to end.
const STEP_TIMEOUT: Duration = Duration::from_secs(600);

/// The sessions this node runs for other nodes, and those its backends run elsewhere.
#[derive(Default)]
pub struct Sessions {
    remote: Mutex<HashMap<(u64, String), Arc<Remote>>>,
    /// session → (node it runs on, origin backend pid).
    origin: Mutex<HashMap<String, (u64, i32)>>,
    /// Idle connections by database.
    pool: Mutex<HashMap<String, Vec<PgConnection>>>,
    /// Steps this node's backends sent elsewhere, by what they carried (`/metrics`).
    pub sent: SentSteps,
    /// Sessions rolled back here, and when: a step that arrives late (from a node that was
    /// paused) must not begin them again and take locks nobody will release.
    ended: Mutex<HashMap<(u64, String), Instant>>,
}

struct Remote {
    conn: tokio::sync::Mutex<Option<PgConnection>>,
    database: String,
    role: String,
    gateway_region: String,
    /// The backend serving this session, to cancel a statement the origin gave up on.
    backend_pid: i32,
    last_seen: Mutex<Instant>,
    /// A statement failed and no savepoint rollback has undone it: the transaction can only
    /// roll back.
    failed: AtomicBool,
    /// `PREPARE TRANSACTION` was sent: a failure from then on may have left `Prepare` entries
    /// that land later (its pre-prepare gave up on an ambiguous write), or a prepared
    /// transaction (the connection broke).
    prepare_sent: AtomicBool,
}

/// Forwarded steps sent, by kind: a statement that commits in the same message costs its
/// transaction one round trip, a statement and a later commit two.
#[derive(Default)]
pub struct SentSteps {
    pub statement: AtomicU64,
    pub statement_and_commit: AtomicU64,
    pub commit: AtomicU64,
    pub other: AtomicU64,
}

impl SentSteps {
    fn count(&self, req: &ForwardRequest) {
        let c = match (&req.statement, &req.finish) {
            (Some(_), None) => &self.statement,
            (Some(_), Some(Finish::Commit)) => &self.statement_and_commit,
            (None, Some(Finish::Commit)) => &self.commit,
            _ => &self.other,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// (kind, count) pairs.
    pub fn read(&self) -> [(&'static str, u64); 4] {
        [
            ("statement", self.statement.load(Ordering::Relaxed)),
            (
                "statement_and_commit",
                self.statement_and_commit.load(Ordering::Relaxed),
            ),
            ("commit", self.commit.load(Ordering::Relaxed)),
            ("other", self.other.load(Ordering::Relaxed)),
        ]
    }
}

impl Ranges {
    /// Forwarded steps sent from here, by kind.
    pub fn forwarded_steps(&self) -> [(&'static str, u64); 4] {
        self.sessions.sent.read()
    }

    /// Sends one step of a forwarded transaction to `node_id` (origin side).
    pub async fn forward(&self, node_id: u64, req: ForwardRequest) -> LocalResponse {
        self.sessions.sent.count(&req);
        let commits = req.finish == Some(Finish::Commit);
        let rollback_only =
            req.finish == Some(Finish::Rollback) && req.statement.is_none() && req.begin.is_none();
        let Some(addr) = self.node_addr(node_id) else {
            return LocalResponse::Error {
                message: format!("node {node_id} is not a member of the cluster"),
                retryable: true,
                ambiguous: false,
            };
        };
        let (session, pid) = (req.session.clone(), req.backend_pid);
        if rollback_only {
            // Nobody waits on a rollback's outcome (an aborting backend least of all): it is
            // sent in the background, and again until the node answers.
            self.sessions
                .origin
                .lock()
                .expect("sessions lock")
                .remove(&session);
            self.roll_back_later(addr, session, pid);
            return LocalResponse::Forwarded {
                processed: 0,
                rows: Vec::new(),
                moved: Vec::new(),
                keys: Vec::new(),
                deferred: Vec::new(),
                wrote: false,
                prepared_ranges: Vec::new(),
            };
        }
        let ends = req.finish.is_some();
        if !ends {
            self.sessions
                .origin
                .lock()
                .expect("sessions lock")
                .insert(session.clone(), (node_id, pid));
        }
        // A statement may run for minutes, but not on a node that stopped heartbeating (paused,
        // cut off, or dead): then the wait ends as a lost connection would.
        let call = self
            .transport
            .call(&addr, PeerRequest::Exec(Box::new(req)), STEP_TIMEOUT);
        let silent = async {
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let now = crate::node::now_ms();
                let live = self.meta.read(|s| {
                    s.nodes()
                        .find(|n| n.node_id == node_id)
                        .is_some_and(|n| n.status(now) == mr_meta::NodeStatus::Live)
                });
                if !live {
                    return;
                }
            }
        };
        let result = tokio::select! {
            r = call => r,
            _ = silent => Err(crate::net::RpcError::Closed {
                addr: addr.clone(),
                reason: format!("node {node_id} stopped heartbeating"),
            }),
        };
        // A commit that came back with referential statements for the origin to run did not
        // happen: the session stays a part of the transaction, kept alive from here.
        let left_open = commits
            && matches!(&result, Ok(PeerResponse::Exec { response })
                if matches!(&**response, LocalResponse::Forwarded { deferred, .. } if !deferred.is_empty()));
        if ends && !left_open {
            self.sessions
                .origin
                .lock()
                .expect("sessions lock")
                .remove(&session);
        } else if left_open {
            self.sessions
                .origin
                .lock()
                .expect("sessions lock")
                .insert(session.clone(), (node_id, pid));
        }
        match result {
            Ok(PeerResponse::Exec { response }) => *response,
            Ok(PeerResponse::Error { message, retryable }) => LocalResponse::Error {
                message: format!("node {node_id}: {message}"),
                retryable,
                ambiguous: false,
            },
            Ok(other) => LocalResponse::error(format!("node {node_id} answered {other:?}")),
            // A lost answer to a commit leaves its outcome unknown; any other step's
            // transaction is rolled back (the origin aborts). Either way the session must not
            // hold its locks until it times out: a rollback follows, until the node answers.
            Err(e) => {
                self.roll_back_later(addr, session, pid);
                LocalResponse::Error {
                    message: format!("lost the connection to node {node_id}: {e}"),
                    retryable: !commits,
                    ambiguous: commits,
                }
            }
        }
    }

    /// Rolls back `session` on the node at `addr` in the background, at once and then every
    /// second while the node does not answer (it may be paused or cut off), for as long as it
    /// would keep the session anyway. A commit already under way there wins: the rollback then
    /// finds no session.
    fn roll_back_later(&self, addr: String, session: String, backend_pid: i32) {
        let transport = self.transport.clone();
        tokio::spawn(async move {
            let until = Instant::now() + IDLE_LIMIT * 2;
            while Instant::now() < until {
                let req = PeerRequest::Exec(Box::new(ForwardRequest {
                    session: session.clone(),
                    backend_pid,
                    begin: None,
                    savepoints: Vec::new(),
                    statement: None,
                    finish: Some(Finish::Rollback),
                    turn: None,
                }));
                if let Ok(PeerResponse::Exec { .. }) =
                    transport.call(&addr, req, Duration::from_secs(2)).await
                {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }

    /// Runs one step of a transaction forwarded by node `origin` (leaseholder side).
    pub async fn serve_exec(&self, origin: u64, req: ForwardRequest) -> LocalResponse {
        let key = (origin, req.session.clone());
        if req.finish == Some(Finish::Rollback) {
            self.sessions
                .ended
                .lock()
                .expect("sessions lock")
                .insert(key.clone(), Instant::now());
        } else if self
            .sessions
            .ended
            .lock()
            .expect("sessions lock")
            .contains_key(&key)
        {
            return LocalResponse::SqlError(gone(self.me));
        }
        // A split statement's share that reads ranges besides its partitions reads them from
        // this node's copies, which must hold every write acknowledged before it began.
        if let Some(st) = req.statement.as_ref().filter(|s| !s.read_ranges.is_empty()) {
            if let Err(e) = self
                .barrier(st.read_ranges.iter().map(|&r| (r, None)))
                .await
            {
                return super::write_error(e);
            }
        }
        let existing = self
            .sessions
            .remote
            .lock()
            .expect("sessions lock")
            .get(&key)
            .cloned();
        // A new session takes the turn as it begins, before its snapshot; an existing one
        // with the step.
        let mut turn = req.turn;
        let remote = match (existing, &req.begin) {
            (Some(r), _) => r,
            (None, Some(begin)) => match self.begin_remote(origin, begin, turn.take()).await {
                Ok(r) => {
                    let r = Arc::new(r);
                    self.sessions
                        .remote
                        .lock()
                        .expect("sessions lock")
                        .insert(key.clone(), r.clone());
                    r
                }
                Err(e) => return LocalResponse::SqlError(e),
            },
            (None, None) if req.finish == Some(Finish::Rollback) => {
                return LocalResponse::Forwarded {
                    processed: 0,
                    rows: Vec::new(),
                    moved: Vec::new(),
                    keys: Vec::new(),
                    deferred: Vec::new(),
                    wrote: false,
                    prepared_ranges: Vec::new(),
                }
            }
            (None, None) => {
                return LocalResponse::SqlError(SqlError {
                    code: "40001".into(),
                    message: format!(
                        "the transaction's session on node {} is gone (rolled back after its node restarted or after {} s without a keepalive)",
                        self.me,
                        IDLE_LIMIT.as_secs()
                    ),
                    detail: None,
                    hint: Some("Retry the transaction.".into()),
                })
            }
        };
        *remote.last_seen.lock().expect("session lock") = Instant::now();
        if req.finish == Some(Finish::Rollback) && req.statement.is_none() {
            // Stop a statement still running for a client that gave up on it.
            if let Ok(guard) = remote.conn.try_lock() {
                drop(guard);
            } else {
                self.cancel_backend(&remote).await;
            }
        }
        let mut guard = remote.conn.lock().await;
        let Some(conn) = guard.as_mut() else {
            return LocalResponse::SqlError(gone(self.me));
        };
        let outcome = run_steps(conn, &remote, &req, turn, self.me).await;
        let mut broken = matches!(&outcome, Err(Step::Broken(_)));
        if req.finish.is_some() && matches!(&outcome, Err(Step::Sql(_))) {
            // A step failed before the finish ran: the transaction is still open there.
            broken |= sqlx::query("ROLLBACK").execute(&mut *conn).await.is_err();
        }
        // Referential statements left for the origin: the commit waits for them.
        let left_open = matches!(&outcome, Ok(Outcome::Rows(r)) if !r.4.is_empty())
            && req.finish == Some(Finish::Commit);
        if (req.finish.is_some() && !left_open) || broken {
            self.sessions
                .remote
                .lock()
                .expect("sessions lock")
                .remove(&key);
            let conn = guard.take();
            drop(guard);
            // A connection whose transaction ended cleanly serves the next one, once the
            // session state a statement may have left (settings, advisory locks, temporary
            // tables) is reset.
            if let (Some(mut conn), false) = (conn, broken) {
                if reset_session(&mut conn).await.is_ok() {
                    self.put_back(&remote.database, conn);
                }
            }
        }
        // A prepare's part ranges, noted as its pre-prepare wrote them (taken whatever the
        // outcome, so that a failed prepare leaves no note behind).
        let uncertain = remote.prepare_sent.load(Ordering::SeqCst)
            && match &outcome {
                Err(Step::Broken(_)) => true,
                Err(Step::Sql(e)) => e.code == "40003",
                Ok(_) => false,
            };
        let prepared_ranges = match &req.finish {
            Some(Finish::Prepare(p)) => {
                let ranges = self.take_prepared(&p.gid);
                if outcome.is_err() && !ranges.is_empty() {
                    // This part did not prepare, so the transaction is certain to abort (its
                    // coordinator commits only once every part has): this node's record says
                    // so at once, and its appliers pass the `Prepare` entries the failed
                    // prepare wrote, lifting their ranges' fence, without waiting for a copy.
                    if let Err(e) = super::store::learn_decision(&self.db, &p.gid, false) {
                        tracing::debug!(gid = p.gid, "could not record an abort here: {e}");
                    }
                }
                ranges
            }
            _ => Vec::new(),
        };
        match outcome {
            Ok(Outcome::Rows((processed, rows, moved, keys, deferred, wrote))) => {
                LocalResponse::Forwarded {
                    processed,
                    rows,
                    moved,
                    keys,
                    deferred,
                    wrote,
                    prepared_ranges,
                }
            }
            // A part that wrote and locked nothing committed instead of preparing.
            Ok(Outcome::CommittedReadOnly) => LocalResponse::Done,
            // Its `Prepare` entries are in those ranges' logs: the coordinator has its abort
            // copied there before it forgets the decision. A `PREPARE TRANSACTION` whose
            // connection broke may even have prepared, and one whose pre-prepare gave up on an
            // ambiguous write (40003) may have entries still to land that nobody noted: the
            // coordinator has this node roll back, and keeps the anchor's record.
            Err(Step::Sql(error)) | Err(Step::Broken(error))
                if !prepared_ranges.is_empty() || uncertain =>
            {
                LocalResponse::PrepareFailed {
                    error,
                    prepared_ranges,
                    broken: uncertain,
                }
            }
            Err(Step::Sql(e)) | Err(Step::Broken(e)) => LocalResponse::SqlError(e),
        }
    }

    async fn begin_remote(
        &self,
        origin: u64,
        begin: &mr_wire::local::ForwardBegin,
        turn: Option<u64>,
    ) -> Result<Remote, SqlError> {
        let pooled = self
            .sessions
            .pool
            .lock()
            .expect("pool lock")
            .get_mut(&begin.database)
            .and_then(Vec::pop);
        // A pooled connection may have died with a PostgreSQL restart: then a fresh one.
        let (mut conn, backend_pid) = match pooled {
            Some(mut c) => match backend_pid(&mut c).await {
                Ok(pid) => (c, pid),
                Err(_) => self.connect(&begin.database).await?,
            },
            None => self.connect(&begin.database).await?,
        };
        // The origin planned its statements against its schema: wait until this node has
        // it (a schema change reaches every node within a poll, usually).
        let deadline = Instant::now() + SCHEMA_WAIT;
        loop {
            let here: i64 = sqlx::query_scalar("SELECT multiregion.schema_version()")
                .fetch_one(&mut conn)
                .await
                .map_err(|e| sql_error(&e))?;
            if here.max(0) as u64 >= begin.schema_version {
                break;
            }
            if Instant::now() >= deadline {
                return Err(SqlError {
                    code: "40001".into(),
                    message: format!(
                        "node {} has not applied schema version {} of database {} yet (it has {here})",
                        self.me, begin.schema_version, begin.database
                    ),
                    detail: None,
                    hint: Some("Retry the transaction.".into()),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        sqlx::query(begin.isolation.begin_sql(begin.read_only))
            .execute(&mut conn)
            .await
            .map_err(|e| sql_error(&e))?;
        // Before anything takes the transaction's snapshot: a wait for the turn then leaves
        // it after the holder's commit.
        if let Some(wait_ms) = turn {
            take_turn(&mut conn, wait_ms, self.me).await?;
        }
        let (names, values): (Vec<String>, Vec<String>) = begin.settings.iter().cloned().unzip();
        sqlx::query(
            "SELECT pg_catalog.set_config(k, v, true) FROM unnest($1::text[], $2::text[]) AS s(k, v)",
        )
        .bind(names)
        .bind(values)
        .execute(&mut conn)
        .await
        .map_err(|e| sql_error(&e))?;
        tracing::debug!(origin, database = %begin.database, role = %begin.role, "began a forwarded transaction");
        Ok(Remote {
            conn: tokio::sync::Mutex::new(Some(conn)),
            database: begin.database.clone(),
            role: begin.role.clone(),
            gateway_region: begin.gateway_region.clone(),
            backend_pid,
            last_seen: Mutex::new(Instant::now()),
            failed: AtomicBool::new(false),
            prepare_sent: AtomicBool::new(false),
        })
    }

    async fn connect(&self, database: &str) -> Result<(PgConnection, i32), SqlError> {
        // The origin's transaction passed its own barriers; this session reads as it is told.
        let mut conn = self
            .pg_cfg
            .connect_options(database)
            .application_name(APPLICATION_NAME)
            .options([("multiregion.snapshot_barrier", "off")])
            .connect()
            .await
            .map_err(|e| sql_error(&e))?;
        let pid = backend_pid(&mut conn).await.map_err(|e| sql_error(&e))?;
        Ok((conn, pid))
    }

    fn put_back(&self, database: &str, conn: PgConnection) {
        let mut pool = self.sessions.pool.lock().expect("pool lock");
        let idle = pool.entry(database.to_string()).or_default();
        if idle.len() < POOL_PER_DATABASE {
            idle.push(conn);
        }
    }

    async fn cancel_backend(&self, remote: &Remote) {
        let opts = self
            .pg_cfg
            .connect_options(&remote.database)
            .application_name(APPLICATION_NAME);
        if let Ok(mut c) = opts.connect().await {
            let _ = sqlx::query("SELECT pg_catalog.pg_cancel_backend($1)")
                .bind(remote.backend_pid)
                .execute(&mut c)
                .await;
            let _ = c.close().await;
        }
    }

    /// The origin's keepalive: `sessions` of node `origin` are still in use.
    pub fn keepalive(&self, origin: u64, sessions: &[String]) {
        let remote = self.sessions.remote.lock().expect("sessions lock");
        for s in sessions {
            if let Some(r) = remote.get(&(origin, s.clone())) {
                *r.last_seen.lock().expect("session lock") = Instant::now();
            }
        }
    }

    /// Both sides' upkeep, every [`KEEPALIVE_EVERY`]: sessions of backends that are gone are
    /// rolled back, the others kept alive; remote sessions without a keepalive end.
    pub(super) async fn session_upkeep(&self) {
        let mine: Vec<(String, u64, i32)> = self
            .sessions
            .origin
            .lock()
            .expect("sessions lock")
            .iter()
            .map(|(s, &(n, p))| (s.clone(), n, p))
            .collect();
        let mut alive: HashMap<u64, Vec<String>> = HashMap::new();
        for (session, node, pid) in mine {
            if std::path::Path::new(&format!("/proc/{pid}")).exists() {
                alive.entry(node).or_default().push(session);
            } else {
                let req = ForwardRequest {
                    session,
                    backend_pid: pid,
                    begin: None,
                    savepoints: Vec::new(),
                    statement: None,
                    finish: Some(Finish::Rollback),
                    turn: None,
                };
                let _ = self.forward(node, req).await;
            }
        }
        for (node, sessions) in alive {
            if let Some(addr) = self.node_addr(node) {
                let req = PeerRequest::ExecKeepalive { sessions };
                let _ = self
                    .transport
                    .call(&addr, req, Duration::from_secs(5))
                    .await;
            }
        }
        self.sweep_prepared().await;
        let now = Instant::now();
        self.sessions
            .ended
            .lock()
            .expect("sessions lock")
            .retain(|_, at| now.duration_since(*at) < IDLE_LIMIT * 4);
        let mut remote = self.sessions.remote.lock().expect("sessions lock");
        remote.retain(|(origin, session), r| {
            let idle = now.duration_since(*r.last_seen.lock().expect("session lock"));
            // A busy session is running a statement its origin is waiting for.
            let keep = idle < IDLE_LIMIT || r.conn.try_lock().is_err();
            if !keep {
                tracing::info!(
                    origin,
                    session,
                    "rolled back a forwarded transaction whose origin went silent"
                );
            }
            keep
        });
    }

    pub(super) async fn run_session_upkeep(
        self: Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let mut tick = tokio::time::interval(KEEPALIVE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            self.session_upkeep().await;
        }
    }
}

/// Takes this node's turn for transactions over several nodes (ARCHITECTURE.md §8.5,
/// "Isolation"): the lock of `multiregion.turn`, held until the transaction ends here, so
/// that no two such transactions overlap on this node, and an update of its row, which fails
/// with 40001 if one of them committed here after this transaction's snapshot was taken.
async fn take_turn(conn: &mut PgConnection, wait_ms: u64, me: u64) -> Result<(), SqlError> {
    let busy = |e: sqlx::Error| {
        let mut e = sql_error(&e);
        match e.code.as_str() {
            "55P03" => {
                e.code = "40001".into();
                e.message = format!(
                    "could not serialize access: node {me}'s turn for transactions over several nodes was held by another one for {wait_ms} ms"
                );
                e.hint = Some("Retry the transaction.".into());
            }
            // The turn row's update found it updated by a transaction committed after this
            // one's snapshot (other serialization failures keep their own words).
            "40001" if e.message.contains("concurrent update") => {
                e.message = format!(
                    "could not serialize access: another transaction over several nodes committed on node {me} after this transaction began there"
                );
                e.hint = Some("Retry the transaction.".into());
            }
            _ => {}
        }
        e
    };
    // SHOW and SET take no snapshot: the lock is waited for before any is taken.
    let before: String = sqlx::query_scalar("SHOW lock_timeout")
        .persistent(false)
        .fetch_one(&mut *conn)
        .await
        .map_err(busy)?;
    let set = format!("SET LOCAL lock_timeout = {wait_ms}");
    for sql in [
        set.as_str(),
        "LOCK TABLE multiregion.turn IN EXCLUSIVE MODE",
        "UPDATE multiregion.turn SET taken = taken + 1",
    ] {
        sqlx::query(sql)
            .persistent(false)
            .execute(&mut *conn)
            .await
            .map_err(busy)?;
    }
    sqlx::query("SELECT pg_catalog.set_config('lock_timeout', $1, true)")
        .bind(before)
        .persistent(false)
        .execute(&mut *conn)
        .await
        .map_err(busy)?;
    Ok(())
}

enum Step {
    /// The statement failed; the session goes on (a savepoint may undo it).
    Sql(SqlError),
    /// The connection is unusable; the session ends.
    Broken(SqlError),
}

/// What `remote_exec` returned in a JSON column, or a broken step if it cannot be read.
fn unreadable<T>(what: &str, parsed: Result<Vec<T>, serde_json::Error>) -> Result<Vec<T>, Step> {
    parsed.map_err(|e| {
        Step::Broken(SqlError {
            code: "XX000".into(),
            message: format!("remote_exec returned unreadable {what}: {e}"),
            detail: None,
            hint: None,
        })
    })
}

/// What a step did.
enum Outcome {
    Rows(Rows),
    /// Asked to prepare, the transaction had written and locked nothing (no transaction id):
    /// it committed, and has no part in the decision.
    CommittedReadOnly,
}

/// A row as text, as `remote_exec` returns it.
type TextRow = Vec<Option<String>>;
/// A row of `remote_exec`: rows processed, a row, as JSON moved rows, key changes and
/// deferred referential statements, and whether the transaction has written.
type ExecRow = (
    i64,
    Option<TextRow>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<bool>,
);
/// Rows processed, the rows returned, rows left for other partitions' leaseholders, changes
/// to global keys left for the key tables' leaseholders, referential statements left for
/// the origin, and whether the transaction has changed replicated rows.
type Rows = (
    u64,
    Vec<TextRow>,
    Vec<mr_wire::local::MovedRows>,
    Vec<mr_wire::local::KeyChanges>,
    Vec<mr_wire::local::DeferredStatement>,
    bool,
);

async fn run_steps(
    conn: &mut PgConnection,
    remote: &Remote,
    req: &ForwardRequest,
    turn: Option<u64>,
    me: u64,
) -> Result<Outcome, Step> {
    for op in &req.savepoints {
        let sql = op.sql();
        if let Err(e) = sqlx::query(&sql)
            .persistent(false)
            .execute(&mut *conn)
            .await
        {
            return Err(failed(remote, e));
        }
        if matches!(op, mr_wire::local::SavepointOp::RollbackTo(_)) {
            remote.failed.store(false, Ordering::SeqCst);
        }
    }
    // Taken again after a rollback to a savepoint undid it (the origin asks again).
    if let Some(wait_ms) = turn {
        if let Err(e) = take_turn(conn, wait_ms, me).await {
            remote.failed.store(true, Ordering::SeqCst);
            return Err(Step::Sql(e));
        }
    }
    // A step without a statement (savepoints only) says nothing about writes: assume some.
    let mut out: Rows = (0, Vec::new(), Vec::new(), Vec::new(), Vec::new(), true);
    if let Some(st) = &req.statement {
        if let Some(ms) = st.lock_timeout_ms {
            let set = sqlx::query("SELECT pg_catalog.set_config('lock_timeout', $1, true)")
                .bind(format!("{ms}ms"))
                .execute(&mut *conn)
                .await;
            if let Err(e) = set {
                return Err(failed(remote, e));
            }
        }
        if !st.settings.is_empty() {
            let (names, values): (Vec<String>, Vec<String>) = st.settings.iter().cloned().unzip();
            let set = sqlx::query(
                "SELECT pg_catalog.set_config(k, v, true) FROM unnest($1::text[], $2::text[]) AS s(k, v)",
            )
            .bind(names)
            .bind(values)
            .execute(&mut *conn)
            .await;
            if let Err(e) = set {
                return Err(failed(remote, e));
            }
        }
        let (types, values): (Vec<String>, Vec<Option<String>>) = st.params.iter().cloned().unzip();
        // `crosscheck` only where asked: older versions of the extension lack it.
        let sql = if st.crosscheck {
            "SELECT processed, \"row\", moved, keys, deferred, wrote FROM multiregion.remote_exec($1, $2, $3, $4, $5, $6, crosscheck => true)"
        } else {
            "SELECT processed, \"row\", moved, keys, deferred, wrote FROM multiregion.remote_exec($1, $2, $3, $4, $5, $6)"
        };
        let result = sqlx::query(sql)
            .bind(st.role.clone().unwrap_or_else(|| remote.role.clone()))
            .bind(remote.gateway_region.clone())
            .bind(st.sql.clone())
            .bind(types)
            .bind(values)
            .bind(st.partitions.clone())
            .fetch_all(&mut *conn)
            .await;
        let rows = match result {
            Ok(rows) => rows,
            Err(e) => return Err(failed(remote, e)),
        };
        for r in rows {
            let decoded: Result<ExecRow, _> = r.try_get(0).and_then(|p| {
                Ok((
                    p,
                    r.try_get(1)?,
                    r.try_get(2)?,
                    r.try_get(3)?,
                    r.try_get(4)?,
                    r.try_get(5)?,
                ))
            });
            match decoded {
                Ok((processed, row, moved, keys, deferred, wrote)) => {
                    if let Some(w) = wrote {
                        out.5 = w;
                    }
                    out.0 = processed.max(0) as u64;
                    out.1.extend(row);
                    if let Some(m) = moved {
                        out.2
                            .extend(unreadable("moved rows", serde_json::from_str(&m))?);
                    }
                    if let Some(k) = keys {
                        out.3
                            .extend(unreadable("key changes", serde_json::from_str(&k))?);
                    }
                    if let Some(d) = deferred {
                        out.4
                            .extend(unreadable("deferred statements", serde_json::from_str(&d))?);
                    }
                }
                Err(e) => return Err(Step::Broken(sql_error(&e))),
            }
        }
    }
    // Rows left for other partitions' leaseholders join the transaction after this step:
    // it cannot end here.
    if (!out.2.is_empty() || !out.3.is_empty()) && req.finish.is_some() {
        let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
        return Err(Step::Sql(SqlError {
            code: "0A000".into(),
            message: "the statement wrote rows or keys leased on other nodes, and was sent to be committed at once".into(),
            detail: None,
            hint: Some("This is a bug in statement routing: please report it with the statement.".into()),
        }));
    }
    match &req.finish {
        // Referential statements the origin must run first: the commit is its to send.
        Some(Finish::Commit) if !out.4.is_empty() => {}
        Some(Finish::Commit) => {
            // COMMIT of a failed transaction rolls back without an error: refuse it here.
            if remote.failed.load(Ordering::SeqCst) {
                let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
                return Err(Step::Sql(aborted()));
            }
            match sqlx::query("COMMIT").execute(&mut *conn).await {
                Ok(_) => {}
                Err(e @ sqlx::Error::Database(_)) => return Err(Step::Sql(sql_error(&e))),
                Err(e) => {
                    return Err(Step::Broken(SqlError {
                        code: "40003".into(),
                        ..sql_error(&e)
                    }))
                }
            }
        }
        Some(Finish::Rollback) => {
            if let Err(e) = sqlx::query("ROLLBACK").execute(&mut *conn).await {
                return Err(Step::Broken(sql_error(&e)));
            }
        }
        Some(Finish::Prepare(p)) => {
            if remote.failed.load(Ordering::SeqCst) {
                let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
                return Err(Step::Sql(aborted()));
            }
            // Nothing written or locked (no transaction id): nothing to prepare.
            let xid: Result<Option<String>, _> =
                sqlx::query_scalar("SELECT pg_catalog.pg_current_xact_id_if_assigned()::text")
                    .fetch_one(&mut *conn)
                    .await;
            match xid {
                Ok(None) => {
                    return match sqlx::query("COMMIT").execute(&mut *conn).await {
                        Ok(_) => Ok(Outcome::CommittedReadOnly),
                        Err(e) => Err(Step::Broken(sql_error(&e))),
                    };
                }
                Ok(Some(_)) => {}
                Err(e) => return Err(failed(remote, e)),
            }
            // The backend's pre-prepare writes its changes as prepared entries anchored where
            // the coordinator records the decision (only a superuser can set this).
            let set =
                sqlx::query("SELECT pg_catalog.set_config('multiregion.prepare_as', $1, true)")
                    .bind(p.setting())
                    .execute(&mut *conn)
                    .await;
            if let Err(e) = set {
                return Err(failed(remote, e));
            }
            let sql = format!(
                "PREPARE TRANSACTION {}",
                super::twophase::quote_literal(&p.prepared_name())
            );
            remote.prepare_sent.store(true, Ordering::SeqCst);
            match sqlx::query(&sql)
                .persistent(false)
                .execute(&mut *conn)
                .await
            {
                Ok(_) => {}
                Err(e @ sqlx::Error::Database(_)) => return Err(Step::Sql(sql_error(&e))),
                Err(e) => return Err(Step::Broken(sql_error(&e))),
            }
        }
        None => {}
    }
    Ok(Outcome::Rows(out))
}

/// A failed step: a statement error leaves the transaction failed until a savepoint
/// rollback; anything else breaks the session.
fn failed(remote: &Remote, e: sqlx::Error) -> Step {
    match e {
        sqlx::Error::Database(_) => {
            remote.failed.store(true, Ordering::SeqCst);
            Step::Sql(sql_error(&e))
        }
        other => Step::Broken(sql_error(&other)),
    }
}

/// Resets what a statement may have changed beyond its transaction. (Not DISCARD ALL: it
/// would drop the prepared statements sqlx caches on the connection.)
async fn reset_session(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    for sql in [
        "RESET ALL",
        "SELECT pg_catalog.pg_advisory_unlock_all()",
        "DISCARD TEMP",
    ] {
        sqlx::query(sql).execute(&mut *conn).await?;
    }
    Ok(())
}

async fn backend_pid(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_catalog.pg_backend_pid()")
        .fetch_one(conn)
        .await
}

fn aborted() -> SqlError {
    SqlError {
        code: "25P02".into(),
        message: "current transaction is aborted, commands ignored until end of transaction block"
            .into(),
        detail: None,
        hint: None,
    }
}

fn gone(me: u64) -> SqlError {
    SqlError {
        code: "40001".into(),
        message: format!("the transaction's session on node {me} has ended"),
        detail: None,
        hint: Some("Retry the transaction.".into()),
    }
}

/// An error as the client should see it: PostgreSQL's own, or a connection failure.
fn sql_error(e: &sqlx::Error) -> SqlError {
    match e {
        sqlx::Error::Database(db) => match db.try_downcast_ref::<PgDatabaseError>() {
            Some(pg) => SqlError {
                code: pg.code().to_string(),
                message: pg.message().to_string(),
                detail: pg.detail().map(str::to_string),
                hint: pg.hint().map(str::to_string),
            },
            None => SqlError {
                code: db.code().map_or("XX000".into(), |c| c.to_string()),
                message: db.message().to_string(),
                detail: None,
                hint: None,
            },
        },
        other => SqlError {
            code: "08006".into(),
            message: format!("the leaseholder's PostgreSQL connection failed: {other}"),
            detail: None,
            hint: None,
        },
    }
}
