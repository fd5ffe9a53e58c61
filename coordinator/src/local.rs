//! The local channel: a Unix socket in the node's run directory, for the extension's backends
//! and for `pgmr status`/`pgmr demo`. Requests are answered in turn, one response each; a backend
//! keeps its connection between calls (`mr_wire::framing::LocalClient`).
//!
//! Only the PostgreSQL OS user, pgmr's own user and root may connect: the socket is mode 0600,
//! owned by the PostgreSQL user, and each connection's peer credentials are checked too.

use crate::node::Node;
use anyhow::{Context, Result};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use mr_wire::local::{LocalRequest, LocalResponse};
use nix::unistd::Uid;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{UnixListener, UnixStream};
use tokio_util::codec::{Framed, LengthDelimitedCodec};

pub fn bind(path: &Path, pg_uid: Option<Uid>) -> Result<UnixListener> {
    // A socket file left by a killed pgmr would make bind fail; nobody can be serving it,
    // since we hold the RPC port by now.
    let _ = fs::remove_file(path);
    let listener =
        UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
    if let Some(uid) = pg_uid {
        std::os::unix::fs::chown(path, Some(uid.as_raw()), None)?;
    }
    Ok(listener)
}

pub async fn serve(listener: UnixListener, node: Arc<Node>, pg_uid: Option<Uid>) {
    let allowed = move |uid: u32| {
        uid == 0 || uid == Uid::effective().as_raw() || Some(uid) == pg_uid.map(|u| u.as_raw())
    };
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("local accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        match stream.peer_cred() {
            Ok(cred) if allowed(cred.uid()) => {}
            Ok(cred) => {
                tracing::warn!(
                    uid = cred.uid(),
                    "refused a local connection from another user"
                );
                continue;
            }
            Err(e) => {
                tracing::warn!("cannot read local peer credentials: {e}");
                continue;
            }
        }
        let node = node.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(stream, &node).await {
                tracing::debug!("local request failed: {e:#}");
            }
        });
    }
}

/// Answers a connection's requests in turn. The first must come within 5 s; after that the
/// connection is a backend's, kept between its statements, and waits as long as it likes.
async fn answer(stream: UnixStream, node: &Node) -> Result<()> {
    let codec = LengthDelimitedCodec::builder()
        .max_frame_length(mr_wire::MAX_LOCAL_FRAME_LEN)
        .new_codec();
    let mut wire = Framed::new(stream, codec);
    let mut frame = tokio::time::timeout(Duration::from_secs(5), wire.next())
        .await
        .context("no request within 5 s")?
        .context("closed before sending a request")??;
    loop {
        let response = match serde_json::from_slice::<LocalRequest>(&frame) {
            Ok(req) => node.local_request(req).await,
            Err(e) => LocalResponse::error(format!("malformed request: {e}")),
        };
        let sent = wire.send(Bytes::from(serde_json::to_vec(&response)?)).await;
        if sent.is_err() {
            // A backend that replicated a write and is gone before hearing so will not commit
            // it locally: the range must not serve writes until its applier has applied it.
            if let LocalResponse::Replicated { entries } = response {
                for (range_id, index) in entries {
                    node.abandon_replicated(range_id, index);
                }
            }
        }
        sent?;
        frame = match wire.next().await {
            Some(next) => next?,
            None => return Ok(()),
        };
    }
}
