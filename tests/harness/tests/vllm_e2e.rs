//! End to end on real engines: vLLM's CPU build (`scripts/install-vllm`, random-weight Qwen2),
//! agents over mTLS, the picker and Envoy. vLLM's own numbers are the referee: the usage's
//! `prompt_tokens_details.cached_tokens`, `/tokenize`, and its `vllm:prefix_cache_*` counters.
//!
//! Two fleets, one after the other (each vLLM engine takes a core and about 2.6 GB):
//! - two engines with LoRA and tools: token counts, the claim of every request, hit rate
//!   against round robin, `cache_salt` tenants, a LoRA adapter;
//! - one engine with a small KV cache: evictions followed block by block, stale routing counted
//!   only when vLLM cached less than claimed, and a restart's resync.
//!
//! Requests are sent one at a time where a per-request claim is compared, so the claim the
//! picker logged is the one the engine's answer is measured against.
#![allow(clippy::expect_used)]

use kvroute_harness::client::post_json;
use kvroute_harness::fleet::metric_value;
use kvroute_harness::workload::seeded_words;
use kvroute_harness::{
    ChatOutcome, EngineKind, Fleet, FleetSpec, GatewayClient, Pacing, RunSummary, VllmSpec, Workload, run_chat_workload,
};
use serde_json::{Value, json};
use std::time::Duration;

/// The fleets run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Tokens per block of the picker's index (its `block_size`).
const INDEX_BLOCK: u32 = 16;
/// The engines' `--block-size`.
const ENGINE_BLOCK: u32 = 32;

fn vllm_fleet(label: &str, engines: usize, v: VllmSpec) -> FleetSpec {
    FleetSpec {
        label: label.into(),
        engines,
        engines_per_agent: 1,
        engine_kind: EngineKind::Vllm(v),
        round_robin_baseline: true,
        max_num_seqs: 8,
        ..Default::default()
    }
}

/// vLLM's own token count for a body (`POST /tokenize`).
async fn vllm_count(http: &reqwest::Client, engine: &str, body: &Value) -> u64 {
    post_json(http, &format!("{engine}/tokenize"), body).await.expect("POST answered")["count"]
        .as_u64()
        .expect("tokenize count")
}

/// The picker's `/explain` of `body` for `path`.
async fn explain(http: &reqwest::Client, fleet: &Fleet, path: &str, body: &Value) -> Value {
    post_json(http, &format!("{}/explain?path={path}", fleet.picker_admin), body).await.expect("POST answered")
}

/// Matched blocks of `pod` in an explanation (0 when it is not a candidate).
fn matched_on(ex: &Value, pod: &str) -> u32 {
    ex["candidates"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["pod"] == pod))
        .and_then(|c| c["matched_blocks"].as_u64())
        .map_or(0, |m| m as u32)
}

/// The `pod selected` line the picker logged for `request_id`: (pod, matched index blocks).
fn logged_claim(fleet: &Fleet, request_id: &str) -> Option<(String, u32)> {
    let log = std::fs::read_to_string(fleet.work.join("picker.log")).ok()?;
    log.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).find_map(|v| {
        let f = &v["fields"];
        (f["message"] == "pod selected" && f["request_id"] == request_id).then(|| {
            (f["pod"].as_str().unwrap_or_default().to_owned(), f["matched_blocks"].as_u64().unwrap_or(0) as u32)
        })
    })
}

/// Sum over the fleet's engines of a vLLM counter.
async fn engine_counter(http: &reqwest::Client, fleet: &Fleet, name: &str) -> f64 {
    let mut sum = 0.0;
    for e in &fleet.engines {
        let text =
            http.get(format!("{}/metrics", e.url())).send().await.expect("engine metrics").text().await.expect("text");
        sum += text
            .lines()
            .filter(|l| l.starts_with(name) && l.as_bytes().get(name.len()) == Some(&b'{'))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum::<f64>();
    }
    sum
}

/// Time for KV events to reach the picker (engine → agent → picker, 10 ms flushes) after an answer.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(400)).await;
}

/// One chat request through `client` that must succeed, with the picker's claim for it.
async fn chat_claimed(fleet: &Fleet, client: &GatewayClient, model: &str, messages: &[Value]) -> (ChatOutcome, u32) {
    let out = client.chat_served(model, messages, 4).await.expect("chat through the gateway");
    claimed(fleet, out).await
}

/// `out` (a served chat request) with the picker's claim for it.
async fn claimed(fleet: &Fleet, out: ChatOutcome) -> (ChatOutcome, u32) {
    let id = out.request_id.clone().expect("x-request-id");
    // The picker's log is written off the request thread: wait for the line.
    let mut claim = None;
    for _ in 0..50 {
        claim = logged_claim(fleet, &id);
        if claim.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (pod, blocks) = claim.unwrap_or_else(|| panic!("no `pod selected` line for {id}"));
    assert_eq!(Some(pod.as_str()), out.served_by.as_deref(), "the picker's choice is the pod that served {id}");
    (out, blocks * INDEX_BLOCK)
}

/// Asserts that `claim` (tokens) is within one engine block of what vLLM served `out` from cache;
/// true when vLLM cached less than claimed by more than a block, a request the picker must count
/// as stale routing.
fn judge_claim(what: &str, claim: u32, out: &ChatOutcome) -> bool {
    let cached = out.cached_tokens;
    assert!(
        claim.abs_diff(cached) <= ENGINE_BLOCK,
        "{what}: claimed {claim} cached tokens, vLLM served {cached} of {} from cache",
        out.prompt_tokens
    );
    cached + ENGINE_BLOCK < claim
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_agrees_with_the_picker_on_tokens_claims_and_hits() {
    let _serial = SERIAL.lock().await;
    let spec = vllm_fleet("vllm-e2e", 2, VllmSpec { lora_adapters: 1, ..Default::default() });
    let model = spec.model.clone();
    let adapter_model = json!({
        "name": "adapter-1", "target_model": model, "adapter": "adapter-1",
        "tokenizer": kvroute_harness::paths::tokenizer_dir().display().to_string(),
    });
    let base_model = json!({
        "name": model, "target_model": model, "adapter": null,
        "tokenizer": kvroute_harness::paths::tokenizer_dir().display().to_string(),
    });
    let spec = FleetSpec { picker_overrides: Some(json!({"models": [base_model, adapter_model]})), ..spec };
    let fleet = Fleet::start(spec).await.expect("fleet of 2 real vLLM engines");
    let http = reqwest::Client::new();
    let engine0 = fleet.engines[0].url();

    // Token counts: the picker's input tokens equal vLLM's /tokenize and its usage.
    let system = json!({"role": "system", "content": format!("You are a careful assistant. {}", seeded_words(1, 60))});
    let user = |t: &str| json!({"role": "user", "content": t});
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let cases: Vec<(&str, Value, Value)> = vec![
        (
            "completions",
            json!({"model": model, "prompt": seeded_words(2, 80)}),
            json!({"model": model, "prompt": seeded_words(2, 80)}),
        ),
        (
            "chat",
            json!({"model": model, "messages": [system, user("hello there")]}),
            json!({"model": model, "messages": [system, user("hello there")]}),
        ),
        (
            "multi-turn chat",
            json!({"model": model, "messages": [system, user("first question"), {"role": "assistant", "content": "first answer"}, user("second question")]}),
            json!({"model": model, "messages": [system, user("first question"), {"role": "assistant", "content": "first answer"}, user("second question")]}),
        ),
        (
            "tools",
            json!({"model": model, "messages": [system, user("weather in Paris?")], "tools": tools}),
            json!({"model": model, "messages": [system, user("weather in Paris?")], "tools": tools}),
        ),
    ];
    for (name, body, tokenize) in &cases {
        let path = if body.get("messages").is_some() { "/v1/chat/completions" } else { "/v1/completions" };
        let picker = explain(&http, &fleet, path, body).await["input_tokens"].as_u64().expect("input_tokens");
        let vllm = vllm_count(&http, &engine0, tokenize).await;
        assert_eq!(picker, vllm, "{name}: picker counts {picker} tokens, vLLM's /tokenize {vllm}");
        let mut req = body.clone();
        req["max_tokens"] = json!(1);
        let served = post_json(&http, &format!("{}{path}", fleet.gateway), &req).await.expect("POST answered");
        assert_eq!(Some(picker), served["usage"]["prompt_tokens"].as_u64(), "{name}: usage.prompt_tokens");
    }
    let responses = json!({"model": model, "instructions": "Answer briefly.", "input": seeded_words(3, 50), "max_output_tokens": 1});
    let picker =
        explain(&http, &fleet, "/v1/responses", &responses).await["input_tokens"].as_u64().expect("input_tokens");
    let served = post_json(&http, &format!("{}/v1/responses", fleet.gateway), &responses).await.expect("POST answered");
    assert_eq!(Some(picker), served["usage"]["input_tokens"].as_u64(), "/v1/responses: usage.input_tokens vs picker");

    // Every request's claim equals vLLM's cached tokens to within one engine block, and no
    // request whose claim held is counted stale.
    fleet.reset_prefix_caches().await.expect("reset");
    settle().await;
    let client = fleet.client(&fleet.gateway).expect("client");
    let workload = Workload::multi_turn_chat(11, 3, 2, 3, 300, 30);
    let stale_before = stale_total(&fleet).await;
    let (mut claimed, mut checked, mut stale_expected) = (0u64, 0u32, 0u64);
    for c in &workload.conversations {
        let mut replies = Vec::new();
        for turn in 0..c.user_messages.len() {
            let messages = workload.messages(c, turn, &replies);
            let (out, claim) = chat_claimed(&fleet, &client, &model, &messages).await;
            stale_expected += u64::from(judge_claim(&format!("conversation {} turn {turn}", c.id), claim, &out));
            claimed += u64::from(claim);
            checked += 1;
            replies.push(out.text.clone());
            settle().await;
        }
    }
    assert!(claimed > 0, "no request was claimed as cached: the index never matched vLLM's blocks");
    let stale = stale_total(&fleet).await - stale_before;
    assert_eq!(stale, stale_expected as f64, "stale routing counted {stale} of {checked}, vLLM says {stale_expected}");
    eprintln!("claims: {checked} requests, {claimed} tokens claimed, {stale} stale");

    // Hit rate, by vLLM's own numbers: kvroute against round robin on the same engines.
    let pacing =
        Pacing { arrival_gap: Duration::from_millis(300), think_time: Duration::from_millis(100), max_tokens: 4 };
    let workload = Workload::multi_turn_chat(23, 4, 3, 2, 400, 30);
    let mut rates = Vec::new();
    for gateway in [fleet.gateway.clone(), fleet.round_robin_gateway.clone().expect("round robin")] {
        fleet.reset_prefix_caches().await.expect("reset");
        settle().await;
        let (hits0, queries0) = (
            engine_counter(&http, &fleet, "vllm:prefix_cache_hits_total").await,
            engine_counter(&http, &fleet, "vllm:prefix_cache_queries_total").await,
        );
        let records = run_chat_workload(&fleet.client(&gateway).expect("client"), &model, &workload, pacing, |_| {})
            .await
            .expect("workload");
        let s = RunSummary::of(&records);
        assert_eq!(s.errors, 0, "{gateway}: errors");
        let hits = engine_counter(&http, &fleet, "vllm:prefix_cache_hits_total").await - hits0;
        let queries = engine_counter(&http, &fleet, "vllm:prefix_cache_queries_total").await - queries0;
        // The counters also see the agents' probes: they agree with the usage to within 10 %.
        let by_counters = hits / queries.max(1.0);
        assert!((by_counters - s.hit_rate()).abs() < 0.10, "usage says {:.3}, counters {by_counters:.3}", s.hit_rate());
        rates.push(s.hit_rate());
    }
    eprintln!("hit rate by vLLM's cached_tokens: kvroute {:.3}, round robin {:.3}", rates[0], rates[1]);
    assert!(rates[0] > rates[1] + 0.05, "kvroute hit rate {:.3} vs round robin {:.3}", rates[0], rates[1]);

    // cache_salt: a tenant's blocks are credited to that tenant only, and vLLM agrees.
    let prompt = format!("Shared tenant document. {}", seeded_words(5, 300));
    let salted = |salt: &str| json!({"model": model, "messages": [{"role": "user", "content": prompt}], "cache_salt": salt, "max_tokens": 1});
    let a1 = post_json(&http, &format!("{}/v1/chat/completions", fleet.gateway), &salted("tenant-a"))
        .await
        .expect("POST answered");
    assert_eq!(a1["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(0), "a fresh prompt");
    settle().await;
    let ex_a = explain(&http, &fleet, "/v1/chat/completions", &salted("tenant-a")).await;
    let holder = ex_a["choice"]["pod"].as_str().or_else(|| ex_a["choice"].as_str()).map(str::to_owned);
    let claim_a: u32 = fleet.engines.iter().map(|e| matched_on(&ex_a, &e.name())).max().unwrap_or(0);
    assert!(claim_a > 0, "tenant-a's repeat is claimed cached: {ex_a}");
    let ex_b = explain(&http, &fleet, "/v1/chat/completions", &salted("tenant-b")).await;
    for e in &fleet.engines {
        assert_eq!(matched_on(&ex_b, &e.name()), 0, "tenant-b credited tenant-a's blocks on {}", e.name());
    }
    for e in &fleet.engines {
        let b = post_json(&http, &format!("{}/v1/chat/completions", e.url()), &salted("tenant-b-direct"))
            .await
            .expect("POST answered");
        assert_eq!(
            b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
            Some(0),
            "vLLM shared a salted prefix on {} ({holder:?})",
            e.name()
        );
    }

    // A LoRA adapter: its blocks are its own, claimed as vLLM caches them.
    let lora_body = json!({"model": "adapter-1", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1});
    let first =
        post_json(&http, &format!("{}/v1/chat/completions", fleet.gateway), &lora_body).await.expect("POST answered");
    assert_eq!(
        first["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(0),
        "the adapter does not share the base model's blocks"
    );
    settle().await;
    let ex = explain(&http, &fleet, "/v1/chat/completions", &lora_body).await;
    assert_eq!(ex["adapter"], "adapter-1", "{ex}");
    let claim: u32 = fleet.engines.iter().map(|e| matched_on(&ex, &e.name())).max().unwrap_or(0) * INDEX_BLOCK;
    let again =
        post_json(&http, &format!("{}/v1/chat/completions", fleet.gateway), &lora_body).await.expect("POST answered");
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as u32;
    assert!(cached > 0, "the adapter's repeat was served from cache");
    assert!(claim.abs_diff(cached) <= ENGINE_BLOCK, "adapter: claimed {claim}, vLLM cached {cached}");
    fleet.shutdown().await;
}

async fn stale_total(fleet: &Fleet) -> f64 {
    let text = fleet.picker_metrics().await.expect("picker metrics");
    text.lines()
        .filter(|l| l.starts_with("epp_stale_cache_routing_total"))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_evictions_and_restart_keep_the_index_right() {
    let _serial = SERIAL.lock().await;
    // 64 blocks of 32 tokens (63 usable): two of the ~750-token prompts fit, and the third
    // evicts the tail of the least recently used one (vLLM frees a request's blocks tail first),
    // so in the rounds after the first each prompt finds only its head cached.
    // The model length must fit the cache (vLLM refuses to start otherwise).
    let spec = vllm_fleet(
        "vllm-pressure",
        1,
        VllmSpec { num_gpu_blocks: Some(64), max_model_len: 2000, ..Default::default() },
    );
    // Pending entries off: a routed chain would be credited for `pending_ttl_ms` after its
    // routing even once the engine evicted part of it; here the index alone is under test.
    let spec = FleetSpec {
        round_robin_baseline: false,
        picker_overrides: Some(json!({"scoring": {"pending_ttl_ms": 0}})),
        ..spec
    };
    let model = spec.model.clone();
    let mut fleet = Fleet::start(spec).await.expect("fleet of 1 real vLLM engine");
    let http = reqwest::Client::new();
    let client = fleet.client(&fleet.gateway).expect("client");
    let pod = fleet.engines[0].name();
    let prompts: Vec<Vec<Value>> = (0..3)
        .map(|i| vec![json!({"role": "user", "content": format!("Document {i}. {}", seeded_words(100 + i, 250))})])
        .collect();

    // Rotate through prompts that evict each other: before each request the index's claim is
    // read, and vLLM's cached tokens must agree with it block for block.
    let stale_before = stale_total(&fleet).await;
    let (mut stale_expected, mut partial, mut full, mut none) = (0u64, 0, 0, 0);
    for round in 0..3 {
        for (i, messages) in prompts.iter().enumerate() {
            let body = json!({"model": model, "messages": messages});
            let before = matched_on(&explain(&http, &fleet, "/v1/chat/completions", &body).await, &pod) * INDEX_BLOCK;
            let (out, claim) = chat_claimed(&fleet, &client, &model, messages).await;
            assert_eq!(before, claim, "round {round} prompt {i}: /explain and routing claim the same");
            let cached = out.cached_tokens;
            stale_expected += u64::from(judge_claim(&format!("round {round} prompt {i}"), claim, &out));
            eprintln!("round {round} prompt {i}: claimed {claim}, cached {cached} of {}", out.prompt_tokens);
            match cached {
                0 => none += 1,
                c if c + 2 * ENGINE_BLOCK >= out.prompt_tokens => full += 1,
                _ => partial += 1,
            }
            settle().await;
        }
    }
    let evictions = fleet.agent_metrics(0).await.expect("agent metrics");
    assert!(none > 0, "the cache was under pressure: some prompts were fully evicted\n{evictions}");
    assert!(partial > 0, "some prompts were partly evicted (followed block by block)\n{evictions}");
    let stale = stale_total(&fleet).await - stale_before;
    assert_eq!(
        stale, stale_expected as f64,
        "stale routing counted {stale}; vLLM cached less than claimed {stale_expected} times"
    );
    eprintln!("pressure: {none} cold, {partial} partial, {full} full hits");

    let last = &prompts[prompts.len() - 1];
    let body = json!({"model": model, "messages": last});
    let claim_before = matched_on(&explain(&http, &fleet, "/v1/chat/completions", &body).await, &pod);
    assert!(claim_before > 0, "the last prompt is still cached");

    // A restart: the agent resyncs, the index forgets the old blocks, then follows the new engine.
    fleet.restart_engine(0).await.expect("restart the engine");
    // The agent sees the engine answer again (a candidate once more) with the index cleared.
    let mut seen = Value::Null;
    for _ in 0..150 {
        seen = explain(&http, &fleet, "/v1/chat/completions", &body).await;
        let candidate = seen["candidates"].as_array().is_some_and(|cs| cs.iter().any(|c| c["pod"] == pod.as_str()));
        if candidate && matched_on(&seen, &pod) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        seen["candidates"].as_array().is_some_and(|cs| cs
            .iter()
            .any(|c| c["pod"] == pod.as_str() && c["matched_blocks"].as_u64().unwrap_or(0) == 0)),
        "after the restart the pod is a candidate again and the index no longer credits the old engine's blocks: {seen}"
    );
    // While the restarted engine warms up on this 2-core machine a scrape can time out, and the
    // agent reports the engine not ready until its next scrape answers: the first request
    // retries that 503 for up to five seconds.
    let mut tries = 0;
    let (first, claim) = loop {
        match client.chat_served(&model, last, 4).await {
            Ok(out) => break claimed(&fleet, out).await,
            Err(e) if tries < 20 && e.to_string().contains("engine not ready") => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => panic!("chat through the gateway after the restart: {e:#}"),
        }
    };
    assert_eq!((first.cached_tokens, claim), (0, 0), "a restarted engine holds nothing");
    settle().await;
    let (again, claim) = chat_claimed(&fleet, &client, &model, last).await;
    assert!(again.cached_tokens > 0, "the restarted engine caches again");
    assert!(
        claim.abs_diff(again.cached_tokens) <= ENGINE_BLOCK,
        "after restart: claimed {claim}, cached {}",
        again.cached_tokens
    );
    let resyncs =
        metric_value(&fleet.agent_metrics(0).await.expect("agent metrics"), "kvroute_agent_kv_resyncs_total", "")
            .unwrap_or(0.0);
    assert!(resyncs >= 1.0, "the agent resynced after the engine's restart ({resyncs})");
    fleet.shutdown().await;
}
