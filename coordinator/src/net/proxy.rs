//! `pgmr debug delay-proxy`: relays TCP connections with the simulated WAN's delay, through
//! the same [`DelayLine`] as pgmr's own links, so that a program that does not speak through
//! pgmr (a PostgreSQL standby streaming from its primary, in the baseline benchmark) sees the
//! same round trips as pgmr's nodes.

use super::link::DelayLine;
use anyhow::{Context, Result};
use bytes::{Bytes, BytesMut};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// Accepts connections on `listen` and relays each to `to`, every byte in either direction
/// delayed by half of `rtt`, in order. Runs until the process is stopped.
pub async fn delay_proxy(listen: SocketAddr, to: SocketAddr, rtt: Duration) -> Result<()> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let line = DelayLine::start();
    let one_way = rtt / 2;
    println!("relaying {listen} to {to}, {rtt:?} round trip");
    loop {
        let (inbound, from) = listener.accept().await?;
        let line = line.clone();
        tokio::spawn(async move {
            let outbound = match TcpStream::connect(to).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(%from, %to, "delay proxy cannot connect: {e}");
                    return;
                }
            };
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            let (ir, iw) = inbound.into_split();
            let (or, ow) = outbound.into_split();
            tokio::join!(
                pump(ir, ow, one_way, line.clone()),
                pump(or, iw, one_way, line)
            );
        });
    }
}

/// Copies `r` to `w`, each chunk released by the delay line `one_way` after it was read; an
/// empty chunk marks the end (the writer then shuts its half down).
async fn pump(mut r: OwnedReadHalf, mut w: OwnedWriteHalf, one_way: Duration, line: DelayLine) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    let writer = tokio::spawn(async move {
        while let Some(chunk) = rx.recv().await {
            if chunk.is_empty() || w.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
    });
    loop {
        let mut buf = BytesMut::with_capacity(64 * 1024);
        let n = r.read_buf(&mut buf).await.unwrap_or(0);
        line.push(Instant::now() + one_way, buf.freeze(), tx.clone());
        if n == 0 {
            break;
        }
    }
    let _ = writer.await;
}
