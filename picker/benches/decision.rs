//! One full routing decision for a 4096-token chat prompt (docs/design.md §10: p99 ≤ 1 ms when earlier turns
//! were seen before), and each of its steps on the same request: parse the JSON body, render the
//! chat template, tokenize (segment cache warm, and cold with the cache off), hash the blocks,
//! look up + score (the router, 8 pods, the prompt's prefix held by one of them).
//!
//! The percentile pass times each call on its own and reports wall-clock p50/p99 over all calls,
//! how many calls lost the CPU to another thread while running (the thread's timeslice count in
//! `/proc/thread-self/schedstat`, read outside the timed interval, went up) and the p99 of the
//! calls that kept it: on a shared 2-core machine a p99 of milliseconds over all calls with a
//! sub-millisecond p99 over the undisturbed ones is the scheduler, not the decision's code.
//! The bench links the picker binary's allocator (mimalloc) so that allocation costs are the same.
//!
//! A second group times the floor's workload (docs/benchmarks.md "Picker latency"): a
//! ≈ 600-token `/v1/completions` prompt shaped like `kvroute-gateway-bench`'s, a new question
//! after a seen prompt each call, its steps, and the same decision after 8 MiB of other writes
//! have evicted the caches (what a picker sharing its cores with Envoy and engines meets).
//!
//! Real functions only: `parse_body`, `ModelTokenizer::{render_chat, encode_chat}`,
//! `BlockHasher::hash_prompt`, `Router::route`, `decision::decide`. After criterion's
//! groups, a percentile pass (2 000 timed full decisions, warm) prints p50/p99 per step, since
//! criterion reports means and medians only. Run: `cargo bench -p kvroute-picker --bench decision`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::io::Read as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::Criterion;
use hdrhistogram::Histogram;
use kvroute_common::BlockHash;
use kvroute_picker::Gateway;
use kvroute_picker::config::PickerConfig;
use kvroute_picker::decision::{DecisionInput, decide};
use kvroute_picker::pool::PoolUpdate;
use kvroute_picker::request::{PromptInput, parse_body};
use kvroute_picker::score::RouteRequest;
use kvroute_proto::agent::v1::{PodInfo, PodStats};
use kvroute_tokenize::{ModelTokenizer, SegmentCacheConfig, TokenizerOptions};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";
const PATH: &str = "/v1/chat/completions";
const COMPLETION_PATH: &str = "/v1/completions";
const TARGET_TOKENS: usize = 4096;

fn tokenizer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer-qwen2.5")
}

/// A multi-turn chat body of at least 4096 tokens built from the fixture's text, and its ids.
fn chat_body(tok: &ModelTokenizer) -> (Vec<u8>, Vec<u32>) {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tokenizer_dir().join("expected-text.json")).unwrap()).unwrap();
    let text = expected["seed_first_2000_chars"]["text"].as_str().unwrap().to_owned();
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": "You are a routing expert. Answer briefly."})];
    for turn in 0.. {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        let chunk: String = text.chars().skip((turn * 97) % 1500).take(400 + turn % 7 * 50).collect();
        messages.push(serde_json::json!({"role": role, "content": format!("Turn {turn}: {chunk}")}));
        if role == "user" {
            let body = serde_json::json!({"model": MODEL, "messages": messages, "max_tokens": 64});
            let bytes = body.to_string().into_bytes();
            let chat = match parse_body(PATH, &bytes).unwrap().prompt {
                PromptInput::Chat(c) => c,
                _ => unreachable!("a chat body"),
            };
            let ids = tok.encode_chat(&chat).unwrap();
            if ids.len() >= TARGET_TOKENS {
                return (bytes, ids);
            }
        }
    }
    unreachable!()
}

/// Words in each completion prompt (`kvroute-gateway-bench`'s default: ≈ 780 tokens).
const COMPLETION_WORDS: usize = 600;

/// `n` `/v1/completions` bodies shaped like `kvroute-gateway-bench`'s: one shared prompt of
/// [`COMPLETION_WORDS`] words and a numbered question at its end, so every body's last text
/// chunk is new to the segment cache and the rest is not (the no-op floor's workload).
fn completion_bodies(n: usize) -> Vec<Vec<u8>> {
    let vocabulary = ["alpha ", "route ", "cache ", "block ", "token ", "pod ", "queue "];
    let shared: String = (0..COMPLETION_WORDS - 8).map(|w| vocabulary[(w * 3) % 7]).collect();
    (0..n)
        .map(|i| {
            let prompt = format!("{shared}question {i} for group 0?");
            serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string().into_bytes()
        })
        .collect()
}

/// A gateway with the Qwen tokenizer and 8 ready pods; `pod-3` holds every block of `ids` but the
/// last turn's (the earlier turns were seen before), the others hold unrelated blocks.
fn gateway(rt: &tokio::runtime::Runtime, ids: &[u32]) -> Arc<Gateway> {
    let config = PickerConfig::from_yaml(&format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\n\
         models: [{{name: {MODEL}, tokenizer: {}}}]\n",
        tokenizer_dir().display()
    ))
    .unwrap();
    let gw = Arc::new(Gateway::new(&config).unwrap());
    let model = gw.models.resolve(MODEL).unwrap().clone();
    let mut blocks = Vec::new();
    model.hasher.hash_prompt(ids, &mut blocks);
    let seen = blocks.len() * 7 / 8;
    rt.block_on(async {
        for p in 0..8u64 {
            let pod = format!("pod-{p}");
            let info = PodInfo {
                pod: pod.clone(),
                endpoint: format!("10.0.0.{p}:8000"),
                model: MODEL.into(),
                block_size: 16,
                index_block_size: 16,
                annotations: Default::default(),
            };
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
            let stats = PodStats {
                observed_at_unix_ms: now,
                health_score: 1.0,
                ready: true,
                gpu_utilization: 0.1 * p as f64,
                ..Default::default()
            };
            let held: Vec<BlockHash> = if p == 3 {
                blocks[..seen].to_vec()
            } else {
                (0..2000u64).map(|i| BlockHash((p << 40 | i).wrapping_mul(0x9E37_79B9_7F4A_7C15))).collect()
            };
            let u = PoolUpdate::Snapshot { stream: 1, info, seq: 0, stats: Some(stats), blocks: held };
            gw.pool.update(u).await.unwrap();
        }
        gw.pool.sync().await.unwrap();
    });
    gw
}

fn completion_input(body: &[u8]) -> DecisionInput<'_> {
    DecisionInput::new("bench", COMPLETION_PATH, Some(body))
}

/// One call's wall-clock time and whether the thread was switched out during it.
#[derive(Clone, Copy)]
struct Sample {
    wall: Duration,
    preempted: bool,
}

/// The calling thread's number of timeslices so far (schedstat's third field); 0 where missing.
fn timeslices(file: &mut Option<std::fs::File>, buf: &mut String) -> u64 {
    let Some(f) = file else { return 0 };
    buf.clear();
    if std::io::Seek::rewind(f).is_err() || f.read_to_string(buf).is_err() {
        return 0;
    }
    buf.split_ascii_whitespace().nth(2).and_then(|x| x.parse().ok()).unwrap_or(0)
}

fn percentiles(name: &str, samples: Vec<Sample>) {
    // Nanoseconds, 1 ns to 1 min, 3 significant digits.
    let histogram = || Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    let (mut all, mut kept) = (histogram(), histogram());
    for s in &samples {
        let ns = u64::try_from(s.wall.as_nanos()).unwrap_or(u64::MAX);
        all.saturating_record(ns);
        if !s.preempted {
            kept.saturating_record(ns);
        }
    }
    let us = |h: &Histogram<u64>, q: f64| if h.is_empty() { f64::NAN } else { h.value_at_quantile(q) as f64 / 1e3 };
    println!(
        "{name:<28} n={:<5} p50 {:>8.1} µs  p99 {:>8.1} µs | switched out: {:>4}; p99 of the others {:>8.1} µs",
        samples.len(),
        us(&all, 0.50),
        us(&all, 0.99),
        all.len() - kept.len(),
        us(&kept, 0.99),
    );
}

fn time<R>(n: usize, mut f: impl FnMut() -> R) -> Vec<Sample> {
    let mut file = std::fs::File::open("/proc/thread-self/schedstat").ok();
    let mut buf = String::with_capacity(64);
    (0..n)
        .map(|_| {
            let before = timeslices(&mut file, &mut buf);
            let t = Instant::now();
            black_box(f());
            let wall = t.elapsed();
            let after = timeslices(&mut file, &mut buf);
            Sample { wall, preempted: after != before }
        })
        .collect()
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let warm = ModelTokenizer::from_dir(&tokenizer_dir()).unwrap();
    let (body, ids) = chat_body(&warm);
    let gw = gateway(&rt, &ids);
    let model = gw.models.resolve(MODEL).unwrap().clone();
    let tok = model.tokenizer.clone().unwrap();
    let cold = ModelTokenizer::from_dir_with(
        &tokenizer_dir(),
        TokenizerOptions { segment_cache: SegmentCacheConfig { max_bytes: 0, ..Default::default() } },
    )
    .unwrap();
    let chat = match parse_body(PATH, &body).unwrap().prompt {
        PromptInput::Chat(c) => c,
        _ => unreachable!("a chat body"),
    };
    assert_eq!(tok.encode_chat(&chat).unwrap(), ids, "segment-cached ids differ from whole-text ids");
    assert_eq!(cold.encode_chat(&chat).unwrap(), ids);
    let rendered = tok.render_chat(&chat).unwrap();
    let mut hashes = Vec::with_capacity(ids.len() / 16);
    model.hasher.hash_prompt(&ids, &mut hashes);
    let route_req = RouteRequest { model: &model.target_model, adapter: None, block_hashes: &hashes, subset: None };
    let d = gw.router.route(&route_req).unwrap();
    println!(
        "request: {} body bytes, {} tokens, {} blocks; chosen {} with {} matched blocks",
        body.len(),
        ids.len(),
        hashes.len(),
        d.pod,
        d.matched_blocks
    );
    drop(d);
    let input = DecisionInput::new("bench", PATH, Some(&body));

    let mut c = Criterion::default().configure_from_args().sample_size(50).measurement_time(Duration::from_secs(3));
    let mut g = c.benchmark_group("decision_4096_token_chat");
    g.bench_function("full_decide", |b| b.iter(|| decide(&gw, black_box(&input)).unwrap()));
    g.bench_function("1_parse_body", |b| b.iter(|| parse_body(PATH, black_box(&body)).unwrap()));
    g.bench_function("2_render_template", |b| b.iter(|| tok.render_chat(black_box(&chat)).unwrap()));
    g.bench_function("3_template_and_tokenize_warm", |b| b.iter(|| tok.encode_chat(black_box(&chat)).unwrap()));
    g.bench_function("4_hash_blocks", |b| {
        let mut out = Vec::with_capacity(hashes.len());
        b.iter(|| model.hasher.hash_prompt(black_box(&ids), &mut out))
    });
    g.bench_function("5_lookup_and_score", |b| b.iter(|| gw.router.route(black_box(&route_req)).unwrap()));
    g.sample_size(10);
    g.bench_function("3c_template_and_tokenize_cold", |b| b.iter(|| cold.encode_chat(black_box(&chat)).unwrap()));
    g.finish();

    println!("\npercentiles (timed one by one, same process):");
    let n = 2000;
    percentiles("full_decide", time(n, || decide(&gw, &input).unwrap()));
    percentiles("1_parse_body", time(n, || parse_body(PATH, &body).unwrap()));
    percentiles("2_render_template", time(n, || tok.render_chat(&chat).unwrap()));
    percentiles("3_template+tokenize_warm", time(n, || tok.encode_chat(&chat).unwrap()));
    let mut out = Vec::with_capacity(hashes.len());
    percentiles("4_hash_blocks", time(n, || model.hasher.hash_prompt(&ids, &mut out)));
    percentiles("5_lookup_and_score", time(n, || gw.router.route(&route_req).unwrap()));
    percentiles("3c_template+tokenize_cold", time(50, || cold.encode_chat(&chat).unwrap()));
    black_box(rendered);

    // The ≤ 1k-token completion of the ext_proc floor's target: a new question after a seen prompt.
    let bodies = completion_bodies(4096);
    let first = parse_body(COMPLETION_PATH, &bodies[0]).unwrap().prompt;
    let cids = model.tokens(&first, "bench");
    let cgw = gateway(&rt, &cids);
    let cmodel = cgw.models.resolve(MODEL).unwrap().clone();
    let mut chashes = Vec::with_capacity(cids.len() / 16);
    cmodel.hasher.hash_prompt(&cids, &mut chashes);
    let croute = RouteRequest { model: &cmodel.target_model, adapter: None, block_hashes: &chashes, subset: None };
    println!("\ncompletion: {} body bytes, {} tokens, {} blocks", bodies[0].len(), cids.len(), chashes.len());
    let next = std::cell::Cell::new(0usize);
    let body_i = || {
        let i = next.get();
        next.set((i + 1) % bodies.len());
        &bodies[i]
    };
    let cinput = |body: &[u8]| decide(&cgw, &completion_input(body)).unwrap();
    let parsed = |body: &[u8]| parse_body(COMPLETION_PATH, body).unwrap().prompt;
    let mut g = c.benchmark_group("decision_780_token_completion");
    g.bench_function("full_decide", |b| b.iter(|| cinput(black_box(body_i()))));
    g.bench_function("1_parse_body", |b| b.iter(|| parsed(black_box(body_i()))));
    g.bench_function("1_2_parse_and_tokenize", |b| b.iter(|| cmodel.tokens(&parsed(black_box(body_i())), "bench")));
    g.bench_function("3_hash_blocks", |b| {
        let mut out = Vec::with_capacity(chashes.len());
        b.iter(|| cmodel.hasher.hash_prompt(black_box(&cids), &mut out))
    });
    g.bench_function("4_lookup_and_score", |b| b.iter(|| cgw.router.route(black_box(&croute)).unwrap()));
    g.finish();
    println!("\npercentiles, completion (timed one by one, same process):");
    percentiles("full_decide", time(n, || cinput(body_i())));
    // Between two requests of the live bench other processes run on the same cores and evict the
    // picker's data from the caches: the same decision after writing 8 MiB elsewhere.
    let mut evict = vec![0u8; 8 << 20];
    let mut flushed = Vec::with_capacity(n);
    for round in 0..n {
        evict.iter_mut().step_by(64).for_each(|b| *b = b.wrapping_add(round as u8));
        black_box(&evict);
        flushed.extend(time(1, || cinput(body_i())));
    }
    percentiles("full_decide, caches evicted", flushed);
    percentiles("1_parse_body", time(n, || parsed(body_i())));
    percentiles("1_2_parse_and_tokenize", time(n, || cmodel.tokens(&parsed(body_i()), "bench")));
    percentiles("3_hash_blocks", time(n, || cmodel.hasher.hash_prompt(&cids, &mut out)));
    percentiles("4_lookup_and_score", time(n, || cgw.router.route(&croute).unwrap()));
    c.final_summary();
}
