//! Every read from an engine is bounded: hostile engines on loopback (an endless chunked
//! `/metrics`, a huge probe reply with and without a `Content-Length`) get a clear error, not
//! the agent's memory.

use super::*;
use std::sync::atomic::AtomicU64;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// How a hostile engine answers every request.
#[derive(Clone, Copy)]
enum Answer {
    /// 200, chunked, 64 KiB chunks for ever.
    EndlessChunked,
    /// 200 with `Content-Length` of this many bytes, then that many zeros.
    Sized(u64),
    /// 200 with this body and a `Content-Length`.
    Body(&'static str),
}

/// Serves `answer` on a free loopback port; returns its `ip:port` and a count of the body bytes
/// it managed to write.
async fn engine(answer: Answer) -> (String, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let written = Arc::new(AtomicU64::new(0));
    let count = written.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut req = vec![0u8; 8192];
                let _ = sock.read(&mut req).await;
                let chunk = vec![b'#'; 64 << 10];
                match answer {
                    Answer::EndlessChunked => {
                        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n";
                        if sock.write_all(head.as_bytes()).await.is_err() {
                            return;
                        }
                        loop {
                            let framed = [format!("{:x}\r\n", chunk.len()).as_bytes(), &chunk, b"\r\n"].concat();
                            if sock.write_all(&framed).await.is_err() {
                                return;
                            }
                            count.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                        }
                    }
                    Answer::Sized(n) => {
                        let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {n}\r\n\r\n");
                        if sock.write_all(head.as_bytes()).await.is_err() {
                            return;
                        }
                        let mut left = n;
                        while left > 0 {
                            let k = left.min(chunk.len() as u64);
                            if sock.write_all(&chunk[..k as usize]).await.is_err() {
                                return;
                            }
                            count.fetch_add(k, Ordering::Relaxed);
                            left -= k;
                        }
                    }
                    Answer::Body(b) => {
                        let resp = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{b}", b.len());
                        let _ = sock.write_all(resp.as_bytes()).await;
                    }
                }
            });
        }
    });
    (addr, written)
}

fn too_large(r: Result<impl std::fmt::Debug, ScrapeError>, limit: usize) {
    match r {
        Err(ScrapeError::TooLarge { limit: l, .. }) => assert_eq!(l, limit),
        other => panic!("expected TooLarge, got {other:?}"),
    }
}

#[tokio::test]
async fn an_endless_chunked_metrics_page_is_cut_at_its_limit() {
    let (addr, written) = engine(Answer::EndlessChunked).await;
    // A long timeout: the limit, not the clock, must end the read.
    let client = EngineClient::new(&addr, Duration::from_secs(30));
    let start = Instant::now();
    too_large(client.metrics().await, ReadLimits::default().metrics);
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    // The engine could write the limit plus what the socket buffers hold, not more.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sent = written.load(Ordering::Relaxed);
    assert!(sent < 64 << 20, "engine wrote {sent} bytes");
    // /health and /v1/models are bounded the same way.
    too_large(client.health().await, ReadLimits::default().health);
    too_large(client.model().await, ReadLimits::default().models);
}

#[tokio::test]
async fn a_200_mb_probe_reply_is_refused_by_its_length_before_its_body() {
    let (addr, written) = engine(Answer::Sized(200 << 20)).await;
    let client = EngineClient::new(&addr, Duration::from_secs(30));
    too_large(client.probe("m", Duration::from_secs(30)).await, ReadLimits::default().probe);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(written.load(Ordering::Relaxed) < 64 << 20);
}

#[tokio::test]
async fn a_chunked_probe_reply_over_its_limit_is_cut() {
    let (addr, _) = engine(Answer::EndlessChunked).await;
    let limits = ReadLimits { probe: 100_000, ..ReadLimits::default() };
    let client = EngineClient::with_limits(&addr, Duration::from_secs(30), limits);
    too_large(client.probe("m", Duration::from_secs(30)).await, 100_000);
}

#[tokio::test]
async fn answers_within_their_limits_are_read() {
    let (addr, _) = engine(Answer::Body(r#"{"object":"list","data":[{"id":"base","parent":null}]}"#)).await;
    let client = EngineClient::new(&addr, Duration::from_secs(5));
    assert_eq!(client.model().await.expect("models"), Some("base".to_string()));
    client.health().await.expect("health");
    // The same answer over a smaller limit is refused.
    let small =
        EngineClient::with_limits(&addr, Duration::from_secs(5), ReadLimits { models: 10, ..ReadLimits::default() });
    too_large(small.model().await, 10);
}
