//! `pgmr start`: one node's life — prepare, join, serve, supervise, stop.

use crate::cli::StartArgs;
use crate::identity::{random_hex, DataDir, Identity};
use crate::membership::{Membership, HEARTBEAT_INTERVAL};
use crate::net::{Handler, PeerInfo, RpcError, SelfView, Transport};
use crate::postgres::{self, PgConfig, PgState};
use anyhow::{bail, Context, Result};
use futures::future::BoxFuture;
use mr_topology::{Locality, RttMatrix};
use mr_wire::local::{LinkFault, LocalRequest, LocalResponse, NodeInfo, Status};
use mr_wire::peer::{NodeDescriptor, PeerRequest, PeerResponse};
use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);
const JOIN_CALL_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Node {
    identity: Mutex<Identity>,
    data: DataDir,
    locality: Locality,
    membership: Membership,
    transport: Transport,
    pg: Arc<PgState>,
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
    };
    let listener = TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
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
    let sql_addr = format!("{listen_host}:{}", args.pg_port);

    let (identity, members) = match stored {
        Some(id) => (id, Vec::new()),
        None if bootstrapping => {
            let id = Identity {
                cluster_id: random_hex(16)?,
                node_id: 1,
                next_node_id: Some(2),
            };
            data.save_identity(&id)?;
            tracing::info!(cluster_id = %id.cluster_id, "bootstrapped a new cluster as node 1");
            (id, Vec::new())
        }
        None => {
            let (id, members) = join(&transport, &args, &advertise, &sql_addr).await?;
            data.save_identity(&id)?;
            tracing::info!(node_id = id.node_id, cluster_id = %id.cluster_id, "joined the cluster");
            (id, members)
        }
    };
    transport
        .set_identity(identity.cluster_id.clone(), identity.node_id)
        .await;

    let me = NodeDescriptor {
        node_id: identity.node_id,
        rpc_addr: advertise.clone(),
        sql_addr,
        locality: args.locality.to_string(),
        pgmr_version: mr_wire::PGMR_VERSION.to_string(),
    };
    let node = Arc::new(Node {
        identity: Mutex::new(identity),
        data: data.clone(),
        locality: args.locality.clone(),
        membership: Membership::new(me),
        transport: transport.clone(),
        pg: Arc::new(PgState::default()),
        started: Instant::now(),
    });
    node.membership.learn(&members);
    transport.set_handler(node.clone());

    let stop = CancellationToken::new();
    let local = crate::local::bind(&data.socket(), run_as.map(|(u, _)| u))?;
    tokio::spawn(crate::local::serve(
        local,
        node.clone(),
        run_as.map(|(u, _)| u),
    ));
    tokio::spawn(transport.clone().serve(listener));
    tokio::spawn(heartbeats(node.clone(), args.join.clone(), stop.clone()));

    let supervisor = postgres::start(pg_cfg, node.pg.clone(), stop.clone()).await?;
    tracing::info!(
        node_id = node.id(),
        rpc = %advertise,
        socket = %data.socket().display(),
        "node is up"
    );

    wait_for_shutdown(args.die_with_parent).await;
    tracing::info!("shutting down");
    stop.cancel();
    let _ = supervisor.await;
    let _ = std::fs::remove_file(data.socket());
    Ok(())
}

/// Asks the --join addresses for a node id, following redirects to the allocating node, until
/// one answers or `--join-timeout` passes.
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
                        next_node_id: None,
                    };
                    return Ok((id, members));
                }
                Ok(PeerResponse::Redirect { rpc_addr }) if hops < 3 => {
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
                Ok(other) => last_error = format!("{addr}: unexpected answer {other:?}"),
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
                let sent = Instant::now();
                let req = PeerRequest::Heartbeat(node.membership.gossip());
                match node.transport.call(&addr, req, HEARTBEAT_TIMEOUT).await {
                    Ok(PeerResponse::HeartbeatAck(ack)) => {
                        let rtt = sent.elapsed();
                        node.membership.heard_from(&ack);
                        node.membership.record_rtt(ack.from.node_id, rtt);
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

    pub fn local_request(&self, req: LocalRequest) -> LocalResponse {
        match req {
            LocalRequest::NodeInfo => LocalResponse::NodeInfo(self.info()),
            LocalRequest::NetworkLatency => LocalResponse::NetworkLatency {
                rows: self.membership.rtt_rows(),
            },
            LocalRequest::ClusterRegions => LocalResponse::ClusterRegions {
                regions: self.membership.regions(),
            },
            LocalRequest::Status => LocalResponse::Status(Status {
                node: self.info(),
                peers: self.membership.peer_status(),
                faults: self.transport.link().faults(),
            }),
            LocalRequest::SetLinkFaults { peers, fault } => self.set_link_faults(peers, fault),
        }
    }

    /// Injects (or heals) faults on this node's outgoing links; an empty `peers` means every
    /// peer this node knows (for a fault) or every link with a fault (for healing).
    fn set_link_faults(&self, peers: Vec<u64>, fault: Option<LinkFault>) -> LocalResponse {
        let link = self.transport.link();
        if let Some(f) = &fault {
            if let Err(message) = f.validate() {
                return LocalResponse::Error { message };
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

    /// Hands out the next node id. Only the bootstrap node allocates (until the meta Raft group
    /// takes over); a retried join from the same address that has not yet been heard from
    /// gets the id it was given before, so a lost answer does not burn ids.
    fn allocate(&self, rpc_addr: &str, sql_addr: &str, locality: &str) -> PeerResponse {
        if let Err(e) = Locality::parse(locality) {
            return PeerResponse::Error {
                message: format!("bad locality: {e}"),
                retryable: false,
            };
        }
        let mut id = self.identity.lock().expect("identity lock");
        let Some(next) = id.next_node_id else {
            return match self.membership.addr_of(1) {
                Some(rpc_addr) => PeerResponse::Redirect { rpc_addr },
                None => PeerResponse::Error {
                    message: "this node does not know the allocating node yet".into(),
                    retryable: true,
                },
            };
        };
        let node_id = match self.membership.unheard_with_addr(rpc_addr) {
            Some(existing) => existing,
            None => {
                let mut updated = id.clone();
                updated.next_node_id = Some(next + 1);
                if let Err(e) = self.data.save_identity(&updated) {
                    return PeerResponse::Error {
                        message: format!("{e:#}"),
                        retryable: true,
                    };
                }
                *id = updated;
                next
            }
        };
        let desc = NodeDescriptor {
            node_id,
            rpc_addr: rpc_addr.to_string(),
            sql_addr: sql_addr.to_string(),
            locality: locality.to_string(),
            pgmr_version: String::new(),
        };
        self.membership.learn(&[desc]);
        PeerResponse::Joined {
            node_id,
            cluster_id: id.cluster_id.clone(),
            members: self.membership.members(),
        }
    }
}

impl Handler for Node {
    fn handle(&self, peer: PeerInfo, req: PeerRequest) -> BoxFuture<'static, PeerResponse> {
        let resp = match req {
            PeerRequest::Heartbeat(g) => {
                self.membership.heard_from(&g);
                PeerResponse::HeartbeatAck(self.membership.gossip())
            }
            PeerRequest::Join {
                rpc_addr,
                sql_addr,
                locality,
            } => self.allocate(&rpc_addr, &sql_addr, &locality),
            PeerRequest::Unknown => {
                tracing::warn!(node = ?peer.node_id, locality = %peer.locality, "a peer sent a request this version does not know");
                PeerResponse::Error {
                    message: format!("pgmr {} does not serve this request", mr_wire::PGMR_VERSION),
                    retryable: false,
                }
            }
        };
        Box::pin(async move { resp })
    }
}
