//! Decision latency at fleet scale (docs/capacity.md): 1,000 pods, a 10M-entry index, and the same
//! 4,096-token chat request as `benches/decision.rs`, decided end to end (`decision::decide`:
//! parse, template, tokenize, hash, walk, score, choose); then the same pool under load, and
//! requests with inline images beside the text ones.
//!
//! Run: `cargo bench -p kvroute-picker --bench scale` (about 1.6 GB of memory, ~50 s). It prints:
//!
//! 1. **Unloaded, closed loop.** 2,000 decisions timed one by one (warm) over 8 pods and a
//!    16K-entry index (the baseline), then over 1,000 pods and 10M entries, with each index's
//!    size (entries, nodes, bytes estimate, the process's resident memory) and how long loading
//!    it took.
//! 2. **Paced, open loop.** [`DECIDERS`] threads call `decide` at [`TEXT_RATE`] decisions/s in
//!    total, each at its scheduled time whether or not the previous one finished, cycling through
//!    eight chats that walk the index differently (the 4,096-token chat; the same with another
//!    last question; shorter ones ending at an earlier turn; ones with another system prompt,
//!    which match nothing). Phases, in order:
//!    - `alone`: beside the agents' stats reports only (every pod every 2 s, the agent's default
//!      report period; no block events);
//!    - `ingest`: beside KV events at [`INGEST_EVENTS_PER_S`] (the capacity plan's rate for a
//!      1,000-GPU pool at h = 0.5): each pod in turn stores 144 fresh blocks and removes its 144
//!      oldest (one request's worth at h = 0.5), one agent delta per pod and request, through
//!      the ingest's stream handling (`ingest::StreamDriver`: sequence checks, conversion) into
//!      the pool's writer, which applies them in batches and publishes; it prints the rate
//!      offered and achieved and the writer's CPU time;
//!    - `new images`: beside requests with four inline 720p images each (two PNGs of 1.9 MB,
//!      two JPEGs of 0.8 MB, real encoder output made here) at [`IMAGE_RATE`] req/s on a model
//!      with `vision` (the count from each image's header, the identifier vLLM's content hash of
//!      its bytes), every image new (three bytes after its end changed per request, which
//!      decoders ignore and the hash does not): the decision sizes each from its header and the
//!      background reader reads its identifier (docs/decisions/0049-image-identifier-off-the-decision.md);
//!      the image decisions are reported too, and the reads queued and dropped;
//!    - `images seen before`: the same with two requests in turn, as a chat resends its images
//!      (the model's image cache answers after the background read);
//!    - `alone` again, to show the drift between the first and last phases.
//!
//!    Each line gives p50 / p99 / p99.9 / max of the decision's own time (`decide`, start to
//!    return), how many decisions lost the CPU while running (the thread's timeslice count in
//!    `/proc/thread-self/schedstat` went up, as in `decision.rs`) and the percentiles of those
//!    that kept it, and the p99 from each request's due time to the decision's end (the issuing
//!    thread's wake-up and any wait behind its previous request included).
//! 3. **What an image costs**: the steps of one inline image (base64 decode, header size,
//!    vLLM's content hash; all three whole, then streamed as the background reader does; the
//!    header-only size from the payload and the cache key, as the decision does), the parse of the
//!    whole image request's body, the chat template with and without the URLs, and the whole
//!    decision with new images and with images seen before, timed one by one on this thread.
//!
//! On a machine with few cores the paced phases share them with the pool's writer, the ingest
//! thread and anything else running: the switched-out count says how much of a tail is the
//! scheduler's.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::io::Read as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use kvroute_picker::Gateway;
use kvroute_picker::config::PickerConfig;
use kvroute_picker::decision::{DecisionInput, decide};
use kvroute_picker::ingest::StreamDriver;
use kvroute_picker::request::{PromptInput, parse_body};
use kvroute_proto::agent::v1::{
    AgentMessage, BlockChanges, BlockRun, PodDelta, PodInfo, PodSnapshot, PodStats, agent_message, picker_message,
};
use kvroute_tokenize::ModelTokenizer;
use serde_json::{Value, json};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";
/// The image model: the same pods and tokenizer, the count from each image's size.
const VISION_MODEL: &str = "vl";
const PATH: &str = "/v1/chat/completions";
const TARGET_TOKENS: usize = 4096;
/// Blocks of its own per pod, and per store (one prefill's worth).
const OWN_BLOCKS: u64 = 10_000;
const CHAIN: usize = 250;
/// Decisions per second of the paced phases, and the threads issuing them.
const TEXT_RATE: f64 = 1_000.0;
const DECIDERS: u64 = 4;
/// Block events per second offered in the `ingest` phase: docs/capacity.md, 1,000 GPUs at
/// 10 req/s and 288 events per request (h = 0.5).
const INGEST_EVENTS_PER_S: f64 = 2_880_000.0;
/// Blocks stored (and as many removed) per agent delta: one request at h = 0.5, (1 − h)·256 + 16.
const BLOCKS_PER_DELTA: u64 = 144;
/// Each pod's stats report period (the agent's default `report_interval_ms`).
const STATS_PERIOD_S: f64 = 2.0;
/// Image requests per second in the `images` phase, and 720p images per request.
const IMAGE_RATE: f64 = 20.0;
const IMAGES_PER_REQUEST: usize = 4;
const ALONE: Duration = Duration::from_secs(5);
const LOADED: Duration = Duration::from_secs(10);

fn tokenizer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer-qwen2.5")
}

fn chat_bytes(messages: &[Value]) -> Vec<u8> {
    json!({"model": MODEL, "messages": messages, "max_tokens": 64}).to_string().into_bytes()
}

/// The multi-turn chat of `benches/decision.rs` (≥ 4,096 tokens): its messages and token ids.
fn chat_messages(tok: &ModelTokenizer) -> (Vec<Value>, Vec<u32>) {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tokenizer_dir().join("expected-text.json")).unwrap()).unwrap();
    let text = expected["seed_first_2000_chars"]["text"].as_str().unwrap().to_owned();
    let mut messages = vec![json!({"role": "system", "content": "You are a routing expert. Answer briefly."})];
    for turn in 0.. {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        let chunk: String = text.chars().skip((turn * 97) % 1500).take(400 + turn % 7 * 50).collect();
        messages.push(json!({"role": role, "content": format!("Turn {turn}: {chunk}")}));
        if role == "user" {
            let PromptInput::Chat(chat) = parse_body(PATH, &chat_bytes(&messages)).unwrap().prompt else {
                unreachable!("a chat body")
            };
            let ids = tok.encode_chat(&chat).unwrap();
            if ids.len() >= TARGET_TOKENS {
                return (messages, ids);
            }
        }
    }
    unreachable!()
}

/// The paced phases' eight requests (see the module docs): the chat, two with another last
/// question, three ending at an earlier user turn, two with another system prompt.
fn text_variants(messages: &[Value]) -> Vec<Vec<u8>> {
    let mut out = vec![chat_bytes(messages)];
    for q in 0..2 {
        let mut m = messages.to_vec();
        let last = m.len() - 1;
        m[last]["content"] = json!(format!("Question {q}: which pod holds the longest prefix, and why?"));
        out.push(chat_bytes(&m));
    }
    for cut in [3, 5, 7] {
        let users: Vec<usize> = (0..messages.len()).filter(|&i| messages[i]["role"] == "user").collect();
        let end = users[users.len().saturating_sub(cut).max(1)];
        out.push(chat_bytes(&messages[..=end]));
    }
    for s in 0..2 {
        let mut m = messages.to_vec();
        m[0]["content"] = json!(format!("You are assistant number {s}. Think step by step."));
        out.push(chat_bytes(&m));
    }
    out
}

/// Pod `p`'s `i`-th own block: a bijection of (p, i), so every block ever stored is fresh.
fn own_block(p: u64, i: u64) -> u64 {
    ((p + 1) << 40 | i).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

fn pod_stats(p: u64) -> PodStats {
    PodStats {
        observed_at_unix_ms: now_ms(),
        health_score: 1.0,
        ready: true,
        gpu_utilization: (p % 10) as f64 / 10.0,
        num_requests_waiting: (p % 7) as u32,
        ..Default::default()
    }
}

fn message(msg: agent_message::Msg) -> AgentMessage {
    AgentMessage { msg: Some(msg) }
}

/// One pod as its agent stream sees it: the next sequence number and the window of own blocks
/// it holds, `[lo, hi)`.
struct PodState {
    seq: u64,
    lo: u64,
    hi: u64,
}

/// A pool fed through one agent stream, as the picker's ingest handles it.
struct Fleet {
    gw: Arc<Gateway>,
    driver: StreamDriver,
    pods: Vec<PodState>,
    /// Resync requests the stream answered with (a sequence error in the bench: must stay 0).
    resyncs: usize,
}

impl Fleet {
    async fn feed(&mut self, msg: AgentMessage) {
        let replies = self.driver.feed(msg).await.unwrap();
        self.resyncs += replies.iter().filter(|m| matches!(m.msg, Some(picker_message::Msg::Resync(_)))).count();
    }

    /// Pod `p`'s next delta: `blocks` fresh blocks stored and as many of its oldest removed,
    /// and its stats when `stats`.
    async fn delta(&mut self, p: usize, blocks: u64, stats: bool) {
        let st = &mut self.pods[p];
        st.seq += 1;
        let stored: Vec<u64> = (st.hi..st.hi + blocks).map(|i| own_block(p as u64, i)).collect();
        let removed: Vec<u64> = (st.lo..st.lo + blocks).map(|i| own_block(p as u64, i)).collect();
        st.hi += blocks;
        st.lo += blocks;
        let changes = (blocks > 0).then(|| BlockChanges {
            cleared: false,
            stored: vec![BlockRun { parent: 0, hashes: stored }],
            removed,
        });
        let d = PodDelta {
            pod: format!("pod-{p}"),
            seq: st.seq,
            blocks: changes,
            stats: stats.then(|| pod_stats(p as u64)),
            offloaded: None,
        };
        self.feed(message(agent_message::Msg::Delta(d))).await;
    }
}

/// A gateway with `pods` ready pods as in the module docs (`own` blocks each, chains of [`CHAIN`];
/// pods 0..8 also hold the chat's earlier turns to staggered depths, pod 3 all of them), loaded
/// through one agent stream, and how long loading the pods took.
fn fleet(rt: &tokio::runtime::Runtime, ids: &[u32], pods: u64, own: u64) -> (Fleet, Duration) {
    let config = PickerConfig::from_yaml(&format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\n\
         models: [{{name: {MODEL}, tokenizer: {dir}}}, \
         {{name: {VISION_MODEL}, target_model: {MODEL}, tokenizer: {dir}, vision: {{}}}}]\n",
        dir = tokenizer_dir().display()
    ))
    .unwrap();
    let gw = Arc::new(Gateway::new(&config).unwrap());
    let model = gw.models.resolve(MODEL).unwrap().clone();
    let mut prompt = Vec::new();
    model.hasher.hash_prompt(ids, &mut prompt);
    let seen = prompt.len() * 7 / 8;
    let driver = StreamDriver::new(gw.pool.clone());
    let mut f = Fleet { gw, driver, pods: Vec::new(), resyncs: 0 };
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
            let snapshot = PodSnapshot {
                info: Some(info),
                seq: 0,
                stats: Some(pod_stats(p)),
                blocks: vec![],
                offloaded_blocks: vec![],
            };
            f.feed(message(agent_message::Msg::Snapshot(snapshot))).await;
            f.pods.push(PodState { seq: 0, lo: 0, hi: own });
            // Own blocks in chains of CHAIN (a prefill's blocks arrive in one event), then the
            // chat's earlier turns to a staggered depth on pods 0..8 (all of them on pod 3).
            let own: Vec<u64> = (0..own).map(|i| own_block(p, i)).collect();
            let mut stores: Vec<Vec<u64>> = own.chunks(CHAIN).map(<[u64]>::to_vec).collect();
            if p < 8 {
                let depth = if p == 3 { seen } else { seen * (p as usize + 1) / 9 };
                stores.push(prompt[..depth].iter().map(|b| b.0).collect());
            }
            for hashes in stores {
                let st = &mut f.pods[p as usize];
                st.seq += 1;
                let blocks =
                    BlockChanges { cleared: false, stored: vec![BlockRun { parent: 0, hashes }], removed: vec![] };
                let d = PodDelta {
                    pod: format!("pod-{p}"),
                    seq: st.seq,
                    blocks: Some(blocks),
                    stats: None,
                    offloaded: None,
                };
                f.feed(message(agent_message::Msg::Delta(d))).await;
            }
        }
        f.gw.pool.sync().await.unwrap();
    });
    assert_eq!(f.resyncs, 0, "the stream asked for a resync while loading");
    (f, t.elapsed())
}

/// One call's wall-clock time, whether the thread was switched out during it, and (paced calls)
/// how late it started after its scheduled arrival.
#[derive(Clone, Copy)]
struct Sample {
    wall: Duration,
    preempted: bool,
    late: Duration,
}

/// Reads a thread's `schedstat` (CPU time ns, wait ns, timeslices).
struct Schedstat(Option<std::fs::File>, String);

impl Schedstat {
    fn open(path: &str) -> Self {
        Schedstat(std::fs::File::open(path).ok(), String::with_capacity(64))
    }

    fn field(&mut self, n: usize) -> u64 {
        let Schedstat(Some(f), buf) = self else { return 0 };
        buf.clear();
        if std::io::Seek::rewind(f).is_err() || f.read_to_string(buf).is_err() {
            return 0;
        }
        buf.split_ascii_whitespace().nth(n).and_then(|x| x.parse().ok()).unwrap_or(0)
    }

    fn timeslices(&mut self) -> u64 {
        self.field(2)
    }

    fn cpu(&mut self) -> Duration {
        Duration::from_nanos(self.field(0))
    }
}

/// The newest pool writer thread's schedstat (its name starts `kvroute-pool-w`).
fn writer_schedstat() -> Schedstat {
    let newest = std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|t| std::fs::read_to_string(t.path().join("comm")).unwrap_or_default().starts_with("kvroute-pool-w"))
        .max_by_key(|t| t.file_name().to_string_lossy().parse::<u64>().unwrap_or(0));
    match newest {
        Some(t) => Schedstat::open(&t.path().join("schedstat").to_string_lossy()),
        None => Schedstat(None, String::new()),
    }
}

/// `f` called `n` times back to back, each timed alone.
fn time<R>(n: usize, mut f: impl FnMut() -> R) -> Vec<Sample> {
    let mut stat = Schedstat::open("/proc/thread-self/schedstat");
    (0..n)
        .map(|_| {
            let before = stat.timeslices();
            let t = Instant::now();
            black_box(f());
            let wall = t.elapsed();
            Sample { wall, preempted: stat.timeslices() != before, late: Duration::ZERO }
        })
        .collect()
}

/// Decisions of `body(i)` at `rate` per second over `threads` threads from `start` for `length`:
/// request `i` is due at `start + i / rate` and is issued by thread `i % threads` then, or as
/// soon as that thread is free (open loop). The body is made before the clock starts.
fn paced<B: AsRef<[u8]>>(
    gw: &Gateway,
    body: &(dyn Fn(u64) -> B + Sync),
    rate: f64,
    threads: u64,
    start: Instant,
    length: Duration,
) -> Vec<Sample> {
    let per_thread = |k: u64| {
        let mut stat = Schedstat::open("/proc/thread-self/schedstat");
        let mut out = Vec::new();
        let mut i = k;
        loop {
            let due = start + Duration::from_secs_f64(i as f64 / rate);
            if due >= start + length {
                return out;
            }
            let body = body(i);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let input = DecisionInput::new("bench", PATH, Some(body.as_ref()));
            let before = stat.timeslices();
            let t = Instant::now();
            black_box(decide(gw, &input).unwrap());
            let wall = t.elapsed();
            out.push(Sample { wall, preempted: stat.timeslices() != before, late: t.saturating_duration_since(due) });
            i += threads;
        }
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|k| s.spawn(move || per_thread(k))).collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    })
}

/// What [`ingest`] offered and the writer did.
struct Ingested {
    events: u64,
    deltas: u64,
    /// From the phase's start until the pool had applied and published everything sent.
    elapsed: Duration,
    writer_cpu: Duration,
    ingest_cpu: Duration,
}

/// Agent deltas through `fleet`'s stream from `start` for `length`: block events at
/// `events_per_s` (0: none) in deltas of [`BLOCKS_PER_DELTA`] stores and as many removals, pods
/// in turn, and each pod's stats every [`STATS_PERIOD_S`]; paced, sending as fast as the writer
/// takes them when behind. Returns once the pool applied everything sent.
fn ingest(
    rt: &tokio::runtime::Handle,
    fleet: &mut Fleet,
    events_per_s: f64,
    start: Instant,
    length: Duration,
) -> Ingested {
    let deltas_per_s = events_per_s / (2 * BLOCKS_PER_DELTA) as f64;
    let pods = fleet.pods.len();
    let stats_per_s = pods as f64 / STATS_PERIOD_S;
    let (mut writer, mut me) = (writer_schedstat(), Schedstat::open("/proc/thread-self/schedstat"));
    let (writer0, me0) = (writer.cpu(), me.cpu());
    let (mut deltas, mut stats, mut events) = (0u64, 0u64, 0u64);
    rt.block_on(async {
        loop {
            let elapsed = start.elapsed();
            if elapsed >= length {
                break;
            }
            let due_deltas = (elapsed.as_secs_f64() * deltas_per_s) as u64;
            let due_stats = (elapsed.as_secs_f64() * stats_per_s) as u64;
            if deltas >= due_deltas && stats >= due_stats {
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
            // A stats report rides on the pod's block delta when both are due.
            while deltas < due_deltas {
                let p = (deltas % pods as u64) as usize;
                let with_stats = stats < due_stats && (stats % pods as u64) as usize == p;
                fleet.delta(p, BLOCKS_PER_DELTA, with_stats).await;
                stats += u64::from(with_stats);
                deltas += 1;
                events += 2 * BLOCKS_PER_DELTA;
                if deltas % 64 == 0 && start.elapsed() >= length {
                    break;
                }
            }
            while stats < due_stats {
                fleet.delta((stats % pods as u64) as usize, 0, true).await;
                stats += 1;
            }
        }
        fleet.gw.pool.sync().await.unwrap();
    });
    Ingested {
        events,
        deltas,
        elapsed: start.elapsed(),
        writer_cpu: writer.cpu() - writer0,
        ingest_cpu: me.cpu() - me0,
    }
}

fn quantile(mut v: Vec<Duration>, p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_unstable();
    v[((v.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e6
}

/// Prints p50 / p99 / p99.9 / max of the calls' own time, the count switched out and the
/// percentiles of the others, and (paced calls) the p99 from due time to the end.
fn report(name: &str, samples: &[Sample]) {
    let all: Vec<Duration> = samples.iter().map(|s| s.wall).collect();
    let kept: Vec<Duration> = samples.iter().filter(|s| !s.preempted).map(|s| s.wall).collect();
    let paced = samples.iter().any(|s| s.late > Duration::ZERO);
    let arrival: Vec<Duration> = samples.iter().map(|s| s.wall + s.late).collect();
    let due = if paced { format!(" | p99 from due time {:>8.1} µs", quantile(arrival, 0.99)) } else { String::new() };
    println!(
        "{name:<30} n={:<6} p50 {:>7.1}  p99 {:>7.1}  p99.9 {:>8.1}  max {:>8.1} µs | switched out {:>4}; the others: p50 {:>6.1}  p99 {:>7.1}  p99.9 {:>7.1} µs{due}",
        samples.len(),
        quantile(all.clone(), 0.50),
        quantile(all.clone(), 0.99),
        quantile(all.clone(), 0.999),
        quantile(all, 1.0),
        samples.len() - kept.len(),
        quantile(kept.clone(), 0.50),
        quantile(kept.clone(), 0.99),
        quantile(kept, 0.999),
    );
}

/// Resident memory of this process, MiB (`/proc/self/statm`), 0 where missing.
fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm.split_ascii_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or(0.0);
    pages * 4096.0 / (1 << 20) as f64
}

/// A 1280×720 RGB picture: a gradient under 4 bits of noise per channel, so a PNG of it is the
/// size of a photograph's (≈ 1.5 MB) and a JPEG of it is not tiny either.
fn picture(seed: u32) -> Vec<u8> {
    let (w, h) = (1280u32, 720u32);
    let mut state = 0x9E37_79B9u32 ^ seed.wrapping_mul(0x85EB_CA6B);
    let mut out = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            for c in 0..3u32 {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let base = (x * (c + 1) + y * (3 - c) + seed * 40) / 8;
                out.push((base + (state & 0x0F)) as u8);
            }
        }
    }
    out
}

/// `n` distinct inline images as data URLs (even: PNG, odd: JPEG at quality 95) and their sizes.
/// Each file ends with [`STAMP`]'s three bytes after the image's end (which decoders ignore and
/// vLLM hashes), on a 3-byte boundary, so its URL ends with the stamp's four base64 characters:
/// [`stamped`] rewrites them to make the same picture a new image.
fn images(n: usize) -> Vec<(String, usize)> {
    use image::ImageEncoder as _;
    (0..n)
        .map(|i| {
            let rgb = picture(i as u32);
            let mut bytes = Vec::new();
            let media = if i % 2 == 0 {
                image::codecs::png::PngEncoder::new(&mut bytes)
                    .write_image(&rgb, 1280, 720, image::ColorType::Rgb8)
                    .unwrap();
                "image/png"
            } else {
                image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 95)
                    .encode(&rgb, 1280, 720, image::ColorType::Rgb8)
                    .unwrap();
                "image/jpeg"
            };
            bytes.resize(bytes.len().next_multiple_of(3), 0);
            bytes.extend_from_slice(&[0; 3]);
            let url = format!("data:{media};base64,{}", base64::engine::general_purpose::STANDARD.encode(&bytes));
            assert!(url.ends_with(STAMP));
            (url, bytes.len())
        })
        .collect()
}

/// The base64 of an image's last three (zero) bytes, then the end of its URL in a body.
const STAMP: &str = "AAAA";

/// Where each image's [`STAMP`] starts in `body`.
fn stamps(body: &[u8]) -> Vec<usize> {
    body.windows(STAMP.len() + 1).enumerate().filter(|(_, w)| w.ends_with(b"AAAA\"")).map(|(at, _)| at).collect()
}

/// `body` with every image made new: each URL's last three bytes (at `stamps`) set to request
/// `i` and the image's place (distinct for 4 million requests).
fn stamped(body: &[u8], stamps: &[usize], i: u64) -> Vec<u8> {
    let mut out = body.to_vec();
    for (k, &at) in stamps.iter().enumerate() {
        let tag = ((i * IMAGES_PER_REQUEST as u64 + k as u64) & 0xFF_FFFF) as u32;
        let b64 = base64::engine::general_purpose::STANDARD.encode(&tag.to_be_bytes()[1..]);
        out[at..at + 4].copy_from_slice(b64.as_bytes());
    }
    out
}

/// An image request: a system prompt, then a user message with a text, `urls` and a question.
fn image_body(urls: &[&str]) -> Vec<u8> {
    let mut parts = vec![json!({"type": "text", "text": "Here are the pictures from the inspection:"})];
    parts.extend(urls.iter().map(|u| json!({"type": "image_url", "image_url": {"url": u}})));
    parts.push(json!({"type": "text", "text": "Which of them shows damage, and where?"}));
    let system = "You inspect photographs of machine parts for a maintenance log. ".repeat(8);
    json!({"model": VISION_MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": parts}]})
        .to_string()
        .into_bytes()
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let tok = ModelTokenizer::from_dir(&tokenizer_dir()).unwrap();
    let (messages, ids) = chat_messages(&tok);
    let body = chat_bytes(&messages);
    let input = DecisionInput::new("bench", PATH, Some(&body));
    println!("1. unloaded, closed loop");
    let mut big = None;
    for (name, pods, own) in
        [("8 pods, 16K entries (baseline)", 8, 2_000), ("1000 pods, 10M entries", 1000, OWN_BLOCKS)]
    {
        let rss = rss_mib();
        let (fleet, load) = fleet(&rt, &ids, pods, own);
        let gw = fleet.gw.clone();
        let s = gw.pool.index_stats();
        let d = decide(&gw, &input).unwrap();
        println!(
            "{name}: {} entries, {} nodes, index bytes estimate {:.0} MiB ({:.1} B/entry), resident +{:.0} MiB; loaded in {:.1} s ({:.2} M entries/s through the stream and pool)",
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
        drop(d);
        for _ in 0..200 {
            black_box(decide(&gw, &input).unwrap());
        }
        report("  full_decide (4,096-token chat)", &time(2000, || decide(&gw, &input).unwrap()));
        if pods == 1000 {
            big = Some(fleet);
        }
    }
    let mut fleet = big.unwrap();
    let gw = fleet.gw.clone();

    let texts = text_variants(&messages);
    for b in &texts {
        let d = decide(&gw, &DecisionInput::new("warm", PATH, Some(b))).unwrap();
        println!(
            "  variant: {} body bytes, {} of {} blocks matched on {}",
            b.len(),
            d.matched_blocks,
            d.total_blocks,
            d.pod
        );
    }
    let urls = images(2 * IMAGES_PER_REQUEST);
    let sizes: Vec<String> = urls.iter().map(|(_, n)| format!("{:.2}", *n as f64 / 1e6)).collect();
    let image_bodies: Vec<Vec<u8>> = urls
        .chunks(IMAGES_PER_REQUEST)
        .map(|c| image_body(&c.iter().map(|(u, _)| u.as_str()).collect::<Vec<_>>()))
        .collect();
    let image_stamps: Vec<Vec<usize>> = image_bodies.iter().map(|b| stamps(b)).collect();
    assert!(image_stamps.iter().all(|s| s.len() == IMAGES_PER_REQUEST));
    assert_ne!(stamped(&image_bodies[0], &image_stamps[0], 1), stamped(&image_bodies[0], &image_stamps[0], 2));
    let d = decide(&gw, &DecisionInput::new("warm", PATH, Some(&image_bodies[0]))).unwrap();
    println!(
        "  image requests: {} of 720p images (MB: {}), bodies of {:.1} MB; decision: {} of {} blocks, on {}",
        IMAGES_PER_REQUEST,
        sizes.join(", "),
        image_bodies[0].len() as f64 / 1e6,
        d.matched_blocks,
        d.total_blocks,
        d.pod
    );
    drop(d);

    println!(
        "\n2. paced: {TEXT_RATE} text decisions/s over {DECIDERS} threads, 1000 pods, 10M entries; {} CPUs online",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let handle = rt.handle().clone();
    let text_body = |i: u64| &texts[i as usize % texts.len()];
    // Every image new (no request repeats an image), or the same two requests in turn (a chat
    // resending its images, read from the model's image cache after the first time).
    let fresh = |i: u64| {
        let k = i as usize % image_bodies.len();
        stamped(&image_bodies[k], &image_stamps[k], i)
    };
    let repeated = |i: u64| image_bodies[i as usize % image_bodies.len()].clone();
    let mut phase = |name: &str,
                     length: Duration,
                     events_per_s: f64,
                     images: Option<&(dyn Fn(u64) -> Vec<u8> + Sync)>| {
        let start = Instant::now() + Duration::from_millis(20);
        let gw: &Gateway = &gw;
        let reads = (gw.metrics.image_reads_deferred.get(), gw.metrics.image_reads_dropped.get());
        let (text, images, ingested) = std::thread::scope(|s| {
            let text = s.spawn(|| paced(gw, &text_body, TEXT_RATE, DECIDERS, start, length));
            let images = images.map(|body| s.spawn(move || paced(gw, body, IMAGE_RATE, 1, start, length)));
            let ingested = ingest(&handle, &mut fleet, events_per_s, start, length);
            (text.join().unwrap(), images.map(|h| h.join().unwrap()), ingested)
        });
        report(&format!("  {name}: text"), &text);
        if let Some(images) = images {
            report(&format!("  {name}: 4-image requests"), &images);
            println!(
                "    images read in the background: {} queued, {} dropped (queue full)",
                gw.metrics.image_reads_deferred.get() - reads.0,
                gw.metrics.image_reads_dropped.get() - reads.1
            );
        }
        let secs = ingested.elapsed.as_secs_f64();
        println!(
            "    ingest: {} deltas, {:.2} M block events/s achieved of {:.2} M/s offered ({:.0} %); writer CPU {:.2} s ({:.1} M events per writer CPU-second), ingest thread CPU {:.2} s; {} entries",
            ingested.deltas,
            ingested.events as f64 / secs / 1e6,
            events_per_s / 1e6,
            if events_per_s > 0.0 { 100.0 * ingested.events as f64 / secs / events_per_s } else { f64::NAN },
            ingested.writer_cpu.as_secs_f64(),
            ingested.events as f64 / ingested.writer_cpu.as_secs_f64().max(1e-9) / 1e6,
            ingested.ingest_cpu.as_secs_f64(),
            gw.pool.index_stats().entries,
        );
    };
    phase("alone", ALONE, 0.0, None);
    phase("ingest", LOADED, INGEST_EVENTS_PER_S, None);
    phase("new images", LOADED, 0.0, Some(&fresh));
    phase("images seen before", LOADED, 0.0, Some(&repeated));
    phase("alone again", ALONE, 0.0, None);
    assert_eq!(fleet.resyncs, 0, "the stream asked for a resync");
    println!("  resident memory {:.0} MiB", rss_mib());

    println!("\n3. what an image costs (one by one, this thread)");
    let (png, jpeg) = (&urls[0].0, &urls[1].0);
    for (name, url) in [("PNG", png), ("JPEG", jpeg)] {
        use kvroute_common::image::*;
        let payload = data_url_payload(url).unwrap();
        let bytes = decode_base64(payload, 64 << 20).unwrap();
        report(&format!("  {name}: base64 decode (whole)"), &time(50, || decode_base64(payload, 64 << 20).unwrap()));
        report(&format!("  {name}: header size"), &time(50, || image_size(&bytes).unwrap()));
        report(
            &format!("  {name}: header size from the payload"),
            &time(50, || inline_image_size(payload, 64 << 20).unwrap()),
        );
        report(&format!("  {name}: payload key (cache)"), &time(50, || payload_key(payload)));
        report(&format!("  {name}: content hash"), &time(50, || content_identifier(MODEL, &bytes)));
        report(
            &format!("  {name}: decode+size+hash, whole"),
            &time(50, || {
                let b = decode_base64(payload, 64 << 20).unwrap();
                (image_size(&b).unwrap(), content_identifier(MODEL, &b))
            }),
        );
        report(
            &format!("  {name}: the same, streamed"),
            &time(50, || inline_image(payload, Some(MODEL), 64 << 20).unwrap()),
        );
    }
    report("  parse the 4-image body", &time(50, || parse_body(PATH, &image_bodies[0]).unwrap()));
    // The chat template sees each image part, URL included (copied into the template's values).
    let vl = gw.models.resolve(VISION_MODEL).unwrap().clone();
    let prompt = parse_body(PATH, &image_bodies[0]).unwrap().prompt;
    report("  template + tokenize, 4 images", &time(50, || vl.tokens(&prompt, "bench")));
    let blank = image_body(&["data:,"; IMAGES_PER_REQUEST]);
    let blank = parse_body(PATH, &blank).unwrap().prompt;
    report("  the same, URLs empty", &time(50, || vl.tokens(&blank, "bench")));
    let mut new_images = Vec::new();
    for i in 0..50 {
        let body = stamped(&image_bodies[0], &image_stamps[0], 1_000_000 + i);
        let input = DecisionInput::new("bench", PATH, Some(&body));
        new_images.extend(time(1, || decide(&gw, &input).unwrap()));
    }
    report("  full_decide, 4 new images", &new_images);
    let input = DecisionInput::new("bench", PATH, Some(&image_bodies[0]));
    report("  full_decide, 4 images seen before", &time(50, || decide(&gw, &input).unwrap()));
}
