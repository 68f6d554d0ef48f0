//! Expensive request bodies are refused before they cost much (`limits.max_messages`,
//! `max_content_parts`, `max_tools`, `max_rendered_prompt_bytes`, `max_tokenize_ms`,
//! `max_concurrent_tokenizations`; docs/decisions/0044-expensive-bodies.md): each refusal is a 413
//! naming its bound, through the ext_proc stream. An ignored measurement runs 8 worst-case bodies
//! at once beside small decisions and prints the small ones' latency against a baseline.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse};
use kvroute_picker::RunningPicker;
use kvroute_picker::config::PickerConfig;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";

fn tokenizer_dir() -> String {
    format!("{}/../tests/fixtures/tokenizer-qwen2.5", env!("CARGO_MANIFEST_DIR"))
}

async fn start_picker(limits: &str) -> RunningPicker {
    let yaml = format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\ninsecure_ingest: true\nadmin_addr: 127.0.0.1:0\n\
         models: [{{name: {MODEL}, tokenizer: {}}}]\nlimits: {{{limits}}}\n",
        tokenizer_dir()
    );
    let config = PickerConfig::from_yaml(&yaml).unwrap();
    config.validate().unwrap();
    kvroute_picker::start(&config).await.unwrap()
}

fn headers(path: &str) -> ProcessingRequest {
    let headers = [(":path", path), (":method", "POST")]
        .iter()
        .map(|(k, v)| HeaderValue { key: (*k).into(), raw_value: v.as_bytes().to_vec(), ..Default::default() })
        .collect();
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn body(bytes: Vec<u8>) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody { body: bytes, end_of_stream: true, ..Default::default() })),
        ..Default::default()
    }
}

/// Sends one chat request on a new stream of `client`; the answer to its body and how long it
/// took from the body's send.
async fn decide(
    client: &ExternalProcessorClient<tonic::transport::Channel>,
    bytes: Vec<u8>,
) -> (ProcessingResponse, Duration) {
    let (tx, rx) = mpsc::channel(4);
    let mut answers = client.clone().process(ReceiverStream::new(rx)).await.unwrap().into_inner();
    tx.send(headers("/v1/chat/completions")).await.unwrap();
    let _headers_answer = answers.message().await.unwrap().unwrap();
    let t = Instant::now();
    tx.send(body(bytes)).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(60), answers.message()).await.unwrap().unwrap().unwrap();
    (answer, t.elapsed())
}

fn status_of(r: &ProcessingResponse) -> Option<(i32, String)> {
    let Some(Response::ImmediateResponse(i)) = &r.response else { return None };
    let v: serde_json::Value = serde_json::from_slice(&i.body).unwrap_or_default();
    Some((i.status.as_ref().map_or(0, |s| s.code), v["error"]["message"].as_str().unwrap_or_default().to_owned()))
}

fn chat(messages: Vec<serde_json::Value>, tools: Option<usize>) -> Vec<u8> {
    let mut v = json!({"model": MODEL, "messages": messages});
    if let Some(n) = tools {
        v["tools"] = json!(
            (0..n).map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}})).collect::<Vec<_>>()
        );
    }
    v.to_string().into_bytes()
}

fn messages(n: usize, text: &str) -> Vec<serde_json::Value> {
    (0..n).map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": text})).collect()
}

/// The body: 3.5 MB, 100,000 messages.
fn hundred_thousand_messages() -> Vec<u8> {
    chat(messages(100_000, "hi there, again"), None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expensive_bodies_are_refused_with_413_naming_the_bound() {
    let picker =
        start_picker("max_messages: 1000, max_content_parts: 2000, max_tools: 8, max_rendered_prompt_bytes: 100000")
            .await;
    let client = ExternalProcessorClient::connect(format!("http://{}", picker.ext_proc_addr)).await.unwrap();
    let parts = |n: usize| json!({"role": "user", "content": (0..n).map(|_| json!({"type": "text", "text": "x"})).collect::<Vec<_>>()});
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("100,000 messages (3.5 MB)", hundred_thousand_messages(), "limits.max_messages (1000)"),
        ("2,001 content parts", chat(vec![parts(1000), parts(1001)], None), "limits.max_content_parts (2000)"),
        ("9 tools", chat(messages(1, "hi"), Some(9)), "limits.max_tools (8)"),
        (
            "a 200 KB rendered prompt",
            chat(messages(2, &"word ".repeat(20_000)), None),
            "limits.max_rendered_prompt_bytes (100000)",
        ),
    ];
    for (what, bytes, bound) in cases {
        let (answer, took) = decide(&client, bytes).await;
        let (code, message) = status_of(&answer).unwrap_or_else(|| panic!("{what}: not refused: {answer:?}"));
        assert_eq!(code, 413, "{what}: {message}");
        assert!(message.contains(bound), "{what}: the message names {bound}: {message}");
        eprintln!("{what}: 413 after {took:?}: {message}");
    }
    // Within the bounds: not refused by them (503: no pod to route to).
    let (answer, _) = decide(&client, chat(messages(10, "hello"), Some(2))).await;
    assert_eq!(status_of(&answer).map(|(c, _)| c), Some(503), "{answer:?}");
    picker.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenization_past_its_deadline_is_413() {
    let picker = start_picker("max_tokenize_ms: 1").await;
    let client = ExternalProcessorClient::connect(format!("http://{}", picker.ext_proc_addr)).await.unwrap();
    // About 2 MB of text to tokenize: well over 1 ms.
    let (answer, took) = decide(&client, chat(messages(8, &"tokenize me slowly ".repeat(14_000)), None)).await;
    let (code, message) = status_of(&answer).unwrap_or_else(|| panic!("not refused: {answer:?}"));
    assert_eq!(code, 413, "{message}");
    assert!(message.contains("limits.max_tokenize_ms (1 ms)"), "{message}");
    assert!(took < Duration::from_secs(5), "stopped after {took:?}");
    picker.shutdown();
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Small decisions' latency alone, then beside 8 streams that each send worst-case bodies in a
/// loop: the 100,000-message body (refused by `max_messages`), and the largest body the
/// bounds let through (16,384 messages, 7.5 MB under the 8 MiB body limit, tokenized). Prints p50/p99 of both
/// phases and their ratio.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: cargo test -p kvroute-picker --release --test expensive_bodies -- --ignored --nocapture"]
async fn worst_case_bodies_beside_small_decisions() {
    let picker = start_picker("max_tokenize_ms: 60000").await;
    let client = ExternalProcessorClient::connect(format!("http://{}", picker.ext_proc_addr)).await.unwrap();
    let small = || chat(messages(2, "What is the capital of France? Answer briefly."), None);
    let measure = |n: usize| {
        let client = client.clone();
        async move {
            let mut took = Vec::with_capacity(n);
            for _ in 0..n {
                took.push(decide(&client, small()).await.1);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            took.sort();
            took
        }
    };
    let baseline = measure(300).await;
    for (label, heavy) in [
        ("100,000 messages, 3.5 MB (refused)", hundred_thousand_messages()),
        (
            "16,384 messages, 7.5 MB (tokenized)",
            chat(messages(16_384, &"lorem ipsum dolor sit amet ".repeat(16)), None),
        ),
    ] {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let heavy_done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let loaders: Vec<_> = (0..8)
            .map(|_| {
                let (client, heavy, stop, done) = (client.clone(), heavy.clone(), stop.clone(), heavy_done.clone());
                tokio::spawn(async move {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        decide(&client, heavy.clone()).await;
                        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let loaded = measure(300).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for l in loaders {
            l.await.unwrap();
        }
        eprintln!(
            "small decisions beside 8 × {label} ({} heavy done): p50 {:?} p99 {:?}; alone p50 {:?} p99 {:?}; p99 ratio {:.2}",
            heavy_done.load(std::sync::atomic::Ordering::Relaxed),
            percentile(&loaded, 0.5),
            percentile(&loaded, 0.99),
            percentile(&baseline, 0.5),
            percentile(&baseline, 0.99),
            percentile(&loaded, 0.99).as_secs_f64() / percentile(&baseline, 0.99).as_secs_f64()
        );
    }
    picker.shutdown();
}
