//! End-to-end: real processes (emulated vLLM engines, agents in mock-NVML mode, the picker and a
//! real Envoy 1.40 running `deploy/envoy/envoy.yaml`), real requests through Envoy.
//!
//! Needs the workspace binaries (`cargo build --bins`) and Envoy (`scripts/install-envoy`);
//! `scripts/test` does both. Each test starts its own fleet; a lock runs them one at a time so
//! the 2-core machine is not oversubscribed.

#![allow(clippy::expect_used)]

use kvroute_harness::{ChatOutcome, Fleet, FleetSpec, GatewayClient, Workload};
use serde_json::{Value, json};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

static ONE_FLEET_AT_A_TIME: LazyLock<tokio::sync::Mutex<()>> = LazyLock::new(|| tokio::sync::Mutex::new(()));

use kvroute_harness::DEFAULT_MODEL as MODEL;
/// Time for a KV event to travel engine → agent → picker (docs/design.md §10 target p99 ≤ 50 ms).
const PROPAGATION: Duration = Duration::from_millis(400);

/// Sends a chat body (JSON bytes) through the gateway and asserts it was served (200).
async fn send_chat(client: &GatewayClient, body: Vec<u8>) -> ChatOutcome {
    let out = client.post_raw("/v1/chat/completions", body, &[]).await.expect("request");
    assert_eq!(out.status, 200, "{:?}", out.error);
    out
}

/// (blocks the picker credits `pod` with, blocks in the request's chain, its prompt tokens), from
/// the picker's `/explain` of the chat body `b`.
async fn claimed(fleet: &Fleet, b: &Value, pod: &str) -> (u32, u32, u32) {
    let ex = fleet.explain_chat(b).await.expect("explain");
    let matched = ex["candidates"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["pod"] == pod)
        .and_then(|c| c["matched_blocks"].as_u64())
        .unwrap_or(0) as u32;
    let total = ex["total_blocks"].as_u64().unwrap_or(0) as u32;
    (matched, total, ex["input_tokens"].as_u64().unwrap_or(0) as u32)
}

fn spec(label: &str) -> FleetSpec {
    FleetSpec { label: label.into(), time_scale: 0.2, ..Default::default() }
}

async fn chat(client: &GatewayClient, messages: &[Value]) -> ChatOutcome {
    client.chat_served(MODEL, messages, 8).await.expect("request served through Envoy")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_stick_to_their_pod_and_shared_system_prompts_find_it() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let fleet = Fleet::start(spec("e2e-affinity")).await.expect("fleet starts");
    let client = GatewayClient::new(&fleet.gateway).expect("client");
    // Four system prompts of ~600 words (~700 tokens), two conversations each.
    let w = Workload::multi_turn_chat(11, 4, 2, 3, 600, 30);

    // Turn 1 of the first conversation of every system prompt: four cold prefixes.
    let mut first_pod = Vec::new();
    let mut replies = Vec::new();
    for c in w.conversations.iter().take(4) {
        let out = chat(&client, &w.messages(c, 0, &[])).await;
        first_pod.push(out.served_by.clone().expect("served_by"));
        replies.push(vec![out.text]);
        tokio::time::sleep(PROPAGATION).await;
    }

    // Turn 2 of each: lands where turn 1 went, and the engine reports the history as cached.
    for (i, c) in w.conversations.iter().take(4).enumerate() {
        let out = chat(&client, &w.messages(c, 1, &replies[i])).await;
        assert_eq!(out.served_by.as_deref(), Some(first_pod[i].as_str()), "conversation {i} turn 2 moved pods");
        assert!(
            out.cached_tokens * 2 > out.prompt_tokens,
            "conversation {i} turn 2: only {} of {} prompt tokens cached",
            out.cached_tokens,
            out.prompt_tokens
        );
    }

    // A new conversation that shares only the system prompt lands on the pod holding it, even
    // when the client tries to force a destination (the header is stripped and overwritten).
    tokio::time::sleep(PROPAGATION).await;
    for (i, c) in w.conversations.iter().skip(4).enumerate() {
        let messages = w.messages(c, 0, &[]);
        let body = serde_json::to_vec(&json!({"model": MODEL, "messages": messages, "max_tokens": 4})).expect("json");
        let out = client
            .post_raw("/v1/chat/completions", body, &[("x-gateway-destination-endpoint", "127.0.0.1:1")])
            .await
            .expect("request");
        assert_eq!(out.status, 200, "{:?}", out.error);
        let sys = c.system_prompt;
        assert_eq!(
            out.served_by.as_deref(),
            Some(first_pod[sys].as_str()),
            "new conversation {i} on system prompt {sys}"
        );
        assert!(out.cached_tokens > 0, "new conversation {i}: the shared system prompt was not a cache hit");
    }
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_with_uncorrected_ecc_errors_gets_no_requests() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    // Agent 1 watches engine-2 (GPU 0) and engine-3 (GPU 1); its scenario breaks GPU 1.
    let spec =
        FleetSpec { agent_scenarios: vec!["healthy.yaml".into(), "ecc-uncorrected.yaml".into()], ..spec("e2e-ecc") };
    let fleet = Fleet::start(spec).await.expect("fleet starts");
    let health = fleet
        .wait_pod_gauge("epp_pod_health_score", "engine-3-rank-0", Duration::from_secs(15), |h| h < 0.3)
        .await
        .expect("engine-3's health falls below the exclusion threshold");
    let healthy = fleet.pod_gauge("epp_pod_health_score", "engine-0-rank-0").await.expect("metrics").unwrap_or(0.0);
    assert!(healthy >= 0.9, "engine-0 should be healthy, got {healthy}");

    let client = GatewayClient::new(&fleet.gateway).expect("client");
    let w = Workload::multi_turn_chat(23, 16, 1, 1, 80, 10);
    let mut served = std::collections::BTreeMap::<String, usize>::new();
    for c in &w.conversations {
        let out = chat(&client, &w.messages(c, 0, &[])).await;
        *served.entry(out.served_by.unwrap_or_default()).or_default() += 1;
    }
    assert!(!served.contains_key("engine-3-rank-0"), "engine-3 (health {health}) was sent requests: {served:?}");
    assert!(served.len() >= 2, "cold requests should spread over the healthy pods by load: {served:?}");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_engine_down_gives_503_with_a_json_error() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let mut fleet = Fleet::start(spec("e2e-down")).await.expect("fleet starts");
    let client = GatewayClient::new(&fleet.gateway).expect("client");
    let messages = [json!({"role": "user", "content": "hello there"})];
    chat(&client, &messages).await;
    for i in 0..fleet.engines.len() {
        fleet.kill_engine(i).await;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let out = loop {
        let out = client.chat(MODEL, &messages, 4).await.expect("Envoy answers");
        if out.status == 503 || Instant::now() > deadline {
            break out;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(out.status, 503, "expected 503 with every engine down, got {} {:?}", out.status, out.error);
    let err = out.error.expect("a JSON body");
    assert!(err["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "OpenAI-style error body: {err}");
    // Once the agents have reported the engines gone, the picker itself answers (no candidate).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = client.chat(MODEL, &messages, 4).await.expect("Envoy answers");
        let err = out.error.clone().unwrap_or_default();
        if out.status == 503 && err["error"]["type"] != "upstream_unavailable" {
            assert!(err["error"]["message"].as_str().is_some(), "picker's 503 body: {err}");
            break;
        }
        assert!(Instant::now() < deadline, "picker never answered 503 itself; last: {} {err}", out.status);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    fleet.shutdown().await;
}

/// File mode (docs/design.md §14): the picker's pool file is the only source of candidates. Edits
/// move traffic without a restart: a pod that left the file or turned unready gets no request, its
/// agent's reports for the departed pod are refused and counted, and a pod put back is a candidate
/// again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_file_edits_move_traffic_without_restarts() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let fleet = Fleet::start(spec("e2e-pool-file")).await.expect("fleet starts");
    let client = GatewayClient::new(&fleet.gateway).expect("client");
    // engine-3 leaves the pool, engine-2 turns unready; the picker polls the file every 500 ms.
    fleet.set_pool(&[(0, true), (1, true), (2, false)]).expect("pool file written");
    let candidates = |ex: &Value| -> Vec<String> {
        ex["candidates"].as_array().into_iter().flatten().filter_map(|c| c["pod"].as_str().map(String::from)).collect()
    };
    let probe = json!({"model": MODEL, "messages": [{"role": "user", "content": "which pods?"}]});
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let ex = fleet.explain_chat(&probe).await.expect("explain");
        let mut c = candidates(&ex);
        c.sort();
        if c == ["engine-0-rank-0", "engine-1-rank-0"] {
            break;
        }
        assert!(Instant::now() < deadline, "routing did not follow the pool file within 2 s: {c:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let w = Workload::multi_turn_chat(29, 12, 1, 1, 60, 10);
    for c in &w.conversations {
        let served = chat(&client, &w.messages(c, 0, &[])).await.served_by.unwrap_or_default();
        assert!(served == "engine-0-rank-0" || served == "engine-1-rank-0", "served by {served} outside the pool");
    }
    // The agent still reports engine-3 (its static list): refused, counted.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = fleet.picker_metrics().await.expect("metrics");
        let refused =
            kvroute_harness::fleet::metric_value(&text, "epp_ingest_refusals_total", "reason=\"not_in_pool\"");
        if refused.is_some_and(|v| v >= 1.0) {
            break;
        }
        assert!(Instant::now() < deadline, "engine-3's reports were not refused");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Back in the pool: a candidate again at once, its agent's state following.
    fleet.set_pool(&[(0, true), (1, true), (2, true), (3, true)]).expect("pool file written");
    let deadline = Instant::now() + Duration::from_secs(2);
    while candidates(&fleet.explain_chat(&probe).await.expect("explain")).len() < 4 {
        assert!(Instant::now() < deadline, "pods put back were not candidates within 2 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fleet.shutdown().await;
}

/// docs/design.md §2 salted prompts, end to end: the picker folds a request's `cache_salt` into
/// its block hashes as vLLM does, the emulated engine keys its cache by the salt and reports the
/// salted blocks, the agent re-hashes them the same way. A tenant's repeat finds its own pod and
/// cache; the same prompt unsalted or under another salt matches nothing and is served cold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_prompt_matches_only_its_own_tenants_cache() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let fleet = Fleet::start(spec("e2e-salt")).await.expect("fleet starts");
    let client = GatewayClient::new(&fleet.gateway).expect("client");
    let w = Workload::multi_turn_chat(17, 1, 1, 1, 600, 30);
    let messages = w.messages(&w.conversations[0], 0, &[]);
    let send = |salt: Option<&str>| {
        let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": 4});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        let body = serde_json::to_vec(&body).expect("json");
        let client = &client;
        async move {
            let out = client.post_raw("/v1/chat/completions", body, &[]).await.expect("request");
            assert_eq!(out.status, 200, "{:?}", out.error);
            out
        }
    };
    let first = send(Some("tenant-a")).await;
    assert_eq!(first.cached_tokens, 0, "a cold fleet");
    tokio::time::sleep(PROPAGATION).await;
    // The same tenant again: routed to the pod holding its salted prefix, served from cache.
    let again = send(Some("tenant-a")).await;
    assert_eq!(again.served_by, first.served_by, "tenant-a's repeat moved pods");
    assert!(again.cached_tokens * 2 > again.prompt_tokens, "tenant-a's repeat: {} cached", again.cached_tokens);
    // Unsalted and another tenant's: nothing of tenant-a's cache is credited or served.
    for salt in [None, Some("tenant-b")] {
        let out = send(salt).await;
        assert_eq!(out.cached_tokens, 0, "{salt:?} was served from tenant-a's cache on {:?}", out.served_by);
        tokio::time::sleep(PROPAGATION).await;
    }
    // tenant-b's repeat now finds tenant-b's own copy.
    let b = send(Some("tenant-b")).await;
    assert!(b.cached_tokens * 2 > b.prompt_tokens, "tenant-b's repeat: {} cached", b.cached_tokens);
    fleet.shutdown().await;
}

/// docs/design.md §2 inline images, end to end: with `vision` on the picker and `--mm-vision` on
/// the emulated engines, an image sent as a base64 data URL without `uuid` (the fixtures' PNG:
/// 300×200, 77 tokens; JPEG: 130×90, 15 tokens) is expanded and keyed by both as vLLM does (its
/// content hash, its size's count), the agents fold the engines' keys, and the picker credits
/// the pod that served it through the image for the same image and up to it for another; an
/// http(s) image still stops the claim at the image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_images_without_uuid_match_through_the_image_on_the_pod_that_served_them() {
    use base64::Engine as _;
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let spec = FleetSpec { image_vision: true, image_tokens: Some(64), ..spec("e2e-inline-images") };
    let fleet = Fleet::start(spec).await.expect("fleet starts");
    let client = GatewayClient::new(&fleet.gateway).expect("client");
    let system = "You describe pictures for a museum catalogue, precisely and briefly. ".repeat(40);
    let body = |url: &str| {
        json!({"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "text", "text": "Here is the picture:"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What does it show, and in which colours, mostly?"}]}]})
    };
    let inline = |name: &str, media_type: &str| {
        let path = format!("{}/../fixtures/images/{name}", env!("CARGO_MANIFEST_DIR"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        format!("data:{media_type};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
    };
    let send = |b: &Value| send_chat(&client, serde_json::to_vec(b).expect("json"));
    let claim = |b: Value, pod: String| {
        let fleet = &fleet;
        async move { claimed(fleet, &b, &pod).await }
    };

    let png = body(&inline("gradient-300x200.png", "image/png"));
    let first = send(&png).await;
    assert_eq!(first.cached_tokens, 0, "a cold fleet");
    let holder = first.served_by.clone().expect("served_by");
    tokio::time::sleep(PROPAGATION).await;
    // An http(s) image: not fetched, the claim stops at it; that is the text before the image.
    let (text_blocks, url_total, _) = claim(body("https://example.com/cat.png"), holder.clone()).await;
    assert!(text_blocks >= 20 && url_total == text_blocks, "{text_blocks} of {url_total}");
    // The same inline image: every block credited, through the image, and served from cache.
    let (matched, total, input_tokens) = claim(png.clone(), holder.clone()).await;
    assert_eq!(matched, total, "the same inline image: every block credited");
    assert!(total * 16 >= text_blocks * 16 + 77, "the chain covers the image's 77 tokens: {total} blocks");
    let again = send(&png).await;
    assert_eq!(again.served_by.as_deref(), Some(holder.as_str()));
    assert_eq!(input_tokens, again.prompt_tokens, "the picker expands the image as the engine does");
    assert!(again.cached_tokens + 16 >= total * 16, "served through the image: {} cached", again.cached_tokens);
    // Another inline image: credited up to the image only, and the engine agrees.
    let jpg = body(&inline("pattern-130x90-progressive-exif.jpg", "image/jpeg"));
    let (matched, total, input_tokens) = claim(jpg.clone(), holder.clone()).await;
    assert_eq!(matched, text_blocks, "another image: credited up to it");
    assert!(total > text_blocks, "its own chain goes on through the image");
    let other = send(&jpg).await;
    assert_eq!(other.served_by.as_deref(), Some(holder.as_str()), "a new image left the system prompt's pod");
    assert_eq!(input_tokens, other.prompt_tokens, "15 tokens on both sides");
    assert_eq!(other.cached_tokens, text_blocks * 16, "credited exactly what the engine served from cache");
    fleet.shutdown().await;
}

/// docs/design.md §2 images, end to end: the emulated engines expand each image to 64 placeholder
/// tokens and key the blocks they cover with the image's identifier (its `uuid` when given), the
/// agents fold those keys in, and the picker (`image_tokens: 64`) claims exactly what the engine
/// will serve from cache. Different images without a uuid: routed to the pod holding the shared
/// system prompt, credited and served the text before the image only. The same uuid (another
/// URL): credited and served through the image. Another uuid: stops at the image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_find_the_system_prompts_pod_and_match_through_the_image_by_uuid() {
    let _one = ONE_FLEET_AT_A_TIME.lock().await;
    let fleet = Fleet::start(FleetSpec { image_tokens: Some(64), ..spec("e2e-images") }).await.expect("fleet starts");
    let client = GatewayClient::new(&fleet.gateway).expect("client");
    let system = "You describe pictures for a museum catalogue, precisely and briefly. ".repeat(40);
    let body = |url: &str, uuid: Option<&str>| {
        let mut image = json!({"type": "image_url", "image_url": {"url": url}});
        if let Some(u) = uuid {
            image["uuid"] = json!(u);
        }
        json!({"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "text", "text": "Here is the picture:"}, image,
                {"type": "text", "text": "What does it show, and in which colours, mostly?"}]}]})
    };
    let send = |b: &Value| send_chat(&client, serde_json::to_vec(b).expect("json"));
    let claim = |b: Value, pod: String| {
        let fleet = &fleet;
        async move { claimed(fleet, &b, &pod).await }
    };

    let cat = send(&body("https://example.com/cat.png", None)).await;
    assert_eq!(cat.cached_tokens, 0, "a cold fleet");
    let holder = cat.served_by.clone().expect("served_by");
    tokio::time::sleep(PROPAGATION).await;
    // Another image, no uuid: the text blocks before the image only, all of them on the holder.
    let dog_body = body("https://example.com/dog.png", None);
    let (text_blocks, total, _) = claim(dog_body.clone(), holder.clone()).await;
    assert!(text_blocks >= 20, "the system prompt's blocks are credited: {text_blocks}");
    assert_eq!(total, text_blocks, "no block from the image on is claimed");
    let dog = send(&dog_body).await;
    assert_eq!(dog.served_by.as_deref(), Some(holder.as_str()), "a new image left the system prompt's pod");
    assert_eq!(dog.cached_tokens, text_blocks * 16, "credited exactly what the engine served from cache");

    // With a uuid: the first one is new after the text; the same uuid under another URL is
    // credited and served through the image; another uuid stops at the image.
    let first = send(&body("https://example.com/cat.png", Some("img-cat"))).await;
    assert_eq!(first.served_by.as_deref(), Some(holder.as_str()));
    assert_eq!(first.cached_tokens, text_blocks * 16);
    tokio::time::sleep(PROPAGATION).await;
    let same_body = body("https://mirror.example.org/cat-copy.png", Some("img-cat"));
    let (matched, total, input_tokens) = claim(same_body.clone(), holder.clone()).await;
    assert_eq!(matched, total, "the same uuid: every block credited");
    assert!(total * 16 > text_blocks * 16 + 64, "the chain covers the image: {total} blocks");
    let same = send(&same_body).await;
    assert_eq!(same.served_by.as_deref(), Some(holder.as_str()));
    assert_eq!(input_tokens, same.prompt_tokens, "the picker expands the image as the engine does");
    assert!(same.cached_tokens + 16 >= total * 16, "served through the image: {} cached", same.cached_tokens);
    let other_body = body("https://example.com/cat.png", Some("img-dog"));
    let (matched, other_total, _) = claim(other_body.clone(), holder.clone()).await;
    assert_eq!((matched, other_total), (text_blocks, total), "another uuid: credited up to the image");
    let other = send(&other_body).await;
    assert_eq!(other.cached_tokens, text_blocks * 16, "another uuid was served from the first image's blocks");
    fleet.shutdown().await;
}
