//! `pgmr start`: one node's life — prepare, join, serve, supervise, stop.

use crate::cli::StartArgs;
use crate::identity::{random_hex, DataDir, Identity};
use crate::membership::{Membership, HEARTBEAT_INTERVAL};
use crate::meta::{Meta, MetaNode, MetaUnavailable};
use crate::net::{Handler, PeerInfo, RpcError, SelfView, Transport};
use crate::postgres::{self, PgConfig, PgState};
use anyhow::{bail, Context, Result};
use futures::future::BoxFuture;
use mr_meta::{ClientId, Command, MetaError, Outcome, Proposal};
use mr_topology::{Locality, RttMatrix};
use mr_wire::local::{
    EventRow, LinkFault, LocalRequest, LocalResponse, MemberProgress, MetaGroup, NodeInfo, NodeRow,
    RegionZones, Status,
};
use mr_wire::peer::{NodeDescriptor, PeerRequest, PeerResponse};
use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);
const JOIN_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How often each node records its liveness in the meta group; four missed beats make it
/// suspect ([`mr_meta::SUSPECT_AFTER_MS`]).
const LIVENESS_INTERVAL: Duration = Duration::from_secs(1);
/// How long a linearizable read for the extension may wait for the meta group.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a metadata write may wait to commit, leader elections included.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

pub struct Node {
    identity: Mutex<Identity>,
    locality: Locality,
    membership: Membership,
    transport: Transport,
    pg: Arc<PgState>,
    /// Set once the meta group member has started; before that, Raft traffic is refused.
    meta: OnceLock<Arc<Meta>>,
    /// The range groups, started right after the meta group.
    ranges: OnceLock<Arc<crate::range::Ranges>>,
    /// The schema-change applier's progress, per database (`pgmr status`).
    schema: Arc<crate::schema::Progress>,
    /// The SQL gateway, once it serves.
    gateway: OnceLock<Arc<crate::gateway::Gateway>>,
    started: Instant,
}

pub async fn run(args: StartArgs) -> Result<()> {
    // Everything that can fail without side effects comes first, so a bad flag or a busy
    // port leaves the data dir as it was.
    let data = DataDir::prepare(&args.data_dir)?;
    let stored = data.load_identity()?;
    let bootstrapping = stored.is_none() && args.join.is_empty();
    let run_as = postgres::resolve_user(&args.pg_user)?;
    let listen_host = match &args.pg_listen {
        Some(h) => h.clone(),
        None => args
            .listen
            .rsplit_once(':')
            .map(|(h, _)| h.to_string())
            .unwrap_or_default(),
    };
    let pg_cfg = PgConfig {
        bin: postgres::resolve_bin(args.pg_bin.as_deref())?,
        data: data.clone(),
        listen_host: listen_host.clone(),
        port: args.pg_port,
        locality: args.locality.clone(),
        run_as,
        ephemeral: args.ephemeral,
        trusted_networks: args.pg_trust.clone(),
    };
    let listener = TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let gateway_cfg = crate::gateway::GatewayConfig {
        listen: args
            .sql_listen
            .clone()
            .unwrap_or_else(|| crate::gateway::default_listen(&args.listen)),
        tls_cert: args.sql_tls_cert.clone(),
        tls_key: args.sql_tls_key.clone(),
    };
    let sql_listener = crate::gateway::bind(&gateway_cfg).await?;
    let http_addr = args.http_listen.clone().unwrap_or_else(|| {
        let host = args.listen.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
        format!("{host}:8080")
    });
    let http_listener = crate::http::bind(&http_addr).await?;
    let gateway = crate::gateway::Gateway::new(pg_cfg.clone(), &gateway_cfg)?;
    pg_cfg.stop_orphan().await?;
    pg_cfg.check_port()?;
    let secret = data.secret(args.secret_file.as_deref(), bootstrapping)?;

    let matrix = args
        .latency
        .as_ref()
        .map(|l| l.matrix.clone())
        .unwrap_or_else(RttMatrix::zero);
    let transport = Transport::new(
        secret,
        SelfView {
            cluster_id: stored.as_ref().map(|i| i.cluster_id.clone()),
            node_id: stored.as_ref().map(|i| i.node_id),
            locality: args.locality.clone(),
        },
        matrix,
    );
    let advertise = args
        .advertise
        .clone()
        .unwrap_or_else(|| args.listen.clone());
    // What other nodes and `multiregion.nodes` show: a wildcard listen address names no host,
    // the advertised one does.
    let pg_host = match listen_host.as_str() {
        "0.0.0.0" | "::" | "*" | "" => advertise.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h),
        h => h,
    };
    let sql_addr = format!("{pg_host}:{}", args.pg_port);

    let (identity, members, fresh_bootstrap) = match stored {
        Some(id) => (id, Vec::new(), false),
        None if bootstrapping => {
            let id = Identity {
                cluster_id: random_hex(16)?,
                node_id: 1,
            };
            data.save_identity(&id)?;
            tracing::info!(cluster_id = %id.cluster_id, "bootstrapping a new cluster as node 1");
            (id, Vec::new(), true)
        }
        None => {
            let (id, members) = join(&transport, &args, &advertise, &sql_addr).await?;
            data.save_identity(&id)?;
            tracing::info!(node_id = id.node_id, cluster_id = %id.cluster_id, "joined the cluster");
            (id, members, false)
        }
    };
    transport
        .set_identity(identity.cluster_id.clone(), identity.node_id)
        .await;

    let me = NodeDescriptor {
        node_id: identity.node_id,
        rpc_addr: advertise.clone(),
        sql_addr: sql_addr.clone(),
        locality: args.locality.to_string(),
        pgmr_version: mr_wire::PGMR_VERSION.to_string(),
    };
    let node = Arc::new(Node {
        identity: Mutex::new(identity.clone()),
        locality: args.locality.clone(),
        membership: Membership::new(me),
        transport: transport.clone(),
        pg: Arc::new(PgState::default()),
        meta: OnceLock::new(),
        ranges: OnceLock::new(),
        schema: Arc::default(),
        gateway: OnceLock::new(),
        started: Instant::now(),
    });
    node.membership.learn(&members);
    transport.set_handler(node.clone());
    tokio::spawn(transport.clone().serve(listener));

    let meta = Meta::start(&data.root, identity.node_id, transport.clone()).await?;
    let _ = node.meta.set(meta.clone());
    if identity.node_id == 1 && (fresh_bootstrap || !meta.raft.is_initialized().await?) {
        meta.bootstrap(MetaNode {
            rpc_addr: advertise.clone(),
            locality: args.locality.to_string(),
        })
        .await?;
    }
    if fresh_bootstrap {
        register_first_node(&meta, &advertise, &sql_addr, &args.locality).await?;
    }
    if meta.read(|s| s.node(identity.node_id).is_some_and(|n| n.decommissioned)) {
        bail!(
            "node {} was decommissioned; wipe {} to join again as a new node",
            identity.node_id,
            data.root.display()
        );
    }

    let stop = CancellationToken::new();
    let fatal = CancellationToken::new();
    let local = crate::local::bind(&data.socket(), run_as.map(|(u, _)| u))?;
    tokio::spawn(crate::local::serve(
        local,
        node.clone(),
        run_as.map(|(u, _)| u),
    ));
    tokio::spawn(heartbeats(node.clone(), args.join.clone(), stop.clone()));
    // Why the node stopped itself, reported as pgmr's exit error.
    let fatal_reason = Arc::new(Mutex::new(None::<String>));
    tokio::spawn(liveness(
        node.clone(),
        advertise.clone(),
        sql_addr,
        stop.clone(),
        fatal.clone(),
        fatal_reason.clone(),
    ));
    tokio::spawn(clock_guard(
        node.clone(),
        stop.clone(),
        fatal.clone(),
        fatal_reason.clone(),
    ));

    let ranges = crate::range::Ranges::open(
        &data.root,
        node.id(),
        transport.clone(),
        meta.clone(),
        pg_cfg.clone(),
        node.pg.clone(),
    )?;
    let _ = node.ranges.set(ranges.clone());
    tokio::spawn(ranges.clone().run(stop.clone()));

    // The applier waits for PostgreSQL to be ready (and ready again after a restart) itself.
    let applier = crate::schema::Applier {
        node_id: node.id(),
        meta: meta.clone(),
        pg: node.pg.clone(),
        pg_cfg: pg_cfg.clone(),
        progress: node.schema.clone(),
        ranges: ranges.clone(),
    };
    tokio::spawn(applier.run(stop.clone()));

    let supervisor = postgres::start(pg_cfg, node.pg.clone(), stop.clone()).await?;
    let _ = node.gateway.set(gateway.clone());
    tokio::spawn(gateway.serve(sql_listener, stop.clone()));
    tokio::spawn(crate::http::serve(
        node.clone(),
        http_listener,
        stop.clone(),
    ));
    tracing::info!(
        node_id = node.id(),
        rpc = %advertise,
        socket = %data.socket().display(),
        sql_gateway = %gateway_cfg.listen,
        console = %http_addr,
        "node is up"
    );

    tokio::select! {
        _ = wait_for_shutdown(args.die_with_parent) => {}
        _ = fatal.cancelled() => {}
    }
    tracing::info!("shutting down");
    stop.cancel();
    let _ = supervisor.await;
    let _ = meta.raft.shutdown().await;
    let _ = std::fs::remove_file(data.socket());
    if let Some(reason) = fatal_reason.lock().expect("fatal reason lock").take() {
        bail!(reason);
    }
    Ok(())
}

/// Records the bootstrap node as node 1 in the metadata state. Proposed under a fixed
/// client id and sequence number, so a bootstrap retried after a crash cannot add it twice.
async fn register_first_node(
    meta: &Meta,
    rpc_addr: &str,
    sql_addr: &str,
    locality: &Locality,
) -> Result<()> {
    let p = Proposal {
        client: BOOTSTRAP_CLIENT,
        seq: 1,
        command: Command::AddNode {
            rpc_addr: rpc_addr.to_string(),
            sql_addr: sql_addr.to_string(),
            locality: locality.to_string(),
            at_ms: now_ms(),
        },
    };
    match meta
        .submit(&p, Instant::now() + Duration::from_secs(30))
        .await?
    {
        Outcome::NodeAdded { node_id: 1 } => Ok(()),
        other => bail!("bootstrapping the metadata group failed: {other:?}"),
    }
}

/// The client id under which the bootstrap node registers itself; joining nodes use
/// `node_id: 0` with their random join token as the incarnation.
const BOOTSTRAP_CLIENT: ClientId = ClientId {
    node_id: 0,
    incarnation: 0,
};

/// Every range as `multiregion.ranges` shows it.
fn range_rows(s: &mr_meta::MetaState) -> Vec<mr_wire::local::RangeRow> {
    let region = |id: u64| {
        s.node(id)
            .and_then(|n| mr_topology::Locality::parse(&n.locality).ok())
            .map(|l| l.region().to_string())
            .unwrap_or_default()
    };
    s.ranges()
        .map(|r| {
            let of = |kind| -> Vec<u64> {
                r.replicas
                    .iter()
                    .filter(|x| x.kind == kind)
                    .map(|x| x.node_id)
                    .collect()
            };
            let voting = of(mr_meta::ReplicaKind::Voter);
            let non_voting = of(mr_meta::ReplicaKind::NonVoter);
            let lease_holder = s.lease(r.range_id).map(|l| l.holder);
            mr_wire::local::RangeRow {
                range_id: r.range_id,
                database_name: r.table.database.clone(),
                schema_name: r.table.schema.clone(),
                table_name: r.table.table.clone(),
                partition: r.partition.clone(),
                lease_holder,
                lease_holder_region: lease_holder.map(region),
                replica_regions: voting
                    .iter()
                    .chain(&non_voting)
                    .map(|id| region(*id))
                    .collect(),
                voting_replicas: voting,
                non_voting_replicas: non_voting,
                generation: r.generation,
            }
        })
        .collect()
}

/// This node's wall clock (Unix ms): every time pgmr stamps or compares comes from here.
/// `PGMR_CLOCK_SKEW_MS` (a testing knob, read once) shifts it, to try a node whose clock is
/// off.
pub fn now_ms() -> u64 {
    static SKEW_MS: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    let skew = *SKEW_MS.get_or_init(|| {
        std::env::var("PGMR_CLOCK_SKEW_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    });
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    now.saturating_add_signed(skew)
}

/// Asks the --join addresses to admit this node, following redirects to the meta group's
/// leader, until one answers or `--join-timeout` passes. The join token is the same on every
/// retry, so a retry after a lost answer gets the id the first try was given.
async fn join(
    transport: &Transport,
    args: &StartArgs,
    advertise: &str,
    sql_addr: &str,
) -> Result<(Identity, Vec<NodeDescriptor>)> {
    let deadline = Instant::now() + args.join_timeout;
    let req = PeerRequest::Join {
        rpc_addr: advertise.to_string(),
        sql_addr: sql_addr.to_string(),
        locality: args.locality.to_string(),
        token: rand::random::<u64>() | 1,
    };
    let mut last_error = String::from("no address tried");
    loop {
        let mut queue: VecDeque<String> = args.join.iter().cloned().collect();
        let mut hops = 0;
        while let Some(addr) = queue.pop_front() {
            match transport.call(&addr, req.clone(), JOIN_CALL_TIMEOUT).await {
                Ok(PeerResponse::Joined {
                    node_id,
                    cluster_id,
                    members,
                }) => {
                    let id = Identity {
                        cluster_id,
                        node_id,
                    };
                    return Ok((id, members));
                }
                Ok(
                    PeerResponse::Redirect { rpc_addr }
                    | PeerResponse::NotLeader {
                        leader_addr: Some(rpc_addr),
                        ..
                    },
                ) if hops < 5 => {
                    hops += 1;
                    queue.push_front(rpc_addr);
                }
                Ok(PeerResponse::Error {
                    message,
                    retryable: false,
                }) => {
                    bail!("{addr} refused to let this node join: {message}")
                }
                Err(e @ RpcError::Handshake { .. }) => bail!("cannot join: {e}"),
                Ok(other) => last_error = format!("{addr}: {other:?}"),
                Err(e) => last_error = e.to_string(),
            }
        }
        if Instant::now() >= deadline {
            bail!(
                "cannot join the cluster: no --join address answered within {} s (last error: {last_error})",
                args.join_timeout.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Records this node's liveness in the meta group every [`LIVENESS_INTERVAL`], and runs the
/// leader's membership upkeep. Stops the node if it learns it was decommissioned.
async fn liveness(
    node: Arc<Node>,
    rpc_addr: String,
    sql_addr: String,
    stop: CancellationToken,
    fatal: CancellationToken,
    fatal_reason: Arc<Mutex<Option<String>>>,
) {
    let meta = node.meta().clone();
    let me = node.id();
    let mut tick = tokio::time::interval(LIVENESS_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Upkeep runs on its own task so that a slow membership change never delays heartbeats.
    {
        let (meta, stop) = (meta.clone(), stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(LIVENESS_INTERVAL);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.cancelled() => return,
                }
                if let Err(e) = meta.reconcile(now_ms()).await {
                    tracing::debug!("metadata membership upkeep: {e}");
                }
                if let Err(e) = meta.reconcile_ranges(now_ms()).await {
                    tracing::debug!("range descriptor upkeep: {e}");
                }
            }
        });
    }
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        let beat = Command::Heartbeat {
            node_id: me,
            rpc_addr: rpc_addr.clone(),
            sql_addr: sql_addr.clone(),
            at_ms: now_ms(),
        };
        match meta.propose(beat, LIVENESS_INTERVAL * 3).await {
            Ok(Outcome::Rejected {
                error: MetaError::Decommissioned { .. },
            }) => {
                let reason =
                    format!("node {me} was decommissioned; its data dir can no longer be used");
                tracing::error!("{reason}");
                *fatal_reason.lock().expect("fatal reason lock") = Some(reason);
                fatal.cancel();
                return;
            }
            Ok(Outcome::Rejected { error }) => {
                tracing::warn!("liveness heartbeat refused: {error}")
            }
            Ok(_) => {}
            Err(e) => tracing::debug!("liveness heartbeat: {e}"),
        }
    }
}

/// Stops the node when its clock has been too far from most of the cluster's for 10 s
/// running (`membership::clock_out_of_bounds`): the commit protocol compares times taken
/// on different nodes (ARCHITECTURE.md §8.5, "Clocks"), and a node whose clock is far off
/// would, leading a range, abort every commit proposed to it from elsewhere. Like
/// CockroachDB, the node with the wrong clock stops rather than serve; the others go on.
async fn clock_guard(
    node: Arc<Node>,
    stop: CancellationToken,
    fatal: CancellationToken,
    fatal_reason: Arc<Mutex<Option<String>>>,
) {
    const CHECK_EVERY: Duration = Duration::from_secs(1);
    const STRIKES: u32 = 10;
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut strikes = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        let offsets = node.membership.clock_offsets();
        let pairs: Vec<(f64, f64)> = offsets.iter().map(|(_, o, u)| (*o, *u)).collect();
        if !crate::membership::clock_out_of_bounds(&pairs, crate::membership::MAX_CLOCK_OFFSET_MS) {
            strikes = 0;
            continue;
        }
        strikes += 1;
        let seen = offsets
            .iter()
            .map(|(n, o, _)| format!("{:+.0} ms from node {n}'s", -o))
            .collect::<Vec<_>>()
            .join(", ");
        tracing::warn!(
            strikes,
            "this node's clock is far from the other nodes' ({seen})"
        );
        if strikes >= STRIKES {
            let reason = format!(
                "node {}'s clock is more than {} ms from most other nodes' ({seen}); fix its time synchronization (chrony, NTP) and start it again",
                node.id(),
                crate::membership::MAX_CLOCK_OFFSET_MS
            );
            tracing::error!("{reason}");
            *fatal_reason.lock().expect("fatal reason lock") = Some(reason);
            fatal.cancel();
            return;
        }
    }
}

/// Probes every known peer (and the --join seeds, to rediscover the cluster after a restart)
/// every interval; one probe per target in flight, so a hung peer cannot pile them up.
async fn heartbeats(node: Arc<Node>, seeds: Vec<String>, stop: CancellationToken) {
    let in_flight: Arc<Mutex<HashSet<String>>> = Arc::default();
    let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        let mut targets: Vec<String> = node
            .membership
            .probe_targets()
            .into_iter()
            .map(|(_, addr)| addr)
            .collect();
        targets.extend(
            seeds
                .iter()
                .filter(|a| !node.membership.knows_addr(a))
                .cloned(),
        );
        for addr in targets {
            if !in_flight
                .lock()
                .expect("in-flight lock")
                .insert(addr.clone())
            {
                continue;
            }
            let (node, in_flight) = (node.clone(), in_flight.clone());
            tokio::spawn(async move {
                let (sent, sent_ms) = (Instant::now(), now_ms());
                let req = PeerRequest::Heartbeat(node.membership.gossip());
                match node.transport.call(&addr, req, HEARTBEAT_TIMEOUT).await {
                    Ok(PeerResponse::HeartbeatAck(ack)) => {
                        let rtt = sent.elapsed();
                        node.membership.heard_from(&ack);
                        node.membership.record_rtt(ack.from.node_id, rtt);
                        // The peer read its clock somewhere within the round trip: taken at
                        // its middle, off by half of it at most (and a millisecond of
                        // rounding on each side).
                        if let Some(theirs) = ack.now_ms {
                            let half = rtt.as_secs_f64() * 500.0;
                            let offset = theirs as f64 - (sent_ms as f64 + half);
                            node.membership
                                .record_offset(ack.from.node_id, offset, half + 2.0);
                        }
                    }
                    Ok(other) => tracing::debug!(%addr, "unexpected heartbeat answer {other:?}"),
                    Err(e) => tracing::debug!("heartbeat: {e}"),
                }
                in_flight.lock().expect("in-flight lock").remove(&addr);
            });
        }
    }
}

async fn wait_for_shutdown(die_with_parent: bool) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let parent = std::os::unix::process::parent_id();
    let orphaned = async move {
        if !die_with_parent {
            return futures::future::pending::<()>().await;
        }
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            if std::os::unix::process::parent_id() != parent {
                tracing::warn!("parent process exited");
                return;
            }
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
        _ = orphaned => {}
    }
}

impl Node {
    fn id(&self) -> u64 {
        self.identity.lock().expect("identity lock").node_id
    }

    fn meta(&self) -> &Arc<Meta> {
        self.meta
            .get()
            .expect("the meta group starts before requests are served")
    }

    /// See [`crate::range::Ranges::abandon`].
    pub fn abandon_replicated(&self, range_id: u64, index: u64) {
        self.ranges().abandon(range_id, index);
    }

    fn ranges(&self) -> &Arc<crate::range::Ranges> {
        self.ranges
            .get()
            .expect("the range groups start before requests are served")
    }

    /// Every range replica's progress: this node's own, and each other node's as it reports.
    /// Every live node's SQL gateway statement latencies: (node id, region, windows).
    pub async fn sql_latency(&self) -> Vec<(u64, String, Vec<mr_wire::peer::SqlWindow>)> {
        let me = self.id();
        let peers: Vec<(u64, String)> = self.meta().read(|s| {
            s.nodes()
                .filter(|n| n.node_id != me && !n.decommissioned)
                .map(|n| (n.node_id, n.rpc_addr.clone()))
                .collect()
        });
        let mut all = vec![(
            me,
            self.locality.region().to_string(),
            self.gateway_stats()
                .map(|s| s.windows())
                .unwrap_or_default(),
        )];
        let asks = peers.iter().map(|(id, addr)| async move {
            match self
                .transport
                .call(addr, PeerRequest::SqlLatency, Duration::from_secs(2))
                .await
            {
                Ok(PeerResponse::SqlLatency { region, windows }) => Some((*id, region, windows)),
                _ => None,
            }
        });
        all.extend(futures::future::join_all(asks).await.into_iter().flatten());
        all.sort_by_key(|(id, _, _)| *id);
        all
    }

    /// The SQL gateway's statement statistics, once it serves.
    pub fn gateway_stats(&self) -> Option<&crate::stats::SqlStats> {
        self.gateway.get().map(|g| &g.stats)
    }

    /// SQL gateway sessions open now.
    pub fn gateway_sessions(&self) -> i64 {
        self.gateway.get().map_or(0, |g| {
            g.sessions_open.load(std::sync::atomic::Ordering::Relaxed)
        })
    }

    /// This node's replicas' progress (no peers asked).
    pub fn local_range_progress(&self) -> Vec<mr_wire::local::RangeProgress> {
        self.ranges.get().map(|r| r.progress()).unwrap_or_default()
    }

    /// Two-phase commit decisions kept on this node: its own records, its ranges', and
    /// their plans.
    pub fn decision_counts(&self) -> (u64, u64, u64) {
        self.ranges
            .get()
            .map(|r| r.decision_counts())
            .unwrap_or_default()
    }

    /// Forwarded steps this node's backends sent, by kind (`/metrics`).
    pub fn forwarded_steps(&self) -> Vec<(&'static str, u64)> {
        self.ranges
            .get()
            .map(|r| r.forwarded_steps().to_vec())
            .unwrap_or_default()
    }

    /// The meta group's Raft metrics on this node.
    pub fn meta_metrics(&self) -> Option<openraft::RaftMetrics<u64, crate::meta::MetaNode>> {
        self.meta.get().map(|m| m.metrics())
    }

    /// Measured round trips to the other nodes: (peer id, peer region, median ms).
    pub fn peer_rtts(&self) -> Vec<(u64, String, f64)> {
        let me = self.id();
        self.membership
            .rtt_rows()
            .into_iter()
            .filter(|r| r.from_node == me)
            .filter_map(|r| Some((r.to_node, r.to_region, r.rtt_ms?)))
            .collect()
    }

    /// Each live peer's clock minus this node's, as measured by heartbeats (ms).
    pub fn peer_clock_offsets(&self) -> Vec<(u64, f64)> {
        self.membership
            .clock_offsets()
            .into_iter()
            .map(|(n, o, _)| (n, o))
            .collect()
    }

    pub fn node_id(&self) -> u64 {
        self.id()
    }

    /// Whether the node serves: its PostgreSQL is up and it is a member, not decommissioned.
    pub fn healthy(&self) -> bool {
        let me = self.id();
        self.pg.ready_pid().is_some()
            && self
                .meta
                .get()
                .is_some_and(|m| m.read(|s| s.node(me).is_some_and(|n| !n.decommissioned)))
    }

    pub fn region(&self) -> &str {
        self.locality.region()
    }

    async fn range_progress(&self) -> Vec<mr_wire::local::RangeProgress> {
        let me = self.id();
        let peers: Vec<String> = self.meta().read(|s| {
            s.nodes()
                .filter(|n| n.node_id != me && !n.decommissioned)
                .map(|n| n.rpc_addr.clone())
                .collect()
        });
        let mut all = self.ranges().progress();
        let asks = peers.iter().map(|a| self.ranges().remote_progress(a));
        for r in futures::future::join_all(asks).await {
            all.extend(r);
        }
        all.sort_by_key(|p| (p.range_id, p.node_id));
        all
    }

    fn info(&self) -> NodeInfo {
        let id = self.identity.lock().expect("identity lock").clone();
        let me = self.membership.me();
        NodeInfo {
            node_id: id.node_id,
            cluster_id: id.cluster_id,
            locality: self.locality.to_string(),
            region: self.locality.region().to_string(),
            zone: self.locality.zone().map(str::to_string),
            pgmr_version: mr_wire::PGMR_VERSION.to_string(),
            rpc_addr: me.rpc_addr,
            sql_addr: me.sql_addr,
            uptime_ms: self.started.elapsed().as_millis() as u64,
            postmaster_pid: self.pg.ready_pid(),
            pg_restarts: self.pg.restarts(),
        }
    }

    pub async fn local_request(&self, req: LocalRequest) -> LocalResponse {
        match req {
            LocalRequest::NodeInfo => LocalResponse::NodeInfo(self.info()),
            LocalRequest::NetworkLatency => LocalResponse::NetworkLatency {
                rows: self.membership.rtt_rows(),
            },
            LocalRequest::ClusterRegions => {
                self.read(|s, now| LocalResponse::ClusterRegions {
                    regions: cluster_regions(s, now),
                })
                .await
            }
            LocalRequest::Status => LocalResponse::Status(Status {
                node: self.info(),
                peers: self.membership.peer_status(),
                faults: self.transport.link().faults(),
                schema: self.schema.snapshot(),
            }),
            LocalRequest::SetLinkFaults { peers, fault } => self.set_link_faults(peers, fault),
            LocalRequest::Nodes => {
                let m = self.meta().metrics();
                let membership = m.membership_config.membership().clone();
                let voters: BTreeSet<u64> = membership.voter_ids().collect();
                let learners: BTreeSet<u64> = membership.learner_ids().collect();
                self.read(move |s, now| LocalResponse::Nodes {
                    nodes: s
                        .nodes()
                        .map(|n| node_row(n, now, &voters, &learners))
                        .collect(),
                })
                .await
            }
            LocalRequest::MetaGroup => LocalResponse::MetaGroup(self.meta_group().await),
            LocalRequest::Decommission { node_id } => self.decommission(node_id).await,
            LocalRequest::SetClusterSetting { name, value } => {
                self.write(Command::SetClusterSetting { name, value }).await
            }
            LocalRequest::RestartIdleReaders { backend_pids } => LocalResponse::Restarted {
                backend_pids: match self.gateway.get() {
                    Some(g) => g.restart_idle_readers(&backend_pids).await,
                    None => Vec::new(),
                },
            },
            LocalRequest::Ranges => {
                self.read(|s, _| LocalResponse::Ranges {
                    ranges: range_rows(s),
                })
                .await
            }
            LocalRequest::RangeProgress => LocalResponse::RangeProgress {
                replicas: self.range_progress().await,
            },
            LocalRequest::ReplicateTxn {
                database,
                writes,
                txn_id,
                schema_version,
                txn_start_ms,
                prepare,
            } => {
                let meta = crate::range::TxnMeta {
                    txn_id,
                    schema_version,
                    start_ms: txn_start_ms,
                };
                match self
                    .ranges()
                    .replicate(database, writes, meta, prepare)
                    .await
                {
                    Ok(Some(entries)) => LocalResponse::Replicated { entries },
                    Ok(None) => LocalResponse::NotReplicated,
                    Err(e) => crate::range::write_error(e),
                }
            }
            LocalRequest::CommitDistributed {
                database,
                gid,
                backend_pid,
                participants,
                local,
            } => {
                self.ranges()
                    .commit_distributed(database, gid, backend_pid, participants, local)
                    .await
            }
            LocalRequest::ReplicationEnabled => LocalResponse::ReadBarrier {
                enabled: self.ranges().enabled(),
            },
            LocalRequest::CheckConsistency => LocalResponse::Consistency {
                replicas: self.ranges().check_consistency().await,
            },
            LocalRequest::TableRanges { database, tables } => {
                self.ranges().table_ranges(&database, &tables).await
            }
            LocalRequest::FenceBarrier { database, ranges } => {
                match self.ranges().fence_barrier(&database, &ranges).await {
                    Ok(after) => LocalResponse::FenceBarrier { after },
                    Err(e) => crate::range::write_error(e),
                }
            }
            LocalRequest::ReadBarrier {
                database,
                targets,
                local_only,
            } => {
                match self
                    .ranges()
                    .read_barrier(&database, &targets, local_only)
                    .await
                {
                    Ok(enabled) => LocalResponse::ReadBarrier { enabled },
                    Err(e) => crate::range::write_error(e),
                }
            }
            LocalRequest::Route {
                database,
                targets,
                write,
                modifies,
                splittable,
                txn_nodes,
                one_leaseholder,
                may_gather,
                inserted,
                split_reads,
                locked,
            } => match self
                .ranges()
                .route(
                    &database,
                    &targets,
                    &inserted,
                    crate::range::Routing {
                        write,
                        modifies,
                        splittable,
                        one_leaseholder,
                        may_gather,
                        locked: &locked,
                    },
                    &txn_nodes,
                    split_reads.as_ref(),
                )
                .await
            {
                Ok(r) => LocalResponse::Route {
                    enabled: r.enabled,
                    forward_to: r.forward_to,
                    split: r.split,
                    mixed: r.mixed,
                    gather: r.gather,
                    read_ranges: r.read_ranges,
                    locked_elsewhere: r.locked_elsewhere,
                },
                Err(e) => crate::range::write_error(e),
            },
            LocalRequest::Forward { node_id, request } => {
                self.ranges().forward(node_id, request).await
            }
            LocalRequest::ForwardEach { requests } => {
                let ranges = self.ranges();
                let answers = futures::future::join_all(
                    requests
                        .into_iter()
                        .map(|(node_id, request)| ranges.forward(node_id, request)),
                )
                .await;
                LocalResponse::ForwardedEach { answers }
            }
            LocalRequest::AbandonTxn { range_id, index } => {
                self.ranges().abandon(range_id, index);
                LocalResponse::Done
            }
            LocalRequest::DatabaseConfigs => {
                self.read(|s, _| LocalResponse::DatabaseConfigs {
                    databases: s.databases().cloned().collect(),
                })
                .await
            }
            LocalRequest::PartitionSample { table, partition } => {
                if !self.ranges().enabled() {
                    return LocalResponse::NotReplicated;
                }
                match self.ranges().partition_sample(&table, &partition).await {
                    Ok(Some(row)) => LocalResponse::PartitionSample { row },
                    // No range yet, or leased here: the asking session's copy is the one.
                    Ok(None) => LocalResponse::NotReplicated,
                    Err(e) => LocalResponse::Error {
                        message: format!(
                            "cannot read partition {partition:?} of {}.{} at its leaseholder: {e}",
                            table.schema, table.table
                        ),
                        retryable: true,
                        ambiguous: false,
                    },
                }
            }
            LocalRequest::SchemaAppliers => {
                self.read(|s, _| {
                    let nodes: Vec<u64> = s.nodes().map(|n| n.node_id).collect();
                    let mut appliers = vec![];
                    for (db, log) in s.schemas() {
                        for &node_id in &nodes {
                            let failure = log.failures.get(&node_id);
                            appliers.push(mr_wire::local::SchemaApplierRow {
                                database: db.to_string(),
                                node_id,
                                applied: log.applied_by(node_id),
                                latest: log.version,
                                failed_version: failure.map(|f| f.0),
                                error: failure.map(|f| f.1.clone()),
                            });
                        }
                    }
                    LocalResponse::SchemaAppliers { appliers }
                })
                .await
            }
            LocalRequest::ZoneOverrides { database } => {
                self.read(move |s, _| LocalResponse::ZoneOverrides {
                    zones: s.zones(&database).to_vec(),
                })
                .await
            }
            LocalRequest::ClusterSettings => {
                self.read(|s, _| LocalResponse::ClusterSettings {
                    settings: s
                        .cluster_settings()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                })
                .await
            }
            LocalRequest::EventLog => {
                self.read(|s, _| LocalResponse::EventLog {
                    events: s.events().map(event_row).collect(),
                })
                .await
            }
            LocalRequest::ProposeSchemaChange {
                database,
                expected_version,
                change,
                config,
                localities,
                tables,
                fenced,
                notify,
                key_seeds,
                sequences,
                zones,
            } => {
                let command = Command::SchemaChange {
                    database: database.clone(),
                    expected_version,
                    change,
                    config,
                    localities,
                    at_ms: now_ms(),
                    tables,
                    fenced,
                    key_seeds,
                    sequences,
                    zones,
                };
                match self.meta().propose(command, WRITE_TIMEOUT).await {
                    Ok(Outcome::SchemaVersion { version }) => {
                        self.ranges()
                            .notify_schema(&database, version, &notify)
                            .await;
                        LocalResponse::SchemaVersion { version }
                    }
                    Ok(Outcome::Rejected {
                        error: error @ MetaError::SchemaVersionMismatch { .. },
                    }) => LocalResponse::Error {
                        message: error.to_string(),
                        retryable: true,
                        ambiguous: false,
                    },
                    Ok(Outcome::Rejected { error }) => LocalResponse::error(error.to_string()),
                    Ok(other) => LocalResponse::error(format!(
                        "unexpected outcome of a schema change: {other:?}"
                    )),
                    Err(e) => unavailable(e),
                }
            }
            LocalRequest::NextSequenceValues {
                sequence,
                params,
                initial,
                count,
            } => {
                if !self.ranges().enabled() {
                    return LocalResponse::NotReplicated;
                }
                let command = Command::NextSequenceValues {
                    sequence,
                    params,
                    initial,
                    count,
                };
                match self.meta().propose(command, WRITE_TIMEOUT).await {
                    Ok(Outcome::SequenceValues { block }) => LocalResponse::SequenceValues {
                        first: block.first,
                        count: block.count,
                    },
                    Ok(Outcome::SequenceLimit { limit }) => LocalResponse::SequenceLimit { limit },
                    Ok(Outcome::Rejected { error }) => LocalResponse::error(error.to_string()),
                    Ok(other) => {
                        LocalResponse::error(format!("unexpected outcome of a draw: {other:?}"))
                    }
                    Err(e) => unavailable(e),
                }
            }
            LocalRequest::ChangeSequences { changes } => {
                if !self.ranges().enabled() {
                    return LocalResponse::NotReplicated;
                }
                self.write(Command::ChangeSequences { changes }).await
            }
            LocalRequest::AwaitSchemaApplied {
                database,
                version,
                timeout_ms,
            } => {
                self.await_schema_applied(&database, version, timeout_ms)
                    .await
            }
            LocalRequest::CreateDatabase { database } => {
                let command = Command::CreateDatabase { database };
                match self.meta().propose(command, WRITE_TIMEOUT).await {
                    Ok(Outcome::Done) => LocalResponse::Done,
                    Ok(other) => LocalResponse::error(format!(
                        "unexpected outcome of creating a database: {other:?}"
                    )),
                    Err(e) => unavailable(e),
                }
            }
            LocalRequest::DropDatabase { database } => {
                // A database the cluster never knew (created from another template) was this
                // node's alone: other nodes' databases of that name are not its copies.
                if self.meta().read(|s| s.schema(&database).is_none()) {
                    return LocalResponse::Done;
                }
                let command = Command::ForgetDatabase {
                    database,
                    node_id: self.id(),
                };
                match self.meta().propose(command, WRITE_TIMEOUT).await {
                    Ok(Outcome::Done) => LocalResponse::Done,
                    Ok(other) => LocalResponse::error(format!(
                        "unexpected outcome of dropping a database: {other:?}"
                    )),
                    Err(e) => unavailable(e),
                }
            }
            LocalRequest::SchemaLog { database } => {
                self.read(move |s, _| match s.schema(&database) {
                    Some(log) => LocalResponse::SchemaLog {
                        version: log.version,
                        changes: log
                            .changes
                            .iter()
                            .map(|c| (c.version, c.change.clone()))
                            .collect(),
                        applied: log.applied.iter().map(|(n, v)| (*n, *v)).collect(),
                    },
                    None => LocalResponse::SchemaLog {
                        version: 0,
                        changes: Vec::new(),
                        applied: Vec::new(),
                    },
                })
                .await
            }
        }
    }

    /// Waits until every live node but this one has applied `database`'s schema up to
    /// `version`. This node is left out: the caller applied the change in its own, still
    /// open, transaction. One read-index barrier makes the local copy at least as new as the
    /// request; after it, local reads suffice, since the state only ever shows committed
    /// reports, and each poll sees a newer copy.
    async fn await_schema_applied(
        &self,
        database: &str,
        version: u64,
        timeout_ms: u64,
    ) -> LocalResponse {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        let meta = self.meta();
        let me = self.id();
        let mut applied = meta.raft.data_metrics();
        let mut barrier: Result<(), MetaUnavailable> =
            Err(MetaUnavailable::Retryable("not tried".into()));
        loop {
            if barrier.is_err() {
                let remaining = deadline.saturating_duration_since(Instant::now());
                barrier = meta.linearizable(remaining.min(READ_TIMEOUT)).await;
            }
            if barrier.is_ok() {
                let (latest, lagging) = meta.read(|s| schema_lagging(s, database, me, now_ms()));
                if latest < version {
                    return LocalResponse::error(format!(
                        "database {database:?} has no schema version {version} (the latest is {latest})"
                    ));
                }
                let lagging: Vec<(u64, u64)> =
                    lagging.into_iter().filter(|(_, v)| *v < version).collect();
                if lagging.is_empty() {
                    return LocalResponse::Done;
                }
                if Instant::now() >= deadline {
                    // A lagging node whose applier reported this change (or an earlier one)
                    // failing is named with PostgreSQL's error: it will not catch up by itself
                    // unless the cause goes (a lock it waited on may have been all it was).
                    let failed: Option<(u64, u64, String)> = meta.read(|s| {
                        let log = s.schema(database)?;
                        lagging.iter().find_map(|(node, _)| {
                            let (v, e) = log.failures.get(node)?;
                            (*v <= version).then(|| (*node, *v, e.clone()))
                        })
                    });
                    if let Some((node, v, e)) = failed {
                        return LocalResponse::error(format!(
                            "schema change {version} on database {database:?} is committed, but \
                             node {node} cannot apply version {v}: {e}; it retries on its own \
                             once the cause is fixed there (multiregion.schema_appliers shows it)"
                        ));
                    }
                    return LocalResponse::error(lagging_message(
                        database, version, &lagging, timeout_ms,
                    ));
                }
            } else if Instant::now() >= deadline {
                let e = barrier.err().map(|e| e.to_string()).unwrap_or_default();
                return LocalResponse::error(format!(
                    "schema change {version} on database {database:?} is committed, but whether \
                     the other nodes have applied it is unknown: {e}; they will apply it when they can"
                ));
            }
            // Wake on newly applied entries (a report arriving), or poll.
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(50));
            crate::schema::changed_or(&mut applied, wait).await;
        }
    }

    /// A linearizable read of the metadata state: `f` sees every write acknowledged before
    /// the request arrived. `f` also gets this node's clock (Unix ms) for liveness.
    async fn read(
        &self,
        f: impl FnOnce(&mr_meta::MetaState, u64) -> LocalResponse,
    ) -> LocalResponse {
        let meta = self.meta();
        match meta.linearizable(READ_TIMEOUT).await {
            Ok(()) => meta.read(|s| f(s, now_ms())),
            Err(e) => unavailable(e),
        }
    }

    async fn write(&self, command: Command) -> LocalResponse {
        match self.meta().propose(command, WRITE_TIMEOUT).await {
            Ok(Outcome::Rejected { error }) => LocalResponse::error(error.to_string()),
            Ok(_) => LocalResponse::Done,
            Err(e) => unavailable(e),
        }
    }

    /// Marks the node decommissioned, then waits until the leader has taken it out of the
    /// meta group, so that when this returns the node no longer votes or counts.
    async fn decommission(&self, node_id: u64) -> LocalResponse {
        match self.write(Command::Decommission { node_id }).await {
            LocalResponse::Done => {}
            other => return other,
        }
        let deadline = Instant::now() + WRITE_TIMEOUT * 3;
        let meta = self.meta();
        loop {
            let m = meta.metrics();
            let still = m
                .membership_config
                .membership()
                .nodes()
                .any(|(id, _)| *id == node_id);
            if !still {
                return LocalResponse::Done;
            }
            if Instant::now() >= deadline {
                return LocalResponse::Error {
                    message: format!(
                        "node {node_id} is decommissioned but still in the metadata group; \
                         the leader removes it once a quorum is reachable"
                    ),
                    retryable: true,
                    ambiguous: false,
                };
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The meta group as this node sees it, with replication progress from the leader.
    async fn meta_group(&self) -> MetaGroup {
        let meta = self.meta();
        let m = meta.metrics();
        let membership = m.membership_config.membership().clone();
        let voters: Vec<u64> = membership.voter_ids().collect();
        let learners: Vec<u64> = membership.learner_ids().collect();
        let commit_index = meta
            .raft
            .with_raft_state(|st| st.committed.map(|l| l.index))
            .await
            .ok()
            .flatten();
        let progress = match m.current_leader {
            Some(l) if l == m.id => Some(meta.serve_progress().await),
            Some(l) => match membership.get_node(&l) {
                Some(n) => self
                    .transport
                    .call(
                        &n.rpc_addr,
                        PeerRequest::MetaProgress,
                        Duration::from_secs(2),
                    )
                    .await
                    .ok(),
                None => None,
            },
            None => None,
        };
        let mut members = Vec::new();
        if let Some(PeerResponse::MetaProgress {
            last_log_index,
            matched,
            ..
        }) = progress
        {
            let matched: BTreeMap<u64, Option<u64>> = matched.into_iter().collect();
            for id in voters.iter().chain(learners.iter()) {
                let role = if voters.contains(id) {
                    "voter"
                } else {
                    "learner"
                };
                // The leader is not in its own replication map: it has everything.
                let matched_index = if Some(*id) == m.current_leader {
                    Some(last_log_index)
                } else {
                    matched.get(id).copied().flatten()
                };
                members.push(MemberProgress {
                    node_id: *id,
                    role: role.into(),
                    matched_index,
                    lag: last_log_index.saturating_sub(matched_index.unwrap_or(0)),
                });
            }
        }
        MetaGroup {
            node_id: m.id,
            state: format!("{:?}", m.state).to_lowercase(),
            leader: m.current_leader,
            term: m.current_term,
            last_log_index: m.last_log_index,
            commit_index,
            applied_index: m.last_applied.map(|l| l.index),
            voters,
            learners,
            members,
        }
    }

    /// Injects (or heals) faults on this node's outgoing links; an empty `peers` means every
    /// peer this node knows (for a fault) or every link with a fault (for healing).
    fn set_link_faults(&self, peers: Vec<u64>, fault: Option<LinkFault>) -> LocalResponse {
        let link = self.transport.link();
        if let Some(f) = &fault {
            if let Err(message) = f.validate() {
                return LocalResponse::error(message);
            }
        }
        match (peers.is_empty(), &fault) {
            (true, None) => link.clear_faults(),
            (true, Some(_)) => {
                let me = self.id();
                let all: Vec<u64> = self
                    .membership
                    .members()
                    .iter()
                    .map(|d| d.node_id)
                    .filter(|id| *id != me)
                    .collect();
                link.set_faults(&all, fault.clone());
            }
            (false, _) => link.set_faults(&peers, fault.clone()),
        }
        tracing::warn!(?peers, ?fault, "link faults changed");
        LocalResponse::LinkFaults {
            faults: link.faults(),
        }
    }
}

/// `database`'s latest schema version, and each live node other than `me` with the version
/// it has applied.
fn schema_lagging(
    s: &mr_meta::MetaState,
    database: &str,
    me: u64,
    now: u64,
) -> (u64, Vec<(u64, u64)>) {
    let log = s.schema(database);
    let latest = log.map_or(0, |l| l.version);
    let nodes = s
        .nodes()
        .filter(|n| n.node_id != me && n.status(now) == mr_meta::NodeStatus::Live)
        .map(|n| (n.node_id, log.map_or(0, |l| l.applied_by(n.node_id))))
        .collect();
    (latest, nodes)
}

/// "schema change 5 on database "movr" is committed but nodes 2 (at version 4), 3 (at 4) have
/// not applied it within 30 s; they will apply it when they can"
fn lagging_message(
    database: &str,
    version: u64,
    lagging: &[(u64, u64)],
    timeout_ms: u64,
) -> String {
    let list: Vec<String> = lagging
        .iter()
        .enumerate()
        .map(|(i, (n, v))| {
            if i == 0 {
                format!("{n} (at version {v})")
            } else {
                format!("{n} (at {v})")
            }
        })
        .collect();
    let (nodes, have, they) = if lagging.len() == 1 {
        ("node", "has", "it")
    } else {
        ("nodes", "have", "they")
    };
    format!(
        "schema change {version} on database {database:?} is committed but {nodes} {} {have} not \
         applied it within {} s; {they} will apply it when {they} can",
        list.join(", "),
        timeout_ms as f64 / 1000.0
    )
}

fn unavailable(e: MetaUnavailable) -> LocalResponse {
    LocalResponse::Error {
        message: e.to_string(),
        retryable: matches!(e, MetaUnavailable::Retryable(_)),
        ambiguous: matches!(e, MetaUnavailable::Ambiguous(_)),
    }
}

/// `SHOW REGIONS FROM CLUSTER`: regions and zones of the nodes that are members (live or
/// suspect; dead and decommissioned nodes do not count).
fn cluster_regions(s: &mr_meta::MetaState, now: u64) -> Vec<RegionZones> {
    let mut map: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for n in s.nodes() {
        if !matches!(
            n.status(now),
            mr_meta::NodeStatus::Live | mr_meta::NodeStatus::Suspect
        ) {
            continue;
        }
        if let Ok(l) = Locality::parse(&n.locality) {
            let zones = map.entry(l.region().to_string()).or_default();
            if let Some(z) = l.zone() {
                zones.insert(z.to_string());
            }
        }
    }
    map.into_iter()
        .map(|(region, zones)| RegionZones {
            region,
            zones: zones.into_iter().collect(),
        })
        .collect()
}

fn node_row(
    n: &mr_meta::NodeRecord,
    now: u64,
    voters: &BTreeSet<u64>,
    learners: &BTreeSet<u64>,
) -> NodeRow {
    let loc = Locality::parse(&n.locality).ok();
    let role = if voters.contains(&n.node_id) {
        "voter"
    } else if learners.contains(&n.node_id) {
        "learner"
    } else {
        "none"
    };
    NodeRow {
        node_id: n.node_id,
        rpc_addr: n.rpc_addr.clone(),
        sql_addr: n.sql_addr.clone(),
        locality: n.locality.clone(),
        region: loc
            .as_ref()
            .map(|l| l.region().to_string())
            .unwrap_or_default(),
        zone: loc.as_ref().and_then(|l| l.zone().map(str::to_string)),
        joined_at_ms: n.joined_at_ms,
        last_heartbeat_ms: n.last_heartbeat_ms,
        status: serde_json::to_value(n.status(now))
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        meta_role: role.into(),
    }
}

fn event_row(e: &mr_meta::Event) -> EventRow {
    let info = serde_json::to_value(&e.command).unwrap_or_default();
    EventRow {
        id: e.id,
        at_ms: e.at_ms,
        node_id: e.client.node_id,
        seq: e.seq,
        event_type: info
            .get("op")
            .and_then(|v| v.as_str())
            .unwrap_or("unknown")
            .to_string(),
        info: info.to_string(),
    }
}

/// Admits a joining node: the leader records it (exactly once per join token) and adds it to
/// the meta group as a learner; other nodes send the joiner to the leader.
async fn admit(
    meta: Arc<Meta>,
    cluster_id: String,
    members: Vec<NodeDescriptor>,
    rpc_addr: String,
    sql_addr: String,
    locality: String,
    token: u64,
) -> PeerResponse {
    if let Err(e) = Locality::parse(&locality) {
        return PeerResponse::Error {
            message: format!("bad locality: {e}"),
            retryable: false,
        };
    }
    let m = meta.metrics();
    if m.state != openraft::ServerState::Leader {
        let leader_addr = m.current_leader.and_then(|l| {
            m.membership_config
                .membership()
                .get_node(&l)
                .map(|n| n.rpc_addr.clone())
        });
        return PeerResponse::NotLeader {
            leader_id: m.current_leader,
            leader_addr,
        };
    }
    let p = Proposal {
        client: ClientId {
            node_id: 0,
            incarnation: token,
        },
        seq: 1,
        command: Command::AddNode {
            rpc_addr: rpc_addr.clone(),
            sql_addr,
            locality: locality.clone(),
            at_ms: now_ms(),
        },
    };
    let node_id = match meta.submit(&p, Instant::now() + JOIN_CALL_TIMEOUT).await {
        Ok(Outcome::NodeAdded { node_id }) => node_id,
        Ok(other) => {
            return PeerResponse::Error {
                message: format!("cannot add the node: {other:?}"),
                retryable: false,
            }
        }
        Err(e) => {
            return PeerResponse::Error {
                message: e.to_string(),
                retryable: true,
            }
        }
    };
    let node = MetaNode { rpc_addr, locality };
    if let Err(e) = meta.raft.add_learner(node_id, node, false).await {
        // The leader's upkeep adds it later; the joiner can start either way.
        tracing::warn!(node_id, "could not add the new node as a learner yet: {e}");
    }
    PeerResponse::Joined {
        node_id,
        cluster_id,
        members,
    }
}

impl Handler for Node {
    fn handle(&self, peer: PeerInfo, req: PeerRequest) -> BoxFuture<'static, PeerResponse> {
        let not_ready = || PeerResponse::Error {
            message: "this node's metadata group member is still starting".into(),
            retryable: true,
        };
        let Some(meta) = self.meta.get().cloned() else {
            return match req {
                PeerRequest::Heartbeat(g) => {
                    self.membership.heard_from(&g);
                    let ack = PeerResponse::HeartbeatAck(self.membership.gossip());
                    Box::pin(async move { ack })
                }
                _ => Box::pin(async move { not_ready() }),
            };
        };
        match req {
            PeerRequest::Heartbeat(g) => {
                self.membership.heard_from(&g);
                let ack = PeerResponse::HeartbeatAck(self.membership.gossip());
                Box::pin(async move { ack })
            }
            PeerRequest::Join {
                rpc_addr,
                sql_addr,
                locality,
                token,
            } => {
                let cluster_id = self
                    .identity
                    .lock()
                    .expect("identity lock")
                    .cluster_id
                    .clone();
                let members = self.membership.members();
                Box::pin(admit(
                    meta, cluster_id, members, rpc_addr, sql_addr, locality, token,
                ))
            }
            PeerRequest::Raft {
                group: 0,
                to,
                kind,
                body,
            } => Box::pin(async move { meta.serve_raft(to, kind, body).await }),
            PeerRequest::Raft {
                group,
                to,
                kind,
                body,
            } => match self.ranges.get().cloned() {
                Some(r) => Box::pin(async move { r.serve_raft(group, to, kind, body).await }),
                None => Box::pin(async move { not_ready() }),
            },
            PeerRequest::RangeChecksum { range_id } => match self.ranges.get().cloned() {
                Some(r) => Box::pin(async move { r.serve_checksum(range_id).await }),
                None => Box::pin(async move { not_ready() }),
            },
            PeerRequest::RangeSample { range_id } => match self.ranges.get().cloned() {
                Some(r) => Box::pin(async move { r.serve_sample(range_id).await }),
                None => Box::pin(async move { not_ready() }),
            },
            PeerRequest::RangeSeed {
                from,
                schema,
                table,
                partition,
                schema_version,
                after,
                merge,
            } => match self.ranges.get().cloned() {
                Some(r) => Box::pin(async move {
                    let at = crate::range::SeedAt {
                        schema_version,
                        after,
                        merge,
                    };
                    r.serve_seed(from, &schema, &table, partition.as_deref(), at)
                        .await
                }),
                None => Box::pin(async move { not_ready() }),
            },
            PeerRequest::AwaitSchemaKnown {
                database,
                version,
                timeout_ms,
            } => Box::pin(async move {
                let known = crate::range::fence::schema_known(
                    &meta,
                    &database,
                    version,
                    Duration::from_millis(timeout_ms),
                )
                .await;
                PeerResponse::SchemaKnown { known }
            }),
            PeerRequest::RangeReadIndex { range_id } => match self.ranges.get().cloned() {
                Some(r) => Box::pin(async move { r.serve_read_index(range_id).await }),
                None => Box::pin(async move { not_ready() }),
            },
            PeerRequest::Exec(req) => match (self.ranges.get().cloned(), peer.node_id) {
                (Some(r), Some(origin)) => Box::pin(async move {
                    PeerResponse::Exec {
                        response: Box::new(r.serve_exec(origin, *req).await),
                    }
                }),
                _ => Box::pin(async move { not_ready() }),
            },
            PeerRequest::TxnDecision {
                anchor,
                gid,
                propose,
                copy,
                plan,
            } => match self.ranges.get().cloned() {
                Some(r) => {
                    Box::pin(
                        async move { r.serve_decision(anchor, gid, propose, copy, plan).await },
                    )
                }
                None => Box::pin(async move { not_ready() }),
            },
            PeerRequest::FinishPrepared {
                database,
                name,
                commit,
                record,
            } => match self.ranges.get().cloned() {
                Some(r) => Box::pin(async move {
                    r.serve_finish_prepared(database, name, commit, record)
                        .await
                }),
                None => Box::pin(async move { not_ready() }),
            },
            PeerRequest::ForgetDecisions {
                range_id,
                gids,
                plans_only,
            } => match self.ranges.get().cloned() {
                Some(r) => {
                    Box::pin(async move { r.serve_forget(range_id, gids, plans_only).await })
                }
                None => Box::pin(async move { not_ready() }),
            },
            PeerRequest::SealRange { range_id } => match self.ranges.get().cloned() {
                Some(r) => Box::pin(async move { r.serve_seal(range_id).await }),
                None => Box::pin(async move { not_ready() }),
            },
            PeerRequest::TxnCoordinating { gid } => {
                let coordinating = self.ranges.get().is_some_and(|r| r.coordinating(&gid));
                Box::pin(async move { PeerResponse::TxnCoordinating { coordinating } })
            }
            PeerRequest::ExecKeepalive { sessions } => {
                if let (Some(r), Some(origin)) = (self.ranges.get(), peer.node_id) {
                    r.keepalive(origin, &sessions);
                }
                Box::pin(async move {
                    PeerResponse::Exec {
                        response: Box::new(LocalResponse::Done),
                    }
                })
            }
            PeerRequest::RangeProgress => {
                let ranges = self.ranges.get().map(|r| r.progress()).unwrap_or_default();
                Box::pin(async move { PeerResponse::RangeProgress { ranges } })
            }
            PeerRequest::SqlLatency => {
                let region = self.locality.region().to_string();
                let windows = self
                    .gateway_stats()
                    .map(|s| s.windows())
                    .unwrap_or_default();
                Box::pin(async move { PeerResponse::SqlLatency { region, windows } })
            }
            PeerRequest::MetaPropose { proposal } => {
                Box::pin(async move { meta.serve_propose(proposal).await })
            }
            PeerRequest::MetaReadIndex => Box::pin(async move { meta.serve_read_index().await }),
            PeerRequest::MetaProgress => Box::pin(async move { meta.serve_progress().await }),
            PeerRequest::Unknown => {
                tracing::warn!(node = ?peer.node_id, locality = %peer.locality, "a peer sent a request this version does not know");
                let resp = PeerResponse::Error {
                    message: format!("pgmr {} does not serve this request", mr_wire::PGMR_VERSION),
                    retryable: false,
                };
                Box::pin(async move { resp })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mr_meta::{MetaState, Proposal};

    #[test]
    fn lagging_nodes_are_named_with_their_versions() {
        assert_eq!(
            lagging_message("movr", 5, &[(2, 4), (3, 4)], 30_000),
            "schema change 5 on database \"movr\" is committed but nodes 2 (at version 4), \
             3 (at 4) have not applied it within 30 s; they will apply it when they can"
        );
        assert_eq!(
            lagging_message("movr", 1, &[(7, 0)], 2_500),
            "schema change 1 on database \"movr\" is committed but node 7 (at version 0) has \
             not applied it within 2.5 s; it will apply it when it can"
        );
    }

    /// Only live nodes other than the asking one are waited for.
    #[test]
    fn only_other_live_nodes_are_waited_for() {
        let t0 = 1_700_000_000_000;
        let mut s = MetaState::bootstrap("a:1", "a:2", "region=r1", t0);
        let client = ClientId {
            node_id: 1,
            incarnation: 1,
        };
        let mut seq = 0;
        let mut apply = |s: &mut MetaState, command| {
            seq += 1;
            s.apply(&Proposal {
                client,
                seq,
                command,
            })
        };
        for i in 0..3 {
            apply(
                &mut s,
                Command::AddNode {
                    rpc_addr: format!("n:{i}"),
                    sql_addr: "x".into(),
                    locality: "region=r2".into(),
                    at_ms: t0,
                },
            );
        }
        apply(&mut s, Command::Decommission { node_id: 4 });
        let change = Command::SchemaChange {
            database: "movr".into(),
            expected_version: 0,
            change: "c".into(),
            config: None,
            localities: vec![],
            at_ms: t0,
            tables: None,
            fenced: vec![],
            key_seeds: vec![],
            sequences: vec![],
            zones: vec![],
        };
        assert_eq!(apply(&mut s, change), Outcome::SchemaVersion { version: 1 });
        apply(
            &mut s,
            Command::SchemaApplied {
                node_id: 3,
                database: "movr".into(),
                version: 1,
            },
        );
        let (latest, nodes) = schema_lagging(&s, "movr", 1, t0 + 10);
        assert_eq!(latest, 1);
        assert_eq!(
            nodes,
            vec![(2, 0), (3, 1)],
            "not 1 (asking), not 4 (decommissioned)"
        );
        let (_, nodes) = schema_lagging(&s, "movr", 1, t0 + mr_meta::SUSPECT_AFTER_MS);
        assert!(nodes.is_empty(), "suspect nodes are not waited for");
        assert_eq!(schema_lagging(&s, "bank", 1, t0).0, 0);
    }
}
