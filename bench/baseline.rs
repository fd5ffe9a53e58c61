//! The replication baseline the data plane is measured against: a PostgreSQL primary with two
//! synchronous standbys (`synchronous_standby_names = 'ANY 1 (s1, s2)'`: a commit waits for
//! one of them, as a Raft write waits for one of two followers), each standby streaming
//! through `pgmr debug delay-proxy`, so its WAL and acknowledgements cross the same
//! simulated WAN, with the same delay line, as pgmr's Raft messages.
//!
//! Durability matches the data plane's: the primary runs with `fsync = off`, as pgmr's
//! `--ephemeral` PostgreSQL does, and the standbys with `fsync = on`, as pgmr's range logs
//! fsync every append.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A primary, two standbys and their delay proxies; all stopped when dropped.
pub struct StandbyCluster {
    pub primary_port: u16,
    children: Vec<Child>,
    dirs: Vec<PathBuf>,
}

fn bindir() -> PathBuf {
    let out = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .expect("pg_config");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// Runs a PostgreSQL program as the `postgres` OS user (they refuse to run as root).
fn as_postgres(program: &Path) -> Command {
    let mut c = Command::new("runuser");
    c.args(["-u", "postgres", "--"]).arg(program);
    c
}

/// An empty directory for a data directory: the `postgres` user's, mode 0700 (PostgreSQL
/// refuses any other).
fn postgres_owned_dir(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path).expect("mkdir");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let ok = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(path)
        .status()
        .expect("chown")
        .success();
    assert!(ok, "chown {}", path.display());
}

/// Waits until `port` accepts connections; `log` says why not.
fn wait_for_port(port: u16, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nothing listens on {port}: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl StandbyCluster {
    /// Starts it under `dir` on ports `base`.. (primary `base`, proxies `base + 1`, `base + 2`,
    /// standbys `base + 11`, `base + 12`), the standbys `rtts` away from the primary.
    pub fn start(dir: &Path, base: u16, pgmr: &str, rtts: [Duration; 2]) -> StandbyCluster {
        let bin = bindir();
        let mut me = StandbyCluster {
            primary_port: base,
            children: vec![],
            dirs: vec![],
        };
        let primary = dir.join(format!("baseline-{base}-primary"));
        postgres_owned_dir(&primary);
        me.dirs.push(primary.clone());
        let ok = as_postgres(&bin.join("initdb"))
            .args(["-D"])
            .arg(&primary)
            .args(["-U", "postgres", "--auth", "trust", "--no-sync"])
            .stdout(Stdio::null())
            .status()
            .expect("initdb")
            .success();
        assert!(ok, "initdb");
        let server = |data: &Path, port: u16, extra: &[String]| -> Child {
            let mut c = as_postgres(&bin.join("postgres"));
            c.arg("-D").arg(data).args([
                "-p",
                &port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                &format!("unix_socket_directories={}", data.display()),
            ]);
            for e in extra {
                c.args(["-c", e]);
            }
            let log = std::fs::File::create(data.with_extension("log")).expect("server log");
            c.stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("postgres")
        };
        me.children.push(server(
            &primary,
            base,
            &[
                "fsync=off".into(),
                "wal_level=replica".into(),
                "max_wal_senders=5".into(),
                "synchronous_standby_names=ANY 1 (s1, s2)".into(),
            ],
        ));
        wait_for_port(base, &primary.with_extension("log"));
        for (i, rtt) in rtts.iter().enumerate() {
            let name = format!("s{}", i + 1);
            let proxy_port = base + 1 + i as u16;
            let standby_port = base + 11 + i as u16;
            me.children.push(
                Command::new(pgmr)
                    .args([
                        "debug",
                        "delay-proxy",
                        "--listen",
                        &format!("127.0.0.1:{proxy_port}"),
                        "--to",
                        &format!("127.0.0.1:{base}"),
                        "--rtt",
                        &format!("{}ms", rtt.as_millis()),
                    ])
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("delay proxy"),
            );
            wait_for_port(proxy_port, Path::new("/dev/null"));
            let data = dir.join(format!("baseline-{base}-{name}"));
            // pg_basebackup fills an existing empty directory.
            postgres_owned_dir(&data);
            let conninfo =
                format!("host=127.0.0.1 port={proxy_port} user=postgres application_name={name}");
            let ok = as_postgres(&bin.join("pg_basebackup"))
                .args(["-d", &conninfo, "-R", "--no-sync", "-D"])
                .arg(&data)
                .status()
                .expect("pg_basebackup")
                .success();
            assert!(ok, "pg_basebackup");
            me.dirs.push(data.clone());
            me.children.push(server(
                &data,
                standby_port,
                &["fsync=on".into(), format!("primary_conninfo={conninfo}")],
            ));
            wait_for_port(standby_port, &data.with_extension("log"));
        }
        me
    }
}

impl Drop for StandbyCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
        }
        for c in &mut self.children {
            let _ = c.wait();
        }
        // runuser's child (postgres) may outlive runuser's exit: stop it by its data dir.
        for d in &self.dirs {
            let _ = Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(bindir().join("pg_ctl"))
                .args(["stop", "-m", "immediate", "-D"])
                .arg(d)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}
