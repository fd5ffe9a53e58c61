//! The DB Console and `/metrics`, served by every node over HTTP (axum).
//!
//! Read-only views of what the node already knows — the answers its local channel gives
//! psql's `multiregion.*` functions, and the SQL gateway's statement latencies — rendered on
//! the server as HTML and SVG, so the pages need no script from a registry we cannot reach.
//! Nothing secret is shown: addresses and states, never the cluster secret or credentials.

mod console;
mod metrics;

use crate::node::Node;
use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Binds the console's port: a busy port stops `pgmr start` with one line.
pub async fn bind(addr: &str) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen for the console on {addr}"))
}

/// Serves the console until `stop`.
pub async fn serve(node: Arc<Node>, listener: TcpListener, stop: CancellationToken) {
    let app = Router::new()
        .route("/", get(overview))
        .route("/network", get(network))
        .route("/sql", get(sql))
        .route("/ranges", get(ranges))
        .route("/metrics", get(prometheus))
        .route("/health", get(health))
        .with_state(node);
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await;
    if let Err(e) = served {
        tracing::error!("console: {e}");
    }
}

type Shared = State<Arc<Node>>;

async fn overview(State(node): Shared) -> Html<String> {
    Html(console::overview(&node).await)
}

async fn network(State(node): Shared) -> Html<String> {
    Html(console::network(&node).await)
}

async fn sql(State(node): Shared) -> Html<String> {
    Html(console::sql(&node).await)
}

async fn ranges(State(node): Shared) -> Html<String> {
    Html(console::ranges(&node).await)
}

async fn prometheus(State(node): Shared) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics::render(&node).await,
    )
        .into_response()
}

/// 200 once this node's PostgreSQL serves and the node is a live member; 503 before.
async fn health(State(node): Shared) -> Response {
    if node.healthy() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n").into_response()
    }
}
