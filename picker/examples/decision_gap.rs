//! One decision's wall-clock time against the idle time before it (docs/benchmarks.md "Picker
//! latency", docs/decisions/0021-ext-proc-layout.md): the same full `decide` as the decision
//! bench's `decision_780_token_completion` group (a ≈ 600-token `/v1/completions` prompt, a new
//! question after a seen prompt each call, 4 ready pods), called back to back and with the thread
//! asleep for a gap before each call, as in a live picker that routes one request every few
//! milliseconds.
//! Nothing else needs to run: the gap alone is what is measured.
//!
//! Run: `cargo run --release -p kvroute-picker --example decision_gap -- [gap_us ...]` (default
//! gaps 0, 1000 and 10000 µs; wrap it in `taskset -c N` to keep the thread on one CPU).
//! Prints per gap the mean, p50 and p90 over 1,900 calls after 100 warm-up calls.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_common::BlockHash;
use kvroute_picker::Gateway;
use kvroute_picker::config::PickerConfig;
use kvroute_picker::decision::{DecisionInput, decide};
use kvroute_picker::pool::PoolUpdate;
use kvroute_proto::agent::v1::{PodInfo, PodStats};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";
const CALLS: usize = 2_000;
const WARM_UP: usize = 100;

/// A gateway with the Qwen fixture tokenizer and 4 ready pods holding unrelated blocks.
fn gateway() -> Arc<Gateway> {
    let tokenizer = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer-qwen2.5");
    let config = PickerConfig::from_yaml(&format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\n\
         models: [{{name: {MODEL}, tokenizer: {}}}]\n",
        tokenizer.display()
    ))
    .unwrap();
    let gw = Arc::new(Gateway::new(&config).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
        for p in 0..4u64 {
            let info = PodInfo {
                pod: format!("pod-{p}"),
                endpoint: format!("10.0.0.{p}:8000"),
                model: MODEL.into(),
                block_size: 16,
                index_block_size: 16,
                annotations: Default::default(),
            };
            let stats = PodStats { observed_at_unix_ms: now, health_score: 1.0, ready: true, ..Default::default() };
            let blocks = (0..2000u64).map(|i| BlockHash((p << 40 | i).wrapping_mul(0x9E37_79B9_7F4A_7C15))).collect();
            gw.pool.update(PoolUpdate::Snapshot { stream: 1, info, seq: 0, stats: Some(stats), blocks }).await.unwrap();
        }
        gw.pool.sync().await.unwrap();
    });
    gw
}

fn main() {
    let gaps: Vec<u64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let gaps = if gaps.is_empty() { vec![0, 1_000, 10_000] } else { gaps };
    let gw = gateway();
    let vocabulary = ["alpha ", "route ", "cache ", "block ", "token ", "pod ", "queue "];
    let shared: String = (0..592).map(|w| vocabulary[(w * 3) % 7]).collect();
    for gap_us in gaps {
        let bodies: Vec<Vec<u8>> = (0..CALLS)
            .map(|i| {
                let prompt = format!("{shared}question {i} after a {gap_us} µs gap?");
                serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string().into_bytes()
            })
            .collect();
        let mut us = Vec::with_capacity(CALLS);
        for body in &bodies {
            if gap_us > 0 {
                std::thread::sleep(Duration::from_micros(gap_us));
            }
            let input = DecisionInput::new("gap", "/v1/completions", Some(body));
            let started = Instant::now();
            let decision = decide(&gw, &input);
            us.push(started.elapsed().as_secs_f64() * 1e6);
            drop(decision.unwrap());
        }
        let mut us = us.split_off(WARM_UP);
        us.sort_by(f64::total_cmp);
        let mean = us.iter().sum::<f64>() / us.len() as f64;
        let at = |q: f64| us[((us.len() - 1) as f64 * q) as usize];
        println!("gap {gap_us:>6} µs: decision mean {mean:6.1} µs, p50 {:6.1} µs, p90 {:6.1} µs", at(0.5), at(0.9));
    }
}
