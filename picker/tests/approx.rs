//! Approximate mode at the ext_proc level (docs/design.md §6): a model without a tokenizer, pods that never
//! report a KV block, and a tonic ext_proc client playing Envoy. A request sharing a long prefix
//! with an earlier one goes where the earlier one went, even against a better-loaded pod.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use kvroute_harness::{FakeAgent, FakePod, poll_until};
use kvroute_picker::RunningPicker;
use kvroute_picker::config::PickerConfig;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const MODEL: &str = "acme/no-tokenizer-7b";
const TIMEOUT: Duration = Duration::from_secs(10);
const IDLE: &str = "10.0.0.1:8000";
const BUSY: &str = "10.0.0.2:8000";

async fn start_picker() -> RunningPicker {
    let yaml = format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\ninsecure_ingest: true\nadmin_addr: 127.0.0.1:0\nblock_size: 16\n\
         models:\n  - name: {MODEL}\n"
    );
    let config = PickerConfig::from_yaml(&yaml).unwrap();
    config.validate().unwrap();
    kvroute_picker::start(&config).await.unwrap()
}

/// Reports two ready pods and no KV blocks, ever: `pod-idle` (0% GPU) and `pod-busy` (80%).
async fn connect_agent(picker: &RunningPicker) -> FakeAgent {
    let pods = [FakePod::new("pod-idle", IDLE, MODEL), FakePod::new("pod-busy", BUSY, MODEL).with_gpu_utilization(0.8)];
    let agent = FakeAgent::connect(picker.ingest_addr, &pods).await.unwrap();
    let ready = || picker.gateway.pool.pods().iter().filter(|p| p.ready).count() >= 2;
    assert!(poll_until(TIMEOUT, ready).await, "pods never showed up: {:?}", picker.gateway.pool.pods());
    agent
}

fn hdr(k: &str, v: &str) -> HeaderValue {
    HeaderValue { key: k.into(), value: String::new(), raw_value: v.as_bytes().to_vec() }
}

/// One request through its own ext_proc stream (closed after the answer, releasing the slot);
/// `subset` restricts the candidates like Envoy's subset hint. Returns the routed endpoint.
async fn route(picker: &RunningPicker, path: &str, body: &serde_json::Value, subset: Option<&str>) -> String {
    let mut client = ExternalProcessorClient::connect(format!("http://{}", picker.ext_proc_addr)).await.unwrap();
    let (tx, rx) = mpsc::channel(4);
    let mut answers = client.process(ReceiverStream::new(rx)).await.unwrap().into_inner();
    let headers = vec![hdr(":method", "POST"), hdr(":path", path), hdr("content-type", "application/json")];
    let metadata_context = subset.map(|s| Metadata {
        filter_metadata: HashMap::from([(
            "envoy.lb.subset_hint".to_owned(),
            Struct {
                fields: HashMap::from([(
                    "x-gateway-destination-endpoint-subset".to_owned(),
                    Value { kind: Some(Kind::StringValue(s.into())) },
                )]),
            },
        )]),
        ..Default::default()
    });
    let first = ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            ..Default::default()
        })),
        metadata_context,
        ..Default::default()
    };
    tx.send(first).await.unwrap();
    assert!(matches!(next(&mut answers).await.response, Some(Response::RequestHeaders(_))));
    let body = ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: body.to_string().into_bytes(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    };
    tx.send(body).await.unwrap();
    let r = next(&mut answers).await;
    let Some(Response::RequestBody(b)) = &r.response else { panic!("expected a routed body answer, got {r:?}") };
    let set = &b.response.as_ref().unwrap().header_mutation.as_ref().unwrap().set_headers;
    let h = set.iter().filter_map(|h| h.header.as_ref()).find(|h| h.key == "x-gateway-destination-endpoint");
    String::from_utf8(h.expect("destination header").raw_value.clone()).unwrap()
}

async fn next(answers: &mut tonic::Streaming<ProcessingResponse>) -> ProcessingResponse {
    tokio::time::timeout(TIMEOUT, answers.message()).await.expect("picker did not answer").unwrap().unwrap()
}

/// A long shared document: 40 blocks of 64 characters, all distinct.
fn document() -> String {
    (0..320).map(|i| format!("line{i:03} ")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefix_follows_the_first_request_without_tokenizer_or_kv_events() {
    let picker = start_picker().await;
    let _agent = connect_agent(&picker).await;
    assert!(picker.gateway.models.resolve(MODEL).unwrap().approx.is_some(), "no tokenizer: approximate");
    let doc = document();

    // Turn 1 is pinned to the busy pod by a subset hint; nothing tells the picker what it caches.
    let q1 = serde_json::json!({"model": MODEL, "prompt": format!("{doc}\nQ: first question?")});
    assert_eq!(route(&picker, "/v1/completions", &q1, Some(BUSY)).await, BUSY);
    // Turn 2 shares the document: it follows turn 1 although the other pod is idle.
    let q2 = serde_json::json!({"model": MODEL, "prompt": format!("{doc}\nQ: second question?")});
    assert_eq!(route(&picker, "/v1/completions", &q2, None).await, BUSY);
    // An unrelated prompt has nothing to follow: load decides.
    let other = serde_json::json!({"model": MODEL, "prompt": "z".repeat(3000)});
    assert_eq!(route(&picker, "/v1/completions", &other, None).await, IDLE);

    // Chat: turn 2 (turn 1 + the answer + a new question) lands on turn 1's pod.
    let turn1 = vec![
        serde_json::json!({"role": "system", "content": doc}),
        serde_json::json!({"role": "user", "content": "Summarize."}),
    ];
    let c1 = serde_json::json!({"model": MODEL, "messages": turn1});
    assert_eq!(route(&picker, "/v1/chat/completions", &c1, Some(BUSY)).await, BUSY);
    let mut turn2 = turn1.clone();
    turn2.push(serde_json::json!({"role": "assistant", "content": "A list of lines."}));
    turn2.push(serde_json::json!({"role": "user", "content": "Which is the longest?"}));
    let c2 = serde_json::json!({"model": MODEL, "messages": turn2});
    assert_eq!(route(&picker, "/v1/chat/completions", &c2, None).await, BUSY);
    // The same contents under other roles are another prompt.
    let roles = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": doc}]});
    assert_eq!(route(&picker, "/v1/chat/completions", &roles, None).await, IDLE);

    // epp_cache_match_ratio saw the two follow-ups' high ratios (plus four zeros).
    let m = &picker.gateway.metrics.cache_match_ratio;
    let mut text = String::new();
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register("ratio", "test", m.clone());
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let sum: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("ratio_sum "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no ratio_sum in {text}"));
    assert!(sum > 1.8, "two follow-ups with ratios near 1 expected: {text}");
    picker.shutdown();
}
