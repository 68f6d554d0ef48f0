//! The bounded listener over real sockets: half-sent requests and idle kept-alive connections
//! are closed after the header-read timeout, and past the connection bound the slow
//! connections make room for new clients.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use kvroute_common::listener::{ListenerLimits, serve};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

async fn start(limits: ListenerLimits) -> (SocketAddr, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let router = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
    let (tx, rx) = oneshot::channel();
    let task = tokio::spawn(serve(listener, router, limits, async move {
        let _ = rx.await;
    }));
    (addr, tx, task)
}

/// Reads until the peer closes (Ok(bytes)) or `within` passes (Err).
async fn closed_within(sock: &mut TcpStream, within: Duration) -> Result<Vec<u8>, ()> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, sock.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return Err(()),
        }
    }
}

async fn get_healthz(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.expect("write");
    let got = closed_within(&mut s, Duration::from_secs(5)).await.expect("answered and closed");
    String::from_utf8_lossy(&got).into_owned()
}

fn quick(timeout_ms: u64, max_connections: usize) -> ListenerLimits {
    ListenerLimits {
        header_read_timeout: Duration::from_millis(timeout_ms),
        max_connections,
        ..ListenerLimits::default()
    }
}

#[tokio::test]
async fn a_half_sent_request_is_closed_after_the_header_timeout() {
    let (addr, _stop, _task) = start(quick(300, 16)).await;
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n").await.expect("write");
    let t = Instant::now();
    let got = closed_within(&mut s, Duration::from_secs(5)).await.expect("closed by the server");
    assert!(t.elapsed() >= Duration::from_millis(250), "not before the timeout: {:?}", t.elapsed());
    // hyper answers 408 or just closes; either way no 200.
    assert!(!String::from_utf8_lossy(&got).contains("200 OK"));
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed_after_the_timeout() {
    let (addr, _stop, _task) = start(quick(300, 16)).await;
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.expect("write");
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).await.expect("response");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // Kept alive, then idle: closed after the timeout.
    closed_within(&mut s, Duration::from_secs(5)).await.expect("idle connection closed");
}

#[tokio::test]
async fn past_the_bound_slow_connections_make_room_and_served_ones_stay() {
    // A long timeout: only the bound can free connections here.
    let (addr, _stop, _task) = start(quick(60_000, 8)).await;
    let mut kept = TcpStream::connect(addr).await.expect("connect");
    kept.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.expect("write");
    let mut buf = [0u8; 1024];
    assert!(kept.read(&mut buf).await.expect("response") > 0);
    let mut slow = Vec::new();
    for _ in 0..1100 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n").await.expect("write");
        slow.push(s);
    }
    let t = Instant::now();
    assert!(get_healthz(addr).await.starts_with("HTTP/1.1 200"), "a new client is served");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // The connection that had sent a request was not the one closed.
    kept.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.expect("write");
    let n = tokio::time::timeout(Duration::from_secs(2), kept.read(&mut buf)).await.expect("answer").expect("read");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // All but the newest 7 slow ones were closed.
    let mut open = 0;
    for s in &mut slow {
        if closed_within(s, Duration::from_millis(1)).await.is_err() {
            open += 1;
        }
    }
    assert!(open <= 7, "{open} slow connections still open");
}

#[tokio::test]
async fn shutdown_stops_accepting_and_returns() {
    let (addr, stop, task) = start(quick(60_000, 16)).await;
    let mut idle = TcpStream::connect(addr).await.expect("connect");
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n").await.expect("write");
    assert!(get_healthz(addr).await.starts_with("HTTP/1.1 200"));
    stop.send(()).expect("stop");
    tokio::time::timeout(Duration::from_secs(5), task).await.expect("returns within the grace").expect("no panic");
    assert!(TcpStream::connect(addr).await.is_err(), "no longer accepting");
}
