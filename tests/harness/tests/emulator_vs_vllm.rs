//! Differential test: the emulator against real vLLM (the CPU build, `scripts/install-vllm`), on
//! the same seeded stream. The emulator stands in for vLLM in every other end-to-end test, the
//! demo and the benchmarks, so where it answers differently from vLLM those results say nothing
//! about kvroute on vLLM; this test is what keeps it calibrated.
//!
//! One vLLM engine and one emulator, each alone (no agent, picker or gateway: the agent's active
//! probe would add requests), with the same block size (32: vLLM's CPU attention refuses 16), the
//! same 64 KV blocks (`--num-gpu-blocks-override`; both keep one as vLLM's null block, so 63 hold
//! KV, room for `max_model_len` 2000), the same `max_num_seqs`, prefix caching and KV events on
//! ZeroMQ. Compared:
//! - per request of a sequential stream (conversations sharing a system prompt, an exact repeat, a
//!   fully cached prompt of a whole number of blocks, long documents that evict each other and the
//!   conversations): `usage.prompt_tokens` and `prompt_tokens_details.cached_tokens` (and
//!   `created_cache_tokens`, the prompt tokens the request wrote to the cache);
//! - after each request, the engines' KV events re-hashed by the agent's own [`BlockRecord`]
//!   into kvroute block hashes: the blocks stored and removed since the request before, and the
//!   whole set each engine holds, equal;
//! - `/metrics`: every `vllm:` series the emulator exports exists on vLLM's page with the same
//!   label names, and what the agent reads parses on both with the same block size and count;
//!   `vllm:prefix_cache_queries_total` / `_hits_total` move by the same amounts over the stream
//!   (vLLM counts each request's prompt tokens and its cached tokens); idle after it (0 running,
//!   0 waiting, KV usage 0: vLLM counts blocks held by running requests, not cached free ones);
//!   and under a burst of more requests than `max_num_seqs`: running never above it, some
//!   waiting, KV usage above 0 whenever a request runs, and the same peak KV usage to within a
//!   block per running request.
//!
//! Differences that are inherent, not asserted (docs/design.md §8 "The emulator against vLLM"):
//! - generated tokens: vLLM's random-weight model samples its own, the emulator cycles a filler
//!   sentence, so a block holding output tokens hashes differently. The stream asks for one token
//!   (`max_tokens` 1): the last generated token's KV is never computed, so only prompt blocks are
//!   cached, on both;
//! - timing (prefill and decode speed, when a burst's requests start): only bounds are compared;
//! - `vllm:cache_config_info`'s labels are a dump of the engine's cache config and change with
//!   every vLLM release; only those the agent reads (`block_size`, `num_gpu_blocks`) are compared;
//! - families vLLM 0.32 has and the emulator does not export (e.g. `vllm:request_prompt_tokens`,
//!   `vllm:num_requests_waiting_by_reason`): nothing in kvroute reads them;
//! - KV-event wire details (vLLM 0.32 adds `group_idx` and `kv_cache_spec_kind`): the decoder
//!   ignores them; what is compared is what the agent makes of the events;
//! - vLLM admits a request only when its blocks are free, and preempts under KV pressure; the
//!   emulator does neither, so the burst stays well within the cache.
#![allow(clippy::expect_used)]

use kvroute_agent::engine::blocks::BlockRecord;
use kvroute_agent::engine::kv_events::{KvMessage, decode_message};
use kvroute_agent::engine::metrics::{Sample, parse_engine_metrics, parse_samples};
use kvroute_harness::client::post_json;
use kvroute_harness::fleet::Engine;
use kvroute_harness::workload::seeded_words;
use kvroute_harness::{DEFAULT_MODEL, EngineKind, FleetSpec, VllmSpec, Workload, paths};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Tokens per engine block, on both.
const ENGINE_BLOCK: u32 = 32;
/// KV blocks of each engine, vLLM's null block included.
const GPU_BLOCKS: u32 = 64;
const MAX_NUM_SEQS: u32 = 4;
/// Must fit the 63 usable blocks (2016 tokens), or vLLM refuses to start.
const MAX_MODEL_LEN: u32 = 2000;
/// Tokens per kvroute block in the agent's record (the picker's default `block_size`).
const INDEX_BLOCK: u32 = 16;

/// One engine under comparison and the agent's view of its KV events.
struct Side {
    name: &'static str,
    engine: Engine,
    events: mpsc::Receiver<KvMessage>,
    record: BlockRecord,
    /// Sequence number of the next batch expected (a gap would make the records meaningless).
    next_seq: u64,
}

impl Side {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.engine.url())
    }

    /// Applies every batch received so far; panics on a lost batch.
    fn drain(&mut self) {
        while let Ok(m) = self.events.try_recv() {
            assert_eq!(m.seq, self.next_seq, "{}: KV-event batch lost", self.name);
            self.next_seq += 1;
            let out = self.record.apply(&m.batch);
            assert_eq!(
                (out.dropped_unknown_parent, out.skipped_extra_keys, out.dropped_block_size),
                (0, 0, 0),
                "{}: the agent could not place every block",
                self.name
            );
        }
    }

    /// Every kvroute hash the record holds on GPU.
    fn gpu_set(&self) -> BTreeSet<u64> {
        self.record.snapshot_runs().into_iter().flat_map(|r| r.hashes).collect()
    }
}

/// Subscribes to an engine's KV-event PUB socket on a thread of its own (the `zmq` crate is
/// blocking), decoding each message with the agent's decoder.
fn subscribe(port: u16, stop: Arc<AtomicBool>) -> mpsc::Receiver<KvMessage> {
    let (tx, rx) = mpsc::channel();
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).expect("SUB socket");
    sub.set_subscribe(b"").expect("subscribe");
    sub.set_rcvtimeo(100).expect("receive timeout");
    sub.connect(&format!("tcp://127.0.0.1:{port}")).expect("connect SUB");
    std::thread::spawn(move || {
        let _ctx = ctx;
        while !stop.load(Ordering::Relaxed) {
            match sub.recv_multipart(0) {
                Ok(frames) => {
                    let m = decode_message(&frames).expect("a KV-event message the agent decodes");
                    if tx.send(m).is_err() {
                        return;
                    }
                }
                Err(zmq::Error::EAGAIN) => {}
                Err(e) => panic!("KV-event SUB on port {port}: {e}"),
            }
        }
    });
    rx
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

async fn metrics_page(http: &reqwest::Client, side: &Side) -> String {
    let r = http.get(side.url("/metrics")).send().await.expect("GET /metrics");
    r.text().await.expect("metrics text")
}

/// Sum of the samples of `name` on a page.
fn value(samples: &[Sample], name: &str) -> f64 {
    samples.iter().filter(|s| s.name == name).map(|s| s.value).sum()
}

/// `vllm:` series names and the label names each carries (over all its samples).
fn families(samples: &[Sample]) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.name.starts_with("vllm:")) {
        out.entry(s.name.clone()).or_default().extend(s.labels.iter().map(|(k, _)| k.clone()));
    }
    out
}

/// A chat body asking for one token: the output's KV is never computed, so both engines cache
/// the prompt's blocks only (their generated tokens differ).
fn chat_body(messages: &[Value]) -> Value {
    json!({"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 1})
}

/// The stream: (label, messages). Conversations on one system prompt, turns interleaved; an exact
/// repeat; a prompt of a whole number of blocks sent twice (vLLM recomputes its last block into a
/// second copy); three ~900-token documents in turn, twice (the third evicts the first's tail, and
/// so on), then the conversations again, partly evicted.
async fn stream(http: &reqwest::Client, emulator: &Side) -> Vec<(String, Vec<Value>)> {
    let w = Workload::multi_turn_chat(41, 1, 3, 3, 110, 25);
    let replies = w.synthetic_replies(41, 12);
    let mut out = Vec::new();
    for turn in 0..2 {
        for c in &w.conversations {
            out.push((format!("conversation {} turn {turn}", c.id), w.messages(c, turn, &replies[c.id])));
        }
    }
    let repeat = out[out.len() - 1].clone();
    out.push((format!("{} again", repeat.0), repeat.1));
    // A user message whose chat prompt is a whole number of blocks (found with /tokenize).
    let mut whole = None;
    for n in 60..120 {
        let m = vec![user(&seeded_words(7, n))];
        let count = post_json(http, &emulator.url("/tokenize"), &json!({"model": DEFAULT_MODEL, "messages": m}))
            .await
            .expect("POST answered")["count"]
            .as_u64()
            .expect("tokenize count");
        if count % u64::from(ENGINE_BLOCK) == 0 {
            whole = Some(m);
            break;
        }
    }
    let whole = whole.expect("a prompt of a whole number of blocks");
    out.push(("whole blocks".into(), whole.clone()));
    out.push(("whole blocks again".into(), whole));
    // About 900 tokens (29 blocks) each: two fit beside the conversations, the third does not.
    let docs: Vec<Vec<Value>> =
        (0..3).map(|d| vec![user(&format!("Document {d}. {}", seeded_words(100 + d, 290)))]).collect();
    for round in 0..2 {
        for (d, m) in docs.iter().enumerate() {
            out.push((format!("document {d} round {round}"), m.clone()));
        }
    }
    for c in &w.conversations {
        out.push((format!("conversation {} turn 2", c.id), w.messages(c, 2, &replies[c.id])));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_and_the_emulator_answer_alike() {
    let started = Instant::now();
    let work = paths::work_dir("emulator-vs-vllm").expect("work dir");
    let common = FleetSpec { engines: 1, max_num_seqs: MAX_NUM_SEQS, ..Default::default() };
    let vllm_spec = FleetSpec {
        engine_kind: EngineKind::Vllm(VllmSpec {
            block_size: ENGINE_BLOCK,
            num_gpu_blocks: Some(GPU_BLOCKS),
            max_model_len: MAX_MODEL_LEN,
            ..Default::default()
        }),
        ..common.clone()
    };
    let emulator_spec = FleetSpec {
        engine_kind: EngineKind::Emulator,
        num_gpu_blocks: GPU_BLOCKS,
        emulator_block_size: ENGINE_BLOCK,
        ..common
    };
    let (vllm, emulator) = tokio::join!(
        Engine::start_alone(&vllm_spec, "vllm", 0, &work),
        Engine::start_alone(&emulator_spec, "emulator", 1, &work),
    );
    let (vllm, emulator) = (vllm.expect("vLLM serves"), emulator.expect("the emulator serves"));
    eprintln!("engines up after {:.1} s", started.elapsed().as_secs_f64());
    let stop = Arc::new(AtomicBool::new(false));
    let side = |name, engine: Engine| Side {
        name,
        events: subscribe(engine.kv_events_port, stop.clone()),
        engine,
        record: BlockRecord::new(DEFAULT_MODEL, INDEX_BLOCK),
        next_seq: 0,
    };
    let mut sides = [side("vLLM", vllm), side("emulator", emulator)];
    // ZeroMQ drops what a PUB sends before the SUB's connection is up.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().expect("http client");

    // /metrics: names and labels, before any load.
    let pages = [metrics_page(&http, &sides[0]).await, metrics_page(&http, &sides[1]).await];
    let before: Vec<Vec<Sample>> = pages.iter().map(|p| parse_samples(p).expect("a Prometheus page")).collect();
    let (theirs, ours) = (families(&before[0]), families(&before[1]));
    for (name, labels) in &ours {
        let Some(vllm_labels) = theirs.get(name) else { panic!("the emulator exports {name}, vLLM does not") };
        if name != "vllm:cache_config_info" {
            assert_eq!(labels, vllm_labels, "labels of {name}: emulator vs vLLM");
        }
    }
    for (page, side) in pages.iter().zip(&sides) {
        let m =
            parse_engine_metrics(page).unwrap_or_else(|e| panic!("{}: the agent cannot read /metrics: {e}", side.name));
        assert_eq!(m.block_size, Some(ENGINE_BLOCK), "{}: cache_config_info block_size", side.name);
        assert_eq!(m.num_gpu_blocks, Some(u64::from(GPU_BLOCKS)), "{}: cache_config_info num_gpu_blocks", side.name);
        assert!(m.tokens_processed.is_some(), "{}: prompt/generation token counters", side.name);
    }

    // The sequential stream.
    let stream = stream(&http, &sides[1]).await;
    let (mut prompt_sum, mut cached_sum, mut evicted) = (0u64, 0u64, 0usize);
    for (label, messages) in &stream {
        let body = chat_body(messages);
        let urls = sides.each_ref().map(|s| s.url("/v1/chat/completions"));
        let (a, b) = tokio::join!(post_json(&http, &urls[0], &body), post_json(&http, &urls[1], &body));
        let (a, b) = (a.expect("POST answered"), b.expect("POST answered"));
        let usage = |v: &Value| {
            let details = &v["usage"]["prompt_tokens_details"];
            (
                v["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens"),
                details["cached_tokens"].as_u64().expect("cached_tokens"),
                details["created_cache_tokens"].as_u64().expect("created_cache_tokens"),
            )
        };
        let (theirs, ours) = (usage(&a), usage(&b));
        eprintln!("{label}: prompt {} cached {} (vLLM) / {} (emulator)", theirs.0, theirs.1, ours.1);
        assert_eq!(ours.0, theirs.0, "{label}: prompt_tokens, emulator vs vLLM");
        assert_eq!(ours.1, theirs.1, "{label}: cached_tokens, emulator vs vLLM");
        assert_eq!(ours.2, theirs.2, "{label}: created_cache_tokens, emulator vs vLLM");
        prompt_sum += theirs.0;
        cached_sum += theirs.1;

        // KV events are published at the end of an engine step: wait until both records agree,
        // or give up after 3 s and compare what came.
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            tokio::time::sleep(Duration::from_millis(150)).await;
            sides.iter_mut().for_each(Side::drain);
            if sides[0].gpu_set() == sides[1].gpu_set() || Instant::now() > deadline {
                break;
            }
        }
        let changes: Vec<(BTreeSet<u64>, BTreeSet<u64>)> = sides
            .iter_mut()
            .map(|s| {
                let c = s.record.take_changes();
                (c.stored.into_iter().flat_map(|r| r.hashes).collect(), c.removed.into_iter().collect())
            })
            .collect();
        assert_eq!(changes[1].0, changes[0].0, "{label}: blocks stored, emulator vs vLLM (kvroute hashes)");
        assert_eq!(changes[1].1, changes[0].1, "{label}: blocks removed, emulator vs vLLM (kvroute hashes)");
        assert_eq!(sides[1].gpu_set(), sides[0].gpu_set(), "{label}: blocks held, emulator vs vLLM");
        evicted += changes[0].1.len();
    }
    assert!(cached_sum > 0, "the stream hit the cache");
    assert!(evicted > 0, "the stream evicted blocks");
    eprintln!(
        "stream: {} requests, {prompt_sum} prompt tokens, {cached_sum} cached, {evicted} index blocks evicted",
        stream.len()
    );

    // Counters over the stream, and idle after it.
    let mut after = Vec::new();
    for side in &sides {
        after.push(parse_samples(&metrics_page(&http, side).await).expect("a Prometheus page"));
    }
    let delta = |i: usize, name: &str| value(&after[i], name) - value(&before[i], name);
    for name in ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total"] {
        eprintln!("{name}: +{} (vLLM) / +{} (emulator)", delta(0, name), delta(1, name));
        assert_eq!(delta(1, name), delta(0, name), "{name} over the stream, emulator vs vLLM");
    }
    assert_eq!(delta(0, "vllm:prefix_cache_queries_total"), prompt_sum as f64, "vLLM: queries = prompt tokens");
    assert_eq!(delta(0, "vllm:prefix_cache_hits_total"), cached_sum as f64, "vLLM: hits = cached tokens");
    for (samples, side) in after.iter().zip(&sides) {
        for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"] {
            assert_eq!(value(samples, name), 0.0, "{}: {name} when idle (cached free blocks are not usage)", side.name);
        }
    }

    // A burst of more requests than max_num_seqs, /metrics sampled while it runs.
    let burst = 2 * MAX_NUM_SEQS as usize + 2;
    let mut runs = Vec::new();
    for side in &sides {
        let url = side.url("/v1/chat/completions");
        let requests: Vec<_> = (0..burst)
            .map(|k| {
                let body = json!({
                    "model": DEFAULT_MODEL,
                    "messages": [user(&format!("Burst request {k}. {}", seeded_words(500 + k as u64, 60)))],
                    "max_tokens": 48,
                    "ignore_eos": true,
                });
                let (http, url) = (http.clone(), url.clone());
                tokio::spawn(async move { post_json(&http, &url, &body).await.expect("POST answered") })
            })
            .collect();
        runs.push(requests);
    }
    let mut samples: [Vec<(f64, f64, f64)>; 2] = [Vec::new(), Vec::new()];
    while runs.iter().flatten().any(|t| !t.is_finished()) {
        for (i, side) in sides.iter().enumerate() {
            let page = parse_samples(&metrics_page(&http, side).await).expect("a Prometheus page");
            samples[i].push((
                value(&page, "vllm:num_requests_running"),
                value(&page, "vllm:num_requests_waiting"),
                value(&page, "vllm:kv_cache_usage_perc"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    for t in runs.into_iter().flatten() {
        t.await.expect("burst request");
    }
    let mut peaks = Vec::new();
    for (s, side) in samples.iter().zip(&sides) {
        let max = |f: fn(&(f64, f64, f64)) -> f64| s.iter().map(f).fold(0.0, f64::max);
        let (running, waiting, usage) = (max(|x| x.0), max(|x| x.1), max(|x| x.2));
        peaks.push(usage);
        eprintln!(
            "{} under load: {} samples, max running {running}, waiting {waiting}, usage {usage:.3}",
            side.name,
            s.len()
        );
        assert!(running <= f64::from(MAX_NUM_SEQS), "{}: running {running} above max_num_seqs", side.name);
        assert!(running >= 1.0, "{}: a request was seen running", side.name);
        assert!(waiting > 0.0, "{}: {burst} requests at once, some waited", side.name);
        assert!(usage <= 1.0, "{}: usage {usage}", side.name);
        for &(r, _, u) in s {
            assert!(r == 0.0 || u > 0.0, "{}: {r} running with KV usage {u}", side.name);
        }
    }
    // The same requests hold the same blocks: at the peak (a full batch near the end of its
    // decode) the usages agree to within a block per running request, whatever the sampling.
    let slack = f64::from(MAX_NUM_SEQS) / f64::from(GPU_BLOCKS - 1);
    assert!((peaks[1] - peaks[0]).abs() <= slack, "peak KV usage: vLLM {:.3}, emulator {:.3}", peaks[0], peaks[1]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    for side in &sides {
        let page = parse_samples(&metrics_page(&http, side).await).expect("a Prometheus page");
        for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"] {
            assert_eq!(value(&page, name), 0.0, "{}: {name} after the burst", side.name);
        }
    }
    stop.store(true, Ordering::Relaxed);
    eprintln!("done in {:.1} s", started.elapsed().as_secs_f64());
}
