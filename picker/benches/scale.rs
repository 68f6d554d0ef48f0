//! Decision latency at fleet scale (docs/capacity.md): 1,000 pods, a 10M-entry index, and the same
//! 4,096-token chat request as `benches/decision.rs`, decided end to end (`decision::decide`:
//! parse, template, tokenize, hash, walk, score, choose). Baseline in the same run: the same
//! request over 8 pods and a 16K-entry index, so the figure reads as "what 1,000 pods and 10M
//! entries add". Also prints the index's size (entries, nodes, bytes estimate, and the process's
//! resident memory) and how long loading it took.
//!
//! Fleet: every pod holds 10,000 blocks of its own, stored as chains of 250 (a prefill's blocks
//! arrive together), so 1,000 pods make 10M (block, pod) entries; pods 0..8 also hold the
//! request's earlier turns to staggered depths (pod 3 all of them), so the walk intersects them.
//! Percentiles time each decision alone (2,000, warm) and flag those that lost the CPU (the
//! thread's timeslice count in `/proc/thread-self/schedstat` went up), as `decision.rs` does.
//! Run: `cargo bench -p kvroute-picker --bench scale` (about 1 GiB of memory, ~30 s).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::io::Read as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_common::BlockHash;
use kvroute_picker::Gateway;
use kvroute_picker::config::PickerConfig;
use kvroute_picker::decision::{DecisionInput, decide};
use kvroute_picker::pool::PoolUpdate;
use kvroute_picker::request::{PromptInput, parse_body};
use kvroute_proto::agent::v1::{PodInfo, PodStats};
use kvroute_tokenize::ModelTokenizer;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";
const PATH: &str = "/v1/chat/completions";
const TARGET_TOKENS: usize = 4096;
/// Blocks of its own per pod, and per store (one prefill's worth).
const OWN_BLOCKS: u64 = 10_000;
const CHAIN: usize = 250;

fn tokenizer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer-qwen2.5")
}

/// The multi-turn chat body of `benches/decision.rs` (≥ 4,096 tokens) and its token ids.
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
            let bytes =
                serde_json::json!({"model": MODEL, "messages": messages, "max_tokens": 64}).to_string().into_bytes();
            let PromptInput::Chat(chat) = parse_body(PATH, &bytes).unwrap().prompt else { unreachable!("a chat body") };
            let ids = tok.encode_chat(&chat).unwrap();
            if ids.len() >= TARGET_TOKENS {
                return (bytes, ids);
            }
        }
    }
    unreachable!()
}

/// A gateway with `pods` ready pods as in the module docs (`own` blocks each), and how long
/// loading the pods took (the pool's updates, not the gateway's tokenizer).
fn gateway(rt: &tokio::runtime::Runtime, ids: &[u32], pods: u64, own: u64) -> (Arc<Gateway>, Duration) {
    let config = PickerConfig::from_yaml(&format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\n\
         models: [{{name: {MODEL}, tokenizer: {}}}]\n",
        tokenizer_dir().display()
    ))
    .unwrap();
    let gw = Arc::new(Gateway::new(&config).unwrap());
    let model = gw.models.resolve(MODEL).unwrap().clone();
    let mut prompt = Vec::new();
    model.hasher.hash_prompt(ids, &mut prompt);
    let seen = prompt.len() * 7 / 8;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let t = Instant::now();
    rt.block_on(async {
        for p in 0..pods {
            let info = PodInfo {
                pod: format!("pod-{p}"),
                endpoint: format!("10.{}.{}.{}:8000", p / 65536, (p / 256) % 256, p % 256),
                model: MODEL.into(),
                block_size: 16,
                index_block_size: 16,
                annotations: Default::default(),
            };
            let stats = PodStats {
                observed_at_unix_ms: now,
                health_score: 1.0,
                ready: true,
                gpu_utilization: (p % 10) as f64 / 10.0,
                num_requests_waiting: (p % 7) as u32,
                ..Default::default()
            };
            let hello = PoolUpdate::Snapshot { stream: 1, info, seq: 0, stats: Some(stats), blocks: Vec::new() };
            gw.pool.update(hello).await.unwrap();
            // Own blocks in chains of CHAIN (a prefill's blocks arrive in one event), then the
            // request's earlier turns to a staggered depth on pods 0..8 (all of them on pod 3).
            let own: Vec<BlockHash> =
                (0..own).map(|i| BlockHash(((p + 1) << 40 | i).wrapping_mul(0x9E37_79B9_7F4A_7C15))).collect();
            let mut stores: Vec<Vec<BlockHash>> = own.chunks(CHAIN).map(<[BlockHash]>::to_vec).collect();
            if p < 8 {
                let depth = if p == 3 { seen } else { seen * (p as usize + 1) / 9 };
                stores.push(prompt[..depth].to_vec());
            }
            for stored in stores {
                let u = PoolUpdate::Delta {
                    stream: 1,
                    pod: format!("pod-{p}"),
                    seq: 1,
                    cleared: false,
                    stored,
                    removed: Vec::new(),
                    stats: None,
                };
                gw.pool.update(u).await.unwrap();
            }
        }
        gw.pool.sync().await.unwrap();
    });
    (gw, t.elapsed())
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

fn time<R>(n: usize, mut f: impl FnMut() -> R) -> Vec<Sample> {
    let mut file = std::fs::File::open("/proc/thread-self/schedstat").ok();
    let mut buf = String::with_capacity(64);
    (0..n)
        .map(|_| {
            let before = timeslices(&mut file, &mut buf);
            let t = Instant::now();
            black_box(f());
            let wall = t.elapsed();
            Sample { wall, preempted: timeslices(&mut file, &mut buf) != before }
        })
        .collect()
}

fn report(name: &str, samples: &[Sample]) {
    let q = |mut v: Vec<Duration>, p: f64| {
        if v.is_empty() {
            return f64::NAN;
        }
        v.sort_unstable();
        v[((v.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e6
    };
    let all: Vec<Duration> = samples.iter().map(|s| s.wall).collect();
    let kept: Vec<Duration> = samples.iter().filter(|s| !s.preempted).map(|s| s.wall).collect();
    println!(
        "{name:<34} n={:<5} p50 {:>7.1} µs  p99 {:>7.1} µs  max {:>8.1} µs | switched out: {:>4}; p99 of the others {:>7.1} µs",
        samples.len(),
        q(all.clone(), 0.50),
        q(all.clone(), 0.99),
        q(all, 1.0),
        samples.len() - kept.len(),
        q(kept, 0.99),
    );
}

/// Resident memory of this process, MiB (`/proc/self/statm`), 0 where missing.
fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm.split_ascii_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or(0.0);
    pages * 4096.0 / (1 << 20) as f64
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let tok = ModelTokenizer::from_dir(&tokenizer_dir()).unwrap();
    let (body, ids) = chat_body(&tok);
    let input = DecisionInput::new("bench", PATH, Some(&body));
    for (name, pods, own) in
        [("8 pods, 16K entries (baseline)", 8, 2_000), ("1000 pods, 10M entries", 1000, OWN_BLOCKS)]
    {
        let rss = rss_mib();
        let (gw, load) = gateway(&rt, &ids, pods, own);
        let s = gw.pool.index_stats();
        let d = decide(&gw, &input).unwrap();
        println!(
            "{name}: {} entries, {} nodes, index bytes estimate {:.0} MiB ({:.1} B/entry), resident +{:.0} MiB; loaded in {:.1} s ({:.2} M entries/s through the pool)",
            s.entries,
            s.nodes,
            s.bytes_estimate as f64 / (1 << 20) as f64,
            s.bytes_estimate as f64 / s.entries as f64,
            rss_mib() - rss,
            load.as_secs_f64(),
            s.entries as f64 / load.as_secs_f64() / 1e6,
        );
        println!(
            "  decision: {} ({} of {} blocks matched), {} candidates",
            d.pod, d.matched_blocks, d.total_blocks, d.candidate_count
        );
        for _ in 0..200 {
            black_box(decide(&gw, &input).unwrap());
        }
        report("  full_decide (4,096-token chat)", &time(2000, || decide(&gw, &input).unwrap()));
        drop(gw);
    }
}
