//! `pgmr demo`: a throwaway multi-node cluster on loopback, like `cockroach demo --global`.
//!
//! Every node is a real `pgmr start` child process with its own PostgreSQL; the demo only
//! chooses ports, localities and the shared secret, waits until every node sees every other,
//! prints the connection table and opens psql on node 1.

use crate::cli::DemoArgs;
use crate::identity::random_hex;
use anyhow::{bail, Context, Result};
use mr_topology::demo_layout;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, SignalKind};

const START_TIMEOUT: Duration = Duration::from_secs(180);

struct DemoNode {
    index: usize,
    locality: mr_topology::Locality,
    data_dir: PathBuf,
    pg_port: u16,
    sql_port: u16,
    rpc_addr: String,
    child: Child,
}

impl DemoNode {
    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.pg_port)
    }
    /// The SQL gateway, as CockroachDB's tools write it (user root, sslmode=disable).
    fn gateway_url(&self) -> String {
        format!(
            "postgresql://root@127.0.0.1:{}/defaultdb?sslmode=disable",
            self.sql_port
        )
    }
}

pub async fn run(args: DemoArgs) -> Result<()> {
    // Registered first so that Ctrl-C during startup or in psql reaches us as an event,
    // not as death; the children run in their own process groups and never see it.
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;

    let n = args.nodes as usize;
    let layout = demo_layout(n);
    for i in 0..n {
        for port in [
            args.pg_port_base as usize + i,
            args.rpc_port_base as usize + i,
            args.sql_port_base as usize + i,
        ] {
            let port = u16::try_from(port).context("port out of range")?;
            std::net::TcpListener::bind(("127.0.0.1", port)).with_context(|| {
                format!("port {port} is in use (choose others with --pg-port-base/--rpc-port-base/--sql-port-base)")
            })?;
        }
    }
    let base = tempfile::Builder::new()
        .prefix("pgmr-demo-")
        .tempdir()
        .context("cannot create a temporary directory")?;
    fs::set_permissions(base.path(), fs::Permissions::from_mode(0o711))?;
    let secret = base.path().join("cluster-secret");
    fs::write(&secret, random_hex(32)?)?;
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600))?;
    let latency = if args.global {
        Some("global".to_string())
    } else {
        args.latency_matrix.as_ref().map(|l| l.arg.clone())
    };

    let exe = std::env::current_exe().context("cannot find the pgmr executable")?;
    let mut nodes: Vec<DemoNode> = Vec::new();
    let result = async {
        for d in &layout {
            let i = d.index - 1;
            let data_dir = base.path().join(format!("node{}", d.index));
            fs::create_dir_all(&data_dir)?;
            let rpc_addr = format!("127.0.0.1:{}", args.rpc_port_base as usize + i);
            let pg_port = args.pg_port_base + i as u16;
            let sql_port = args.sql_port_base + i as u16;
            let http_port = args.http_port_base + i as u16;
            let log = fs::File::create(data_dir.join("pgmr.log"))?;
            let mut cmd = Command::new(&exe);
            cmd.arg("start")
                .arg("--locality")
                .arg(d.locality.to_string())
                .arg("--data-dir")
                .arg(&data_dir)
                .arg("--listen")
                .arg(&rpc_addr)
                .arg("--secret-file")
                .arg(&secret)
                .arg("--pg-port")
                .arg(pg_port.to_string())
                .arg("--sql-listen")
                .arg(format!("127.0.0.1:{sql_port}"))
                .arg("--http-listen")
                .arg(format!("127.0.0.1:{http_port}"))
                .arg("--pg-user")
                .arg(&args.pg_user)
                .args(["--die-with-parent", "--ephemeral"]);
            if let Some(bin) = &args.pg_bin {
                cmd.arg("--pg-bin").arg(bin);
            }
            if let Some(l) = &latency {
                cmd.arg("--latency").arg(l);
            }
            if let Some(first) = nodes.first() {
                cmd.arg("--join").arg(&first.rpc_addr);
            }
            cmd.stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .process_group(0);
            let child = cmd.spawn().context("cannot start a pgmr node")?;
            eprintln!("starting node {} ({})", d.index, d.locality);
            nodes.push(DemoNode {
                index: d.index,
                locality: d.locality.clone(),
                data_dir,
                pg_port,
                sql_port,
                rpc_addr,
                child,
            });
            // A node answers on its local socket once it has joined. Waiting for that before
            // starting the next one makes node ids follow the layout (node N is the Nth
            // locality) while PostgreSQL startups still overlap.
            wait_until(&mut nodes, START_TIMEOUT, |_, s| s.is_some()).await?;
        }
        eprint!("waiting for every node to see every other ...");
        wait_until(&mut nodes, START_TIMEOUT, |n, s| {
            s.is_some_and(|s| {
                s.node.postmaster_pid.is_some()
                    && s.peers
                        .iter()
                        .filter(|p| p.live && p.rtt_ms.is_some())
                        .count()
                        + 1
                        >= n
            })
        })
        .await?;
        eprintln!(" done");
        Ok::<(), anyhow::Error>(())
    }
    .await;

    if let Err(e) = result {
        eprintln!();
        stop_all(&mut nodes).await;
        let path = base.keep();
        bail!("{e:#} (logs kept in {})", path.display());
    }

    print_banner(&nodes, latency.as_deref());
    if args.no_shell {
        println!("# Press Ctrl-C to stop the cluster.");
        tokio::select! {
            _ = sigint.recv() => {}
            _ = sigterm.recv() => {}
        }
    } else {
        let mut psql = Command::new("psql")
            .arg(nodes[0].url())
            .spawn()
            .context("cannot start psql")?;
        loop {
            tokio::select! {
                _ = psql.wait() => break,
                _ = sigint.recv() => {} // psql handles Ctrl-C itself (cancels the query)
                _ = sigterm.recv() => {
                    let _ = psql.kill().await;
                    break;
                }
            }
        }
    }

    eprintln!("stopping {} nodes ...", nodes.len());
    stop_all(&mut nodes).await;
    if args.keep {
        let path = base.keep();
        eprintln!("data kept in {}", path.display());
    }
    Ok(())
}

/// Polls every node's status until `ready(node_count, status)` holds for all of them.
async fn wait_until(
    nodes: &mut [DemoNode],
    timeout: Duration,
    ready: impl Fn(usize, Option<&mr_wire::local::Status>) -> bool,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let total = nodes.len();
    loop {
        let mut all = true;
        for node in nodes.iter_mut() {
            if let Some(status) = node.child.try_wait()? {
                bail!(
                    "node {} exited ({status}): {}",
                    node.index,
                    last_line(&node.data_dir.join("pgmr.log"))
                );
            }
            let s = crate::status::fetch(&node.data_dir.join("run").join("pgmr.sock"))
                .await
                .ok();
            if !ready(total, s.as_ref()) {
                all = false;
            }
        }
        if all {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the cluster did not come up within {} s", timeout.as_secs());
        }
        eprint!(".");
        let _ = std::io::stderr().flush();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn last_line(path: &Path) -> String {
    fs::read_to_string(path)
        .ok()
        .and_then(|t| {
            t.lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(str::to_string)
        })
        .unwrap_or_else(|| format!("see {}", path.display()))
}

/// SIGTERM to every node at once (each stops its PostgreSQL), SIGKILL after a grace period.
async fn stop_all(nodes: &mut [DemoNode]) {
    for n in nodes.iter() {
        if let Some(pid) = n.child.id() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
        }
    }
    for n in nodes.iter_mut() {
        if tokio::time::timeout(Duration::from_secs(40), n.child.wait())
            .await
            .is_err()
        {
            let _ = n.child.kill().await;
        }
        // A node that died, or was killed, before stopping its PostgreSQL left it holding
        // the node's ports: the next demo could not start.
        let pgdata = crate::identity::pgdata_in(&n.data_dir);
        if let Some(pid) = crate::postgres::stop_left_running(&pgdata).await {
            eprintln!(
                "stopped node {}'s PostgreSQL (pid {pid}), which its pgmr left running",
                n.index
            );
        }
    }
}

fn print_banner(nodes: &[DemoNode], latency: Option<&str>) {
    let regions: Vec<&str> = {
        let mut r: Vec<&str> = nodes.iter().map(|n| n.locality.region()).collect();
        r.dedup();
        r
    };
    println!("#");
    println!(
        "# Welcome to the pg_multiregion demo: {} nodes in {}.",
        nodes.len(),
        regions.join(", ")
    );
    match latency {
        Some("global") => println!("# Simulated WAN: the MovR tutorial's round-trip times (us-east1/us-west1 63 ms, us-east1/europe-west1 87 ms, us-west1/europe-west1 132 ms)."),
        Some(file) => println!("# Simulated WAN: {file}."),
        None => println!("# No simulated WAN latency (use --global)."),
    }
    println!("# Measured round-trip times: SELECT * FROM multiregion.network_latency();");
    println!("# Regions: SELECT * FROM multiregion.cluster_regions();");
    println!("#");
    println!("# PostgreSQL's own SQL (sql) and CockroachDB's through the SQL gateway (gateway).");
    println!("#");
    println!(
        "{:>6} | {:<13} | {:<15} | {:<43} | gateway",
        "node", "region", "zone", "sql"
    );
    println!("{:-<7}+{:-<15}+{:-<17}+{:-<45}+{:-<56}", "", "", "", "", "");
    for n in nodes {
        println!(
            "{:>6} | {:<13} | {:<15} | {:<43} | {}",
            n.index,
            n.locality.region(),
            n.locality.zone().unwrap_or(""),
            n.url(),
            n.gateway_url()
        );
    }
    println!();
}
