//! `pgmr status`: a node's view of itself and its peers, over the local channel.

use crate::cli::{DebugCommand, NodeCommand, StatusArgs};
use anyhow::{anyhow, bail, Result};
use mr_wire::framing::call_local;
use mr_wire::local::{LinkFault, LocalRequest, LocalResponse, MetaGroup, SchemaApplierRow, Status};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One request to the pgmr whose local socket is `socket`.
async fn ask(socket: &Path, req: LocalRequest) -> Result<LocalResponse> {
    ask_within(socket, req, Duration::from_secs(2)).await
}

/// As [`ask`], for requests that go through the meta group and may wait for an election.
async fn ask_within(socket: &Path, req: LocalRequest, timeout: Duration) -> Result<LocalResponse> {
    let socket: PathBuf = socket.to_path_buf();
    Ok(tokio::task::spawn_blocking(move || call_local(&socket, &req, timeout, || true)).await??)
}

const META_TIMEOUT: Duration = Duration::from_secs(15);

fn socket_of(data_dir: &Path) -> PathBuf {
    data_dir.join("run").join("pgmr.sock")
}

/// Asks the pgmr whose local socket is `socket` for its status.
pub async fn fetch(socket: &Path) -> Result<Status> {
    match ask(socket, LocalRequest::Status).await? {
        LocalResponse::Status(s) => Ok(s),
        LocalResponse::Error { message, .. } => Err(anyhow!(message)),
        other => Err(anyhow!("unexpected answer {other:?}")),
    }
}

pub async fn meta_group(socket: &Path) -> Result<MetaGroup> {
    match ask_within(socket, LocalRequest::MetaGroup, META_TIMEOUT).await? {
        LocalResponse::MetaGroup(g) => Ok(g),
        LocalResponse::Error { message, .. } => Err(anyhow!(message)),
        other => Err(anyhow!("unexpected answer {other:?}")),
    }
}

/// Every node's schema appliers, from the meta group.
pub async fn schema_appliers(socket: &Path) -> Result<Vec<SchemaApplierRow>> {
    match ask_within(socket, LocalRequest::SchemaAppliers, META_TIMEOUT).await? {
        LocalResponse::SchemaAppliers { appliers } => Ok(appliers),
        LocalResponse::Error { message, .. } => Err(anyhow!(message)),
        other => Err(anyhow!("unexpected answer {other:?}")),
    }
}

pub async fn run(args: StatusArgs) -> Result<()> {
    let socket = socket_of(&args.data_dir);
    let s = fetch(&socket).await?;
    // The meta group may be unreachable (a partition); the node's own view still prints.
    let g = meta_group(&socket).await;
    let failing: Vec<SchemaApplierRow> = match &g {
        Ok(_) => schema_appliers(&socket)
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|a| a.failed_version.is_some())
            .collect(),
        Err(_) => vec![],
    };
    if args.json {
        let mut v = serde_json::to_value(&s)?;
        match &g {
            Ok(g) => v["meta"] = serde_json::to_value(g)?,
            Err(e) => v["meta_error"] = e.to_string().into(),
        }
        v["failing_schema_appliers"] = serde_json::to_value(&failing)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let n = &s.node;
    println!(
        "node {} ({}), cluster {}",
        n.node_id, n.locality, n.cluster_id
    );
    println!(
        "  pgmr {}  rpc {}  sql {}  up {} s  postgres pid {}  restarts {}",
        n.pgmr_version,
        n.rpc_addr,
        n.sql_addr,
        n.uptime_ms / 1000,
        n.postmaster_pid.map_or("-".into(), |p| p.to_string()),
        n.pg_restarts
    );
    println!(
        "{:>6}  {:<40} {:<22} {:>5} {:>9}",
        "peer", "locality", "rpc", "live", "rtt_ms"
    );
    for p in &s.peers {
        println!(
            "{:>6}  {:<40} {:<22} {:>5} {:>9}",
            p.node_id,
            p.locality,
            p.rpc_addr,
            if p.live { "yes" } else { "no" },
            p.rtt_ms.map_or("-".into(), |r| format!("{r:.1}"))
        );
    }
    for (peer, f) in &s.faults {
        println!(
            "  injected fault to node {peer}: partitioned={} drop_rate={} extra_delay_ms={}",
            f.partitioned, f.drop_rate, f.extra_delay_ms
        );
    }
    for (db, p) in &s.schema {
        println!(
            "  schema of database {db:?}: applied {} of {}{}",
            p.applied,
            p.latest,
            p.last_error
                .as_ref()
                .map_or(String::new(), |e| format!("; last error: {e}"))
        );
    }
    for a in &failing {
        println!(
            "  FAILING: node {} cannot apply schema version {} of database {:?} (applied {} of {}): {}",
            a.node_id,
            a.failed_version.unwrap_or_default(),
            a.database,
            a.applied,
            a.latest,
            a.error.as_deref().unwrap_or("")
        );
    }
    match g {
        Ok(g) => print_meta(&g),
        Err(e) => println!("meta group: unavailable ({e})"),
    }
    Ok(())
}

fn print_meta(g: &MetaGroup) {
    let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    println!(
        "meta group: this node is {}, leader {}, term {}, commit {}, applied {}, last log {}",
        g.state,
        opt(g.leader),
        g.term,
        opt(g.commit_index),
        opt(g.applied_index),
        opt(g.last_log_index)
    );
    println!("  voters {:?}  learners {:?}", g.voters, g.learners);
    if g.members.is_empty() {
        println!("  (no replication progress: no leader answered)");
    }
    for m in &g.members {
        println!(
            "  {:>6}  {:<8} matched {:>8}  lag {:>6}",
            m.node_id,
            m.role,
            opt(m.matched_index),
            m.lag
        );
    }
}

/// `pgmr node ls|decommission`.
pub async fn node(cmd: NodeCommand) -> Result<()> {
    match cmd {
        NodeCommand::Ls(args) => {
            let nodes = match ask_within(
                &socket_of(&args.data_dir),
                LocalRequest::Nodes,
                META_TIMEOUT,
            )
            .await?
            {
                LocalResponse::Nodes { nodes } => nodes,
                LocalResponse::Error { message, .. } => bail!(message),
                other => bail!("unexpected answer {other:?}"),
            };
            if args.json {
                println!("{}", serde_json::to_string_pretty(&nodes)?);
                return Ok(());
            }
            println!(
                "{:>4}  {:<40} {:<22} {:<15} {:<8}",
                "id", "locality", "rpc", "status", "meta"
            );
            for n in nodes {
                println!(
                    "{:>4}  {:<40} {:<22} {:<15} {:<8}",
                    n.node_id, n.locality, n.rpc_addr, n.status, n.meta_role
                );
            }
            Ok(())
        }
        NodeCommand::Decommission { id, data_dir } => {
            let req = LocalRequest::Decommission { node_id: id };
            match ask_within(&socket_of(&data_dir), req, Duration::from_secs(60)).await? {
                LocalResponse::Done => {
                    println!("node {id} is decommissioned and has left the meta group");
                    Ok(())
                }
                LocalResponse::Error { message, .. } => bail!(message),
                other => bail!("unexpected answer {other:?}"),
            }
        }
    }
}

/// `pgmr debug partition|fault|heal`: changes a node's link faults and prints those in force.
pub async fn debug(cmd: DebugCommand) -> Result<()> {
    let (target, fault) = match cmd {
        DebugCommand::CheckConsistency { data_dir } => return check_consistency(&data_dir).await,
        DebugCommand::DelayProxy { listen, to, rtt } => {
            return crate::net::proxy::delay_proxy(listen, to, rtt).await
        }
        DebugCommand::Partition(t) => (
            t,
            Some(LinkFault {
                partitioned: true,
                ..LinkFault::default()
            }),
        ),
        DebugCommand::Fault {
            target,
            drop_rate,
            extra_delay,
        } => {
            let f = LinkFault {
                partitioned: false,
                drop_rate,
                extra_delay_ms: extra_delay.as_secs_f64() * 1000.0,
            };
            f.validate().map_err(|e| anyhow!(e))?;
            (target, Some(f))
        }
        DebugCommand::Heal(t) => (t, None),
    };
    let req = LocalRequest::SetLinkFaults {
        peers: target.peers,
        fault,
    };
    match ask(&socket_of(&target.data_dir), req).await? {
        LocalResponse::LinkFaults { faults } => {
            if faults.is_empty() {
                println!("no link faults");
            }
            for (peer, f) in faults {
                println!(
                    "to node {peer}: partitioned={} drop_rate={} extra_delay_ms={}",
                    f.partitioned, f.drop_rate, f.extra_delay_ms
                );
            }
            Ok(())
        }
        LocalResponse::Error { message, .. } => Err(anyhow!(message)),
        other => Err(anyhow!("unexpected answer {other:?}")),
    }
}

/// `pgmr debug check-consistency`: one line per replica; fails if any range's replicas differ
/// or could not be compared.
async fn check_consistency(data_dir: &std::path::Path) -> Result<()> {
    let req = LocalRequest::CheckConsistency;
    let replicas = match ask_within(&socket_of(data_dir), req, Duration::from_secs(300)).await? {
        LocalResponse::Consistency { replicas } => replicas,
        LocalResponse::Error { message, .. } => bail!(message),
        other => bail!("unexpected answer {other:?}"),
    };
    println!(
        "{:>6} {:>5} {:>8} {:>8}  {:<32}  status",
        "range", "node", "applied", "rows", "checksum"
    );
    let mut bad = BTreeSet::new();
    for r in &replicas {
        let status = match (&r.error, r.consistent) {
            (Some(e), _) => e.clone(),
            (None, true) => "ok".into(),
            (None, false) => "DIFFERS".into(),
        };
        if !r.consistent {
            bad.insert(r.range_id);
        }
        let n = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
        println!(
            "{:>6} {:>5} {:>8} {:>8}  {:<32}  {status}",
            r.range_id,
            r.node_id,
            n(r.applied_index),
            n(r.row_count),
            r.checksum.as_deref().unwrap_or("-"),
        );
    }
    if !bad.is_empty() {
        let list: Vec<String> = bad.iter().map(u64::to_string).collect();
        bail!(
            "replicas differ or could not be compared in ranges {}",
            list.join(", ")
        );
    }
    println!(
        "{} replicas of {} ranges agree",
        replicas.len(),
        replicas
            .iter()
            .map(|r| r.range_id)
            .collect::<BTreeSet<_>>()
            .len()
    );
    Ok(())
}
