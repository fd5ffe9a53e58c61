//! Length-prefixed JSON frames, and the blocking client the extension uses.

use crate::local::{LocalRequest, LocalResponse};
use crate::MAX_LOCAL_FRAME_LEN;
use serde::{de::DeserializeOwned, Serialize};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {0} bytes exceeds the limit of {MAX_LOCAL_FRAME_LEN} bytes")]
    TooLong(usize),
    #[error("malformed message: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Serializes `msg` as one frame: length prefix included.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(msg)?;
    if body.len() > MAX_LOCAL_FRAME_LEN {
        return Err(FrameError::TooLong(body.len()));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Parses a frame body (without its length prefix).
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    Ok(serde_json::from_slice(body)?)
}

/// Why a local call failed. The extension maps each variant to a SQLSTATE.
#[derive(Debug, thiserror::Error)]
pub enum LocalCallError {
    /// Nothing listens on the socket: pgmr is not running (or the path is wrong).
    #[error("could not connect to pgmr at \"{path}\": {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    /// pgmr accepted but did not answer in time.
    #[error("pgmr at \"{path}\" did not answer within {} ms", timeout.as_millis())]
    Timeout { path: String, timeout: Duration },
    /// The connection broke, or pgmr sent something unreadable.
    #[error("lost the connection to pgmr at \"{path}\": {source}")]
    Broken { path: String, source: FrameError },
    /// The caller asked to stop (e.g. a query cancel), reported by the `tick` callback.
    #[error("interrupted")]
    Interrupted,
}

/// How often a blocked call wakes to run its `tick` callback (e.g. to honour a query cancel).
const TICK: Duration = Duration::from_millis(50);

/// Sends one request to pgmr's local socket on a connection of its own and waits for its
/// response, for at most `timeout`.
///
/// `tick` runs every 50 ms while waiting; returning `false` abandons the call. A backend uses it
/// to honour query cancellation, so a stuck pgmr can never hang a PostgreSQL backend.
pub fn call_local(
    path: &Path,
    req: &LocalRequest,
    timeout: Duration,
    tick: impl FnMut() -> bool,
) -> Result<LocalResponse, LocalCallError> {
    LocalClient::default().call(path, req, timeout, tick)
}

/// A connection to pgmr's local socket kept from one call to the next: a backend connects
/// once instead of once per statement and commit (connect, accept and close cost both sides
/// more than the request itself).
///
/// Kept only after a call that got its whole response: a call that fails, times out or is
/// abandoned (including by a panic unwinding out of `tick`, which drops the stream taken out
/// here) closes its connection, so a late response can never be read as the next call's.
#[derive(Debug, Default)]
pub struct LocalClient {
    kept: Option<(PathBuf, UnixStream)>,
}

impl LocalClient {
    /// Sends `req` and waits for its response, as [`call_local`], reusing the kept connection
    /// when it is to `path` and still open.
    pub fn call(
        &mut self,
        path: &Path,
        req: &LocalRequest,
        timeout: Duration,
        mut tick: impl FnMut() -> bool,
    ) -> Result<LocalResponse, LocalCallError> {
        let p = || path.display().to_string();
        let deadline = Instant::now() + timeout;
        let broken = |source: FrameError| LocalCallError::Broken { path: p(), source };
        let frame = encode(req).map_err(broken)?;
        let kept = self
            .kept
            .take()
            .filter(|(at, stream)| at == path && still_open(stream));
        let reused = kept.is_some();
        let mut stream = match kept {
            Some((_, stream)) => stream,
            None => connect(path)?,
        };
        let mut sent = send(&mut stream, &frame, timeout);
        if reused && matches!(&sent, Err(e) if closed_by_peer(e)) {
            // pgmr closed the kept connection (it restarted, or dropped idle ones) before
            // the request went out: nothing was delivered, so a new connection may send it.
            stream = connect(path)?;
            sent = send(&mut stream, &frame, timeout);
        }
        sent.map_err(|e| {
            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                LocalCallError::Timeout { path: p(), timeout }
            } else {
                broken(e.into())
            }
        })?;
        stream
            .set_read_timeout(Some(TICK))
            .map_err(|e| broken(e.into()))?;

        let mut buf: Vec<u8> = Vec::new();
        let mut chunk = [0u8; 8192];
        loop {
            if buf.len() >= 4 {
                let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
                if len > MAX_LOCAL_FRAME_LEN {
                    return Err(broken(FrameError::TooLong(len)));
                }
                if buf.len() >= 4 + len {
                    let response = decode(&buf[4..4 + len]).map_err(broken)?;
                    if buf.len() == 4 + len {
                        self.kept = Some((path.to_path_buf(), stream));
                    }
                    return Ok(response);
                }
            }
            match stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(broken(FrameError::Io(std::io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "pgmr closed the connection before answering",
                    ))))
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(broken(e.into())),
            }
            if !tick() {
                return Err(LocalCallError::Interrupted);
            }
            if Instant::now() >= deadline {
                return Err(LocalCallError::Timeout { path: p(), timeout });
            }
        }
    }
}

fn connect(path: &Path) -> Result<UnixStream, LocalCallError> {
    UnixStream::connect(path).map_err(|source| LocalCallError::Connect {
        path: path.display().to_string(),
        source,
    })
}

fn send(stream: &mut UnixStream, frame: &[u8], timeout: Duration) -> std::io::Result<()> {
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(frame)
}

fn closed_by_peer(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::NotConnected
    )
}

/// Whether a kept connection is still usable: open, with nothing unread on it (pgmr sends
/// only responses, so anything waiting there is not for the next request).
fn still_open(stream: &UnixStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return false;
    }
    let mut byte = [0u8; 1];
    let open = matches!(
        (&*stream).read(&mut byte),
        Err(e) if e.kind() == ErrorKind::WouldBlock
    );
    open && stream.set_nonblocking(false).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::{LocalRequest, LocalResponse};
    use std::os::unix::net::UnixListener;

    fn socket_path(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("mr-wire-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("s.sock")
    }

    #[test]
    fn frames_round_trip() {
        let f = encode(&LocalRequest::ClusterRegions).unwrap();
        let len = u32::from_be_bytes([f[0], f[1], f[2], f[3]]) as usize;
        assert_eq!(len, f.len() - 4);
        let back: LocalRequest = decode(&f[4..]).unwrap();
        assert_eq!(back, LocalRequest::ClusterRegions);
    }

    #[test]
    fn call_without_listener_fails_to_connect_at_once() {
        let path = socket_path("none");
        let t = Instant::now();
        let err = call_local(
            &path,
            &LocalRequest::NodeInfo,
            Duration::from_secs(5),
            || true,
        )
        .unwrap_err();
        assert!(matches!(err, LocalCallError::Connect { .. }), "{err}");
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn call_to_a_silent_listener_times_out() {
        let path = socket_path("silent");
        let _listener = UnixListener::bind(&path).unwrap();
        let err = call_local(
            &path,
            &LocalRequest::NodeInfo,
            Duration::from_millis(300),
            || true,
        )
        .unwrap_err();
        assert!(matches!(err, LocalCallError::Timeout { .. }), "{err}");
    }

    #[test]
    fn tick_returning_false_abandons_the_call() {
        let path = socket_path("tick");
        let _listener = UnixListener::bind(&path).unwrap();
        let err = call_local(
            &path,
            &LocalRequest::NodeInfo,
            Duration::from_secs(30),
            || false,
        )
        .unwrap_err();
        assert!(matches!(err, LocalCallError::Interrupted), "{err}");
    }

    #[test]
    fn call_reads_a_response_split_across_writes() {
        let path = socket_path("split");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            read_request(&mut s);
            let frame = encode(&LocalResponse::error("x".repeat(20_000))).unwrap();
            let (a, b) = frame.split_at(3);
            s.write_all(a).unwrap();
            std::thread::sleep(Duration::from_millis(120));
            s.write_all(b).unwrap();
        });
        let resp = call_local(
            &path,
            &LocalRequest::NodeInfo,
            Duration::from_secs(5),
            || true,
        )
        .unwrap();
        server.join().unwrap();
        assert!(matches!(resp, LocalResponse::Error { message, .. } if message.len() == 20_000));
    }

    #[test]
    fn oversized_length_prefix_is_refused_without_buffering() {
        let path = socket_path("huge");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(&u32::MAX.to_be_bytes()).unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let err = call_local(
            &path,
            &LocalRequest::NodeInfo,
            Duration::from_secs(5),
            || true,
        )
        .unwrap_err();
        server.join().unwrap();
        assert!(matches!(
            err,
            LocalCallError::Broken {
                source: FrameError::TooLong(_),
                ..
            }
        ));
    }

    /// Reads one request frame off a server-side connection.
    fn read_request(s: &mut std::os::unix::net::UnixStream) {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut body).unwrap();
    }

    /// Serves `n` requests on one accepted connection, answering each with its index.
    fn answer(s: &mut std::os::unix::net::UnixStream, n: usize) {
        for i in 0..n {
            read_request(s);
            s.write_all(&encode(&LocalResponse::error(i.to_string())).unwrap())
                .unwrap();
        }
    }

    fn message(r: LocalResponse) -> String {
        match r {
            LocalResponse::Error { message, .. } => message,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_kept_connection_carries_the_next_call() {
        let path = socket_path("kept");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            answer(&mut s, 3);
            listener.set_nonblocking(true).unwrap();
            listener.accept().is_ok()
        });
        let mut client = LocalClient::default();
        for i in 0..3 {
            let r = client
                .call(
                    &path,
                    &LocalRequest::NodeInfo,
                    Duration::from_secs(5),
                    || true,
                )
                .unwrap();
            assert_eq!(message(r), i.to_string());
        }
        assert!(!server.join().unwrap(), "a second connection was made");
    }

    #[test]
    fn a_connection_closed_by_pgmr_is_replaced_before_the_next_call() {
        let path = socket_path("closed");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            answer(&mut s, 1);
            drop(s);
            let (mut s, _) = listener.accept().unwrap();
            answer(&mut s, 1);
        });
        let mut client = LocalClient::default();
        let call = |c: &mut LocalClient| {
            c.call(
                &path,
                &LocalRequest::NodeInfo,
                Duration::from_secs(5),
                || true,
            )
        };
        assert_eq!(message(call(&mut client).unwrap()), "0");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(message(call(&mut client).unwrap()), "0");
        server.join().unwrap();
    }

    #[test]
    fn an_abandoned_call_leaves_no_connection_to_reuse() {
        let path = socket_path("abandoned");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            // The first request is read but answered only after the caller gave up.
            let (mut first, _) = listener.accept().unwrap();
            read_request(&mut first);
            let (mut second, _) = listener.accept().unwrap();
            let _ = first.write_all(&encode(&LocalResponse::error("late")).unwrap());
            answer(&mut second, 1);
        });
        let mut client = LocalClient::default();
        let err = client
            .call(
                &path,
                &LocalRequest::NodeInfo,
                Duration::from_secs(5),
                || false,
            )
            .unwrap_err();
        assert!(matches!(err, LocalCallError::Interrupted), "{err}");
        let r = client
            .call(
                &path,
                &LocalRequest::NodeInfo,
                Duration::from_secs(5),
                || true,
            )
            .unwrap();
        assert_eq!(message(r), "0", "the abandoned call's late answer was read");
        server.join().unwrap();
    }
}
