//! An HTTP/1 listener for the binaries' own endpoints (metrics, health, admin) whose every
//! connection is bounded in time and whose connections are bounded in number: otherwise a
//! half-sent request holds a socket for ever, and a thousand of them starve `/healthz` once the
//! process runs out of file descriptors (docs/decisions/0024-bounded-outside-input.md).
//!
//! - **Header-read timeout** ([`ListenerLimits::header_read_timeout`]): a request's head must
//!   arrive within it, else the connection is closed. hyper starts this timer whenever the
//!   connection waits for a request head, so it is also the **idle timeout** of a kept-alive
//!   connection between requests.
//! - **Connection bound** ([`ListenerLimits::max_connections`]): when a new connection would
//!   exceed it, the oldest connection that has not yet delivered a request head is closed (else
//!   the oldest connection), so new clients (a kubelet probe) are served while slow ones wait
//!   their turn to be dropped, and the process keeps file descriptors for its own work.
//! - **Graceful stop**: on `shutdown` the listener stops accepting, connections finish their
//!   request in flight (hyper's graceful shutdown) within [`ListenerLimits::shutdown_grace`].
//!
//! Concurrency: one accept task; one task per connection. The connection table is a mutex held
//! only to insert, remove or pick a connection to close.

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tower::Service;

/// Default [`ListenerLimits::header_read_timeout`].
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`ListenerLimits::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Default [`ListenerLimits::shutdown_grace`].
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// The bounds of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// Longest wait for a request's head, and for the next request on a kept-alive connection.
    /// Default [`DEFAULT_HEADER_READ_TIMEOUT`] (10 s).
    pub header_read_timeout: Duration,
    /// Most connections open at once (at least 1). Default [`DEFAULT_MAX_CONNECTIONS`] (256).
    pub max_connections: usize,
    /// Longest wait for requests in flight at shutdown. Default [`DEFAULT_SHUTDOWN_GRACE`] (2 s).
    pub shutdown_grace: Duration,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
        }
    }
}

/// One open connection, as the table sees it.
struct Entry {
    opened: Instant,
    /// A request head arrived on it.
    served: Arc<AtomicBool>,
    /// Notified to close it.
    close: Arc<Notify>,
}

/// The open connections, by id.
#[derive(Default)]
struct Table {
    next_id: u64,
    open: HashMap<u64, Entry>,
}

impl Table {
    /// The connection to close for a newcomer: the oldest that delivered no request head, else
    /// the oldest.
    fn victim(&self) -> Option<u64> {
        let oldest = |unserved_only: bool| {
            self.open
                .iter()
                .filter(|(_, e)| !unserved_only || !e.served.load(Ordering::Relaxed))
                .min_by_key(|(id, e)| (e.opened, **id))
                .map(|(id, _)| *id)
        };
        oldest(true).or_else(|| oldest(false))
    }
}

fn lock(table: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    table.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Serves `router` on `listener` within `limits` until `shutdown` completes (see the module
/// docs). Accept errors (out of file descriptors, …) are logged and retried after 100 ms; the
/// function returns only at shutdown.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let table = Arc::new(Mutex::new(Table::default()));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed; retrying in 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // Reap finished connection tasks so the set does not grow.
        while tasks.try_join_next().is_some() {}
        let served = Arc::new(AtomicBool::new(false));
        let close = Arc::new(Notify::new());
        let id = {
            let mut t = lock(&table);
            while t.open.len() >= limits.max_connections.max(1) {
                let Some(victim) = t.victim() else { break };
                if let Some(e) = t.open.remove(&victim) {
                    tracing::debug!(
                        served = e.served.load(Ordering::Relaxed),
                        "connection bound reached: closing the oldest slow connection"
                    );
                    e.close.notify_one();
                }
            }
            let id = t.next_id;
            t.next_id += 1;
            t.open.insert(id, Entry { opened: Instant::now(), served: served.clone(), close: close.clone() });
            id
        };
        let conn = Connection { router: router.clone(), peer, served, close, stop: stop_rx.clone(), limits };
        let table = table.clone();
        tasks.spawn(async move {
            conn.run(stream).await;
            lock(&table).open.remove(&id);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let drained = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(limits.shutdown_grace + Duration::from_millis(100), drained).await.is_err() {
        tasks.abort_all();
    }
}

/// One connection's task.
struct Connection {
    router: Router,
    /// The client's address, handed to handlers as axum's `ConnectInfo<SocketAddr>`.
    peer: std::net::SocketAddr,
    served: Arc<AtomicBool>,
    close: Arc<Notify>,
    stop: watch::Receiver<bool>,
    limits: ListenerLimits,
}

impl Connection {
    async fn run(self, stream: tokio::net::TcpStream) {
        let router = self.router;
        let served = self.served;
        let peer = self.peer;
        let svc = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            served.store(true, Ordering::Relaxed);
            req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
            router.clone().call(req)
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(self.limits.header_read_timeout);
        let conn = builder.serve_connection(TokioIo::new(stream), svc);
        tokio::pin!(conn);
        let mut stop = self.stop;
        // The guard `wait_for` returns is not Send: drop it inside.
        let stopping = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended");
                }
            }
            _ = self.close.notified() => {}
            () = stopping => {
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(self.limits.shutdown_grace, conn).await;
            }
        }
    }
}
