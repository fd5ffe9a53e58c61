//! Inter-node transport: every message between nodes goes through here.
//!
//! One TCP connection per (dialer, peer address), authenticated by a mutual HMAC handshake
//! over the cluster secret, then carrying id-tagged requests and responses in both directions
//! so that independent RPCs (heartbeats today; Raft and range traffic later) share it without
//! waiting on each other. Each connection's writer is the **link**: it delays every outgoing
//! frame by the simulated one-way latency to the peer's region ([`link`]), which is also where
//! fault injection (drops, extra delay, partitions) will be applied.

mod conn;
pub mod link;
pub mod proxy;

pub use conn::RpcError;

use crate::identity::random_hex;
use conn::Conn;
use futures::future::BoxFuture;
use link::Link;
use mr_topology::RttMatrix;
use mr_wire::peer::{PeerRequest, PeerResponse};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

/// What the transport tells a request handler about the peer that sent the request.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub node_id: Option<u64>,
    pub locality: String,
}

/// Serves requests arriving from peers.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, peer: PeerInfo, req: PeerRequest) -> BoxFuture<'static, PeerResponse>;
}

/// Who this node is, as announced in handshakes. It changes once, when the node joins.
#[derive(Debug, Clone)]
pub struct SelfView {
    pub cluster_id: Option<String>,
    pub node_id: Option<u64>,
    pub locality: mr_topology::Locality,
}

#[derive(Clone)]
pub struct Transport {
    inner: Arc<Inner>,
}

struct Inner {
    secret: Vec<u8>,
    me: RwLock<SelfView>,
    link: Link,
    conns: Mutex<HashMap<String, DialSlot>>,
    handler: OnceLock<Arc<dyn Handler>>,
}

const DIAL_TIMEOUT: Duration = Duration::from_secs(3);

/// The connection to one address, if any; locked while dialling it.
type DialSlot = Arc<tokio::sync::Mutex<Option<Arc<Conn>>>>;

impl Transport {
    pub fn new(secret: Vec<u8>, me: SelfView, matrix: RttMatrix) -> Transport {
        let link = Link::new(me.locality.region().to_string(), matrix);
        Transport {
            inner: Arc::new(Inner {
                secret,
                me: RwLock::new(me),
                link,
                conns: Mutex::new(HashMap::new()),
                handler: OnceLock::new(),
            }),
        }
    }

    /// The link policy: simulated latency and injected faults.
    pub fn link(&self) -> &Link {
        &self.inner.link
    }

    pub fn set_handler(&self, h: Arc<dyn Handler>) {
        let _ = self.inner.handler.set(h);
    }

    /// Records the identity this node got by joining, and closes the connections it opened
    /// before: their handshakes announced no node id, so peers could not tell whose they are
    /// (and per-peer link faults would not apply to them). Later calls redial as this node.
    pub async fn set_identity(&self, cluster_id: String, node_id: u64) {
        {
            let mut me = self.inner.me.write().expect("self view lock");
            me.cluster_id = Some(cluster_id);
            me.node_id = Some(node_id);
        }
        let slots: Vec<DialSlot> = {
            let mut conns = self.inner.conns.lock().expect("conns lock");
            conns.drain().map(|(_, slot)| slot).collect()
        };
        for slot in slots {
            if let Some(c) = slot.lock().await.take() {
                c.close();
            }
        }
    }

    fn hello(&self) -> anyhow::Result<(mr_wire::peer::Hello, String)> {
        let me = self.inner.me.read().expect("self view lock").clone();
        let nonce = random_hex(32)?;
        Ok((
            mr_wire::peer::Hello {
                protocol_version: mr_wire::PROTOCOL_VERSION,
                cluster_id: me.cluster_id,
                node_id: me.node_id,
                locality: me.locality.to_string(),
                nonce: nonce.clone(),
            },
            nonce,
        ))
    }

    /// Accepts peers until the listener fails; each connection runs on its own tasks.
    pub async fn serve(self, listener: TcpListener) {
        loop {
            match listener.accept().await {
                Ok((stream, addr)) => {
                    let t = self.clone();
                    tokio::spawn(async move {
                        if let Err(e) = t.accept(stream).await {
                            tracing::warn!(%addr, "refused an inter-node connection: {e}");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    async fn accept(&self, stream: TcpStream) -> anyhow::Result<()> {
        let (hello, nonce) = self.hello()?;
        let handler = self.inner.handler.get().cloned();
        let conn = Conn::accept(
            stream,
            &self.inner.secret,
            hello,
            nonce,
            &self.inner.link,
            handler,
        )
        .await
        .map_err(anyhow::Error::msg)?;
        tracing::debug!(peer = ?conn.peer(), "accepted a peer connection");
        Ok(())
    }

    /// Sends `req` to the node at `addr` and waits for its response, dialling if needed.
    pub async fn call(
        &self,
        addr: &str,
        req: PeerRequest,
        timeout: Duration,
    ) -> Result<PeerResponse, RpcError> {
        // A connection that closed is replaced by the next call's dial.
        self.conn(addr).await?.call(req, timeout).await
    }

    /// The open connection to `addr`, dialling it if there is none. Each address has its own
    /// slot, held across the dial: concurrent callers share one connection instead of racing
    /// to create two (the loser of such a race would live on, unused, holding both ends), and
    /// a slow dial to one peer does not hold up calls to others.
    async fn conn(&self, addr: &str) -> Result<Arc<Conn>, RpcError> {
        let slot = self
            .inner
            .conns
            .lock()
            .expect("conns lock")
            .entry(addr.to_string())
            .or_default()
            .clone();
        let mut slot = slot.lock().await;
        if let Some(c) = slot.as_ref().filter(|c| c.is_open()) {
            return Ok(c.clone());
        }
        let dial_error = |reason: String| RpcError::Dial {
            addr: addr.to_string(),
            reason,
        };
        let stream = tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| dial_error(format!("no answer within {} s", DIAL_TIMEOUT.as_secs())))?
            .map_err(|e| dial_error(e.to_string()))?;
        let (hello, nonce) = self.hello().map_err(|e| dial_error(e.to_string()))?;
        let handler = self.inner.handler.get().cloned();
        let conn = Conn::dial(
            stream,
            addr,
            &self.inner.secret,
            hello,
            nonce,
            &self.inner.link,
            handler,
        )
        .await?;
        let conn = Arc::new(conn);
        *slot = Some(conn.clone());
        Ok(conn)
    }
}
