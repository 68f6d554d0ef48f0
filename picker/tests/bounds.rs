//! The picker's listeners bound hostile peers in time and size (`picker/src/limits.rs`,
//! docs/decisions/0024-bounded-outside-input.md): an ext_proc stream that sends headers and then no
//! body, or part of a body and stalls, gets a 408 and is ended; `/explain` takes any body the
//! ext_proc path takes (not axum's 2 MiB); the admin listener closes a half-sent request and keeps
//! serving `/healthz`.

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
        ("headers, then nothing", vec![headers("/v1/completions", false)]),
        ("part of a body, then nothing", vec![headers("/v1/completions", false), body(&[b'{'; 64 * 1024], false)]),
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
        exchange(&picker, vec![headers("/v1/completions", false), body(br#"{"model":"x","prompt":"p"}"#, true)], 2)
            .await;
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

fn headers(path: &str, end_of_stream: bool) -> ProcessingRequest {
    let headers = [(":path", path), (":method", if end_of_stream { "GET" } else { "POST" })]
        .iter()
        .map(|(k, v)| HeaderValue { key: (*k).into(), raw_value: v.as_bytes().to_vec(), ..Default::default() })
        .collect();
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Opens `n` streams on one connection, sends `msg` on each and waits for each one's first answer;
/// returns the senders (the streams stay open while they live) and the answers.
async fn open_streams(
    picker: &RunningPicker,
    n: usize,
    msg: impl Fn() -> ProcessingRequest,
) -> (Vec<mpsc::Sender<ProcessingRequest>>, Vec<ProcessingResponse>) {
    let client = ExternalProcessorClient::connect(format!("http://{}", picker.ext_proc_addr)).await.unwrap();
    let (mut held, mut answers) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let (tx, rx) = mpsc::channel(4);
        let mut stream = client.clone().process(ReceiverStream::new(rx)).await.unwrap().into_inner();
        tx.send(msg()).await.unwrap();
        let first = tokio::time::timeout(Duration::from_secs(5), stream.message()).await.unwrap().unwrap().unwrap();
        answers.push(first);
        held.push(tx);
        tokio::spawn(async move { while let Ok(Some(_)) = stream.message().await {} });
    }
    (held, answers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_only_streams_hold_no_in_flight_slot() {
    use kvroute_picker::pool::PoolUpdate;
    use kvroute_proto::agent::v1::{PodInfo, PodStats};
    let yaml = "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\ninsecure_ingest: true\nadmin_addr: 127.0.0.1:0\n\
                models: [{name: m}]\nscoring: {max_queue: 20}\nlimits: {body_timeout_ms: 5000}\n";
    let config = PickerConfig::from_yaml(yaml).unwrap();
    let picker = kvroute_picker::start(&config).await.unwrap();
    let pool = picker.gateway.pool.clone();
    let info = PodInfo {
        pod: "a".into(),
        endpoint: "127.0.0.1:9".into(),
        model: "m".into(),
        block_size: 16,
        index_block_size: 16,
        ..Default::default()
    };
    let stats = PodStats { ready: true, health_score: 1.0, ..Default::default() };
    let snapshot = PoolUpdate::Snapshot { stream: 1, info, seq: 0, stats: Some(stats), blocks: vec![] };
    pool.update(snapshot).await.unwrap();
    pool.sync().await.unwrap();

    // 100 inference requests whose body never comes: answered CONTINUE, nothing reserved.
    let (held, answers) = open_streams(&picker, 100, || headers("/v1/completions", false)).await;
    assert!(answers.iter().all(|a| matches!(a.response, Some(Response::RequestHeaders(_)))), "{:?}", answers[0]);
    let a = &pool.pods()[0];
    assert_eq!((a.in_flight, a.queue_depth), (0, 0), "headers without a body reserve nothing");
    drop(held);

    // 100 body-less requests (GET /v1/models), routed and then held open: no inference work, no slot.
    let (held, answers) = open_streams(&picker, 100, || headers("/v1/models", true)).await;
    assert!(answers.iter().all(|a| status_of(a).is_none()), "routed, not rejected: {:?}", answers[0]);
    let a = &pool.pods()[0];
    assert!(a.queue_depth < 20, "queue depth {} pushed to maxQueue by body-less requests", a.queue_depth);
    assert_eq!(a.in_flight, 0, "a body-less request holds no in-flight slot");
    drop(held);
    picker.shutdown();
}

/// A large prompt's tokenization stops soon after its ext_proc stream ends: Envoy gave up, nobody
/// waits for the decision. Measured against the same-size decision run to its end in the same
/// test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenization_stops_when_the_stream_ends() {
    let tokenizer = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer-qwen2.5");
    let yaml = format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\ninsecure_ingest: true\nadmin_addr: 127.0.0.1:0\n\
         models: [{{name: m, tokenizer: {}}}]\n",
        tokenizer.display()
    );
    let picker = kvroute_picker::start(&PickerConfig::from_yaml(&yaml).unwrap()).await.unwrap();
    let cancelled = || picker.gateway.metrics.tokenizations_cancelled.get();
    // Distinct words (the segment cache cannot shortcut them), different in each run.
    let prompt = |seed: u64| {
        let words: String =
            (0..1_000_000u64).map(|i| format!("w{} ", (i ^ seed).wrapping_mul(2_654_435_761) % 1_000_003)).collect();
        format!(r#"{{"model":"m","prompt":"{words}"}}"#)
    };
    let open = |body_bytes: Vec<u8>| {
        let addr = picker.ext_proc_addr;
        async move {
            let mut client = ExternalProcessorClient::connect(format!("http://{addr}")).await.unwrap();
            let (tx, rx) = mpsc::channel(4);
            let answers = client.process(ReceiverStream::new(rx)).await.unwrap().into_inner();
            tx.send(headers("/v1/completions", false)).await.unwrap();
            tx.send(body(&body_bytes, true)).await.unwrap();
            (client, tx, answers)
        }
    };

    // Baseline: the whole decision (no pod: it ends in a 503 once tokenized and scored).
    let first = prompt(1);
    assert!(first.len() > 6_000_000 && first.len() < 8 << 20, "{}", first.len());
    let sent = Instant::now();
    let (_c, _tx, mut answers) = open(first.into_bytes()).await;
    let mut full = None;
    while let Ok(Some(r)) = answers.message().await {
        if status_of(&r).is_some() {
            full = Some(sent.elapsed());
            break;
        }
    }
    let full = full.expect("the baseline decision answered");

    // The same size, abandoned a third of the way in.
    let (client, tx, answers) = open(prompt(2).into_bytes()).await;
    tokio::time::sleep(full / 3).await;
    assert_eq!(cancelled(), 0);
    let gone = Instant::now();
    drop((answers, tx, client));
    while cancelled() == 0 {
        assert!(gone.elapsed() < full, "tokenization ran on after its stream ended (full decision: {full:?})");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stopped = gone.elapsed();
    eprintln!(
        "a 7 MB prompt: full decision {full:?}; abandoned after {:?}, tokenization stopped {stopped:?} later",
        full / 3
    );
    assert!(stopped < full / 3, "stopped {stopped:?} after the stream ended; the whole decision takes {full:?}");
    picker.shutdown();
}
