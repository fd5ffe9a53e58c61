//! `pgmr status`: a node's view of itself and its peers, over the local channel.

use crate::cli::{DebugCommand, StatusArgs};
use anyhow::{anyhow, Result};
use mr_wire::framing::call_local;
use mr_wire::local::{LinkFault, LocalRequest, LocalResponse, Status};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One request to the pgmr whose local socket is `socket`.
async fn ask(socket: &Path, req: LocalRequest) -> Result<LocalResponse> {
    let socket: PathBuf = socket.to_path_buf();
    Ok(tokio::task::spawn_blocking(move || {
        call_local(&socket, &req, Duration::from_secs(2), || true)
    })
    .await??)
}

fn socket_of(data_dir: &Path) -> PathBuf {
    data_dir.join("run").join("pgmr.sock")
}

/// Asks the pgmr whose local socket is `socket` for its status.
pub async fn fetch(socket: &Path) -> Result<Status> {
    match ask(socket, LocalRequest::Status).await? {
        LocalResponse::Status(s) => Ok(s),
        LocalResponse::Error { message } => Err(anyhow!(message)),
        other => Err(anyhow!("unexpected answer {other:?}")),
    }
}

pub async fn run(args: StatusArgs) -> Result<()> {
    let s = fetch(&socket_of(&args.data_dir)).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
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
    Ok(())
}

/// `pgmr debug partition|fault|heal`: changes a node's link faults and prints those in force.
pub async fn debug(cmd: DebugCommand) -> Result<()> {
    let (target, fault) = match cmd {
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
        LocalResponse::Error { message } => Err(anyhow!(message)),
        other => Err(anyhow!("unexpected answer {other:?}")),
    }
}
