//! Bounds on the ext_proc listener's connections (docs/decisions/0042-bounded-ext-proc-listener.md):
//! how many may be open, how long one may take to open its first stream, how long one may stay
//! without an open stream.
//!
//! - [`incoming`] accepts TCP connections (TCP_NODELAY set), runs the TLS handshake when
//!   configured, and yields each connection as a [`Bounded`] holding one of `max_connections`
//!   permits. A connection accepted while every permit is held is closed at once: the listen
//!   backlog drains, the file descriptor is returned, and the connections already open keep
//!   working.
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
}

impl<IO> std::fmt::Debug for Bounded<IO> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounded").field("remote_addr", &self.remote_addr).finish_non_exhaustive()
    }
}

impl<IO> Drop for Bounded<IO> {
    fn drop(&mut self) {
        self.counters.open.fetch_sub(1, Ordering::Relaxed);
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

/// Accepts connections on `listener` under `bounds` (TLS when `tls` is given) and yields them for
/// `Server::serve_with_incoming_shutdown`; ends when the server drops the stream. Accept errors
/// (out of file descriptors and the like) are logged and retried after 50 ms.
pub fn incoming(
    listener: TcpListener,
    bounds: ConnBounds,
    tls: Option<Arc<ReloadingTls>>,
    counters: Arc<ConnCounters>,
) -> impl Stream<Item = Result<Bounded<Box<dyn Io>>, io::Error>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let permits = Arc::new(Semaphore::new(bounds.max_connections));
        let mut refused_logged: Option<Instant> = None;
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => break,
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
            counters.open.fetch_add(1, Ordering::Relaxed);
            let state = Arc::new(ConnState::new());
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
                                counters.open.fetch_sub(1, Ordering::Relaxed);
                                return;
                            }
                            Err(_) => {
                                counters.timed_out.fetch_add(1, Ordering::Relaxed);
                                counters.open.fetch_sub(1, Ordering::Relaxed);
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
                };
                let _ = tx.send(Ok(conn)).await;
            });
        }
    });
    ReceiverStream::new(rx)
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
}
