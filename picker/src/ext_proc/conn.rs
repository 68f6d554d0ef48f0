//! Bounds on the ext_proc listener's connections (docs/decisions/0042-bounded-ext-proc-listener.md):
//! how many may be open, how long one may take to open its first stream, how long one may stay
//! without an open stream.
//!
//! - [`spawn_acceptor`] accepts TCP connections (TCP_NODELAY set), each holding one of
//!   `max_connections` permits, and hands each to the least loaded of the event loops serving
//!   ext_proc. A connection accepted while every permit is held is closed at once: the listen
//!   backlog drains, the file descriptor is returned, and the connections already open keep
//!   working. On its loop, [`loop_incoming`] registers the connection, runs the TLS handshake when
//!   configured and yields it as a [`Bounded`]; [`incoming`] does both on one runtime.
//! - [`Bounded`] fails its reads (hyper then closes the connection and its descriptor) when no
//!   stream has opened within `first_stream` of the accept (TLS handshake, HTTP/2 preface and the
//!   first HEADERS included), or when no stream has been open for `idle`.
//! - [`StreamCountLayer`] counts a connection's open streams (a request is open from its headers
//!   until its response body is dropped), for both gRPC services on the port (ext_proc and
//!   health), from the [`ConnInfo`] that tonic puts in each request's extensions.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::{Instant, Sleep};
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::{Body, Bytes, Service, http};
use tonic::transport::server::Connected;

use crate::ingest::tls::ReloadingTls;
pub use crate::limits::ConnBounds;

/// Open ext_proc connections and those refused at the cap, for tests and metrics.
#[derive(Debug, Default)]
pub struct ConnCounters {
    /// Connections open now (holding a permit).
    pub open: AtomicUsize,
    /// Connections closed at accept because `max_connections` were open.
    pub refused: AtomicU64,
    /// Connections closed because no stream opened in time or they stayed idle.
    pub timed_out: AtomicU64,
}

/// One connection's stream bookkeeping, shared by its [`Bounded`] and its requests.
#[derive(Debug)]
struct ConnState {
    /// Streams open now.
    open: AtomicUsize,
    /// Whether any stream has opened.
    opened: AtomicBool,
    /// When the open count last fell to zero, as ms since `start`.
    idle_since_ms: AtomicU64,
    start: Instant,
    /// The connection's reader, woken when the open count falls to zero (its idle timer starts).
    waker: AtomicWaker,
}

impl ConnState {
    fn new() -> Self {
        Self {
            open: AtomicUsize::new(0),
            opened: AtomicBool::new(false),
            idle_since_ms: AtomicU64::new(0),
            start: Instant::now(),
            waker: AtomicWaker::new(),
        }
    }

    /// When the connection must close unless a stream opens before: None while a stream is open.
    fn deadline(&self, bounds: &ConnBounds) -> Option<Instant> {
        if !self.opened.load(Ordering::Acquire) {
            return Some(self.start + bounds.first_stream);
        }
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        Some(self.start + Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire)) + bounds.idle)
    }
}

/// What tonic puts in each request's extensions for a [`Bounded`] connection.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    /// The peer's address, when known.
    pub remote_addr: Option<SocketAddr>,
    state: Arc<ConnState>,
}

/// A connection under [`ConnBounds`]: reads fail with `TimedOut` once its deadline passes with no
/// stream open. Holds one of the listener's permits until dropped.
pub struct Bounded<IO> {
    io: IO,
    state: Arc<ConnState>,
    bounds: ConnBounds,
    remote_addr: Option<SocketAddr>,
    timer: Pin<Box<Sleep>>,
    counters: Arc<ConnCounters>,
    _permit: OwnedSemaphorePermit,
    _load: LoopLoad,
    _open: OpenGuard,
}

impl<IO> std::fmt::Debug for Bounded<IO> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounded").field("remote_addr", &self.remote_addr).finish_non_exhaustive()
    }
}

impl<IO> Bounded<IO> {
    /// Pending while the connection may stay; an error once its deadline passed with no stream
    /// open. Registers the reader's waker with the timer and with the stream count.
    fn check(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.state.waker.register(cx.waker());
        loop {
            let Some(deadline) = self.state.deadline(&self.bounds) else { return Poll::Pending };
            if Instant::now() >= deadline {
                self.counters.timed_out.fetch_add(1, Ordering::Relaxed);
                let why = if self.state.opened.load(Ordering::Acquire) {
                    "ext_proc connection idle past limits.ext_proc_idle_ms"
                } else {
                    "ext_proc connection opened no stream within limits.ext_proc_first_stream_ms"
                };
                tracing::debug!(peer = ?self.remote_addr, why, "closing ext_proc connection");
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why)));
            }
            if self.timer.deadline() != deadline {
                self.timer.as_mut().reset(deadline);
            }
            if self.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Bounded<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Pending => this.check(cx),
            ready => ready,
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Bounded<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<IO> Connected for Bounded<IO> {
    type ConnectInfo = ConnInfo;
    fn connect_info(&self) -> ConnInfo {
        ConnInfo { remote_addr: self.remote_addr, state: self.state.clone() }
    }
}

/// A boxed connection: plain TCP or TLS over TCP.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

/// A connection accepted under the cap and not yet registered with an event loop: the socket,
/// its permit, its stream bookkeeping and its event loop's connection count.
#[derive(Debug)]
pub struct Accepted {
    tcp: std::net::TcpStream,
    peer: SocketAddr,
    state: Arc<ConnState>,
    permit: OwnedSemaphorePermit,
    load: LoopLoad,
    open: OpenGuard,
}

/// Counts a connection in [`ConnCounters::open`] from its accept until it closes.
#[derive(Debug)]
struct OpenGuard(Arc<ConnCounters>);

impl OpenGuard {
    fn new(counters: Arc<ConnCounters>) -> Self {
        counters.open.fetch_add(1, Ordering::Relaxed);
        Self(counters)
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One event loop's share of the open connections; decremented when the connection closes.
#[derive(Debug)]
struct LoopLoad(Arc<AtomicUsize>);

impl LoopLoad {
    fn new(open: &Arc<AtomicUsize>) -> Self {
        open.fetch_add(1, Ordering::Relaxed);
        Self(open.clone())
    }
}

impl Drop for LoopLoad {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where the acceptor hands connections: one per event loop serving ext_proc.
#[derive(Debug)]
pub struct LoopSender {
    tx: mpsc::Sender<Accepted>,
    open: Arc<AtomicUsize>,
}

/// The receiving end of a [`LoopSender`], turned into connections by [`loop_incoming`].
#[derive(Debug)]
pub struct LoopReceiver(mpsc::Receiver<Accepted>);

/// A channel from the acceptor to one event loop (64 connections in flight).
pub fn loop_channel() -> (LoopSender, LoopReceiver) {
    let (tx, rx) = mpsc::channel(64);
    (LoopSender { tx, open: Arc::new(AtomicUsize::new(0)) }, LoopReceiver(rx))
}

/// Accepts connections on `listener` under `bounds` on the calling runtime and hands each to the
/// event loop of `loops` holding the fewest open connections (ties in turn), where it stays: its
/// TLS handshake, its HTTP/2 frames and its streams' tasks all run on that loop's thread, so no
/// message wakes a second thread (docs/decisions/0050-ext-proc-event-loops.md). A connection
/// accepted while every permit is held is closed at once: the listen backlog drains, the file
/// descriptor is returned, and the connections already open keep working. Accept errors (out of
/// file descriptors and the like) are logged and retried after 50 ms. Ends when every loop has
/// stopped (at once when `loops` is empty).
pub fn spawn_acceptor(listener: TcpListener, bounds: ConnBounds, counters: Arc<ConnCounters>, loops: Vec<LoopSender>) {
    tokio::spawn(async move {
        if loops.is_empty() {
            return;
        }
        let permits = Arc::new(Semaphore::new(bounds.max_connections));
        let mut refused_logged: Option<Instant> = None;
        let mut next = 0usize;
        let all_closed = futures::future::join_all(loops.iter().map(|l| l.tx.closed()));
        tokio::pin!(all_closed);
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = &mut all_closed => break,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "ext_proc accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                // Closed at once (dropped): the descriptor returns and the backlog drains.
                counters.refused.fetch_add(1, Ordering::Relaxed);
                if refused_logged.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                    refused_logged = Some(Instant::now());
                    tracing::warn!(max = bounds.max_connections, %peer,
                        "ext_proc connection refused: limits.ext_proc_max_connections open (logged every 10 s)");
                }
                drop(tcp);
                continue;
            };
            let _ = tcp.set_nodelay(true);
            // Leaves this runtime's reactor; the chosen loop registers it with its own.
            let tcp = match tcp.into_std() {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(error = %e, %peer, "ext_proc connection dropped: could not hand it to an event loop");
                    continue;
                }
            };
            let n = loops.len();
            let mut order: Vec<usize> = (0..n).map(|i| (next + i) % n).collect();
            order.sort_by_key(|&i| loops[i].open.load(Ordering::Relaxed));
            next = next.wrapping_add(1);
            let (state, open) = (Arc::new(ConnState::new()), OpenGuard::new(counters.clone()));
            let mut accepted = Accepted { tcp, peer, state, permit, open, load: LoopLoad::new(&loops[order[0]].open) };
            for (k, &i) in order.iter().enumerate() {
                if k > 0 {
                    // The previous loop has stopped: this one counts the connection instead.
                    accepted.load = LoopLoad::new(&loops[i].open);
                }
                match loops[i].tx.send(accepted).await {
                    Ok(()) => break,
                    Err(mpsc::error::SendError(a)) => accepted = a,
                }
            }
            // Taken by no loop (every one has stopped): it closes here, uncounted.
        }
    });
}

/// The connections handed to one event loop, registered with the calling (that loop's) runtime,
/// TLS handshakes run when `tls` is given, yielded as [`Bounded`] for
/// `Server::serve_with_incoming_shutdown`. Ends when the acceptor stops.
pub fn loop_incoming(
    rx: LoopReceiver,
    bounds: ConnBounds,
    tls: Option<Arc<ReloadingTls>>,
    counters: Arc<ConnCounters>,
) -> impl Stream<Item = Result<Bounded<Box<dyn Io>>, io::Error>> {
    let (tx, out) = mpsc::channel(64);
    let mut rx = rx.0;
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = rx.recv() => a,
                () = tx.closed() => break,
            };
            let Some(Accepted { tcp, peer, state, permit, load, open }) = accepted else { break };
            let tcp = match tcp.set_nonblocking(true).and_then(|()| tokio::net::TcpStream::from_std(tcp)) {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(error = %e, %peer, "ext_proc connection dropped: could not register it");
                    continue;
                }
            };
            let deadline = state.start + bounds.first_stream;
            let (tx, tls, counters) = (tx.clone(), tls.clone(), counters.clone());
            tokio::spawn(async move {
                let io: Box<dyn Io> = match tls {
                    None => Box::new(tcp),
                    Some(tls) => {
                        let acceptor = TlsAcceptor::from(tls.current());
                        match tokio::time::timeout_at(deadline, acceptor.accept(tcp)).await {
                            Ok(Ok(s)) => Box::new(s),
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "ext_proc TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                counters.timed_out.fetch_add(1, Ordering::Relaxed);
                                return;
                            }
                        }
                    }
                };
                let conn = Bounded {
                    io,
                    state,
                    bounds,
                    remote_addr: Some(peer),
                    timer: Box::pin(tokio::time::sleep_until(deadline)),
                    counters,
                    _permit: permit,
                    _load: load,
                    _open: open,
                };
                let _ = tx.send(Ok(conn)).await;
            });
        }
    });
    ReceiverStream::new(out)
}

/// Accepts and serves connections on the calling runtime alone: [`spawn_acceptor`] with one
/// event loop, whose connections [`loop_incoming`] yields.
pub fn incoming(
    listener: TcpListener,
    bounds: ConnBounds,
    tls: Option<Arc<ReloadingTls>>,
    counters: Arc<ConnCounters>,
) -> impl Stream<Item = Result<Bounded<Box<dyn Io>>, io::Error>> {
    let (tx, rx) = loop_channel();
    spawn_acceptor(listener, bounds, counters.clone(), vec![tx]);
    loop_incoming(rx, bounds, tls, counters)
}

/// Counts each request as an open stream of its connection from its headers until its response
/// body is dropped (see the module doc).
#[derive(Debug, Clone, Copy, Default)]
pub struct StreamCountLayer;

impl<S> tower::Layer<S> for StreamCountLayer {
    type Service = StreamCount<S>;
    fn layer(&self, inner: S) -> StreamCount<S> {
        StreamCount { inner }
    }
}

/// The service of [`StreamCountLayer`].
#[derive(Debug, Clone)]
pub struct StreamCount<S> {
    inner: S,
}

/// Marks a stream open while alive.
#[derive(Debug)]
struct StreamGuard(Arc<ConnState>);

impl StreamGuard {
    fn new(state: Arc<ConnState>) -> Self {
        state.opened.store(true, Ordering::Release);
        state.open.fetch_add(1, Ordering::AcqRel);
        Self(state)
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let s = &self.0;
        if s.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            s.idle_since_ms.store(s.start.elapsed().as_millis() as u64, Ordering::Release);
            s.waker.wake();
        }
    }
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for StreamCount<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    type Response = http::Response<CountedBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let guard = req.extensions().get::<ConnInfo>().map(|c| StreamGuard::new(c.state.clone()));
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(resp.map(|body| CountedBody { body, _guard: guard }))
        })
    }
}

/// A response body that keeps its stream counted open until dropped.
#[derive(Debug)]
pub struct CountedBody<B> {
    body: B,
    _guard: Option<StreamGuard>,
}

impl<B: Body + Unpin> Body for CountedBody<B> {
    type Data = B::Data;
    type Error = B::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_follows_the_open_streams() {
        let bounds =
            ConnBounds { max_connections: 1, first_stream: Duration::from_secs(5), idle: Duration::from_secs(60) };
        let s = Arc::new(ConnState::new());
        assert_eq!(
            s.deadline(&bounds),
            Some(s.start + bounds.first_stream),
            "no stream yet: the first-stream deadline"
        );
        let g = StreamGuard::new(s.clone());
        let g2 = StreamGuard::new(s.clone());
        assert_eq!(s.deadline(&bounds), None, "a stream is open: no deadline");
        drop(g);
        assert_eq!(s.deadline(&bounds), None, "one stream still open");
        drop(g2);
        let d = s.deadline(&bounds).expect("idle: a deadline");
        assert!(d >= s.start + bounds.idle, "the idle deadline counts from the last close");
    }

    /// Receives the next connection handed to `rx`, failing after 10 s.
    async fn handed(rx: &mut LoopReceiver) -> Accepted {
        tokio::time::timeout(Duration::from_secs(10), rx.0.recv()).await.expect("handed in time").expect("open")
    }

    #[tokio::test]
    async fn connections_go_to_the_least_loaded_loop_and_past_the_cap_are_closed() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let bounds =
            ConnBounds { max_connections: 5, first_stream: Duration::from_secs(5), idle: Duration::from_secs(60) };
        let counters = Arc::new(ConnCounters::default());
        let (tx_a, mut rx_a) = loop_channel();
        let (tx_b, mut rx_b) = loop_channel();
        spawn_acceptor(listener, bounds, counters.clone(), vec![tx_a, tx_b]);
        let mut clients = Vec::new();
        let mut on_a = Vec::new();
        let mut on_b = Vec::new();
        // One at a time, so that each sees the counts the last one left: a, b, a, b.
        for _ in 0..4 {
            clients.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            tokio::select! {
                a = handed(&mut rx_a) => on_a.push(a),
                b = handed(&mut rx_b) => on_b.push(b),
            }
        }
        assert_eq!((on_a.len(), on_b.len()), (2, 2), "alternate while the loads are equal");
        // Two of loop a's connections close: the next two go to a, which now holds none.
        on_a.clear();
        for _ in 0..2 {
            clients.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            on_a.push(handed(&mut rx_a).await);
        }
        assert_eq!(counters.open.load(Ordering::Relaxed), 4, "two handed to each loop, two of them closed since");
        assert_eq!(on_a.iter().filter(|c| c.peer.ip().is_loopback()).count(), 2);
        // A loop that stopped gets nothing more; the other takes the connection.
        drop(rx_a);
        drop(on_a);
        clients.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        on_b.push(handed(&mut rx_b).await);
        assert_eq!(on_b.len(), 3);
        // Five permits: loop b's connections hold three of them, so two more fit and the one
        // after them is closed at accept.
        for _ in 0..2 {
            clients.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            on_b.push(handed(&mut rx_b).await);
        }
        let mut refused = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut byte = [0u8; 1];
        let read =
            tokio::time::timeout(Duration::from_secs(10), tokio::io::AsyncReadExt::read(&mut refused, &mut byte))
                .await
                .expect("closed in time");
        assert!(matches!(read, Ok(0) | Err(_)), "past the cap the connection is closed: {read:?}");
        assert_eq!(counters.refused.load(Ordering::Relaxed), 1);
        drop(on_b);
        assert_eq!(counters.open.load(Ordering::Relaxed), 0, "every handed connection closed");
    }
}
