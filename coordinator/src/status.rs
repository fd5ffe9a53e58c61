//! `pgmr status`: a node's view of itself and its peers, over the local channel.

use crate::cli::StatusArgs;
use anyhow::{anyhow, Result};
use mr_wire::framing::call_local;
use mr_wire::local::{LocalRequest, LocalResponse, Status};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Asks the pgmr whose local socket is `socket` for its status.
pub async fn fetch(socket: &Path) -> Result<Status> {
    let socket: PathBuf = socket.to_path_buf();
    let resp = tokio::task::spawn_blocking(move || {
        call_local(
            &socket,
            &LocalRequest::Status,
            Duration::from_secs(2),
            || true,
        )
    })
    .await??;
    match resp {
        LocalResponse::Status(s) => Ok(s),
        LocalResponse::Error { message } => Err(anyhow!(message)),
        other => Err(anyhow!("unexpected answer {other:?}")),
    }
}

pub async fn run(args: StatusArgs) -> Result<()> {
    let socket = args.data_dir.join("run").join("pgmr.sock");
    let s = fetch(&socket).await?;
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
    Ok(())
}
