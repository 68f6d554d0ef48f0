//! The picker's listeners bound hostile peers in time and size (issue 17; `picker/src/limits.rs`):
//! an ext_proc stream that sends headers and then no body, or part of a body and stalls, gets a
//! 408 and is ended; `/explain` takes any body the ext_proc path takes (not axum's 2 MiB); the
//! admin listener closes a half-sent request and keeps serving `/healthz`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse};
use kvroute_picker::RunningPicker;
use kvroute_picker::config::PickerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const BODY_TIMEOUT_MS: u64 = 300;

async fn start_picker(body_limit_bytes: usize) -> RunningPicker {
    let yaml = format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\ninsecure_ingest: true\nadmin_addr: 127.0.0.1:0\n\
         body_limit_bytes: {body_limit_bytes}\nmodels: [{{name: m}}]\n\
         limits: {{body_timeout_ms: {BODY_TIMEOUT_MS}, admin_header_timeout_ms: 300}}\n"
    );
    let config = PickerConfig::from_yaml(&yaml).unwrap();
    config.validate().unwrap();
    kvroute_picker::start(&config).await.unwrap()
}

fn request_headers() -> ProcessingRequest {
    let headers = [(":path", "/v1/completions"), (":method", "POST")]
        .iter()
        .map(|(k, v)| HeaderValue { key: (*k).into(), raw_value: v.as_bytes().to_vec(), ..Default::default() })
        .collect();
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn body(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody { body: chunk.to_vec(), end_of_stream, ..Default::default() })),
        ..Default::default()
    }
}

/// Opens a stream, sends `msgs`, and returns the picker's answers until it ends the stream or
/// `max` answers came (5 s at most), with the time from the last message sent to then.
async fn exchange(
    picker: &RunningPicker,
    msgs: Vec<ProcessingRequest>,
    max: usize,
) -> (Vec<ProcessingResponse>, Duration) {
    let mut client = ExternalProcessorClient::connect(format!("http://{}", picker.ext_proc_addr)).await.unwrap();
    let (tx, rx) = mpsc::channel(16);
    let mut answers = client.process(ReceiverStream::new(rx)).await.unwrap().into_inner();
    for m in msgs {
        tx.send(m).await.unwrap();
    }
    let sent = Instant::now();
    let mut out = Vec::new();
    while out.len() < max {
        match tokio::time::timeout(Duration::from_secs(5), answers.message()).await {
            Ok(Ok(Some(r))) => out.push(r),
            Ok(Ok(None)) | Ok(Err(_)) => break,
            Err(_) => panic!("stream neither answered nor ended in 5 s: {out:?}"),
        }
    }
    drop(tx); // kept open until here: the picker, not the client, ends the stream
    (out, sent.elapsed())
}

fn status_of(r: &ProcessingResponse) -> Option<(i32, serde_json::Value)> {
    let Some(Response::ImmediateResponse(i)) = &r.response else { return None };
    Some((i.status.as_ref().map_or(0, |s| s.code), serde_json::from_slice(&i.body).unwrap_or_default()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_get_408_and_the_stream_ends() {
    let picker = start_picker(1 << 20).await;
    let cases = [
        ("headers, then nothing", vec![request_headers()]),
        ("part of a body, then nothing", vec![request_headers(), body(&[b'{'; 64 * 1024], false)]),
        ("a body without headers", vec![body(br#"{"model":"m","#, false)]),
    ];
    for (what, msgs) in cases {
        let (answers, took) = exchange(&picker, msgs, usize::MAX).await;
        let last = answers.last().unwrap_or_else(|| panic!("{what}: no answer"));
        let (code, v) = status_of(last).unwrap_or_else(|| panic!("{what}: {last:?}"));
        assert_eq!(code, 408, "{what}: {v}");
        assert_eq!(v["error"]["type"], "request_timeout", "{what}: {v}");
        let min = Duration::from_millis(BODY_TIMEOUT_MS - 50);
        assert!(took >= min && took < Duration::from_secs(3), "{what}: ended after {took:?}");
    }
    // A body that completes in time is not touched by the deadline (404: no such model).
    let (answers, _) =
        exchange(&picker, vec![request_headers(), body(br#"{"model":"x","prompt":"p"}"#, true)], 2).await;
    assert_eq!(answers.iter().filter_map(status_of).map(|(c, _)| c).collect::<Vec<_>>(), vec![404]);
    let metrics = http(&picker, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
    assert!(metrics.contains(r#"code="408"} 3"#), "{metrics}");
    picker.shutdown();
}

async fn http(picker: &RunningPicker, request: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(picker.admin_addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await.unwrap().unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_takes_what_ext_proc_takes_and_admin_drops_half_sent_requests() {
    let limit = 4 << 20;
    let picker = start_picker(limit).await;
    let post = |len: usize| {
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "a".repeat(len - 25));
        assert_eq!(body.len(), len);
        format!("POST /explain HTTP/1.1\r\nHost: x\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n{body}")
    };
    // 3 MiB: over axum's default 2 MiB, under the picker's limit.
    let answer = http(&picker, &post(3 << 20)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{}", &answer[..answer.len().min(400)]);
    let answer = http(&picker, &post(limit + 1)).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{}", &answer[..answer.len().min(400)]);

    // A request head that never ends is closed after admin_header_timeout_ms; /healthz still answers.
    let mut slow = Vec::new();
    for _ in 0..20 {
        let mut s = tokio::net::TcpStream::connect(picker.admin_addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        slow.push(s);
    }
    assert!(http(&picker, "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.ends_with("ok\n"));
    let started = Instant::now();
    for mut s in slow {
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "half-sent request still open after {:?}", started.elapsed());
    }
    picker.shutdown();
}
