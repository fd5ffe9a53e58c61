//! A node's durable identity and its data directory layout.
//!
//! ```text
//! DATA_DIR/
//!   node.json        cluster id and node id
//!   meta.redb        the meta Raft group's log, vote and snapshots (meta/store.rs)
//!   cluster-secret   the shared secret that authenticates inter-node connections (0600)
//!   pg/              PGDATA, owned by the PostgreSQL OS user
//!   run/             Unix sockets: PostgreSQL's and pgmr.sock (the local channel)
//!   postgres.log     PostgreSQL's stderr
//! ```

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Identity {
    pub cluster_id: String,
    /// Given by the meta group when the node joined (1 for the node that bootstrapped it);
    /// also this node's id in the meta group.
    pub node_id: u64,
}

#[derive(Debug, Clone)]
pub struct DataDir {
    pub root: PathBuf,
}

impl DataDir {
    /// Creates the directory if needed and proves it is writable, so a bad path fails at once
    /// with one line instead of deep inside initdb.
    pub fn prepare(root: &Path) -> Result<DataDir> {
        fs::create_dir_all(root)
            .with_context(|| format!("cannot create data dir {}", root.display()))?;
        let root = fs::canonicalize(root)
            .with_context(|| format!("cannot resolve data dir {}", root.display()))?;
        let probe = root.join(".pgmr-write-probe");
        fs::write(&probe, b"ok")
            .with_context(|| format!("data dir {} is not writable", root.display()))?;
        let _ = fs::remove_file(&probe);
        // Others (the PostgreSQL OS user) must traverse into pg/ and run/, but not list.
        fs::set_permissions(&root, fs::Permissions::from_mode(0o711))
            .with_context(|| format!("cannot set permissions on {}", root.display()))?;
        fs::create_dir_all(root.join("run"))?;
        Ok(DataDir { root })
    }

    pub fn pgdata(&self) -> PathBuf {
        pgdata_in(&self.root)
    }
    pub fn run_dir(&self) -> PathBuf {
        self.root.join("run")
    }
    pub fn socket(&self) -> PathBuf {
        self.run_dir().join("pgmr.sock")
    }
    pub fn pg_log(&self) -> PathBuf {
        self.root.join("postgres.log")
    }
    fn identity_path(&self) -> PathBuf {
        self.root.join("node.json")
    }
    pub fn secret_path(&self) -> PathBuf {
        self.root.join("cluster-secret")
    }

    pub fn load_identity(&self) -> Result<Option<Identity>> {
        let path = self.identity_path();
        match fs::read(&path) {
            Ok(bytes) => {
                Ok(Some(serde_json::from_slice(&bytes).with_context(|| {
                    format!("{} is corrupt", path.display())
                })?))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    }

    /// Atomic replace: write a temporary file, fsync, rename.
    pub fn save_identity(&self, id: &Identity) -> Result<()> {
        let path = self.identity_path();
        let tmp = path.with_extension("json.tmp");
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(id)?)?;
        f.sync_all()?;
        fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
        Ok(())
    }

    /// The cluster secret: from `--secret-file` (copied into the data dir so restarts need no
    /// flag), else the data dir's own copy, else — only when bootstrapping — a fresh one.
    pub fn secret(&self, flag: Option<&Path>, bootstrapping: bool) -> Result<Vec<u8>> {
        let own = self.secret_path();
        if let Some(file) = flag {
            let s = read_secret(file)?;
            if fs::read(&own).ok().as_deref() != Some(s.as_slice()) {
                write_private(&own, &s)?;
            }
            return Ok(s);
        }
        if own.exists() {
            return read_secret(&own);
        }
        if !bootstrapping {
            bail!(
                "joining a cluster needs --secret-file (the first node keeps its secret in \
                 DATA_DIR/cluster-secret)"
            );
        }
        let mut raw = [0u8; 32];
        getrandom::fill(&mut raw).context("cannot read random bytes")?;
        let s = mr_wire::auth::to_hex(&raw).into_bytes();
        write_private(&own, &s)?;
        tracing::info!(path = %own.display(), "generated a new cluster secret");
        Ok(s)
    }
}

fn read_secret(path: &Path) -> Result<Vec<u8>> {
    let raw =
        fs::read(path).with_context(|| format!("cannot read secret file {}", path.display()))?;
    let s = String::from_utf8_lossy(&raw).trim().as_bytes().to_vec();
    if s.len() < 16 {
        bail!(
            "secret file {} must hold at least 16 characters",
            path.display()
        );
    }
    Ok(s)
}

pub fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    Ok(())
}

use std::os::unix::fs::OpenOptionsExt;

/// Random hex id (cluster ids, nonces).
pub fn random_hex(bytes: usize) -> Result<String> {
    let mut raw = vec![0u8; bytes];
    getrandom::fill(&mut raw).context("cannot read random bytes")?;
    Ok(mr_wire::auth::to_hex(&raw))
}

/// PostgreSQL's data directory inside the pgmr data directory `root`.
pub fn pgdata_in(root: &Path) -> PathBuf {
    root.join("pg")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_round_trips_and_secret_is_private() {
        let tmp = tempfile::tempdir().unwrap();
        let dd = DataDir::prepare(&tmp.path().join("n1")).unwrap();
        assert_eq!(dd.load_identity().unwrap(), None);
        let id = Identity {
            cluster_id: "c".into(),
            node_id: 1,
        };
        dd.save_identity(&id).unwrap();
        assert_eq!(dd.load_identity().unwrap(), Some(id));
        assert!(
            dd.secret(None, false).is_err(),
            "a joiner without a secret is refused"
        );
        let s = dd.secret(None, true).unwrap();
        assert_eq!(
            dd.secret(None, false).unwrap(),
            s,
            "the generated secret is reused"
        );
        let mode = fs::metadata(dd.secret_path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn unwritable_data_dir_is_refused() {
        let err = DataDir::prepare(Path::new("/proc/pgmr-cannot-be-here")).unwrap_err();
        assert!(format!("{err:#}").contains("/proc/pgmr-cannot-be-here"));
    }
}
