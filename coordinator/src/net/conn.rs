//! One authenticated peer connection: handshake, then a delayed writer and a reader.

use super::link::{Link, Route};
use super::{Handler, PeerInfo};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use mr_topology::Locality;
use mr_wire::auth::{self, Role};
use mr_wire::peer::{Hello, PeerFrame, PeerRequest, PeerResponse};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::{Framed, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why an RPC failed. `Closed` and `Timeout` may succeed on retry; the caller decides.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RpcError {
    #[error("cannot connect to {addr}: {reason}")]
    Dial { addr: String, reason: String },
    #[error("{addr} refused the connection: {reason}")]
    Handshake { addr: String, reason: String },
    #[error("{addr} did not answer within {} ms", after.as_millis())]
    Timeout { addr: String, after: Duration },
    #[error("connection to {addr} closed: {reason}")]
    Closed { addr: String, reason: String },
}

type Wire = Framed<TcpStream, LengthDelimitedCodec>;

fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .max_frame_length(mr_wire::MAX_FRAME_LEN)
        .new_codec()
}

fn encode(frame: &PeerFrame) -> Bytes {
    Bytes::from(serde_json::to_vec(frame).expect("peer frames always serialize"))
}

async fn read_frame(wire: &mut Wire) -> Result<PeerFrame, String> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, wire.next()).await {
        Err(_) => Err("handshake timed out".into()),
        Ok(None) => Err("connection closed during the handshake".into()),
        Ok(Some(Err(e))) => Err(e.to_string()),
        Ok(Some(Ok(buf))) => serde_json::from_slice(&buf).map_err(|e| format!("bad frame: {e}")),
    }
}

async fn write_frame(wire: &mut Wire, frame: &PeerFrame) -> Result<(), String> {
    wire.send(encode(frame)).await.map_err(|e| e.to_string())
}

fn check_hello(own: &Hello, peer: &Hello) -> Result<(), String> {
    if peer.protocol_version != mr_wire::PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {} is not ours ({})",
            peer.protocol_version,
            mr_wire::PROTOCOL_VERSION
        ));
    }
    if let (Some(a), Some(b)) = (&own.cluster_id, &peer.cluster_id) {
        if a != b {
            return Err(format!("node belongs to cluster {b}, this is cluster {a}"));
        }
    }
    Locality::parse(&peer.locality).map_err(|e| format!("bad locality: {e}"))?;
    Ok(())
}

pub struct Conn {
    addr: String,
    peer: PeerInfo,
    route: Arc<Route>,
    link: Link,
    out: mpsc::UnboundedSender<Bytes>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
}

/// State the reader task and callers share.
struct Shared {
    pending: Mutex<HashMap<u64, oneshot::Sender<PeerResponse>>>,
    open: AtomicBool,
    close_reason: Mutex<Option<String>>,
    /// Cancelled to close the connection from this side: the reader and writer stop, which
    /// drops both halves of the socket.
    shutdown: CancellationToken,
}

impl Shared {
    fn close(&self, reason: String) {
        self.open.store(false, Ordering::SeqCst);
        self.close_reason
            .lock()
            .expect("reason lock")
            .get_or_insert(reason);
        // Dropping the senders wakes every waiting caller with `Closed`.
        self.pending.lock().expect("pending lock").clear();
    }
}

impl Conn {
    /// Dialer side: send Hello, read Hello, prove, then read the acceptor's proof (or refusal).
    pub async fn dial(
        stream: TcpStream,
        addr: &str,
        secret: &[u8],
        hello: Hello,
        nonce: String,
        link: &Link,
        handler: Option<Arc<dyn Handler>>,
    ) -> Result<Conn, RpcError> {
        let _ = stream.set_nodelay(true);
        let mut wire = Framed::new(stream, codec());
        let refused = |reason: String| RpcError::Handshake {
            addr: addr.to_string(),
            reason,
        };
        write_frame(&mut wire, &PeerFrame::Hello(hello.clone()))
            .await
            .map_err(refused)?;
        let peer = match read_frame(&mut wire).await.map_err(refused)? {
            PeerFrame::Hello(h) => h,
            other => return Err(refused(format!("expected Hello, got {other:?}"))),
        };
        check_hello(&hello, &peer).map_err(refused)?;
        let proof = auth::prove(
            secret,
            Role::Dialer,
            nonce.as_bytes(),
            peer.nonce.as_bytes(),
        );
        write_frame(&mut wire, &PeerFrame::Proof { mac: proof })
            .await
            .map_err(refused)?;
        match read_frame(&mut wire).await.map_err(refused)? {
            PeerFrame::Proof { mac } => {
                if !auth::verify(
                    secret,
                    Role::Acceptor,
                    peer.nonce.as_bytes(),
                    nonce.as_bytes(),
                    &mac,
                ) {
                    return Err(refused("the peer does not know the cluster secret".into()));
                }
            }
            PeerFrame::Response {
                body: PeerResponse::Error { message, .. },
                ..
            } => return Err(refused(message)),
            other => return Err(refused(format!("expected Proof, got {other:?}"))),
        }
        Ok(Conn::start(wire, addr.to_string(), &peer, link, handler))
    }

    /// Acceptor side: verifies the dialer's proof before proving itself, so a dialer with the
    /// wrong secret learns nothing and gets a readable refusal.
    pub async fn accept(
        stream: TcpStream,
        secret: &[u8],
        hello: Hello,
        nonce: String,
        link: &Link,
        handler: Option<Arc<dyn Handler>>,
    ) -> Result<Conn, String> {
        let _ = stream.set_nodelay(true);
        let addr = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let mut wire = Framed::new(stream, codec());
        write_frame(&mut wire, &PeerFrame::Hello(hello.clone())).await?;
        let peer = match read_frame(&mut wire).await? {
            PeerFrame::Hello(h) => h,
            other => return Err(format!("expected Hello, got {other:?}")),
        };
        let verdict = match check_hello(&hello, &peer) {
            Err(e) => Err(e),
            Ok(()) => match read_frame(&mut wire).await? {
                PeerFrame::Proof { mac } => {
                    if auth::verify(
                        secret,
                        Role::Dialer,
                        peer.nonce.as_bytes(),
                        nonce.as_bytes(),
                        &mac,
                    ) {
                        Ok(())
                    } else {
                        Err("authentication failed: the cluster secret differs".to_string())
                    }
                }
                other => Err(format!("expected Proof, got {other:?}")),
            },
        };
        if let Err(reason) = verdict {
            let refusal = PeerFrame::Response {
                id: 0,
                body: PeerResponse::Error {
                    message: reason.clone(),
                    retryable: false,
                },
            };
            let _ = write_frame(&mut wire, &refusal).await;
            return Err(reason);
        }
        let proof = auth::prove(
            secret,
            Role::Acceptor,
            nonce.as_bytes(),
            peer.nonce.as_bytes(),
        );
        write_frame(&mut wire, &PeerFrame::Proof { mac: proof }).await?;
        Ok(Conn::start(wire, addr, &peer, link, handler))
    }

    fn start(
        wire: Wire,
        addr: String,
        peer: &Hello,
        link: &Link,
        handler: Option<Arc<dyn Handler>>,
    ) -> Conn {
        let locality = Locality::parse(&peer.locality).expect("checked in check_hello");
        let route = Arc::new(link.route(peer.node_id, locality.region()));
        let info = PeerInfo {
            node_id: peer.node_id,
            locality: peer.locality.clone(),
        };
        let (sink, mut stream) = wire.split();
        let (out, rx) = mpsc::unbounded_channel::<Bytes>();
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            open: AtomicBool::new(true),
            close_reason: Mutex::new(None),
            shutdown: CancellationToken::new(),
        });

        tokio::spawn(writer(sink, rx, shared.clone()));

        let reader_shared = shared.clone();
        let reader_out = out.clone();
        let reader_info = info.clone();
        let reader_link = link.clone();
        let reader_route = route.clone();
        tokio::spawn(async move {
            let reason = loop {
                let next = tokio::select! {
                    next = stream.next() => next,
                    _ = reader_shared.shutdown.cancelled() => break "closed by this node".to_string(),
                };
                let buf = match next {
                    None => break "peer closed the connection".to_string(),
                    Some(Err(e)) => break e.to_string(),
                    Some(Ok(buf)) => buf,
                };
                let frame: PeerFrame = match serde_json::from_slice(&buf) {
                    Ok(f) => f,
                    Err(e) => break format!("malformed frame: {e}"),
                };
                match frame {
                    PeerFrame::Request { id, body } => {
                        let Some(h) = handler.clone() else {
                            break "request on a connection that serves none".to_string();
                        };
                        let out = reader_out.clone();
                        let info = reader_info.clone();
                        let link = reader_link.clone();
                        let route = reader_route.clone();
                        tokio::spawn(async move {
                            let body = h.handle(info, body).await;
                            let frame = encode(&PeerFrame::Response { id, body });
                            link.dispatch(&route, frame, &out);
                        });
                    }
                    PeerFrame::Response {
                        id: 0,
                        body: PeerResponse::Error { message, .. },
                    } => {
                        break message;
                    }
                    PeerFrame::Response { id, body } => {
                        let tx = reader_shared
                            .pending
                            .lock()
                            .expect("pending lock")
                            .remove(&id);
                        if let Some(tx) = tx {
                            let _ = tx.send(body);
                        }
                    }
                    PeerFrame::Hello(_) | PeerFrame::Proof { .. } => {
                        break "handshake frame after the handshake".to_string();
                    }
                }
            };
            tracing::debug!(peer = ?reader_info, "peer connection closed: {reason}");
            reader_shared.close(reason);
        });

        Conn {
            addr,
            peer: info,
            route,
            link: link.clone(),
            out,
            shared,
            next_id: AtomicU64::new(1),
        }
    }

    pub fn peer(&self) -> &PeerInfo {
        &self.peer
    }

    /// Closes the connection; calls waiting on it fail with `Closed`.
    pub fn close(&self) {
        self.shared.shutdown.cancel();
        self.shared.close("closed by this node".into());
    }

    pub fn is_open(&self) -> bool {
        self.shared.open.load(Ordering::SeqCst)
    }

    fn closed(&self) -> RpcError {
        let reason = self
            .shared
            .close_reason
            .lock()
            .expect("reason lock")
            .clone()
            .unwrap_or_else(|| "closed".into());
        RpcError::Closed {
            addr: self.addr.clone(),
            reason,
        }
    }

    pub async fn call(
        &self,
        req: PeerRequest,
        timeout: Duration,
    ) -> Result<PeerResponse, RpcError> {
        if !self.is_open() {
            return Err(self.closed());
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.shared
            .pending
            .lock()
            .expect("pending lock")
            .insert(id, tx);
        if !self.is_open() {
            // Closed after the check above: `close` may have cleared `pending` before our
            // insert, and nobody would wake us.
            self.shared
                .pending
                .lock()
                .expect("pending lock")
                .remove(&id);
            return Err(self.closed());
        }
        let frame = encode(&PeerFrame::Request { id, body: req });
        // If the writer is gone the reader has closed the connection too, which drops our
        // pending sender: the wait below then reports `Closed`.
        self.link.dispatch(&self.route, frame, &self.out);
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(_)) => Err(self.closed()),
            Err(_) => {
                self.shared
                    .pending
                    .lock()
                    .expect("pending lock")
                    .remove(&id);
                Err(RpcError::Timeout {
                    addr: self.addr.clone(),
                    after: timeout,
                })
            }
        }
    }
}

/// Writes frames as the link releases them.
async fn writer(
    mut sink: futures::stream::SplitSink<Wire, Bytes>,
    mut rx: mpsc::UnboundedReceiver<Bytes>,
    shared: Arc<Shared>,
) {
    loop {
        let frame = tokio::select! {
            frame = rx.recv() => frame,
            _ = shared.shutdown.cancelled() => None,
        };
        let Some(frame) = frame else { return };
        if let Err(e) = sink.send(frame).await {
            shared.close(format!("write failed: {e}"));
            return;
        }
    }
}
