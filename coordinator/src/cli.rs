//! Command-line flags. Parsing validates what it can (localities, addresses, the latency
//! matrix) so that a bad flag stops pgmr with one line before it touches anything.

use clap::{Args, Parser, Subcommand};
use mr_topology::{Locality, RttMatrix};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(name = "pgmr", version, about = "pg_multiregion node sidecar")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// How pgmr writes its log lines (to stderr).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

impl Cli {
    /// The log format asked for (`pgmr start --log-format`; text otherwise).
    pub fn log_format(&self) -> LogFormat {
        match &self.command {
            Command::Start(args) => args.log_format,
            _ => LogFormat::Text,
        }
    }

    /// Default log filter (overridden by `PGMR_LOG`): the demo keeps its terminal clean.
    pub fn log_level(&self) -> &'static str {
        match self.command {
            Command::Demo(_) | Command::Status(_) | Command::Debug(_) | Command::Node(_) => "warn",
            // sqlx logs server notices at info; they are PostgreSQL's to log, not ours.
            Command::Start(_) => "info,sqlx=warn,openraft=warn",
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Start a node: supervise its PostgreSQL and join (or bootstrap) a cluster.
    Start(Box<StartArgs>),
    /// Start a local multi-node cluster on loopback and open psql on node 1.
    Demo(DemoArgs),
    /// Show a running node's view of the cluster.
    Status(StatusArgs),
    /// Inject faults into a running node's outgoing links (for tests and experiments).
    #[command(subcommand)]
    Debug(DebugCommand),
    /// Manage the cluster's nodes through a running node.
    #[command(subcommand)]
    Node(NodeCommand),
}

#[derive(Subcommand, Debug)]
pub enum NodeCommand {
    /// List the nodes the cluster records, with liveness and meta group role.
    Ls(StatusArgs),
    /// Remove node ID from the cluster for good: it leaves the meta group, stops counting as
    /// a member, and its pgmr stops. Returns once the meta group no longer includes it.
    Decommission {
        /// The node to decommission.
        id: u64,
        /// Data directory of any running node (its socket is DATA_DIR/run/pgmr.sock).
        #[arg(long)]
        data_dir: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
pub enum DebugCommand {
    /// Discard everything this node sends to PEERS (a one-way partition; run it on both sides
    /// for a two-way one).
    Partition(FaultTarget),
    /// Degrade the links to PEERS: drop a share of frames and/or add delay.
    Fault {
        #[command(flatten)]
        target: FaultTarget,
        /// Probability (0 to 1) that a frame is dropped.
        #[arg(long, default_value_t = 0.0)]
        drop_rate: f64,
        /// Delay added to each frame, on top of the simulated WAN.
        #[arg(long, value_parser = parse_duration, default_value = "0ms")]
        extra_delay: std::time::Duration,
    },
    /// Remove the faults on the links to PEERS (all links without --peers).
    Heal(FaultTarget),
    /// Relay TCP connections from LISTEN to TO with the simulated WAN's delay (half of RTT
    /// each way, through the same delay line as pgmr's links): puts a program that does not
    /// talk through pgmr (a PostgreSQL standby, for the baseline benchmark) behind it.
    DelayProxy {
        #[arg(long)]
        listen: std::net::SocketAddr,
        #[arg(long)]
        to: std::net::SocketAddr,
        /// Round trip to simulate, e.g. 2ms or 63ms.
        #[arg(long, value_parser = parse_duration)]
        rtt: std::time::Duration,
    },
    /// Compare a checksum of every replica of every range; exits 1 naming any that differ.
    CheckConsistency {
        /// Data directory of any running node (its socket is DATA_DIR/run/pgmr.sock).
        #[arg(long)]
        data_dir: PathBuf,
    },
}

#[derive(Args, Debug, Clone)]
pub struct FaultTarget {
    /// The node's data directory (its socket is DATA_DIR/run/pgmr.sock).
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Peer node ids, comma-separated; all peers if omitted.
    #[arg(long, value_delimiter = ',')]
    pub peers: Vec<u64>,
}

#[derive(Args, Debug, Clone)]
pub struct StartArgs {
    /// Locality tiers of this node, e.g. region=us-east1,zone=us-east1-b.
    #[arg(long, value_parser = parse_locality)]
    pub locality: Locality,
    /// Directory for this node's state and its PostgreSQL data.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Address for inter-node RPC, HOST:PORT.
    #[arg(long, value_parser = parse_host_port)]
    pub listen: String,
    /// Address other nodes use to reach this one (defaults to --listen).
    #[arg(long, value_parser = parse_host_port)]
    pub advertise: Option<String>,
    /// RPC addresses of existing nodes, comma-separated; any of them can admit this node. Without
    /// it, this node bootstraps a new cluster (or, with an existing data dir, rejoins).
    #[arg(long, value_delimiter = ',', value_parser = parse_host_port)]
    pub join: Vec<String>,
    /// How long to keep trying the --join addresses before giving up.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub join_timeout: std::time::Duration,
    /// File holding the cluster secret that authenticates inter-node connections. A
    /// bootstrapping node without it generates one in DATA_DIR/cluster-secret.
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// TCP port of the supervised PostgreSQL.
    #[arg(long, default_value_t = 5432)]
    pub pg_port: u16,
    /// Address PostgreSQL listens on (defaults to the host of --listen).
    #[arg(long)]
    pub pg_listen: Option<String>,
    /// Directory with the PostgreSQL 15 server binaries (defaults to `pg_config --bindir`).
    #[arg(long)]
    pub pg_bin: Option<PathBuf>,
    /// Networks (CIDR, comma-separated) whose clients PostgreSQL lets in without a password,
    /// as it does loopback's: for demos on a private network (docker-compose), never the
    /// internet. pgmr keeps these lines in a block of pg_hba.conf that it rewrites at start.
    #[arg(long, value_delimiter = ',', value_parser = parse_cidr)]
    pub pg_trust: Vec<String>,
    /// OS user that runs PostgreSQL when pgmr runs as root (PostgreSQL refuses root).
    #[arg(long, default_value = "postgres")]
    pub pg_user: String,
    /// Simulated WAN: `global` (the MovR tutorial's regions) or a matrix file; none by default.
    #[arg(long, value_parser = parse_latency)]
    pub latency: Option<LatencySpec>,
    /// Address of the SQL gateway, CockroachDB's door (HOST:PORT; defaults to the host of
    /// --listen, port 26257).
    #[arg(long, value_parser = parse_host_port)]
    pub sql_listen: Option<String>,
    /// Address of the DB Console and /metrics (HOST:PORT; defaults to the host of --listen,
    /// port 8080). Bound to loopback unless given another host.
    #[arg(long, value_parser = parse_host_port)]
    pub http_listen: Option<String>,
    /// PEM certificate chain the SQL gateway offers over TLS (with --sql-tls-key); without
    /// it, a self-signed certificate kept in DATA_DIR/sql-tls.
    #[arg(long, requires = "sql_tls_key")]
    pub sql_tls_cert: Option<PathBuf>,
    /// PEM private key of --sql-tls-cert.
    #[arg(long, requires = "sql_tls_cert")]
    pub sql_tls_key: Option<PathBuf>,
    /// Log lines as text, or as one JSON object per line (for log collectors).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Stop when the parent process exits (used by `pgmr demo` for its children).
    #[arg(long, hide = true)]
    pub die_with_parent: bool,
    /// Skip fsync in initdb and PostgreSQL: for throwaway demo and test clusters only.
    #[arg(long, hide = true)]
    pub ephemeral: bool,
}

#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Number of nodes, spread over us-east1, us-west1 and europe-west1.
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub nodes: u16,
    /// Simulate the MovR tutorial's inter-region latencies (2022 paper, Table 1).
    #[arg(long, conflicts_with = "latency_matrix")]
    pub global: bool,
    /// Simulate the latencies in this matrix file instead.
    #[arg(long, value_parser = parse_latency_file)]
    pub latency_matrix: Option<LatencySpec>,
    /// Do not open psql; run until Ctrl-C or SIGTERM.
    #[arg(long)]
    pub no_shell: bool,
    /// Keep the demo's data directory on exit.
    #[arg(long)]
    pub keep: bool,
    /// First PostgreSQL port; node N uses this + N - 1.
    #[arg(long, default_value_t = 15432)]
    pub pg_port_base: u16,
    /// First SQL gateway port; node N uses this + N - 1.
    #[arg(long, default_value_t = 26257)]
    pub sql_port_base: u16,
    /// First console (HTTP) port; node N uses this + N - 1.
    #[arg(long, default_value_t = 8080)]
    pub http_port_base: u16,
    /// First RPC port; node N uses this + N - 1. Below the ephemeral port range, clear of the
    /// SQL gateway's 26257 and up.
    #[arg(long, default_value_t = 26357)]
    pub rpc_port_base: u16,
    /// OS user that runs PostgreSQL when pgmr runs as root.
    #[arg(long, default_value = "postgres")]
    pub pg_user: String,
    /// Directory with the PostgreSQL 15 server binaries.
    #[arg(long)]
    pub pg_bin: Option<PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct StatusArgs {
    /// The node's data directory (its socket is DATA_DIR/run/pgmr.sock).
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Where the simulated latencies come from; kept as text so children can be given the same.
#[derive(Debug, Clone)]
pub struct LatencySpec {
    pub arg: String,
    pub matrix: RttMatrix,
}

fn parse_locality(s: &str) -> Result<Locality, String> {
    Locality::parse(s).map_err(|e| format!("{e} ({})", e.hint()))
}

fn parse_host_port(s: &str) -> Result<String, String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?} is not HOST:PORT"))?;
    if host.is_empty() {
        return Err(format!("{s:?} has no host"));
    }
    port.parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{s:?} has no valid port (1-65535)"))?;
    Ok(s.to_string())
}

/// `ADDRESS/PREFIX`, as pg_hba.conf takes it: an IPv4 or IPv6 address and a prefix length
/// that fits it.
fn parse_cidr(s: &str) -> Result<String, String> {
    let bad = || format!("{s:?} is not a network like 172.16.0.0/12");
    let (addr, len) = s.split_once('/').ok_or_else(bad)?;
    let addr: std::net::IpAddr = addr.parse().map_err(|_| bad())?;
    let len: u8 = len.parse().map_err(|_| bad())?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    if len > max {
        return Err(bad());
    }
    Ok(format!("{addr}/{len}"))
}

fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let bad = || format!("{s:?} is not a duration like 500ms, 20s or 2m");
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))
        .ok_or_else(bad)?;
    let n: u64 = num.parse().map_err(|_| bad())?;
    match unit {
        "ms" => Ok(std::time::Duration::from_millis(n)),
        "s" => Ok(std::time::Duration::from_secs(n)),
        "m" => Ok(std::time::Duration::from_secs(n * 60)),
        _ => Err(bad()),
    }
}

fn parse_latency(s: &str) -> Result<LatencySpec, String> {
    if s == "global" {
        return Ok(LatencySpec {
            arg: s.to_string(),
            matrix: RttMatrix::global(),
        });
    }
    parse_latency_file(s)
}

fn parse_latency_file(s: &str) -> Result<LatencySpec, String> {
    let text = std::fs::read_to_string(s).map_err(|e| format!("cannot read {s:?}: {e}"))?;
    let matrix = RttMatrix::parse(&text).map_err(|e| format!("{s}: {e}"))?;
    let arg = std::fs::canonicalize(s).map_err(|e| format!("{s}: {e}"))?;
    Ok(LatencySpec {
        arg: arg.display().to_string(),
        matrix,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_requires_both_parts() {
        assert!(parse_host_port("127.0.0.1:26257").is_ok());
        assert!(parse_host_port("node1:1").is_ok());
        assert!(parse_host_port("127.0.0.1").is_err());
        assert!(parse_host_port(":80").is_err());
        assert!(parse_host_port("h:0").is_err());
        assert!(parse_host_port("h:70000").is_err());
    }

    #[test]
    fn trusted_networks_are_cidrs_that_fit_their_address() {
        assert_eq!(parse_cidr("172.16.0.0/12").as_deref(), Ok("172.16.0.0/12"));
        assert_eq!(parse_cidr("fd00::/8").as_deref(), Ok("fd00::/8"));
        assert!(parse_cidr("172.16.0.0").is_err());
        assert!(parse_cidr("172.16.0.0/33").is_err());
        assert!(parse_cidr("node1/8").is_err());
        assert!(parse_cidr("10.0.0.0/8 trust").is_err());
    }

    #[test]
    fn durations_need_a_unit() {
        assert_eq!(
            parse_duration("500ms"),
            Ok(std::time::Duration::from_millis(500))
        );
        assert_eq!(
            parse_duration("2m"),
            Ok(std::time::Duration::from_secs(120))
        );
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5h").is_err());
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
