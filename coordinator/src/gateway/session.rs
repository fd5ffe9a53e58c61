//! One client connection: startup and authentication relayed to PostgreSQL, then every
//! message relayed both ways in one task. Queries pass through the translator; PostgreSQL's
//! responses pass through untouched except for the statements the gateway rewrote (their
//! command tags become CockroachDB's). Rows and COPY data are streamed, never buffered whole.

use super::{DbError, Gateway};
use anyhow::{anyhow, bail, Context, Result};
use bytes::{Buf, BytesMut};
use mr_pgproto as proto;
use mr_sql::{Outcome, Present};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

/// Stop reading a side while this much is waiting to be written to the other: the client
/// (or PostgreSQL) is not keeping up, and the kernel's buffers should push back on the sender
/// instead of pgmr's memory.
const HIGH_WATER: usize = 1 << 20;

pub async fn run(gw: Arc<Gateway>, mut tcp: TcpStream) -> Result<()> {
    tcp.set_nodelay(true)?;
    let mut packet = read_startup(&mut tcp).await?;
    loop {
        match proto::parse_startup(&packet) {
            Ok(proto::Startup::Ssl) => match gw.tls.clone() {
                Some(acceptor) => {
                    tcp.write_all(b"S").await?;
                    let mut tls = acceptor.accept(tcp).await.context("TLS handshake")?;
                    let packet = read_startup(&mut tls).await?;
                    return match proto::parse_startup(&packet) {
                        Ok(proto::Startup::Params(p)) => startup(gw, tls, p).await,
                        Ok(proto::Startup::Cancel { pid, key }) => {
                            gw.cancel(pid, key).await;
                            Ok(())
                        }
                        Ok(_) => fatal(&mut tls, "08P01", "unexpected request after TLS").await,
                        Err(e) => fatal(&mut tls, "08P01", &e.to_string()).await,
                    };
                }
                None => {
                    tcp.write_all(b"N").await?;
                    packet = read_startup(&mut tcp).await?;
                }
            },
            Ok(proto::Startup::GssEnc) => {
                tcp.write_all(b"N").await?;
                packet = read_startup(&mut tcp).await?;
            }
            Ok(proto::Startup::Cancel { pid, key }) => {
                gw.cancel(pid, key).await;
                return Ok(());
            }
            Ok(proto::Startup::Params(p)) => return startup(gw, tcp, p).await,
            Err(e) => return fatal(&mut tcp, "08P01", &e.to_string()).await,
        }
    }
}

async fn read_startup<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> Result<Vec<u8>> {
    let mut head = [0u8; 4];
    s.read_exact(&mut head).await?;
    let len = match proto::startup_len(&head) {
        Ok(Some(n)) => n,
        Ok(None) => unreachable!("four bytes read"),
        Err(e) => {
            fatal(s, "08P01", &format!("invalid startup packet: {e}")).await?;
            unreachable!("fatal returns an error")
        }
    };
    let mut packet = head.to_vec();
    packet.resize(len, 0);
    s.read_exact(&mut packet[4..]).await?;
    Ok(packet)
}

/// Sends a FATAL error and ends the connection (the error is also returned, for the log).
async fn fatal<S: AsyncWrite + Unpin>(s: &mut S, sqlstate: &str, message: &str) -> Result<()> {
    let mut out = Vec::new();
    proto::error_response(&mut out, "FATAL", sqlstate, message, None);
    let _ = s.write_all(&out).await;
    let _ = s.shutdown().await;
    Err(anyhow!("{sqlstate}: {message}"))
}

/// How the client authenticated, for logging the session into another database (`USE`).
#[derive(Default, Clone)]
struct Credentials {
    /// The password, when PostgreSQL asked for it in clear (`password` in pg_hba.conf).
    cleartext: Option<Vec<u8>>,
}

async fn startup<C>(gw: Arc<Gateway>, mut client: C, params: Vec<(String, String)>) -> Result<()>
where
    C: AsyncRead + AsyncWrite + Unpin + Send,
{
    let Some(user) = params
        .iter()
        .find(|(k, _)| k == "user")
        .map(|(_, v)| v.clone())
    else {
        return fatal(
            &mut client,
            "28000",
            "no PostgreSQL user name specified in startup packet",
        )
        .await;
    };
    let database = params
        .iter()
        .find(|(k, _)| k == "database")
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| user.clone());
    let mut server = match gw.connect_pg().await {
        Ok(s) => s,
        Err(e) => {
            return fatal(
                &mut client,
                "57P03",
                &format!("the database system is not accepting connections: {e}"),
            )
            .await
        }
    };
    let mut out = Vec::new();
    proto::startup_message(&mut out, &params);
    server.write_all(&out).await?;

    // Authentication: PostgreSQL asks, the client answers, until ReadyForQuery or an error.
    let mut creds = Credentials::default();
    let mut cancel_key = None;
    let mut backend_key = (0, 0);
    let mut sbuf = BytesMut::with_capacity(8192);
    let mut cbuf = BytesMut::with_capacity(8192);
    loop {
        let msg = next_message(&mut server, &mut sbuf).await?;
        match msg[0] {
            b'R' => {
                let (code, _) = proto::read_auth(&msg)?;
                client.write_all(&msg).await?;
                // Ok (0) and SASLFinal (12) need no answer.
                if code != 0 && code != 12 {
                    let answer = next_message(&mut client, &mut cbuf).await?;
                    if answer[0] != b'p' {
                        return fatal(&mut client, "08P01", "expected a password response").await;
                    }
                    if code == 3 {
                        let pw = proto::body(&answer);
                        creds.cleartext = Some(pw[..pw.len().saturating_sub(1)].to_vec());
                    }
                    server.write_all(&answer).await?;
                }
            }
            b'K' => {
                backend_key = proto::read_backend_key(&msg)?;
                let (pid, key) = gw.register_cancel(backend_key);
                cancel_key = Some((pid, key));
                let mut k = Vec::new();
                proto::backend_key_data(&mut k, pid, key);
                client.write_all(&k).await?;
            }
            b'E' => {
                client.write_all(&msg).await?;
                return Ok(());
            }
            b'Z' => {
                client.write_all(&msg).await?;
                break;
            }
            _ => client.write_all(&msg).await?,
        }
    }
    let cancel_key = cancel_key.unwrap_or_else(|| gw.register_cancel(backend_key));
    let (control, control_rx) = tokio::sync::mpsc::unbounded_channel();
    gw.register_session(backend_key.0, control.clone());
    let mut s = Session {
        gw: gw.clone(),
        params,
        user,
        database,
        creds,
        cancel_key,
        pending: VecDeque::new(),
        statements: HashMap::new(),
        portals: HashMap::new(),
        txn: b'I',
        c_stream: 0,
        s_stream: 0,
        to_server: BytesMut::new(),
        to_client: BytesMut::new(),
        deferred: None,
        backend_pid: backend_key.0,
        control,
        savepoints: Vec::new(),
        opaque: false,
        started: VecDeque::new(),
    };
    gw.sessions_open
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let _open = SessionCount(gw.clone());
    // Bytes read past ReadyForQuery (none, unless PostgreSQL sent something unprompted) are the
    // start of the relay's input, framed like the rest.
    let result = s.relay(client, server, cbuf, sbuf, control_rx).await;
    gw.forget_cancel(s.cancel_key);
    gw.forget_session(s.backend_pid);
    result
}

/// Reads one whole message of at most `max` bytes: during startup (where messages are small)
/// and for the gateway's own queries, never for relayed traffic.
async fn read_message<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut BytesMut,
    max: usize,
) -> Result<Vec<u8>> {
    loop {
        if let Some((_, len)) = proto::header(buf, max)? {
            if buf.len() >= len {
                return Ok(buf.split_to(len).to_vec());
            }
        }
        if s.read_buf(buf).await? == 0 {
            bail!("connection closed");
        }
    }
}

async fn next_message<S: AsyncRead + Unpin>(s: &mut S, buf: &mut BytesMut) -> Result<Vec<u8>> {
    read_message(s, buf, proto::MAX_STARTUP).await
}

/// What the rest of pgmr may ask of a session.
pub enum Control {
    /// Restart the session's transaction if it is idle, read-only and READ COMMITTED (a
    /// schema change wants the locks it holds); answers whether it did.
    RestartIdleReader(tokio::sync::oneshot::Sender<bool>),
}

/// A response PostgreSQL owes, in the order the requests were sent.
#[derive(Debug)]
enum Expect {
    /// A simple query; `presents` lists its statements when the gateway rewrote it.
    Query {
        presents: Option<Vec<Present>>,
        next: usize,
    },
    Parse(Option<Present>),
    Bind,
    Describe,
    Execute(Option<Present>),
    Close,
    Sync,
    FunctionCall,
}

/// A query the gateway runs itself once every earlier response has reached the client.
enum Deferred {
    Use(String),
    CreateDatabase {
        name: String,
        create: String,
        configure: String,
        if_not_exists: bool,
    },
}

struct Session {
    gw: Arc<Gateway>,
    params: Vec<(String, String)>,
    user: String,
    database: String,
    creds: Credentials,
    cancel_key: (i32, i32),
    pending: VecDeque<Expect>,
    /// Prepared statements and portals the gateway rewrote (the others are not tracked).
    statements: HashMap<String, Present>,
    portals: HashMap<String, Present>,
    /// Transaction status from the last ReadyForQuery.
    txn: u8,
    /// Bytes of a CopyData or DataRow still to relay as they come (from the client / server).
    c_stream: usize,
    s_stream: usize,
    to_server: BytesMut,
    to_client: BytesMut,
    deferred: Option<Deferred>,
    /// The backend's pid, under which the session is registered for [`Control`] requests.
    backend_pid: i32,
    control: tokio::sync::mpsc::UnboundedSender<Control>,
    /// Savepoints of the open transaction, oldest first, and whether it holds state a restart
    /// could not recreate (both as far as the client's statements tell).
    savepoints: Vec<String>,
    opaque: bool,
    /// When each statement the client sent (a Query, or a Sync ending an extended-protocol
    /// batch) arrived, oldest first: its latency is recorded at its ReadyForQuery.
    started: VecDeque<Instant>,
}

impl Session {
    /// A ReadyForQuery went to the client: the oldest statement is done.
    fn statement_done(&mut self) {
        if let Some(t) = self.started.pop_front() {
            self.gw.stats.record(t.elapsed(), crate::node::now_ms());
        }
    }

    async fn relay<C>(
        &mut self,
        client: C,
        server: UnixStream,
        mut cbuf: BytesMut,
        mut sbuf: BytesMut,
        mut control: tokio::sync::mpsc::UnboundedReceiver<Control>,
    ) -> Result<()>
    where
        C: AsyncRead + AsyncWrite + Unpin + Send,
    {
        let (mut cr, mut cw) = tokio::io::split(client);
        let (mut sr, mut sw) = server.into_split();
        sbuf.reserve(64 * 1024);
        if !sbuf.is_empty() {
            self.on_server_bytes(&mut sbuf)?;
        }
        let mut client_open = true;
        // Anything the client pipelined behind its last authentication message.
        if !cbuf.is_empty() {
            self.on_client_bytes(&mut cbuf).await?;
        }
        loop {
            if self.deferred.is_some()
                && self.pending.is_empty()
                && self.to_server.is_empty()
                && self.to_client.is_empty()
            {
                let d = self.deferred.take().expect("checked");
                let new = self.run_deferred(d, &mut sr, &mut sw, &mut sbuf).await?;
                if let Some((r, w)) = new {
                    let mut old = sw;
                    let _ = old.write_all(b"X\0\0\0\x04").await;
                    (sr, sw) = (r, w);
                }
                if !cbuf.is_empty() {
                    self.on_client_bytes(&mut cbuf).await?;
                }
            }
            let read_client =
                client_open && self.deferred.is_none() && self.to_server.len() < HIGH_WATER;
            let read_server = self.to_client.len() < HIGH_WATER;
            tokio::select! {
                r = cr.read_buf(&mut cbuf), if read_client => {
                    if r? == 0 {
                        // The client left. PostgreSQL notices a closed socket only when it
                        // next writes, which a long query may not do for a while: cancel
                        // whatever is still running so the backend ends now.
                        client_open = false;
                        if !self.pending.is_empty() {
                            self.gw.cancel(self.cancel_key.0, self.cancel_key.1).await;
                        }
                        if self.to_server.is_empty() {
                            return Ok(());
                        }
                    } else if let Err(e) = self.on_client_bytes(&mut cbuf).await {
                        let _ = cw.write_all(&self.to_client).await;
                        let _ = cw.shutdown().await;
                        return Err(e);
                    }
                }
                r = sr.read_buf(&mut sbuf), if read_server => {
                    if r? == 0 {
                        cw.write_all(&self.to_client).await?;
                        return Ok(());
                    }
                    self.on_server_bytes(&mut sbuf)?;
                }
                r = cw.write_buf(&mut self.to_client), if !self.to_client.is_empty() => {
                    r?;
                }
                r = sw.write_buf(&mut self.to_server), if !self.to_server.is_empty() => {
                    r?;
                    if !client_open && self.to_server.is_empty() {
                        return Ok(());
                    }
                }
                Some(Control::RestartIdleReader(reply)) = control.recv() => {
                    let done = self.restart_idle_reader(&mut sr, &mut sw, &mut sbuf).await?;
                    let _ = reply.send(done);
                }
            }
        }
    }

    /// Handles every complete client message in `buf`.
    async fn on_client_bytes(&mut self, buf: &mut BytesMut) -> Result<()> {
        loop {
            if self.c_stream > 0 {
                let n = self.c_stream.min(buf.len());
                self.to_server.extend_from_slice(&buf[..n]);
                buf.advance(n);
                self.c_stream -= n;
                if self.c_stream > 0 {
                    return Ok(());
                }
            }
            if self.deferred.is_some() {
                return Ok(());
            }
            let (tag, len) = match proto::header(buf, proto::MAX_MESSAGE) {
                Ok(Some(h)) => h,
                Ok(None) => return Ok(()),
                Err(e) => return self.protocol_violation(&e.to_string()),
            };
            // CopyData streams; everything else is small enough to take whole.
            if tag == b'd' {
                self.c_stream = len;
                continue;
            }
            if buf.len() < len {
                buf.reserve(len - buf.len());
                return Ok(());
            }
            let msg = buf.split_to(len);
            self.client_message(tag, &msg).await?;
        }
    }

    /// Ends the connection with a FATAL error (the relay sends it before closing).
    fn protocol_violation(&mut self, why: &str) -> Result<()> {
        proto_into(&mut self.to_client, |o| {
            proto::error_response(
                o,
                "FATAL",
                "08P01",
                &format!("invalid frontend message: {why}"),
                None,
            )
        });
        bail!("protocol violation: {why}")
    }

    async fn client_message(&mut self, tag: u8, msg: &[u8]) -> Result<()> {
        if matches!(tag, b'Q' | b'S') {
            self.started.push_back(Instant::now());
        }
        match tag {
            b'Q' => {
                let sql = proto::read_query(msg).map_err(|e| anyhow!(e))?;
                self.track_transaction(sql, false);
                match mr_sql::translate(sql) {
                    Outcome::Unchanged => {
                        self.to_server.extend_from_slice(msg);
                        self.pending.push_back(Expect::Query {
                            presents: None,
                            next: 0,
                        });
                    }
                    Outcome::Rewritten(t) => {
                        let sql = self.assemble(&t).await;
                        let mut out = Vec::new();
                        proto::query(&mut out, &sql);
                        self.to_server.extend_from_slice(&out);
                        self.pending.push_back(Expect::Query {
                            presents: Some(t.presents),
                            next: 0,
                        });
                    }
                    Outcome::Use(db) => self.deferred = Some(Deferred::Use(db)),
                    Outcome::CreateDatabase {
                        name,
                        create,
                        configure,
                        if_not_exists,
                    } => {
                        self.deferred = Some(Deferred::CreateDatabase {
                            name,
                            create,
                            configure,
                            if_not_exists,
                        })
                    }
                }
            }
            b'P' => {
                let (name, sql, types) = proto::read_parse(msg).map_err(|e| anyhow!(e))?;
                self.track_transaction(sql, true);
                match mr_sql::translate_one(sql) {
                    Outcome::Rewritten(t) => {
                        let sql = self.assemble(&t).await;
                        let present = t.presents.into_iter().next().unwrap_or(Present::AsIs);
                        let mut out = Vec::new();
                        proto::parse(&mut out, name, &sql, types);
                        self.to_server.extend_from_slice(&out);
                        self.statements.insert(name.to_string(), present.clone());
                        self.pending.push_back(Expect::Parse(Some(present)));
                    }
                    _ => {
                        if !self.statements.is_empty() {
                            self.statements.remove(name);
                        }
                        self.to_server.extend_from_slice(msg);
                        self.pending.push_back(Expect::Parse(None));
                    }
                }
            }
            b'B' => {
                if !self.statements.is_empty() || !self.portals.is_empty() {
                    let (portal, stmt) = proto::read_bind(msg).map_err(|e| anyhow!(e))?;
                    match self.statements.get(stmt) {
                        Some(p) => {
                            let p = p.clone();
                            self.portals.insert(portal.to_string(), p);
                        }
                        None => {
                            self.portals.remove(portal);
                        }
                    }
                }
                self.to_server.extend_from_slice(msg);
                self.pending.push_back(Expect::Bind);
            }
            b'E' => {
                let present = if self.portals.is_empty() {
                    None
                } else {
                    let portal = proto::read_execute(msg).map_err(|e| anyhow!(e))?;
                    self.portals.get(portal).cloned()
                };
                self.to_server.extend_from_slice(msg);
                self.pending.push_back(Expect::Execute(present));
            }
            b'D' => {
                self.to_server.extend_from_slice(msg);
                self.pending.push_back(Expect::Describe);
            }
            b'C' => {
                if let Ok((kind, name)) = proto::read_target(msg) {
                    match kind {
                        b'S' => self.statements.remove(name),
                        _ => self.portals.remove(name),
                    };
                }
                self.to_server.extend_from_slice(msg);
                self.pending.push_back(Expect::Close);
            }
            b'S' => {
                self.to_server.extend_from_slice(msg);
                self.pending.push_back(Expect::Sync);
            }
            b'F' => {
                self.to_server.extend_from_slice(msg);
                self.pending.push_back(Expect::FunctionCall);
            }
            // Flush, CopyDone, CopyFail, Terminate and anything else: PostgreSQL's to judge.
            _ => self.to_server.extend_from_slice(msg),
        }
        Ok(())
    }

    /// Follows the savepoints of the open transaction. A prepared statement may run any
    /// number of times, so one that touches transaction state makes it opaque.
    fn track_transaction(&mut self, sql: &str, prepared: bool) {
        for effect in mr_sql::txn_effects(sql) {
            match effect {
                _ if prepared => self.opaque = true,
                mr_sql::TxnEffect::Savepoint(n) => self.savepoints.push(n),
                mr_sql::TxnEffect::Release(n) => {
                    if let Some(i) = self.savepoints.iter().rposition(|s| *s == n) {
                        self.savepoints.truncate(i);
                    }
                }
                mr_sql::TxnEffect::RollbackTo(n) => {
                    if let Some(i) = self.savepoints.iter().rposition(|s| *s == n) {
                        self.savepoints.truncate(i + 1);
                    }
                }
                mr_sql::TxnEffect::Opaque => self.opaque = true,
            }
        }
    }

    /// CockroachDB's schema changes do not wait for idle readers; PostgreSQL's wait for every
    /// lock holder. A session idle inside a transaction that has only read, under READ
    /// COMMITTED, can have that transaction restarted without the client noticing: each of its
    /// statements reads a fresh snapshot anyway, and the restart recreates its savepoints. It
    /// then holds no locks, and the schema change that asked goes ahead. Anything else — a
    /// write, another isolation level, cursors or other state — and the answer is no.
    async fn restart_idle_reader(
        &mut self,
        sr: &mut tokio::net::unix::OwnedReadHalf,
        sw: &mut tokio::net::unix::OwnedWriteHalf,
        sbuf: &mut BytesMut,
    ) -> Result<bool> {
        let idle = self.pending.is_empty()
            && self.to_server.is_empty()
            && self.deferred.is_none()
            && self.s_stream == 0
            && self.c_stream == 0;
        if !idle || self.txn != b'T' || self.opaque {
            return Ok(false);
        }
        let (error, _, rows) = self
            .own_query_rows(
                "SELECT pg_catalog.current_setting('transaction_isolation'), \
                        pg_catalog.current_setting('transaction_read_only'), \
                        pg_catalog.pg_current_xact_id_if_assigned() IS NULL",
                sr,
                sw,
                sbuf,
            )
            .await?;
        let state: Vec<Option<&str>> = rows
            .first()
            .map(|r| r.iter().map(|c| c.as_deref()).collect())
            .unwrap_or_default();
        let read_only = match state.as_slice() {
            [Some("read committed"), Some(ro), Some("t")] if error.is_none() => *ro == "on",
            _ => return Ok(false),
        };
        let mut sql = format!(
            "ROLLBACK; BEGIN ISOLATION LEVEL READ COMMITTED{}",
            if read_only { ", READ ONLY" } else { "" }
        );
        for sp in &self.savepoints {
            sql.push_str(&format!("; SAVEPOINT {}", mr_sql::ident(sp)));
        }
        let (error, status, _) = self.own_query_rows(&sql, sr, sw, sbuf).await?;
        if error.is_some() || status != b'T' {
            // The client believes its transaction open: leave it aborted, never absent.
            let raise = format!(
                "BEGIN; SELECT multiregion.raise_error('40001', {}, NULL)",
                mr_sql::literal("restart transaction: a schema change restarted it")
            );
            let (_, status, _) = self.own_query_rows(&raise, sr, sw, sbuf).await?;
            self.txn = status;
        }
        tracing::debug!(
            backend = self.backend_pid,
            "restarted an idle reader for a schema change"
        );
        Ok(true)
    }

    /// The rewritten text, with each UPSERT's table looked up.
    async fn assemble(&mut self, t: &mr_sql::Translation) -> String {
        let mut found = HashMap::new();
        for u in t.upserts() {
            if !found.contains_key(&u.table.0) {
                let cols = self
                    .gw
                    .upsert_columns(&self.database, &self.user, &u.table)
                    .await;
                found.insert(u.table.0.clone(), cols);
            }
        }
        t.assemble(|table| {
            found
                .get(&table.0)
                .cloned()
                .unwrap_or_else(|| Err("?".into()))
        })
    }

    /// Handles every complete server message in `buf`, relaying rows as they come.
    fn on_server_bytes(&mut self, buf: &mut BytesMut) -> Result<()> {
        loop {
            if self.s_stream > 0 {
                let n = self.s_stream.min(buf.len());
                self.to_client.extend_from_slice(&buf[..n]);
                buf.advance(n);
                self.s_stream -= n;
                if self.s_stream > 0 {
                    return Ok(());
                }
            }
            let Some((tag, len)) = proto::header(buf, usize::MAX >> 1)? else {
                return Ok(());
            };
            // Rows and COPY data pass through as they arrive, whatever their size.
            if tag == b'D' || tag == b'd' {
                self.s_stream = len;
                continue;
            }
            if buf.len() < len {
                buf.reserve(len - buf.len());
                return Ok(());
            }
            let msg = buf.split_to(len);
            self.server_message(tag, &msg)?;
        }
    }

    fn server_message(&mut self, tag: u8, msg: &[u8]) -> Result<()> {
        match tag {
            b'Z' => {
                self.txn = proto::body(msg).first().copied().unwrap_or(b'I');
                if self.txn == b'I' {
                    self.savepoints.clear();
                    self.opaque = false;
                }
                self.pending.pop_front();
                self.statement_done();
            }
            b'C' => {
                let present = match self.pending.front_mut() {
                    Some(Expect::Query {
                        presents: Some(p),
                        next,
                    }) => {
                        *next += 1;
                        p.get(*next - 1).cloned()
                    }
                    Some(Expect::Execute(p)) => {
                        let p = p.take();
                        self.pending.pop_front();
                        p
                    }
                    _ => None,
                };
                if let Some(p @ Present::Rewritten { .. }) = present {
                    let tag = proto::read_command_complete(msg)?;
                    proto_into(&mut self.to_client, |o| {
                        proto::command_complete(o, &p.command_tag(tag))
                    });
                    return Ok(());
                }
            }
            b'I' => match self.pending.front_mut() {
                Some(Expect::Query { next, .. }) => *next += 1,
                Some(Expect::Execute(_)) => {
                    self.pending.pop_front();
                }
                _ => {}
            },
            b's' => {
                if matches!(self.pending.front(), Some(Expect::Execute(_))) {
                    self.pending.pop_front();
                }
            }
            b'1' | b'2' | b'3' | b'T' | b'n' => {
                let done = matches!(
                    (tag, self.pending.front()),
                    (b'1', Some(Expect::Parse(_)))
                        | (b'2', Some(Expect::Bind))
                        | (b'3', Some(Expect::Close))
                        | (b'T' | b'n', Some(Expect::Describe))
                );
                if done {
                    self.pending.pop_front();
                }
            }
            b'E' => {
                // (strip the context too?, strip the position?)
                let strip = match self.pending.front() {
                    Some(Expect::Query {
                        presents: Some(p),
                        next,
                    }) => Some(matches!(p.get(*next), Some(Present::Rewritten { .. }))),
                    Some(Expect::Parse(p) | Expect::Execute(p)) => p.as_ref().map(|_| true),
                    _ => None,
                };
                // PostgreSQL skips the rest of an extended batch up to Sync.
                while matches!(
                    self.pending.front(),
                    Some(
                        Expect::Parse(_)
                            | Expect::Bind
                            | Expect::Describe
                            | Expect::Execute(_)
                            | Expect::Close
                    )
                ) {
                    self.pending.pop_front();
                }
                if let Some(context) = strip {
                    // Positions point into the rewritten text, not the client's; a rewritten
                    // statement's context names the gateway's plumbing.
                    let fields: Vec<(u8, String)> = proto::read_fields(msg)?
                        .into_iter()
                        .filter(|(c, _)| !matches!(c, b'P' | b'q' | b'p'))
                        .filter(|(c, _)| !(context && *c == b'W'))
                        .collect();
                    proto_into(&mut self.to_client, |o| {
                        proto::fields_message(o, b'E', &fields)
                    });
                    return Ok(());
                }
            }
            _ => {}
        }
        self.to_client.extend_from_slice(msg);
        Ok(())
    }

    async fn run_deferred(
        &mut self,
        d: Deferred,
        sr: &mut tokio::net::unix::OwnedReadHalf,
        sw: &mut tokio::net::unix::OwnedWriteHalf,
        sbuf: &mut BytesMut,
    ) -> Result<
        Option<(
            tokio::net::unix::OwnedReadHalf,
            tokio::net::unix::OwnedWriteHalf,
        )>,
    > {
        match d {
            Deferred::CreateDatabase {
                name,
                create,
                configure,
                if_not_exists,
            } => {
                self.create_database(&name, &create, &configure, if_not_exists, sr, sw, sbuf)
                    .await?;
                Ok(None)
            }
            Deferred::Use(db) => self.use_database(&db, sw, sr, sbuf).await,
        }
    }

    /// Runs a query on the session's backend for the gateway itself: notices reach the
    /// client; the error (if any), the final transaction status and the rows come back.
    async fn own_query_rows(
        &mut self,
        sql: &str,
        sr: &mut tokio::net::unix::OwnedReadHalf,
        sw: &mut tokio::net::unix::OwnedWriteHalf,
        sbuf: &mut BytesMut,
    ) -> Result<(Option<Vec<u8>>, u8, Vec<Vec<Option<String>>>)> {
        let mut out = Vec::new();
        proto::query(&mut out, sql);
        sw.write_all(&out).await?;
        let mut error = None;
        let mut rows = Vec::new();
        loop {
            let msg = next_big_message(sr, sbuf).await?;
            match msg[0] {
                b'E' if error.is_none() => error = Some(msg),
                b'D' => rows.push(proto::read_data_row(&msg)?),
                b'Z' => {
                    let status = proto::body(&msg).first().copied().unwrap_or(b'I');
                    return Ok((error, status, rows));
                }
                b'N' | b'S' | b'A' => self.to_client.extend_from_slice(&msg),
                _ => {}
            }
        }
    }

    async fn own_query(
        &mut self,
        sql: &str,
        sr: &mut tokio::net::unix::OwnedReadHalf,
        sw: &mut tokio::net::unix::OwnedWriteHalf,
        sbuf: &mut BytesMut,
    ) -> Result<(Option<Vec<u8>>, u8)> {
        let (error, status, _) = self.own_query_rows(sql, sr, sw, sbuf).await?;
        Ok((error, status))
    }

    #[allow(clippy::too_many_arguments)]
    async fn create_database(
        &mut self,
        name: &str,
        create: &str,
        configure: &str,
        if_not_exists: bool,
        sr: &mut tokio::net::unix::OwnedReadHalf,
        sw: &mut tokio::net::unix::OwnedWriteHalf,
        sbuf: &mut BytesMut,
    ) -> Result<()> {
        let (error, status) = self.own_query(create, sr, sw, sbuf).await?;
        let exists = |e: &[u8]| {
            proto::read_fields(e)
                .map(|f| f.iter().any(|(k, v)| *k == b'C' && v == "42P04"))
                .unwrap_or(false)
        };
        if let Some(e) = error {
            if if_not_exists && exists(&e) {
                // CockroachDB's IF NOT EXISTS: the database stays as it is, options and all.
                proto_into(&mut self.to_client, |o| {
                    proto::fields_message(
                        o,
                        b'N',
                        &[
                            (b'S', "NOTICE".to_string()),
                            (b'V', "NOTICE".to_string()),
                            (b'C', "42P04".to_string()),
                            (
                                b'M',
                                format!("database \"{name}\" already exists, skipping"),
                            ),
                        ],
                    )
                });
                proto_into(&mut self.to_client, |o| {
                    proto::command_complete(o, "CREATE DATABASE")
                });
            } else {
                self.to_client.extend_from_slice(&e);
            }
        } else {
            match self
                .gw
                .configure_database(name, &self.user, configure)
                .await
            {
                Ok(()) => proto_into(&mut self.to_client, |o| {
                    proto::command_complete(o, "CREATE DATABASE")
                }),
                Err(e) => {
                    self.gw.drop_database(name).await;
                    self.db_error(&e);
                }
            }
        }
        proto_into(&mut self.to_client, |o| proto::ready_for_query(o, status));
        self.statement_done();
        self.txn = status;
        Ok(())
    }

    fn db_error(&mut self, e: &DbError) {
        let mut fields = vec![
            (b'S', "ERROR".to_string()),
            (b'V', "ERROR".to_string()),
            (b'C', e.sqlstate.clone()),
            (b'M', e.message.clone()),
        ];
        if let Some(d) = &e.detail {
            fields.push((b'D', d.clone()));
        }
        if let Some(h) = &e.hint {
            fields.push((b'H', h.clone()));
        }
        proto_into(&mut self.to_client, |o| {
            proto::fields_message(o, b'E', &fields)
        });
    }

    /// `USE db`: a PostgreSQL session belongs to one database, so the gateway logs a new
    /// backend into `db` as the same user, swaps it in and ends the old one. Session settings
    /// and prepared statements stay with the old backend (PostgreSQL has no way to carry them).
    async fn use_database(
        &mut self,
        db: &str,
        sw: &mut tokio::net::unix::OwnedWriteHalf,
        sr: &mut tokio::net::unix::OwnedReadHalf,
        sbuf: &mut BytesMut,
    ) -> Result<
        Option<(
            tokio::net::unix::OwnedReadHalf,
            tokio::net::unix::OwnedWriteHalf,
        )>,
    > {
        if self.txn != b'I' {
            let raise = format!(
                "SELECT multiregion.raise_error('25001', {}, NULL)",
                mr_sql::literal("USE cannot run inside a transaction block")
            );
            let (error, status) = self.own_query(&raise, sr, sw, sbuf).await?;
            if let Some(e) = error {
                self.strip_and_send_error(&e)?;
            }
            proto_into(&mut self.to_client, |o| proto::ready_for_query(o, status));
            self.statement_done();
            self.txn = status;
            return Ok(None);
        }
        match self.login(db).await {
            Ok((stream, statuses, key)) => {
                self.to_client.extend_from_slice(&statuses);
                self.gw.rebind_cancel(self.cancel_key, key);
                self.gw.forget_session(self.backend_pid);
                self.backend_pid = key.0;
                self.gw.register_session(key.0, self.control.clone());
                self.database = db.to_string();
                for (k, v) in self.params.iter_mut() {
                    if k == "database" {
                        *v = db.to_string();
                    }
                }
                if !self.params.iter().any(|(k, _)| k == "database") {
                    self.params.push(("database".into(), db.to_string()));
                }
                self.statements.clear();
                self.portals.clear();
                proto_into(&mut self.to_client, |o| {
                    proto::command_complete(o, "SET");
                    proto::ready_for_query(o, b'I');
                });
                self.statement_done();
                let (r, w) = stream.into_split();
                Ok(Some((r, w)))
            }
            Err(e) => {
                self.db_error(&e);
                proto_into(&mut self.to_client, |o| proto::ready_for_query(o, b'I'));
                self.statement_done();
                Ok(None)
            }
        }
    }

    fn strip_and_send_error(&mut self, msg: &[u8]) -> Result<()> {
        let fields: Vec<(u8, String)> = proto::read_fields(msg)?
            .into_iter()
            .filter(|(c, _)| !matches!(c, b'W' | b'P'))
            .collect();
        proto_into(&mut self.to_client, |o| {
            proto::fields_message(o, b'E', &fields)
        });
        Ok(())
    }

    /// Logs a new backend into `db` as this session's user, answering PostgreSQL's
    /// authentication from what the session's own login proved.
    async fn login(&mut self, db: &str) -> Result<(UnixStream, Vec<u8>, (i32, i32)), DbError> {
        let io = |e: std::io::Error| DbError {
            sqlstate: "08006".into(),
            message: format!("cannot reach PostgreSQL: {e}"),
            hint: None,
            detail: None,
        };
        let mut params = self.params.clone();
        params.retain(|(k, _)| k != "database");
        params.push(("database".into(), db.to_string()));
        let mut s = self.gw.connect_pg().await.map_err(io)?;
        let mut out = Vec::new();
        proto::startup_message(&mut out, &params);
        s.write_all(&out).await.map_err(io)?;
        let mut buf = BytesMut::new();
        let mut statuses = Vec::new();
        let mut key = (0, 0);
        let mut scram: Option<postgres_protocol::authentication::sasl::ScramSha256> = None;
        let proto_err = |e: anyhow::Error| DbError {
            sqlstate: "08P01".into(),
            message: e.to_string(),
            hint: None,
            detail: None,
        };
        loop {
            let msg = next_message(&mut s, &mut buf).await.map_err(proto_err)?;
            match msg[0] {
                b'R' => {
                    let (code, data) = proto::read_auth(&msg).map_err(|e| proto_err(e.into()))?;
                    let mut answer = Vec::new();
                    match code {
                        0 | 12 => {
                            if code == 12 {
                                if let Some(sc) = scram.as_mut() {
                                    sc.finish(data).map_err(|e| proto_err(e.into()))?;
                                }
                            }
                            continue;
                        }
                        3 => match &self.creds.cleartext {
                            Some(pw) => {
                                let mut p = pw.clone();
                                p.push(0);
                                proto::password(&mut answer, &p);
                            }
                            None => return Err(self.cannot_reauthenticate(db)),
                        },
                        5 => {
                            let salt: [u8; 4] = data
                                .get(..4)
                                .and_then(|s| s.try_into().ok())
                                .ok_or_else(|| proto_err(anyhow!("short MD5 salt")))?;
                            let response = match &self.creds.cleartext {
                                Some(pw) => postgres_protocol::authentication::md5_hash(
                                    self.user.as_bytes(),
                                    pw,
                                    salt,
                                ),
                                None => match self.gw.verifier(&self.user).await {
                                    Some(v) if v.starts_with("md5") => md5_salted(&v[3..], salt),
                                    _ => return Err(self.cannot_reauthenticate(db)),
                                },
                            };
                            let mut p = response.into_bytes();
                            p.push(0);
                            proto::password(&mut answer, &p);
                        }
                        10 => {
                            let Some(pw) = &self.creds.cleartext else {
                                return Err(self.cannot_reauthenticate(db));
                            };
                            let sc = postgres_protocol::authentication::sasl::ScramSha256::new(
                                pw,
                                postgres_protocol::authentication::sasl::ChannelBinding::unsupported(),
                            );
                            let mut b = BytesMut::new();
                            postgres_protocol::message::frontend::sasl_initial_response(
                                "SCRAM-SHA-256",
                                sc.message(),
                                &mut b,
                            )
                            .map_err(|e| proto_err(e.into()))?;
                            answer.extend_from_slice(&b);
                            scram = Some(sc);
                        }
                        11 => {
                            let Some(sc) = scram.as_mut() else {
                                return Err(proto_err(anyhow!("unexpected SASL continue")));
                            };
                            sc.update(data).map_err(|e| proto_err(e.into()))?;
                            let mut b = BytesMut::new();
                            postgres_protocol::message::frontend::sasl_response(
                                sc.message(),
                                &mut b,
                            )
                            .map_err(|e| proto_err(e.into()))?;
                            answer.extend_from_slice(&b);
                        }
                        _ => return Err(self.cannot_reauthenticate(db)),
                    }
                    s.write_all(&answer).await.map_err(io)?;
                }
                b'K' => key = proto::read_backend_key(&msg).map_err(|e| proto_err(e.into()))?,
                b'S' => statuses.extend_from_slice(&msg),
                b'E' => {
                    let fields = proto::read_fields(&msg).map_err(|e| proto_err(e.into()))?;
                    let get = |c: u8| fields.iter().find(|(k, _)| *k == c).map(|(_, v)| v.clone());
                    return Err(DbError {
                        sqlstate: get(b'C').unwrap_or_else(|| "08006".into()),
                        message: get(b'M').unwrap_or_default(),
                        hint: get(b'H'),
                        detail: get(b'D'),
                    });
                }
                b'Z' => return Ok((s, statuses, key)),
                _ => {}
            }
        }
    }

    fn cannot_reauthenticate(&self, db: &str) -> DbError {
        DbError {
            sqlstate: "0A000".into(),
            message: format!(
                "USE cannot switch this session to database \"{db}\": its authentication cannot be repeated"
            ),
            hint: Some(format!(
                "connect to database \"{db}\" directly (SCRAM logins cannot be replayed by the gateway)"
            )),
            detail: None,
        }
    }
}

/// `md5` + md5(stored hash + salt): the answer to an MD5 challenge from the stored verifier.
fn md5_salted(hash_hex: &str, salt: [u8; 4]) -> String {
    use md5::{Digest, Md5};
    let mut h = Md5::new();
    h.update(hash_hex.as_bytes());
    h.update(salt);
    let d = h.finalize();
    format!(
        "md5{}",
        d.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

async fn next_big_message<S: AsyncRead + Unpin>(s: &mut S, buf: &mut BytesMut) -> Result<Vec<u8>> {
    read_message(s, buf, proto::MAX_MESSAGE).await
}

/// Builds messages with `mr_pgproto`'s writers straight into an output buffer.
fn proto_into(out: &mut BytesMut, f: impl FnOnce(&mut Vec<u8>)) {
    let mut v = Vec::new();
    f(&mut v);
    out.extend_from_slice(&v);
}

/// Counts a session open while it lives.
struct SessionCount(Arc<Gateway>);

impl Drop for SessionCount {
    fn drop(&mut self) {
        self.0
            .sessions_open
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}
