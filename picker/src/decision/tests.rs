//! The decision pipeline end to end on an in-process gateway: `/explain` names the pod routing
//! chooses, with the same matched blocks, in every mode (precise with a tokenizer, approximate
//! without one, approximate chosen explicitly over a tokenizer), for chat and completion bodies.

use super::*;
use crate::config::PickerConfig;
use crate::pool::tests::{put, stats};

const MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";

fn tokenizer_dir() -> String {
    format!("{}/../tests/fixtures/tokenizer-qwen2.5", env!("CARGO_MANIFEST_DIR"))
}

fn gateway(models: &str) -> Gateway {
    let config = PickerConfig::from_yaml(&format!("models: [{models}]")).unwrap();
    config.validate().unwrap();
    Gateway::new(&config).unwrap()
}

fn chat_body(model: &str) -> Vec<u8> {
    let text = "Routing places each request where its prompt prefix is cached. ".repeat(12);
    serde_json::json!({"model": model, "messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": text},
    ]})
    .to_string()
    .into_bytes()
}

fn completion_body(model: &str) -> Vec<u8> {
    let text = "The quick brown fox jumps over the lazy dog, again and again. ".repeat(12);
    serde_json::json!({"model": model, "prompt": text}).to_string().into_bytes()
}

/// Model `model` (served as base model `model` by `{model}-cached` and `{model}-idle`): the cached
/// pod, at half load, holds the request's whole chain where `mode` reads it (the KV-event index in
/// precise mode, the record of earlier routing in approximate mode); the idle pod holds nothing,
/// so load alone would choose it. Explain and decide must agree on the cached pod, and explain
/// must see every block.
async fn explain_names_the_routed_pod(gw: &Gateway, model: &str, mode: RoutingMode, path: &str, body: &[u8]) {
    let (cached_pod, idle_pod) = (format!("{model}-cached"), format!("{model}-idle"));
    let input = DecisionInput { request_id: "t", path, body: Some(body), subset: None };
    let prepared = prepare(gw, &input).unwrap();
    assert_eq!(prepared.mode, mode, "{model}");
    let chain = prepared.block_hashes().to_vec();
    drop(prepared);
    assert!(chain.len() >= 4, "{model} {path}: a prompt of several blocks, got {}", chain.len());
    let indexed: &[BlockHash] = match gw.models.resolve(model).and_then(|m| m.approx.as_ref()) {
        Some(a) => {
            a.store.record(&cached_pod, &chain);
            &[]
        }
        None => &chain,
    };
    put(&gw.pool, &cached_pod, model, stats(0.5, 0, 1.0), indexed).await;
    put(&gw.pool, &idle_pod, model, stats(0.0, 0, 1.0), &[]).await;

    let explained = explain(gw, &input).unwrap();
    let ex = &explained.explanation;
    let cached = ex.candidates.iter().find(|c| *c.pod == *cached_pod).unwrap();
    assert_eq!(cached.matched_blocks as usize, chain.len(), "{model} {path}: {ex:?}");
    assert_eq!(ex.choice.as_deref(), Some(cached_pod.as_str()), "{model} {path}: {ex:?}");

    let routed = decide(gw, &input).unwrap();
    assert_eq!(Some(routed.pod.as_str()), ex.choice.as_deref(), "{model} {path}");
    assert_eq!(routed.matched_blocks, cached.matched_blocks, "{model} {path}");
}

#[tokio::test]
async fn explain_chooses_what_routing_chooses_in_every_mode() {
    // One gateway (one tokenizer load), one base model per mode.
    let dir = tokenizer_dir();
    let gw = gateway(&format!(
        "{{name: precise, tokenizer: {dir}}}, {{name: approximate}}, \
         {{name: approximate-over-tokenizer, tokenizer: {dir}, mode: approximate}}"
    ));
    let cases = [
        ("precise", RoutingMode::Precise),
        ("approximate", RoutingMode::Approximate),
        ("approximate-over-tokenizer", RoutingMode::Approximate),
    ];
    for (model, mode) in cases {
        explain_names_the_routed_pod(&gw, model, mode, "/v1/chat/completions", &chat_body(model)).await;
        explain_names_the_routed_pod(&gw, model, mode, "/v1/completions", &completion_body(model)).await;
    }
}

#[tokio::test]
async fn explain_rejects_like_routing() {
    let gw = gateway(&format!("{{name: {MODEL}}}"));
    let input = |body: &'static [u8]| DecisionInput {
        request_id: "t",
        path: "/v1/completions",
        body: Some(body),
        subset: None,
    };
    let unknown = explain(&gw, &input(br#"{"model":"nope","prompt":"x"}"#)).unwrap_err();
    assert_eq!((unknown.status, unknown.message.as_str()), (404, "model `nope` does not exist"));
    assert_eq!(explain(&gw, &input(b"{not json")).unwrap_err().status, 400);
    // No pod serves the model: both answer 503.
    assert_eq!(decide(&gw, &input(br#"{"model":"Qwen/Qwen2.5-7B-Instruct","prompt":"x"}"#)).unwrap_err().status, 503);
    let ex = explain(&gw, &input(br#"{"model":"Qwen/Qwen2.5-7B-Instruct","prompt":"x"}"#)).unwrap();
    assert_eq!(ex.explanation.choice, None);
}
