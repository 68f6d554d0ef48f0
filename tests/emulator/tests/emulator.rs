//! End-to-end tests of the emulator over real sockets: HTTP on an ephemeral port, ZeroMQ PUB and
//! ROUTER on `tcp://127.0.0.1:*`, and one run of the real binary.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::time::Duration;

use clap::Parser;
use kvroute_emulator::{EmulatorConfig, RunningEmulator};
use rmpv::Value;
use serde_json::{Value as Json, json};

const TOPIC: &str = "kv@127.0.0.1@test-model";
/// Longer than the publisher's batching window, so events before and after land in separate batches.
const BATCH_GAP: Duration = Duration::from_millis(50);

async fn start(extra: &[&str]) -> RunningEmulator {
    let mut args = vec![
        "kvroute-emulator",
        "--port",
        "0",
        "--model",
        "test-model",
        "--block-size",
        "16",
        "--prefill-us-per-token",
        "10",
        "--decode-ms-per-token",
        "1",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:*",
        "--kv-replay-endpoint",
        "tcp://127.0.0.1:*",
        "--kv-topic",
        TOPIC,
        "--pod-name",
        "engine-7",
    ];
    // Flags given in `extra` replace the defaults above.
    for flag in extra.iter().filter(|a| a.starts_with("--")) {
        if let Some(i) = args.iter().position(|a| a == flag) {
            args.drain(i..i + 2);
        }
    }
    args.extend_from_slice(extra);
    kvroute_emulator::start(EmulatorConfig::try_parse_from(args).unwrap()).await.unwrap()
}

fn url(emu: &RunningEmulator, path: &str) -> String {
    format!("http://{}{path}", emu.http_addr)
}

async fn complete(emu: &RunningEmulator, body: Json) -> Json {
    let resp = reqwest::Client::new().post(url(emu, "/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

fn tokens(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

/// A SUB socket on the emulator's PUB endpoint; waits out ZeroMQ's slow-joiner window.
fn subscribe(emu: &RunningEmulator) -> zmq::Socket {
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_subscribe(b"").unwrap();
    sub.set_rcvtimeo(3000).unwrap();
    sub.connect(&emu.kv_events_endpoint).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    sub
}

/// One message: (topic, seq, decoded payload).
fn recv_batch(sub: &zmq::Socket) -> (String, u64, Value) {
    let frames = sub.recv_multipart(0).expect("a KV-event batch within 3 s");
    assert_eq!(frames.len(), 3);
    let seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
    let payload = rmpv::decode::read_value(&mut frames[2].as_slice()).unwrap();
    (String::from_utf8(frames[0].clone()).unwrap(), seq, payload)
}

fn events(batch: &Value) -> Vec<Value> {
    let arr = batch.as_array().unwrap();
    assert_eq!(arr.len(), 3, "[ts, events, data_parallel_rank]");
    assert!(arr[0].is_f64());
    assert_eq!(arr[2].as_u64(), Some(0));
    arr[1].as_array().unwrap().clone()
}

fn field<'a>(event: &'a Value, key: &str) -> &'a Value {
    event.as_map().unwrap().iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v).unwrap_or(&Value::Nil)
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn non_stream_completion_has_vllm_shape_and_headers() {
    let emu = start(&[]).await;
    let resp = reqwest::Client::new()
        .post(url(&emu, "/v1/completions"))
        .header("x-request-id", "req-42")
        .json(&json!({"model": "test-model", "prompt": tokens(0, 20), "max_tokens": 5, "temperature": 0.7,
                      "ignore_eos": true, "some_unknown_field": [1]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-served-by"], "engine-7");
    assert_eq!(resp.headers()["x-request-id"], "req-42");
    let body: Json = resp.json().await.unwrap();
    assert_eq!(body["object"], "text_completion");
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(body["model"], "test-model");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert!(!body["choices"][0]["text"].as_str().unwrap().is_empty());
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    emu.shutdown().await;
}

/// SSE parsed as strictly as inference-perf does.
#[tokio::test(flavor = "multi_thread")]
async fn stream_completion_is_strict_sse_with_final_usage_chunk() {
    let emu = start(&[]).await;
    let resp = reqwest::Client::new()
        .post(url(&emu, "/v1/completions"))
        .json(&json!({"model": "test-model", "prompt": tokens(0, 20), "max_tokens": 4, "stream": true,
                      "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    assert_eq!(resp.headers()["x-served-by"], "engine-7");
    let text = resp.text().await.unwrap();
    assert!(text.ends_with("\n\n"));
    let events: Vec<&str> = text.strip_suffix("\n\n").unwrap().split("\n\n").collect();
    for e in &events {
        assert!(e.starts_with("data: "), "bad SSE event {e:?}");
        assert!(!e.contains('\n'), "one line per event");
    }
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let chunks: Vec<Json> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(&e[6..]).unwrap()).collect();
    assert_eq!(chunks.len(), 5, "4 token chunks + usage chunk");
    for (i, chunk) in chunks[..4].iter().enumerate() {
        assert_eq!(chunk["object"], "text_completion");
        assert!(!chunk["choices"][0]["text"].as_str().unwrap().is_empty());
        let finish = if i == 3 { json!("length") } else { Json::Null };
        assert_eq!(chunk["choices"][0]["finish_reason"], finish);
        assert!(chunk.get("usage").is_none());
    }
    let usage = &chunks[4];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(chunks.iter().map(|c| c["id"].clone()).collect::<std::collections::HashSet<_>>().len(), 1);
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn repeated_prompt_reports_cached_full_blocks_minus_last_token() {
    let emu = start(&[]).await;
    // 40 tokens: 2 full blocks + 8; the second request hits both blocks.
    let body = json!({"model": "test-model", "prompt": tokens(0, 40), "max_tokens": 1});
    assert_eq!(complete(&emu, body.clone()).await["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(complete(&emu, body).await["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
    // 32 tokens = exactly 2 blocks: the last token is never cached, so only 1 block counts.
    let exact = json!({"model": "test-model", "prompt": tokens(1000, 32), "max_tokens": 1});
    complete(&emu, exact.clone()).await;
    assert_eq!(complete(&emu, exact).await["usage"]["prompt_tokens_details"]["cached_tokens"], 16);
    // A different prefix shares nothing.
    let other = json!({"model": "test-model", "prompt": tokens(5000, 40), "max_tokens": 1});
    assert_eq!(complete(&emu, other).await["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sub_receives_chained_block_stored_events() {
    let emu = start(&[]).await;
    let sub = subscribe(&emu);
    let a = tokens(0, 32);
    complete(&emu, json!({"model": "test-model", "prompt": a, "max_tokens": 1})).await;
    let (topic, seq, batch) = tokio::task::block_in_place(|| recv_batch(&sub));
    assert_eq!((topic.as_str(), seq), (TOPIC, 0));
    let stored = events(&batch);
    assert_eq!(stored.len(), 1);
    let ev = &stored[0];
    assert_eq!(field(ev, "type").as_str(), Some("BlockStored"));
    assert_eq!(field(ev, "parent_block_hash"), &Value::Nil);
    assert_eq!(field(ev, "medium").as_str(), Some("GPU"));
    assert_eq!(field(ev, "block_size").as_u64(), Some(16));
    assert_eq!(field(ev, "lora_id"), &Value::Nil);
    let a_hashes = u64s(field(ev, "block_hashes"));
    assert_eq!(a_hashes.len(), 2);
    assert_eq!(u64s(field(ev, "token_ids")), (0..32).collect::<Vec<u64>>());

    // B shares A's first block, then diverges: one new block, parented on A's first block.
    let mut b = tokens(0, 16);
    b.extend(tokens(900, 16));
    complete(&emu, json!({"model": "test-model", "prompt": b, "max_tokens": 1})).await;
    let (_, seq, batch) = tokio::task::block_in_place(|| recv_batch(&sub));
    assert_eq!(seq, 1);
    let ev = &events(&batch)[0];
    assert_eq!(field(ev, "parent_block_hash").as_u64(), Some(a_hashes[0]));
    assert_eq!(u64s(field(ev, "token_ids")), (900..916).collect::<Vec<u64>>());
    let b_hashes = u64s(field(ev, "block_hashes"));
    assert_eq!(b_hashes.len(), 1);
    assert!(!a_hashes.contains(&b_hashes[0]));
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn lru_eviction_publishes_block_removed() {
    // 5 blocks, one of them vLLM's null block: 4 hold KV.
    let emu = start(&["--num-gpu-blocks", "5"]).await;
    let sub = subscribe(&emu);
    let mut stored = Vec::new();
    for start in [0, 100, 200] {
        complete(&emu, json!({"model": "test-model", "prompt": tokens(start, 32), "max_tokens": 1})).await;
        tokio::time::sleep(BATCH_GAP).await;
    }
    let mut removed = Vec::new();
    tokio::task::block_in_place(|| {
        for _ in 0..3 {
            let (_, _, batch) = recv_batch(&sub);
            for ev in events(&batch) {
                match field(&ev, "type").as_str() {
                    Some("BlockStored") => stored.push(u64s(field(&ev, "block_hashes"))),
                    Some("BlockRemoved") => {
                        assert_eq!(field(&ev, "medium").as_str(), Some("GPU"));
                        removed.extend(u64s(field(&ev, "block_hashes")));
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
    });
    // 4 usable blocks: the third prompt evicts both blocks of the first, the tail first, one
    // BlockRemoved each (as vLLM sends them).
    assert_eq!(stored.len(), 3);
    assert_eq!(removed, vec![stored[0][1], stored[0][0]]);
    // And the first prompt is no longer cached.
    let again = complete(&emu, json!({"model": "test-model", "prompt": tokens(0, 32), "max_tokens": 1})).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    emu.shutdown().await;
}

/// Sends a replay request and collects `(seq, payload)` until the end marker.
/// Replayed batches as (seq, payload), and the end-marker frames.
type Replayed = (Vec<(u64, Vec<u8>)>, Vec<Vec<u8>>);

fn replay(endpoint: &str, start: u64) -> Replayed {
    let ctx = zmq::Context::new();
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_rcvtimeo(3000).unwrap();
    dealer.connect(endpoint).unwrap();
    dealer.send_multipart([&b""[..], &start.to_be_bytes()], 0).unwrap();
    let mut batches = Vec::new();
    loop {
        let frames = dealer.recv_multipart(0).expect("replay reply within 3 s");
        assert_eq!(frames.len(), 4, "0.33 framing: [empty, topic, seq, payload]");
        assert!(frames[0].is_empty());
        if frames[2] == (-1i64).to_be_bytes() {
            return (batches, frames);
        }
        assert_eq!(frames[1], TOPIC.as_bytes());
        batches.push((u64::from_be_bytes(frames[2].as_slice().try_into().unwrap()), frames[3].clone()));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_returns_buffered_batches_and_end_marker() {
    let emu = start(&[]).await;
    let sub = subscribe(&emu);
    let mut live = Vec::new();
    for start in [0, 100, 200] {
        complete(&emu, json!({"model": "test-model", "prompt": tokens(start, 16), "max_tokens": 1})).await;
        live.push(tokio::task::block_in_place(|| sub.recv_multipart(0).unwrap()));
    }
    let endpoint = emu.kv_replay_endpoint.clone();
    let (batches, end) = tokio::task::spawn_blocking(move || replay(&endpoint, 1)).await.unwrap();
    assert_eq!(batches.iter().map(|b| b.0).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(batches[0].1, live[1][2], "replayed payload is the published one");
    assert_eq!(batches[1].1, live[2][2]);
    assert_eq!(end, vec![vec![], vec![], (-1i64).to_be_bytes().to_vec(), vec![]]);
    // Replay from past the end: only the marker.
    let endpoint = emu.kv_replay_endpoint.clone();
    let (none, _) = tokio::task::spawn_blocking(move || replay(&endpoint, 99)).await.unwrap();
    assert!(none.is_empty());
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn dropped_batches_leave_a_seq_gap_that_replay_fills() {
    let emu = start(&[]).await;
    let sub = subscribe(&emu);
    let client = reqwest::Client::new();
    let faults: Json = client
        .post(url(&emu, "/emulator/faults"))
        .json(&json!({"drop_kv_events": 1}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(faults["drop_kv_events"], 1);
    complete(&emu, json!({"model": "test-model", "prompt": tokens(0, 16), "max_tokens": 1})).await;
    tokio::time::sleep(BATCH_GAP).await;
    complete(&emu, json!({"model": "test-model", "prompt": tokens(500, 16), "max_tokens": 1})).await;
    let (_, seq, _) = tokio::task::block_in_place(|| recv_batch(&sub));
    assert_eq!(seq, 1, "batch 0 was dropped: the subscriber sees a gap");
    let endpoint = emu.kv_replay_endpoint.clone();
    let (batches, _) = tokio::task::spawn_blocking(move || replay(&endpoint, 0)).await.unwrap();
    assert_eq!(batches[0].0, 0);
    let payload = rmpv::decode::read_value(&mut batches[0].1.as_slice()).unwrap();
    assert_eq!(u64s(field(&events(&payload)[0], "token_ids")), (0..16).collect::<Vec<u64>>());
    let now: Json = client.get(url(&emu, "/emulator/faults")).send().await.unwrap().json().await.unwrap();
    assert_eq!(now["drop_kv_events"], 0);
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn reset_prefix_cache_publishes_all_blocks_cleared() {
    let emu = start(&[]).await;
    let sub = subscribe(&emu);
    let body = json!({"model": "test-model", "prompt": tokens(0, 40), "max_tokens": 1});
    complete(&emu, body.clone()).await;
    tokio::time::sleep(BATCH_GAP).await;
    let resp = reqwest::Client::new().post(url(&emu, "/reset_prefix_cache")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let types: Vec<String> = tokio::task::block_in_place(|| {
        (0..2)
            .flat_map(|_| events(&recv_batch(&sub).2))
            .map(|e| field(&e, "type").as_str().unwrap().to_string())
            .collect()
    });
    assert_eq!(types, vec!["BlockStored", "AllBlocksCleared"]);
    assert_eq!(complete(&emu, body).await["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_expose_vllm_names_and_labels() {
    let emu = start(&["--lora-modules", "sql-lora=/dev/null", "--max-loras", "3", "--num-gpu-blocks", "64"]).await;
    complete(&emu, json!({"model": "test-model", "prompt": tokens(0, 40), "max_tokens": 2})).await;
    complete(&emu, json!({"model": "test-model", "prompt": tokens(0, 40), "max_tokens": 2})).await;
    let resp = reqwest::get(url(&emu, "/metrics")).await.unwrap();
    assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
    let text = resp.text().await.unwrap();
    let labels = "{engine=\"0\",model_name=\"test-model\"}";
    for needle in [
        format!("vllm:num_requests_running{labels} 0.0"),
        format!("vllm:num_requests_waiting{labels} 0.0"),
        format!("vllm:kv_cache_usage_perc{labels} 0.0"),
        format!("vllm:prefix_cache_queries_total{labels} 80.0"),
        format!("vllm:prefix_cache_hits_total{labels} 32.0"),
        "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"test-model\"} 2.0".to_string(),
        format!("vllm:time_to_first_token_seconds_count{labels} 2.0"),
        "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"test-model\"} 2.0".to_string(),
        "vllm:lora_requests_info{max_lora=\"3\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"}".to_string(),
        "# TYPE vllm:time_to_first_token_seconds histogram".to_string(),
        "# TYPE vllm:prefix_cache_hits_total counter".to_string(),
    ] {
        assert!(text.contains(&needle), "missing {needle:?} in\n{text}");
    }
    let cache_info = text.lines().find(|l| l.starts_with("vllm:cache_config_info{")).unwrap();
    assert!(cache_info.contains("block_size=\"16\"") && cache_info.contains("num_gpu_blocks=\"64\""));
    assert!(cache_info.ends_with(" 1.0"));
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn queue_bounded_by_max_num_seqs() {
    let emu = start(&["--max-num-seqs", "1", "--decode-ms-per-token", "20"]).await;
    let first = tokio::spawn(complete_owned(url(&emu, "/v1/completions"), tokens(0, 8), 20));
    tokio::time::sleep(Duration::from_millis(60)).await;
    let second = tokio::spawn(complete_owned(url(&emu, "/v1/completions"), tokens(100, 8), 1));
    tokio::time::sleep(Duration::from_millis(60)).await;
    let text = reqwest::get(url(&emu, "/metrics")).await.unwrap().text().await.unwrap();
    assert!(text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"test-model\"} 1.0"), "{text}");
    assert!(text.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"test-model\"} 1.0"), "{text}");
    first.await.unwrap();
    second.await.unwrap();
    emu.shutdown().await;
}

/// `--max-num-partial-prefills 1`: a second cold prefill waits for the first (prefill compute is
/// the bottleneck); without the limit both prefill at once. Either way a request of the same prompt
/// finds the first one's blocks: vLLM caches a prompt's full blocks when it schedules it, before
/// its prefill runs, so a request scheduled after it (even in the same step) hits them.
#[tokio::test(flavor = "multi_thread")]
async fn partial_prefill_limit_serialises_prefills() {
    for (limit, expect_serial) in [("1", true), ("0", false)] {
        let emu = start(&["--max-num-partial-prefills", limit, "--prefill-us-per-token", "2000"]).await;
        let body = |start| json!({"model": "test-model", "prompt": tokens(start, 160), "max_tokens": 1});
        // Two different cold prompts: 160 tokens × 2 ms = 320 ms of prefill each.
        let started = std::time::Instant::now();
        let _ = tokio::join!(complete(&emu, body(0)), complete(&emu, body(1000)));
        let elapsed = started.elapsed();
        if expect_serial {
            assert!(elapsed >= Duration::from_millis(600), "limit 1: {elapsed:?}");
        } else {
            assert!(elapsed < Duration::from_millis(600), "no limit: {elapsed:?}");
        }
        // The same prompt twice at once: the hit is 144 tokens (the last block is never counted).
        let cached = |r: &Json| r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        let (a, b) = tokio::join!(complete(&emu, body(2000)), complete(&emu, body(2000)));
        assert_eq!(cached(&a) + cached(&b), 144, "limit {limit}: {a} {b}");
        emu.shutdown().await;
    }
}

async fn complete_owned(url: String, prompt: Vec<u32>, max_tokens: u32) {
    let resp = reqwest::Client::new()
        .post(url)
        .json(&json!({"model": "test-model", "prompt": prompt, "max_tokens": max_tokens}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_use_vllm_error_shape() {
    let emu = start(&[]).await;
    let client = reqwest::Client::new();
    let resp = client
        .post(url(&emu, "/v1/completions"))
        .json(&json!({"model": "nope", "prompt": [1, 2]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    assert_eq!(resp.headers()["x-served-by"], "engine-7");
    let body: Json = resp.json().await.unwrap();
    assert_eq!(body["error"]["type"], "NotFoundError");
    assert_eq!(body["error"]["code"], 404);
    assert_eq!(body["error"]["param"], Json::Null);
    assert_eq!(body["error"]["message"], "The model `nope` does not exist.");
    let resp = client.post(url(&emu, "/v1/completions")).body("{not json").send().await.unwrap();
    assert_eq!(resp.status(), 400);
    let body: Json = resp.json().await.unwrap();
    assert_eq!((body["error"]["type"].as_str(), body["error"]["code"].as_u64()), (Some("BadRequestError"), Some(400)));
    let resp = client
        .post(url(&emu, "/v1/completions"))
        .json(&json!({"model": "test-model", "prompt": [], "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn lora_adapters_load_unload_and_list() {
    let emu = start(&["--lora-modules", "sql-lora=/adapters/sql"]).await;
    let client = reqwest::Client::new();
    let models: Json = client.get(url(&emu, "/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "test-model");
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    assert_eq!(models["data"][1]["id"], "sql-lora");
    assert_eq!(models["data"][1]["parent"], "test-model");
    let load = |name: &str| {
        client.post(url(&emu, "/v1/load_lora_adapter")).json(&json!({"lora_name": name, "lora_path": "/x"})).send()
    };
    assert_eq!(load("chat-lora").await.unwrap().status(), 200);
    assert_eq!(load("chat-lora").await.unwrap().status(), 400);
    let body = json!({"model": "chat-lora", "prompt": tokens(0, 20), "max_tokens": 1});
    assert_eq!(complete(&emu, body.clone()).await["model"], "chat-lora");
    let unload = client
        .post(url(&emu, "/v1/unload_lora_adapter"))
        .json(&json!({"lora_name": "chat-lora"}))
        .send()
        .await
        .unwrap();
    assert_eq!(unload.status(), 200);
    let gone = client.post(url(&emu, "/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(gone.status(), 404);
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn lora_blocks_carry_adapter_identity() {
    let emu = start(&["--lora-modules", "sql-lora=/adapters/sql"]).await;
    let sub = subscribe(&emu);
    complete(&emu, json!({"model": "sql-lora", "prompt": tokens(0, 20), "max_tokens": 1})).await;
    tokio::time::sleep(BATCH_GAP).await;
    complete(&emu, json!({"model": "test-model", "prompt": tokens(0, 20), "max_tokens": 1})).await;
    let (lora_ev, base_ev) = tokio::task::block_in_place(|| (events(&recv_batch(&sub).2), events(&recv_batch(&sub).2)));
    assert_eq!(field(&lora_ev[0], "lora_id").as_u64(), Some(1));
    assert_eq!(field(&lora_ev[0], "lora_name").as_str(), Some("sql-lora"));
    assert_ne!(u64s(field(&lora_ev[0], "block_hashes")), u64s(field(&base_ev[0], "block_hashes")));
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn health_and_stuck_and_die_mid_stream_faults() {
    let emu = start(&[]).await;
    let client = reqwest::Client::new();
    let set = |body: Json| client.post(url(&emu, "/emulator/faults")).json(&body).send();
    assert_eq!(client.get(url(&emu, "/health")).send().await.unwrap().status(), 200);
    set(json!({"unhealthy": true})).await.unwrap();
    assert_eq!(client.get(url(&emu, "/health")).send().await.unwrap().status(), 503);
    set(json!({"unhealthy": false, "stuck": true})).await.unwrap();
    assert_eq!(client.get(url(&emu, "/health")).send().await.unwrap().status(), 200);
    let probe = client
        .post(url(&emu, "/v1/completions"))
        .timeout(Duration::from_millis(300))
        .json(&json!({"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 1}))
        .send()
        .await;
    assert!(probe.is_err_and(|e| e.is_timeout()), "a stuck engine never answers");
    set(json!({"stuck": false, "die_mid_stream": true})).await.unwrap();
    let resp = client
        .post(url(&emu, "/v1/completions"))
        .json(&json!({"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 5, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut resp = resp;
    let mut received = Vec::new();
    let outcome = loop {
        match resp.chunk().await {
            Ok(Some(bytes)) => received.extend_from_slice(&bytes),
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    assert!(outcome.is_err(), "the stream must be cut, not finished");
    let text = String::from_utf8(received).unwrap();
    assert_eq!(text.matches("data: ").count(), 1, "exactly one chunk before the cut: {text:?}");
    assert!(!text.contains("[DONE]"));
    let bad = set(json!({"stuck": "yes"})).await.unwrap();
    assert_eq!(bad.status(), 400);
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn chat_uses_the_tokenizer_or_says_why_not() {
    let dir = format!("{}/../fixtures/tokenizer-qwen2.5", env!("CARGO_MANIFEST_DIR"));
    let emu = start(&["--tokenizer", &dir]).await;
    let resp = reqwest::Client::new()
        .post(url(&emu, "/v1/chat/completions"))
        .json(&json!({"model": "test-model", "messages": [{"role": "user", "content": "Hello!"}],
                      "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    if kvroute_tokenize::ModelTokenizer::from_dir(std::path::Path::new(&dir)).is_ok() {
        assert_eq!(resp.status(), 200);
        let text = resp.text().await.unwrap();
        let chunks: Vec<Json> = text
            .split("\n\n")
            .filter(|e| !e.is_empty() && *e != "data: [DONE]")
            .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
            .collect();
        assert_eq!(chunks[0]["object"], "chat.completion.chunk");
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert!(chunks.last().unwrap()["usage"]["prompt_tokens"].as_u64().unwrap() > 3);
    } else {
        assert_eq!(resp.status(), 400);
        let body: Json = resp.json().await.unwrap();
        assert!(body["error"]["message"].as_str().unwrap().contains("tokenizer"));
    }
    emu.shutdown().await;
}

/// vLLM sends a chat stream's role chunk with the first token (its output stream's first item),
/// so a router that times a stream's first byte times the first token: no byte comes before the
/// prefill is done.
#[tokio::test(flavor = "multi_thread")]
async fn a_chat_stream_sends_nothing_before_its_first_token() {
    let dir = tokenizer_dir();
    if kvroute_tokenize::ModelTokenizer::from_dir(std::path::Path::new(&dir)).is_err() {
        return; // chat_uses_the_tokenizer_or_says_why_not covers the refusal
    }
    // 10 ms per prompt token: the templated prompt's prefill takes well over 100 ms.
    let emu = start(&["--tokenizer", &dir, "--prefill-us-per-token", "10000"]).await;
    let sent = std::time::Instant::now();
    let mut resp = reqwest::Client::new()
        .post(url(&emu, "/v1/chat/completions"))
        .json(&json!({"model": "test-model", "messages": [{"role": "user", "content": "Hello there!"}],
                      "max_tokens": 2, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.unwrap().unwrap();
    let waited = sent.elapsed();
    assert!(waited >= Duration::from_millis(100), "first byte after {waited:?}: {first:?}");
    let mut text = String::from_utf8(first.to_vec()).unwrap();
    while let Some(more) = resp.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&more).unwrap());
    }
    let role = text.find("\"role\":\"assistant\"").expect("a role chunk");
    let token = text.find("\"content\":\"").map(|_| ()).and(text[role + 1..].find("data: "));
    assert!(token.is_some(), "token chunks follow the role chunk: {text}");
    emu.shutdown().await;
}

fn tokenizer_dir() -> String {
    format!("{}/../fixtures/tokenizer-qwen2.5", env!("CARGO_MANIFEST_DIR"))
}

async fn metric(emu: &RunningEmulator, name: &str) -> f64 {
    let text = reqwest::get(url(emu, "/metrics")).await.unwrap().text().await.unwrap();
    let line = text.lines().find(|l| l.starts_with(&format!("{name}{{"))).unwrap_or_else(|| panic!("{name} in {text}"));
    line.rsplit_once(' ').unwrap().1.parse().unwrap()
}

/// vLLM counts a cached block once however many running requests share it. Two requests on the
/// same 64-token prompt (4 blocks of 16), decoding: the first holds its 4 prompt blocks and one
/// for its output; the second hits 3 (never the last prompt token's block), computes block 4
/// again into a block of its own, and takes one for its output: 7 blocks of the 99 usable (one of
/// the 100 is vLLM's null block).
#[tokio::test(flavor = "multi_thread")]
async fn kv_usage_counts_shared_prefix_blocks_once() {
    let emu = start(&["--num-gpu-blocks", "100", "--decode-ms-per-token", "150"]).await;
    let u = url(&emu, "/v1/completions");
    let a = tokio::spawn(complete_owned(u.clone(), tokens(0, 64), 6));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b = tokio::spawn(complete_owned(u, tokens(0, 64), 6));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(metric(&emu, "vllm:num_requests_running").await, 2.0);
    let usage = metric(&emu, "vllm:kv_cache_usage_perc").await;
    assert!((usage - 7.0 / 99.0).abs() < 1e-9, "usage {usage}, want 7 of 99 blocks (shared counted once)");
    a.await.unwrap();
    b.await.unwrap();
    assert_eq!(metric(&emu, "vllm:kv_cache_usage_perc").await, 0.0, "finished requests hold nothing");
    emu.shutdown().await;
}

/// vLLM 0.33: the salt is part of the first block's identity, so a salted prompt never hits an
/// unsalted (or differently salted) cache, and the BlockStored events carry it in `extra_keys`.
#[tokio::test(flavor = "multi_thread")]
async fn cache_salt_isolates_caches_and_travels_in_extra_keys() {
    let emu = start(&[]).await;
    let sub = subscribe(&emu);
    let cached = |v: Json| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let body = |salt: Option<&str>| {
        let mut b = json!({"model": "test-model", "prompt": tokens(0, 48), "max_tokens": 1});
        if let Some(s) = salt {
            b["cache_salt"] = json!(s);
        }
        b
    };
    assert_eq!(cached(complete(&emu, body(None)).await), 0);
    tokio::time::sleep(BATCH_GAP).await;
    assert_eq!(
        cached(complete(&emu, body(Some("tenant-a"))).await),
        0,
        "unsalted cache must not serve a salted prompt"
    );
    tokio::time::sleep(BATCH_GAP).await;
    assert_eq!(cached(complete(&emu, body(Some("tenant-a"))).await), 32, "same salt: its own cache");
    assert_eq!(cached(complete(&emu, body(Some("tenant-b"))).await), 0, "another salt: disjoint");
    let (plain, salted) = tokio::task::block_in_place(|| (events(&recv_batch(&sub).2), events(&recv_batch(&sub).2)));
    assert_eq!(field(&plain[0], "extra_keys"), &Value::Nil, "no extra keys: field omitted, as vLLM does");
    let keys = field(&salted[0], "extra_keys").as_array().unwrap().clone();
    assert_eq!(keys.len(), 3, "one entry per block");
    assert_eq!(keys[0], Value::Array(vec![Value::from("tenant-a")]));
    assert_eq!(keys[1], Value::Nil);
    assert_ne!(u64s(field(&plain[0], "block_hashes")), u64s(field(&salted[0], "block_hashes")));
    let resp = reqwest::Client::new().post(url(&emu, "/v1/completions")).json(&body(Some(""))).send().await.unwrap();
    assert_eq!(resp.status(), 400);
    let err: Json = resp.json().await.unwrap();
    assert_eq!(err["error"]["param"], "cache_salt");
    emu.shutdown().await;
}

/// Each image's placeholder tokens carry `(identifier, offset)` in the keys of the blocks they
/// cover: a different image misses from its first block on, the same image (same URL, or the same
/// `uuid`) hits.
async fn images_are_part_of_block_identity(emu: &RunningEmulator) {
    let sub = subscribe(emu);
    let chat = |image: &str| {
        json!({"model": "test-model", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe this picture in detail, please, all of it."},
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": "And say what colour it mostly is."}]}]})
    };
    let send = |body: Json| {
        let u = url(emu, "/v1/chat/completions");
        async move {
            let resp = reqwest::Client::new().post(u).json(&body).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            resp.json::<Json>().await.unwrap()
        }
    };
    let first = send(chat("https://example.com/cat.png")).await;
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 40, "the image expands to 40 placeholder tokens: {first}");
    let (stored,) = tokio::task::block_in_place(|| (events(&recv_batch(&sub).2),));
    let keys = field(&stored[0], "extra_keys").as_array().unwrap().clone();
    let mm: Vec<(usize, String, i64)> = keys
        .iter()
        .enumerate()
        .filter_map(|(i, k)| {
            let k = k.as_array()?;
            let pair = k[0].as_array()?;
            Some((i, pair[0].as_str()?.to_string(), pair[1].as_i64()?))
        })
        .collect();
    assert!(mm.len() >= 3, "40 placeholder tokens cover 3 or 4 blocks: {keys:?}");
    assert!(mm.windows(2).all(|w| w[0].1 == w[1].1 && w[1].0 == w[0].0 + 1 && w[1].2 == w[0].2 - 16));
    assert!(mm[0].2 >= 0 && mm[1].2 < 0, "offset relative to each block's start: {mm:?}");
    let cached = |v: &Json| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let first_image_block = mm[0].0 as u64;
    let other = send(chat("https://example.com/dog.png")).await;
    assert_eq!(cached(&other), first_image_block * 16, "a different image misses from its first block");
    let again = send(chat("https://example.com/cat.png")).await;
    assert!(cached(&again) > first_image_block * 16 + 40, "the same image hits: {again}");
}

/// vLLM's identifier of an inline image, written out from its hasher's framed layout
/// (docs/design.md §2) independently of the implementation: BLAKE3 over
/// frame("image") 03 frame("image") 03 frame(bytes) frame("model_id") 03 frame(model).
fn vllm_image_hash(model: &str, bytes: &[u8]) -> String {
    let frame = |out: &mut Vec<u8>, chunk: &[u8]| {
        out.extend_from_slice(&(chunk.len() as u64).to_le_bytes());
        out.extend_from_slice(chunk);
    };
    let mut stream = Vec::new();
    frame(&mut stream, b"image");
    stream.push(3);
    frame(&mut stream, b"image");
    stream.push(3);
    frame(&mut stream, bytes);
    frame(&mut stream, b"model_id");
    stream.push(3);
    frame(&mut stream, model.as_bytes());
    blake3::hash(&stream).to_hex().to_string()
}

/// With `--mm-vision`, an inline image (a base64 `data:` URL without `uuid`) is identified as
/// vLLM identifies it (its content hash under the engine's model) and expands to the Qwen2-VL
/// count of its size: 300×200 → 77 tokens, 130×90 → 15, and WebP, GIF, BMP alike (worked in
/// tests/fixtures/images' README); URLs the emulator does not fetch keep the fixed count; data
/// vLLM cannot load is a 400.
async fn inline_images_are_identified_and_sized_as_vllm_does(emu: &RunningEmulator) {
    let data_url = |media_type: &str, bytes: &[u8]| {
        use base64::Engine as _;
        format!("data:{media_type};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
    };
    let fixture = |name: &str, media_type: &str| {
        let path = format!("{}/../fixtures/images/{name}", env!("CARGO_MANIFEST_DIR"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let url = data_url(media_type, &bytes);
        (bytes, url)
    };
    let chat = |image: &str| {
        json!({"model": "test-model", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe this picture in detail, please, all of it and then some more."},
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": "And say what colour it mostly is."}]}]})
    };
    let post = |body: Json| {
        let u = url(emu, "/v1/chat/completions");
        async move { reqwest::Client::new().post(u).json(&body).send().await.unwrap() }
    };
    let send = |body: Json| {
        let resp = post(body);
        async move {
            let resp = resp.await;
            assert_eq!(resp.status(), 200);
            resp.json::<Json>().await.unwrap()
        }
    };
    let prompt_tokens = |v: &Json| v["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = |v: &Json| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let (png, png_url) = fixture("gradient-300x200.png", "image/png");
    let sub = subscribe(emu);
    let first = send(chat(&png_url)).await;
    let stored = tokio::task::block_in_place(|| events(&recv_batch(&sub).2));
    let by_url = send(chat("https://example.com/unfetched.png")).await;
    assert_eq!(prompt_tokens(&first), prompt_tokens(&by_url) - 40 + 77, "77 tokens against the fixed 40");
    let ids: Vec<String> = stored
        .iter()
        .flat_map(|e| field(e, "extra_keys").as_array().cloned().unwrap_or_default())
        .filter_map(|k| Some(k.as_array()?.first()?.as_array()?.first()?.as_str()?.to_owned()))
        .collect();
    assert!(ids.len() >= 5, "77 tokens cover 5 or 6 blocks: {ids:?}");
    assert!(ids.iter().all(|id| *id == vllm_image_hash("test-model", &png)), "{ids:?}");
    let again = send(chat(&png_url)).await;
    assert!(cached(&again) + 16 >= prompt_tokens(&again) - 16, "the same image hits through it: {again}");
    let (_, jpg_url) = fixture("pattern-130x90-progressive-exif.jpg", "image/jpeg");
    let other = send(chat(&jpg_url)).await;
    assert_eq!(prompt_tokens(&other), prompt_tokens(&by_url) - 40 + 15);
    assert!(cached(&other) < prompt_tokens(&first) - 77 - 10 && cached(&other) % 16 == 0, "{other}");
    // The other formats vLLM's loader opens: an animated WebP's canvas (100×80 → 12 tokens), a
    // GIF's screen (150×100 → 20), a BMP (90×60 → 6).
    for (name, media_type, n) in [
        ("anim-100x80-3frames.webp", "image/webp", 12),
        ("anim-150x100-2frames.gif", "image/gif", 20),
        ("pattern-90x60.bmp", "image/bmp", 6),
    ] {
        let (_, data_url) = fixture(name, media_type);
        assert_eq!(prompt_tokens(&send(chat(&data_url)).await), prompt_tokens(&by_url) - 40 + n, "{name}");
    }
    // Data vLLM cannot load: a 400, as vLLM answers (libwebp refuses a WebP cut short).
    let truncated = data_url("image/png", &png[..20]);
    let (webp, _) = fixture("anim-100x80-3frames.webp", "image/webp");
    let cut_webp = data_url("image/webp", &webp[..webp.len() - 1]);
    for bad in ["data:image/png;base64,!!!!", &png_url[..png_url.len() - 1], &truncated, &cut_webp] {
        assert_eq!(post(chat(bad)).await.status(), 400, "{bad:.40}");
    }
}

/// One emulator with the real tokenizer (loading it is the slow part of a debug test) for the
/// tests that render chats.
#[tokio::test(flavor = "multi_thread")]
async fn tokenizer_backed_images_and_responses() {
    let dir = tokenizer_dir();
    if kvroute_tokenize::ModelTokenizer::from_dir(std::path::Path::new(&dir)).is_err() {
        return;
    }
    let emu = start(&["--tokenizer", &dir, "--mm-tokens-per-image", "40", "--mm-vision"]).await;
    images_are_part_of_block_identity(&emu).await;
    inline_images_are_identified_and_sized_as_vllm_does(&emu).await;
    responses_api_is_served_like_chat(&emu).await;
    emu.shutdown().await;
}

/// A body of several MB goes through (up to `--max-body-bytes`) and gets vLLM's context-length
/// 400, not a refusal of the body; above the limit the answer is a 413 in vLLM's error shape.
#[tokio::test(flavor = "multi_thread")]
async fn large_bodies_reach_the_context_length_check() {
    let emu = start(&["--max-model-len", "4096", "--max-body-bytes", "8388608"]).await;
    let client = reqwest::Client::new();
    // 6 MB of token ids: ~1.2M tokens.
    let huge: Vec<u32> = (0..1_200_000u32).map(|i| i % 50_000).collect();
    let body = serde_json::to_vec(&json!({"model": "test-model", "prompt": huge, "max_tokens": 16})).unwrap();
    assert!(body.len() > 6_000_000 && body.len() < 8_388_608, "{}", body.len());
    let resp = client.post(url(&emu, "/v1/completions")).body(body).send().await.unwrap();
    assert_eq!(resp.status(), 400);
    let err: Json = resp.json().await.unwrap();
    assert_eq!(
        err["error"]["message"],
        "You passed 1200000 input tokens and requested 16 output tokens. However, the model's context length is only \
         4096 tokens, resulting in a maximum input length of 4080 tokens. Please reduce the length of the input \
         prompt. (parameter=input_tokens, value=1200000)"
    );
    assert_eq!(
        (err["error"]["type"].as_str(), err["error"]["param"].as_str()),
        (Some("BadRequestError"), Some("input_tokens"))
    );
    // Exactly at the limit: 4080 + 16 = 4096 passes.
    complete(&emu, json!({"model": "test-model", "prompt": tokens(0, 4080), "max_tokens": 16})).await;
    let over = vec![b'x'; 9 * 1024 * 1024];
    // The emulator answers 413 from the Content-Length and closes; a loaded machine may let it
    // close before the client finished writing (broken pipe). Either way nothing was accepted,
    // and a body under the limit still works afterwards.
    match client.post(url(&emu, "/v1/completions")).body(over).send().await {
        Ok(resp) => {
            assert_eq!(resp.status(), 413);
            let err: Json = resp.json().await.unwrap();
            assert_eq!(err["error"]["code"], 413);
        }
        Err(e) => assert!(e.is_request() && !e.is_timeout(), "oversized body: {e}"),
    }
    complete(&emu, json!({"model": "test-model", "prompt": tokens(0, 64), "max_tokens": 4})).await;
    emu.shutdown().await;
}

/// A `prompt` list is a batch: one choice per prompt, `index` in order, usage summed; streamed,
/// each chunk names its choice.
#[tokio::test(flavor = "multi_thread")]
async fn completions_serve_prompt_batches() {
    let emu = start(&[]).await;
    let body =
        complete(&emu, json!({"model": "test-model", "prompt": [tokens(0, 20), tokens(100, 36)], "max_tokens": 3}))
            .await;
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!((choices[0]["index"].as_u64(), choices[1]["index"].as_u64()), (Some(0), Some(1)));
    assert!(choices.iter().all(|c| c["finish_reason"] == "length"));
    assert_eq!(body["usage"]["prompt_tokens"], 56);
    assert_eq!(body["usage"]["completion_tokens"], 6);
    let text = reqwest::Client::new()
        .post(url(&emu, "/v1/completions"))
        .json(&json!({"model": "test-model", "prompt": [tokens(0, 20), tokens(100, 36)], "max_tokens": 2,
                      "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let chunks: Vec<Json> = text
        .split("\n\n")
        .filter(|e| !e.is_empty() && *e != "data: [DONE]")
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    let indexes: Vec<u64> = chunks.iter().filter_map(|c| c["choices"][0]["index"].as_u64()).collect();
    assert_eq!(indexes, vec![0, 0, 1, 1]);
    assert_eq!(chunks.last().unwrap()["usage"]["prompt_tokens"], 56);
    assert!(text.ends_with("data: [DONE]\n\n"));
    let empty = reqwest::Client::new()
        .post(url(&emu, "/v1/completions"))
        .json(&json!({"model": "test-model", "prompt": Vec::<Vec<u32>>::new()}))
        .send()
        .await
        .unwrap();
    assert_eq!(empty.status(), 400);
    emu.shutdown().await;
}

/// `/v1/responses`: `instructions` + `input` (text or message items) rendered as a chat, answered
/// as a Responses API object or event stream; repeating it hits the prefix cache; an empty body is
/// a 400.
async fn responses_api_is_served_like_chat(emu: &RunningEmulator) {
    let client = reqwest::Client::new();
    let long = "You answer questions about the emulator. ".repeat(20);
    let body = json!({"model": "test-model", "instructions": long, "max_output_tokens": 3,
                      "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"}]}]});
    let first: Json = client.post(url(emu, "/v1/responses")).json(&body).send().await.unwrap().json().await.unwrap();
    assert_eq!(first["object"], "response");
    assert!(first["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(first["output"][0]["type"], "message");
    assert_eq!(first["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(first["usage"]["output_tokens"], 3);
    let prompt_tokens = first["usage"]["input_tokens"].as_u64().unwrap();
    // The same conversation through chat renders the same prompt.
    let chat = complete_chat(
        emu,
        json!({"model": "test-model", "max_tokens": 1, "messages": [
        {"role": "system", "content": long}, {"role": "user", "content": "What is it?"}]}),
    )
    .await;
    assert_eq!(chat["usage"]["prompt_tokens"].as_u64(), Some(prompt_tokens));
    assert!(chat["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() >= prompt_tokens - 16);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["input"] = json!("What is it?");
    let text = client.post(url(emu, "/v1/responses")).json(&streamed).send().await.unwrap().text().await.unwrap();
    let kinds: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    assert_eq!(kinds.first(), Some(&"response.created"));
    assert_eq!(kinds.iter().filter(|k| **k == "response.output_text.delta").count(), 3);
    assert_eq!(kinds.last(), Some(&"response.completed"));
    let resp = client.post(url(emu, "/v1/responses")).send().await.unwrap();
    assert_eq!(resp.status(), 400);
}

async fn complete_chat(emu: &RunningEmulator, body: Json) -> Json {
    let resp = reqwest::Client::new().post(url(emu, "/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

#[test]
fn binary_prints_ready_and_serves() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-emulator"))
        .args(["--port", "0", "--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-replay-endpoint", "tcp://127.0.0.1:*"])
        .args(["--log-level", "warn"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line).unwrap();
    let base =
        line.trim().strip_prefix("READY ").unwrap_or_else(|| panic!("unexpected first line {line:?}")).to_string();
    assert!(base.starts_with("http://127.0.0.1:"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let status = rt.block_on(async { reqwest::get(format!("{base}/health")).await.unwrap().status() });
    child.kill().unwrap();
    let _ = child.wait();
    assert_eq!(status, 200);
}
