//! The decision pipeline end to end on an in-process gateway: `/explain` names the pod routing
//! chooses, with the same matched blocks, in every mode (precise with a tokenizer, approximate
//! without one, approximate chosen explicitly over a tokenizer), for chat and completion bodies.

use super::*;
use crate::config::PickerConfig;
use crate::pool::tests::{put, stats};
use kvroute_proto::agent::v1::PodStats;

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
    let input =
        DecisionInput { request_id: "t", path, body: Some(body), subset: None, objective: None, slo_ttft_ms: None };
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
    let input = |body: &'static [u8]| DecisionInput::new("t", "/v1/completions", Some(body));
    let unknown = explain(&gw, &input(br#"{"model":"nope","prompt":"x"}"#)).unwrap_err();
    assert_eq!((unknown.status, unknown.message.as_str()), (404, "model `nope` does not exist"));
    assert_eq!(explain(&gw, &input(b"{not json")).unwrap_err().status, 400);
    // No pod serves the model: both answer 503.
    assert_eq!(decide(&gw, &input(br#"{"model":"Qwen/Qwen2.5-7B-Instruct","prompt":"x"}"#)).unwrap_err().status, 503);
    let ex = explain(&gw, &input(br#"{"model":"Qwen/Qwen2.5-7B-Instruct","prompt":"x"}"#)).unwrap();
    assert_eq!(ex.explanation.choice, None);
}

/// A 4 MB model name, or one carrying line breaks, is quoted in the 404 only bounded and cleaned;
/// so is a parser error quoting a huge string value.
#[test]
fn errors_quote_client_input_bounded_and_without_control_characters() {
    let gw = gateway("{name: m}");
    let huge = format!("evil\nINFO forged line {}", "x".repeat(4 << 20));
    let body = serde_json::json!({"model": huge, "prompt": "hi"}).to_string().into_bytes();
    let input = DecisionInput::new("t", "/v1/completions", Some(&body));
    let Err(rej) = prepare(&gw, &input) else { panic!("unknown model accepted") };
    assert_eq!(rej.status, 404);
    assert!(rej.message.len() <= MAX_MESSAGE_BYTES + 32, "{} bytes", rej.message.len());
    assert!(rej.message.contains("evil\u{FFFD}INFO forged line"), "{}", rej.message);
    assert!(!rej.message.chars().any(char::is_control), "{:?}", rej.message);

    let bad = format!(r#"{{"model":"m","prompt":"hi","max_tokens":"{}"}}"#, "9".repeat(1 << 20)).into_bytes();
    let input = DecisionInput::new("t", "/v1/completions", Some(&bad));
    if let Err(rej) = prepare(&gw, &input) {
        assert!(rej.message.len() <= MAX_MESSAGE_BYTES + 32, "{} bytes", rej.message.len());
    }
    assert_eq!(bounded_message("short".into()), "short");
    let cut = bounded_message("é".repeat(400));
    assert!(cut.ends_with("… (800 bytes)") && cut.len() <= MAX_MESSAGE_BYTES + 32, "{cut}");
}

fn responses_body(model: &str) -> Vec<u8> {
    let text = "Routing places each request where its prompt prefix is cached. ".repeat(12);
    serde_json::json!({"model": model, "instructions": "You are a careful assistant.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": text}]},
    ]})
    .to_string()
    .into_bytes()
}

/// OpenAI Responses API (`/v1/responses`): prefix-matched like chat in every mode, and in precise
/// mode tokenized exactly as the equivalent chat request (instructions = system message), which
/// is what the engine renders; `input` as a plain string too.
#[tokio::test]
async fn responses_api_is_prefix_matched_like_chat() {
    let dir = tokenizer_dir();
    let gw = gateway(&format!("{{name: precise, tokenizer: {dir}}}, {{name: approximate}}"));
    for (model, mode) in [("precise", RoutingMode::Precise), ("approximate", RoutingMode::Approximate)] {
        explain_names_the_routed_pod(&gw, model, mode, "/v1/responses", &responses_body(model)).await;
    }
    let prep = |path: &'static str, body: &[u8]| {
        let input =
            DecisionInput { request_id: "t", path, body: Some(body), subset: None, objective: None, slo_ttft_ms: None };
        let p = prepare(&gw, &input).unwrap();
        (p.tokens.clone(), p.unmatched_reason)
    };
    let (chat, _) = prep("/v1/chat/completions", &chat_body("precise"));
    let (responses, why) = prep("/v1/responses", &responses_body("precise"));
    assert!(chat.len() > 100, "{}", chat.len());
    assert_eq!(responses, chat, "same tokens as the chat request the engine renders ({why})");
    let plain = serde_json::json!({"model": "precise", "input": "hello there"}).to_string();
    let user_only = serde_json::json!({"model": "precise", "messages": [{"role": "user", "content": "hello there"}]});
    assert_eq!(
        prep("/v1/responses", plain.as_bytes()).0,
        prep("/v1/chat/completions", user_only.to_string().as_bytes()).0
    );
    // An item the chat template cannot show the same way: routed by load, with the reason.
    let call = serde_json::json!({"model": "precise", "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]});
    let (tokens, why) = prep("/v1/responses", call.to_string().as_bytes());
    assert!(tokens.is_empty() && why.contains("responses input item"), "{why}");
}

/// An inference request without a body, or with an empty one, is a 400 with a clear message; a
/// body-less request to another path (`/v1/models`) is still routed by load.
#[tokio::test]
async fn empty_body_is_a_400() {
    let gw = gateway(&format!("{{name: {MODEL}}}"));
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/responses"] {
        for body in [None, Some(&b""[..]), Some(&b" \n"[..])] {
            let input = DecisionInput { request_id: "t", path, body, subset: None, objective: None, slo_ttft_ms: None };
            let rej = decide(&gw, &input).unwrap_err();
            assert_eq!(rej.status, 400, "{path} {body:?}: {rej:?}");
            assert!(rej.message.contains("needs a JSON request body"), "{}", rej.message);
        }
    }
    put(&gw.pool, "p", MODEL, stats(0.0, 0, 1.0), &[]).await;
    let input = DecisionInput::new("t", "/v1/models", None);
    assert_eq!(decide(&gw, &input).unwrap().pod.as_str(), "p");
}

/// docs/design.md §2 salted prompts: in precise mode a salted prompt's chain is the keyed chain
/// vLLM and the agent compute (the salt on the first block), shares no block with the unsalted
/// chain or another salt's, and routes to the pod holding its own salted blocks; approximate mode
/// does not match salted prompts.
#[tokio::test]
async fn a_salted_prompt_matches_only_its_salts_chain() {
    let dir = tokenizer_dir();
    let gw = gateway(&format!("{{name: precise, tokenizer: {dir}}}, {{name: approximate}}"));
    let body = |model: &str, salt: Option<&str>| {
        let mut v: serde_json::Value = serde_json::from_slice(&chat_body(model)).unwrap();
        if let Some(s) = salt {
            v["cache_salt"] = serde_json::json!(s);
        }
        v.to_string().into_bytes()
    };
    let chain = |b: &[u8]| {
        let input = DecisionInput::new("t", "/v1/chat/completions", Some(b));
        let p = prepare(&gw, &input).unwrap();
        (p.tokens.clone(), p.block_hashes().to_vec(), p.unmatched_reason)
    };
    let (tokens, plain, _) = chain(&body("precise", None));
    let (_, salted_a, why) = chain(&body("precise", Some("tenant-a")));
    let (_, salted_b, _) = chain(&body("precise", Some("tenant-b")));
    assert_eq!(why, "");
    let Some(model) = gw.models.resolve("precise") else { panic!("model") };
    let mut want = Vec::new();
    let keys = kvroute_common::BlockKeys { cache_salt: Some("tenant-a".into()), items: Vec::new() };
    model.hasher.hash_prompt_keyed(&tokens, &keys, &mut want);
    assert_eq!(salted_a, want);
    assert_eq!(salted_a.len(), plain.len());
    assert!(salted_a.iter().all(|h| !plain.contains(h) && !salted_b.contains(h)));
    // tenant-b's pod holds tenant-b's blocks, the other pod the unsalted ones: tenant-a matches
    // neither; tenant-b routes to its own.
    put(&gw.pool, "b-pod", "precise", stats(0.5, 0, 1.0), &salted_b).await;
    put(&gw.pool, "plain-pod", "precise", stats(0.5, 0, 1.0), &plain).await;
    let a_body = body("precise", Some("tenant-a"));
    let input = DecisionInput::new("t", "/v1/chat/completions", Some(&a_body));
    let ex = explain(&gw, &input).unwrap().explanation;
    assert!(ex.candidates.iter().all(|c| c.matched_blocks == 0), "{ex:?}");
    let b_body = body("precise", Some("tenant-b"));
    let input = DecisionInput::new("t", "/v1/chat/completions", Some(&b_body));
    let routed = decide(&gw, &input).unwrap();
    assert_eq!((routed.pod.as_str(), routed.matched_blocks as usize), ("b-pod", salted_b.len()));
    drop(routed);
    let (_, approx, why) = chain(&body("approximate", Some("tenant-a")));
    assert!(approx.is_empty() && why.contains("cache_salt"), "{why}");
}

/// The Kubernetes source's model resolution (docs/design.md §14): a rewrite target that a pod runs
/// as a LoRA adapter scores as that adapter on the pod's base model; a target named by a
/// `models[]` entry takes that entry; names without a rule pass through when the engines serve
/// them (as base model or adapter) and are 404 otherwise; file mode ignores the table.
#[tokio::test]
async fn rewrite_targets_resolve_through_models_and_the_engines_reports() {
    use kvroute_cluster::{ModelRule, ModelTable, ModelTarget, Source};
    let mut gw = gateway("{name: chat-file, target_model: base-x}");
    gw.rewrites = true;
    let adapters = PodStats { running_adapters: vec!["sql-lora".into()], ..stats(0.1, 0, 1.0) };
    put(&gw.pool, "p", "base-x", adapters, &[]).await;
    let rule = |matches: &str, target: &str| ModelRule {
        source: "r".into(),
        matches: vec![matches.into()],
        targets: vec![ModelTarget { model: target.into(), adapter: None, weight: None }],
    };
    let table = ModelTable::build(
        Source::File("t".into()),
        vec![rule("chat", "sql-lora"), rule("alias", "chat-file"), rule("other", "base-y")],
        Default::default(),
        0,
        true,
    );
    gw.model_table.store(Some(Arc::new(table)));

    let r = gw.resolve("chat").unwrap();
    assert_eq!((r.model.target_model.as_str(), r.model.adapter.as_deref()), ("base-x", Some("sql-lora")));
    assert_eq!(r.rewrite.as_deref(), Some("sql-lora"));
    let r = gw.resolve("alias").unwrap();
    assert_eq!((r.model.name.as_str(), r.model.target_model.as_str()), ("chat-file", "base-x"));
    assert_eq!(r.rewrite.as_deref(), Some("chat-file"));
    let r = gw.resolve("other").unwrap();
    assert_eq!((r.model.target_model.as_str(), r.model.adapter.as_deref()), ("base-y", None), "unknown target: a base");
    let r = gw.resolve("base-x").unwrap();
    assert_eq!((r.model.target_model.as_str(), r.rewrite.as_deref()), ("base-x", None), "served: passed through");
    let r = gw.resolve("sql-lora").unwrap();
    assert_eq!((r.model.adapter.as_deref(), r.rewrite.as_deref()), (Some("sql-lora"), None));
    assert!(Arc::ptr_eq(&gw.resolve("chat").unwrap().model, &r.model), "targets are built once");
    assert!(gw.resolve("nope").is_err());

    // The decision carries the rewrite and scores the adapter on its pod.
    let body = br#"{"model":"chat","prompt":"hello","max_tokens":3}"#;
    let input = DecisionInput::new("t", "/v1/completions", Some(body));
    let (decision, rewrite, _record) = decide_cancellable(&gw, &input, &AtomicBool::new(false)).unwrap();
    assert_eq!((decision.pod.as_str(), rewrite.as_deref()), ("p", Some("sql-lora")));
    let ex = explain(&gw, &input).unwrap();
    assert_eq!(ex.explanation.candidates[0].adapter, 1.0, "the pod runs the adapter");
    let rewritten: serde_json::Value =
        serde_json::from_slice(&crate::request::rewrite_model(body, "sql-lora").unwrap()).unwrap();
    assert_eq!(rewritten, serde_json::json!({"model": "sql-lora", "prompt": "hello", "max_tokens": 3}));
    let unknown = decide(&gw, &DecisionInput { body: Some(br#"{"model":"nope","prompt":"x"}"#), ..input }).unwrap_err();
    assert_eq!((unknown.status, unknown.message.as_str()), (404, "model `nope` does not exist"));

    // File mode: the table is not consulted.
    gw.rewrites = false;
    assert!(gw.resolve("chat").is_err());
    assert_eq!(gw.resolve("chat-file").unwrap().rewrite, None);
}

/// A chat body for the image tests: a long system prompt, then a user message with a text, one
/// image part per `(url, uuid)` and a question.
fn image_chat(model: &str, images: &[(&str, Option<&str>)]) -> Vec<u8> {
    let system = "You describe pictures for a museum catalogue, precisely and briefly. ".repeat(10);
    let mut parts = vec![serde_json::json!({"type": "text", "text": "Here is the picture:"})];
    for (url, uuid) in images {
        let mut part = serde_json::json!({"type": "image_url", "image_url": {"url": url}});
        if let Some(u) = uuid {
            part["uuid"] = serde_json::json!(u);
        }
        parts.push(part);
    }
    parts.push(
        serde_json::json!({"type": "text", "text": "What does it show, and in which colours, mostly? ".repeat(4)}),
    );
    serde_json::json!({"model": model, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": parts},
    ]})
    .to_string()
    .into_bytes()
}

/// A gateway for `models` (`DIR`: the fixture tokenizer) and, for the `vl` chat with one image
/// the picker cannot reproduce, what the template renders: its ids, the image placeholder's id
/// and position, and the plain (unkeyed) block chain of those ids.
struct VisionChat {
    gw: Gateway,
    pad: u32,
    rendered: Vec<u32>,
    at: usize,
    plain: Vec<BlockHash>,
}

fn vision_chat(models: &str) -> VisionChat {
    let gw = gateway(&models.replace("DIR", &tokenizer_dir()));
    let model = gw.models.resolve("vl-size").unwrap().clone();
    let pad = model.images.placeholder.unwrap();
    let (rendered, _, _) =
        prepared_chain(&gw, "/v1/chat/completions", &image_chat("vl", &[("https://x/cat.png", None)]));
    let at = rendered.iter().position(|t| *t == pad).unwrap();
    let mut plain = Vec::new();
    model.hasher.hash_prompt(&rendered, &mut plain);
    VisionChat { gw, pad, rendered, at, plain }
}

/// (tokens, chain, unmatched reason) of a chat body.
fn prepared_chain(gw: &Gateway, path: &str, body: &[u8]) -> (Vec<u32>, Vec<BlockHash>, &'static str) {
    let input =
        DecisionInput { request_id: "t", path, body: Some(body), subset: None, objective: None, slo_ttft_ms: None };
    let p = prepare(gw, &input).unwrap();
    (p.tokens.clone(), p.block_hashes().to_vec(), p.unmatched_reason)
}

/// The prompt the engine sees for `rendered` with its image placeholder at `at` expanded to `n`
/// placeholder tokens `pad`.
fn expanded(rendered: &[u32], at: usize, pad: u32, n: usize) -> Vec<u32> {
    let mut engine = rendered[..at].to_vec();
    engine.extend(std::iter::repeat_n(pad, n));
    engine.extend_from_slice(&rendered[at + 1..]);
    engine
}

/// The block chain the agent folds for `engine` with one image `identifier` over `length`
/// tokens from `at` (the engine's BlockStored keys).
fn one_image_chain(
    model: &ResolvedModel,
    engine: &[u32],
    identifier: &str,
    at: usize,
    length: usize,
) -> Vec<BlockHash> {
    let item = kvroute_common::MmItem { identifier: identifier.to_owned(), offset: at, length };
    let keys = BlockKeys { cache_salt: None, items: vec![item] };
    let mut chain = Vec::new();
    model.hasher.hash_prompt_keyed(engine, &keys, &mut chain);
    chain
}

const IMAGE_MODELS: &str =
    "{name: vl, tokenizer: DIR}, {name: vl-fixed, target_model: vl, tokenizer: DIR, image_tokens: 40}";

/// docs/design.md §2, images the picker cannot reproduce (no `uuid`, or no fixed `image_tokens`):
/// the chain is the plain chain of the full blocks that end before the first image's placeholder,
/// whatever the image, so requests sharing a system prompt but carrying different images go to
/// the pod holding the system prompt, and no block from the image on is claimed.
#[tokio::test]
async fn images_without_uuid_claim_the_text_before_the_first_image_only() {
    let gw = gateway(&IMAGE_MODELS.replace("DIR", &tokenizer_dir()));
    let pad = gw.models.resolve("vl").unwrap().images.placeholder.expect("the fixture has <|image_pad|>");
    let chat = "/v1/chat/completions";
    let (tokens, cat, why) = prepared_chain(&gw, chat, &image_chat("vl", &[("https://x/cat.png", None)]));
    assert_eq!(why, "");
    let at = tokens.iter().position(|t| *t == pad).unwrap();
    assert_eq!(tokens.iter().filter(|t| **t == pad).count(), 1, "not expanded without image_tokens");
    assert!(at >= 64 && tokens.len() / 16 > at / 16 + 2, "text before and after the image: {at} of {}", tokens.len());
    let mut plain = Vec::new();
    gw.models.resolve("vl").unwrap().hasher.hash_prompt(&tokens, &mut plain);
    assert_eq!(cat, plain[..at / 16], "the text blocks before the image, nothing from it on");
    // Another image, or the same one with a uuid but no image_tokens: the same claim.
    let (_, dog, _) = prepared_chain(&gw, chat, &image_chat("vl", &[("https://x/dog.png", None)]));
    let (_, uuid, _) = prepared_chain(&gw, chat, &image_chat("vl", &[("https://x/dog.png", Some("dog"))]));
    let (_, fixed, _) = prepared_chain(&gw, chat, &image_chat("vl-fixed", &[("https://x/dog.png", None)]));
    assert!(dog == cat && uuid == cat && fixed == cat);

    // The pod holding the system prompt's blocks wins over an idle pod for a new image.
    put(&gw.pool, "holder", "vl", stats(0.5, 0, 1.0), &plain[..at / 16]).await;
    put(&gw.pool, "idle", "vl", stats(0.0, 0, 1.0), &[]).await;
    let body = image_chat("vl", &[("https://x/bird.png", None)]);
    let input = DecisionInput::new("t", chat, Some(&body));
    let routed = decide(&gw, &input).unwrap();
    assert_eq!((routed.pod.as_str(), routed.matched_blocks as usize), ("holder", at / 16));
    drop(routed);
    // Routing recorded nothing past the image as pending on the holder: the next image is credited
    // with the text blocks only.
    let body = image_chat("vl", &[("https://x/fish.png", None)]);
    let ex = explain(&gw, &DecisionInput { body: Some(&body), ..input }).unwrap().explanation;
    let holder = ex.candidates.iter().find(|c| &*c.pod == "holder").unwrap();
    assert_eq!(holder.matched_blocks as usize, at / 16, "{ex:?}");
}

/// A fixture image (tests/fixtures/images, README there) as a client sends it inline.
fn fixture_data_url(name: &str, media_type: &str) -> (Vec<u8>, String) {
    let path = format!("{}/../tests/fixtures/images/{name}", env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let url = data_url(media_type, &bytes);
    (bytes, url)
}

/// `bytes` as a base64 `data:` URL of `media_type`.
fn data_url(media_type: &str, bytes: &[u8]) -> String {
    use base64::Engine as _;
    format!("data:{media_type};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// docs/design.md §2, inline images without `uuid` on a model whose count follows the image size
/// (`vision`): the picker decodes the data URL, reads the size from the PNG or JPEG header (other
/// formats: the next test),
/// expands the placeholder to the Qwen2-VL count (300×200 → 77 tokens, worked in the fixtures'
/// README) and keys the blocks with vLLM's content hash of the bytes, so the same image matches
/// through it on the pod that served it, another image only up to it, and anything it cannot
/// reproduce (http URL, malformed base64, a truncated or absurd header) stops the claim at the
/// image, never a rejection.
#[tokio::test]
async fn inline_images_are_hashed_and_sized_as_vllm_does() {
    let models = format!(
        "{IMAGE_MODELS}, {{name: vl-size, target_model: vl, tokenizer: DIR, vision: {{}}}}, \
         {{name: vl-path, target_model: vl, tokenizer: DIR, vision: {{}}, image_hash_model: /models/vl}}"
    );
    let VisionChat { gw, pad, rendered, at, plain } = vision_chat(&models);
    let model = gw.models.resolve("vl-size").unwrap();
    let chat = "/v1/chat/completions";

    let (png, png_url) = fixture_data_url("gradient-300x200.png", "image/png");
    let (tokens, cat, why) = prepared_chain(&gw, chat, &image_chat("vl-size", &[(&png_url, None)]));
    assert_eq!(why, "");
    let engine = expanded(&rendered, at, pad, 77);
    assert_eq!(tokens, engine, "the placeholder expanded to the image's 77 tokens");
    let identifier = kvroute_common::image::content_identifier("vl", &png);
    let want = one_image_chain(model, &engine, &identifier, at, 77);
    assert_eq!(cat, want, "every full block, the image's keyed with vLLM's identifier");
    assert!(cat.len() * 16 > at + 77 + 16, "the chain goes past the image");

    // The same bytes under another media type: the same identity (vLLM hashes the bytes).
    let (_, same, _) =
        prepared_chain(&gw, chat, &image_chat("vl-size", &[(&png_url.replacen("image/png", "image/jpeg", 1), None)]));
    assert_eq!(same, cat);
    // With a uuid: the uuid is the identifier, the size still gives the count.
    let (tokens_uuid, by_uuid, _) = prepared_chain(&gw, chat, &image_chat("vl-size", &[(&png_url, Some("cat"))]));
    assert_eq!(tokens_uuid, engine);
    assert_eq!(by_uuid, one_image_chain(model, &engine, "cat", at, 77));
    // The engine's `model` enters the hash: another image_hash_model, another chain after the text.
    let (_, by_path, _) = prepared_chain(&gw, chat, &image_chat("vl-path", &[(&png_url, None)]));
    assert_eq!((by_path.len(), &by_path[..at / 16]), (cat.len(), &cat[..at / 16]));
    assert_ne!(by_path[at / 16], cat[at / 16]);
    // A JPEG (progressive, EXIF): 130×90 → 15 tokens, its own identity from its first block on.
    let (jpg, jpg_url) = fixture_data_url("pattern-130x90-progressive-exif.jpg", "image/jpeg");
    let (tokens_jpg, dog, _) = prepared_chain(&gw, chat, &image_chat("vl-size", &[(&jpg_url, None)]));
    assert_eq!(tokens_jpg.iter().filter(|t| **t == pad).count(), 15);
    assert_eq!(dog[..at / 16], cat[..at / 16]);
    assert!(dog[at / 16..].iter().all(|h| !cat.contains(h)), "another image: another chain from its first block");
    // A fixed count (image_tokens) also hashes inline images without uuid.
    let (_, fixed, _) = prepared_chain(&gw, chat, &image_chat("vl-fixed", &[(&jpg_url, None)]));
    assert!(fixed.len() > at / 16 + 2 && fixed[..at / 16] == cat[..at / 16]);

    // What the picker cannot reproduce ends the claim at the image, and is no error.
    let truncated = data_url("image/png", &png[..20]);
    let mut absurd = png.clone();
    absurd[16..24].copy_from_slice(&[0, 0, 0x9C, 0x40, 0, 0, 0, 1]); // 40000 × 1: aspect over 200
    let absurd = data_url("image/png", &absurd);
    let cut = &png_url[..png_url.len() - 1];
    let spaced = png_url.replacen(",", ", ", 1);
    for url in ["https://x/cat.png", "data:image/png;base64,!!!!", cut, &spaced, &truncated, &absurd, "data:,", ""] {
        let (_, chain, why) = prepared_chain(&gw, chat, &image_chat("vl-size", &[(url, None)]));
        assert_eq!((chain.as_slice(), why), (&plain[..at / 16], ""), "{:.60}", url);
    }
    // A first image reproduced, a second not: keyed through the first, nothing from the second on.
    let (tokens2, two, _) =
        prepared_chain(&gw, chat, &image_chat("vl-size", &[(&png_url, None), ("https://x/a.png", None)]));
    let second = tokens2.iter().rposition(|t| *t == pad).unwrap();
    assert_eq!(tokens2.iter().filter(|t| **t == pad).count(), 78);
    assert_eq!(two[..], cat[..second / 16]);
    // mm_processor_kwargs enter vLLM's hash (and may resize): the claim stops at the image.
    let mut v: serde_json::Value = serde_json::from_slice(&image_chat("vl-size", &[(&png_url, None)])).unwrap();
    v["mm_processor_kwargs"] = serde_json::json!({"max_pixels": 200704});
    let (_, kwargs, _) = prepared_chain(&gw, chat, v.to_string().as_bytes());
    assert_eq!(kwargs[..], plain[..at / 16]);

    // Routing: the pod holding the first request's blocks is credited through the image for the
    // same image, and up to it for another.
    put(&gw.pool, "holder", "vl", stats(0.5, 0, 1.0), &cat).await;
    put(&gw.pool, "idle", "vl", stats(0.0, 0, 1.0), &[]).await;
    let again = image_chat("vl-size", &[(&png_url, None)]);
    let input = DecisionInput::new("t", chat, Some(&again));
    let routed = decide(&gw, &input).unwrap();
    assert_eq!((routed.pod.as_str(), routed.matched_blocks as usize), ("holder", cat.len()));
    drop(routed);
    let other = image_chat("vl-size", &[(&jpg_url, None)]);
    let ex = explain(&gw, &DecisionInput { body: Some(&other), ..input }).unwrap().explanation;
    let holder = ex.candidates.iter().find(|c| &*c.pod == "holder").unwrap();
    assert_eq!(holder.matched_blocks as usize, at / 16, "another image: up to it only; {ex:?}");
    let _ = jpg;
}

/// docs/decisions/0049-image-identifier-off-the-decision.md: an inline image the picker has not
/// read before (a payload over the cache's 16 KiB floor) is sized from its header alone, so the
/// prompt is expanded to its 77 tokens but nothing is claimed from it on, and its identifier is
/// read in the background; once read, the same payload is keyed through the image as vLLM keys
/// it. A second new image after it is expanded too.
#[tokio::test]
async fn a_new_large_image_is_sized_now_and_identified_in_the_background() {
    let models = format!("{IMAGE_MODELS}, {{name: vl-size, target_model: vl, tokenizer: DIR, vision: {{}}}}");
    let VisionChat { gw, pad, rendered, at, plain } = vision_chat(&models);
    let model = gw.models.resolve("vl-size").unwrap().clone();
    let chat = "/v1/chat/completions";
    // 300×200 (77 tokens), then 60 KB that only the whole read decodes and hashes.
    let mut png =
        std::fs::read(format!("{}/../tests/fixtures/images/gradient-300x200.png", env!("CARGO_MANIFEST_DIR"))).unwrap();
    png.extend((0..60_000u32).map(|i| (i * 7 % 251) as u8));
    let url = data_url("image/png", &png);
    let body = image_chat("vl-size", &[(&url, None)]);
    let engine = expanded(&rendered, at, pad, 77);
    let deferred = gw.metrics.image_reads_deferred.get();
    let (tokens, chain, why) = prepared_chain(&gw, chat, &body);
    assert_eq!((tokens.as_slice(), why), (engine.as_slice(), ""), "expanded from the header");
    assert_eq!(chain, plain[..at / 16], "nothing claimed from the image on");
    assert!(gw.metrics.image_reads_deferred.get() > deferred, "the read was queued");
    // The background read lands in the model's cache (generous bound: a loaded machine).
    let want = one_image_chain(&model, &engine, &kvroute_common::image::content_identifier("vl", &png), at, 77);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let through = loop {
        let (tokens, chain, _) = prepared_chain(&gw, chat, &body);
        assert_eq!(tokens, engine);
        if chain.len() > at / 16 || std::time::Instant::now() > deadline {
            break chain;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(through, want, "keyed through the image with vLLM's identifier");
    // Two images, the first known, the second new: the first keyed, the second expanded but
    // not claimed.
    let mut other = png.clone();
    other.extend_from_slice(b"new");
    let other_url = data_url("image/png", &other);
    let (tokens2, chain2, _) = prepared_chain(&gw, chat, &image_chat("vl-size", &[(&url, None), (&other_url, None)]));
    assert_eq!(tokens2.iter().filter(|t| **t == pad).count(), 2 * 77, "both expanded");
    let second = at + 77 + tokens2[at + 77..].iter().position(|t| *t == pad).unwrap();
    assert_eq!(chain2.len(), second / 16);
    assert_eq!(chain2[..], want[..second / 16]);
}

/// docs/design.md §2, the other formats vLLM's loader (Pillow) opens: a lossy, a lossless and an
/// animated WebP, an animated GIF and a BMP inline get their size from their headers (the
/// canvas, the logical screen), their placeholder the Qwen2-VL count worked in the fixtures'
/// README, and blocks keyed with vLLM's hash of their bytes, so the pod holding an image's blocks
/// is credited through the image; a WebP cut short (libwebp refuses it) stops the claim there.
#[tokio::test]
async fn webp_gif_and_bmp_inline_images_are_matched_through_the_image() {
    let models = format!("{IMAGE_MODELS}, {{name: vl-size, target_model: vl, tokenizer: DIR, vision: {{}}}}");
    let VisionChat { gw, pad, rendered, at, plain } = vision_chat(&models);
    let model = gw.models.resolve("vl-size").unwrap();
    let chat = "/v1/chat/completions";

    let cases = [
        ("photo-200x150-lossy.webp", "image/webp", 35),
        ("gradient-180x120-lossless.webp", "image/webp", 24),
        ("anim-100x80-3frames.webp", "image/webp", 12),
        ("anim-150x100-2frames.gif", "image/gif", 20),
        ("pattern-90x60.bmp", "image/bmp", 6),
    ];
    let mut chains = Vec::new();
    for (name, media_type, n) in cases {
        let (bytes, url) = fixture_data_url(name, media_type);
        let (tokens, chain, why) = prepared_chain(&gw, chat, &image_chat("vl-size", &[(&url, None)]));
        assert_eq!(why, "", "{name}");
        let engine = expanded(&rendered, at, pad, n);
        assert_eq!(tokens, engine, "{name}: the placeholder expanded to {n} tokens");
        let identifier = kvroute_common::image::content_identifier("vl", &bytes);
        assert_eq!(chain, one_image_chain(model, &engine, &identifier, at, n), "{name}");
        assert!(chain.len() * 16 > at + n + 16, "{name}: the chain goes past the image");
        assert!(chains.iter().all(|c: &Vec<BlockHash>| c[at / 16] != chain[at / 16]), "{name}: its own identity");
        chains.push(chain);
        if media_type == "image/webp" {
            let cut = data_url(media_type, &bytes[..bytes.len() - 1]);
            let (_, chain, why) = prepared_chain(&gw, chat, &image_chat("vl-size", &[(&cut, None)]));
            assert_eq!((chain.as_slice(), why), (&plain[..at / 16], ""), "{name} cut short");
        }
    }

    // Routing: the holder of the animated WebP's blocks is credited through it, and only up to
    // the image for the GIF.
    let (_, webp_url) = fixture_data_url("anim-100x80-3frames.webp", "image/webp");
    let (_, gif_url) = fixture_data_url("anim-150x100-2frames.gif", "image/gif");
    put(&gw.pool, "holder", "vl", stats(0.5, 0, 1.0), &chains[2]).await;
    put(&gw.pool, "idle", "vl", stats(0.0, 0, 1.0), &[]).await;
    let again = image_chat("vl-size", &[(&webp_url, None)]);
    let input = DecisionInput::new("t", chat, Some(&again));
    let routed = decide(&gw, &input).unwrap();
    assert_eq!((routed.pod.as_str(), routed.matched_blocks as usize), ("holder", chains[2].len()));
    drop(routed);
    let other = image_chat("vl-size", &[(&gif_url, None)]);
    let ex = explain(&gw, &DecisionInput { body: Some(&other), ..input }).unwrap().explanation;
    let holder = ex.candidates.iter().find(|c| &*c.pod == "holder").unwrap();
    assert_eq!(holder.matched_blocks as usize, at / 16, "another image: up to it only; {ex:?}");
}

/// docs/design.md §2, images the picker reproduces (a `uuid` and a fixed `image_tokens`): the
/// placeholder is expanded and each block it covers keyed with `[uuid, offset]` as vLLM and the
/// agent key them, so the same uuid gives the same chain through the image (whatever its URL),
/// another uuid the same chain up to the image and another from the image's first block on.
#[tokio::test]
async fn images_with_uuid_and_fixed_token_count_are_keyed_as_the_engine_keys_them() {
    let gw = gateway(&IMAGE_MODELS.replace("DIR", &tokenizer_dir()));
    let model = gw.models.resolve("vl-fixed").unwrap();
    let pad = model.images.placeholder.unwrap();
    let chat = "/v1/chat/completions";
    let (rendered, _, _) = prepared_chain(&gw, chat, &image_chat("vl", &[("https://x/cat.png", None)]));
    let at = rendered.iter().position(|t| *t == pad).unwrap();
    let (tokens, cat, why) = prepared_chain(&gw, chat, &image_chat("vl-fixed", &[("https://x/cat.png", Some("cat"))]));
    assert_eq!(why, "");
    // The engine's prompt: the placeholder expanded to 40 tokens.
    let engine = expanded(&rendered, at, pad, 40);
    assert_eq!(tokens, engine);
    assert_eq!(cat, one_image_chain(model, &engine, "cat", at, 40), "every full block, the image's keyed");
    let mut plain = Vec::new();
    model.hasher.hash_prompt(&engine, &mut plain);
    assert_eq!(cat[..at / 16], plain[..at / 16]);
    assert_ne!(cat[at / 16], plain[at / 16]);

    let (_, same, _) = prepared_chain(&gw, chat, &image_chat("vl-fixed", &[("https://y/other.png", Some("cat"))]));
    assert_eq!(same, cat, "the uuid is the image's identity");
    let (_, dog, _) = prepared_chain(&gw, chat, &image_chat("vl-fixed", &[("https://x/cat.png", Some("dog"))]));
    assert_eq!(dog.len(), cat.len());
    assert_eq!(dog[..at / 16], cat[..at / 16]);
    assert!(dog[at / 16..].iter().all(|h| !cat.contains(h)), "another image: another chain from its first block");

    // A second image without a uuid: keyed through the first, nothing claimed from the second on.
    let two = image_chat("vl-fixed", &[("https://x/cat.png", Some("cat")), ("https://x/dog.png", None)]);
    let (tokens2, chain2, _) = prepared_chain(&gw, chat, &two);
    let second = tokens2.iter().rposition(|t| *t == pad).unwrap();
    assert_eq!(tokens2.iter().filter(|t| **t == pad).count(), 41, "the first expanded, the second not");
    assert_eq!(tokens2[..second].iter().filter(|t| **t == pad).count(), 40);
    assert!(second / 16 > at / 16 + 2, "blocks keyed by the first image: {at}..{second}");
    assert_eq!(chain2.len(), second / 16);
    assert_eq!(chain2[..], cat[..second / 16], "{} blocks", chain2.len());

    // The Responses API's input_image carries its uuid the same way.
    let v: serde_json::Value = serde_json::from_slice(&image_chat("vl-fixed", &[])).unwrap();
    let responses = serde_json::json!({"model": "vl-fixed", "instructions": v["messages"][0]["content"],
        "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "Here is the picture:"},
            {"type": "input_image", "image_url": "https://x/cat.png", "uuid": "cat"},
            {"type": "input_text", "text": v["messages"][1]["content"][1]["text"]}]}]});
    let (_, via_responses, _) = prepared_chain(&gw, "/v1/responses", responses.to_string().as_bytes());
    assert_eq!(via_responses, cat);

    // With mm_processor_kwargs vLLM hashes the uuid with them: claims stop at the image.
    let mut v: serde_json::Value =
        serde_json::from_slice(&image_chat("vl-fixed", &[("https://x/cat.png", Some("cat"))])).unwrap();
    v["mm_processor_kwargs"] = serde_json::json!({"max_pixels": 200704});
    let (_, kwargs, _) = prepared_chain(&gw, chat, v.to_string().as_bytes());
    assert_eq!(kwargs[..], cat[..at / 16]);

    // A part the picker cannot place (audio): nothing claimed.
    let mut v: serde_json::Value = serde_json::from_slice(&image_chat("vl-fixed", &[])).unwrap();
    v["messages"][1]["content"][0] =
        serde_json::json!({"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}});
    let (_, none, why) = prepared_chain(&gw, chat, v.to_string().as_bytes());
    assert!(none.is_empty() && why.contains("content part"), "{why}");
}
