//! Workloads (docs/design.md §10): seeded generators and a JSONL trace reader.
//!
//! A request is a list of prompt [`Segment`]s (a segment is a run of tokens with an identity:
//! a system prompt, a document, a user turn). Two requests whose segment lists start the same share
//! that prefix token for token. Token ids are synthesised from `(segment id, offset)` and hashed
//! with the real kvroute block hashing ([`kvroute_common::hash::hash_block`], docs/design.md §2), so the
//! simulated index and engines see exactly the chains the picker would compute.
//!
//! Arrivals are open-loop (Poisson per stage); multi-turn chat schedules turn k+1 a think time after
//! turn k's arrival (think times ≫ TTFT, so the turn almost always follows its answer).
//!
//! Every request also carries the chain approximate routers see: its prompt as *text*, about 4
//! characters per token (each token becomes 4 characters derived from its id), cut into GIE's
//! 64-character chunks and capped at 256 chunks, hashed by the picker's own
//! [`kvroute_picker::approx::TextHasher`]. With a 6 000-token system prompt the 256 chunks
//! (16 384 characters ≈ 4 096 tokens) never reach past it, which is how GIE's text view loses
//! conversations.
//!
//! The `december` workloads (W1, W2, pressure, cold start, llm-d's shape; docs/design.md §10) come
//! with their fleet: KV tokens per pod and router replicas ([`Fleet`]), and warm-up stages excluded
//! from the figures.

use std::io::BufRead;
use std::path::Path;

use kvroute_common::BlockHash;
use kvroute_common::hash::{hash_block, root_hash};
use kvroute_picker::approx::{DEFAULT_BLOCK_CHARS, DEFAULT_MAX_BLOCKS, TextHasher};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;

use crate::SimError;

/// Base model name every simulated pod serves (the chain root's model field).
pub const MODEL: &str = "sim-model";

/// A run of prompt tokens with an identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Identity: equal ids mean equal tokens.
    pub id: u64,
    /// Length in tokens.
    pub tokens: u32,
}

/// One simulated request.
#[derive(Clone, Debug)]
pub struct SimRequest {
    /// Position in the workload (dense, from 0).
    pub id: usize,
    /// Arrival at the router, µs of simulated time.
    pub arrival_us: u64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Tokens to generate.
    pub output_tokens: u32,
    /// LoRA adapter, if any (its chain is disjoint from the base model's, docs/design.md §2).
    pub adapter: Option<String>,
    /// Conversation id (multi-turn chat), if any.
    pub session: Option<u64>,
    /// Group whose shared prefix (system prompt) it starts with, where a workload has groups
    /// (`chat-groups`, and the shared-prefix streams: shared-prefix, W1, llm-d, background): the
    /// report counts the engines each group is served by.
    pub group: Option<u64>,
    /// Load stage the request belongs to (index into [`Workload::stages`]).
    pub stage: usize,
    /// Sent straight to a pod, past the routers (set by the simulation's `direct_share`).
    pub direct: bool,
    /// Full-block chain of the prompt (docs/design.md §2).
    pub blocks: Vec<BlockHash>,
    /// The prompt's text chain as approximate routers hash it (64-character chunks, at most 256).
    pub text_blocks: Vec<BlockHash>,
}

/// A constant-rate phase of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    /// Offered rate, requests per second.
    pub rate_rps: f64,
    /// Length, seconds of simulated time (0 for workloads that are not rate-staged).
    pub duration_s: f64,
    /// Warm-up: its requests run but are left out of every figure.
    pub warmup: bool,
}

impl Stage {
    /// A measured stage of `rate_rps` for `duration_s`.
    pub fn measured(rate_rps: f64, duration_s: f64) -> Stage {
        Stage { rate_rps, duration_s, warmup: false }
    }

    /// A warm-up stage.
    pub fn warmup(rate_rps: f64, duration_s: f64) -> Stage {
        Stage { rate_rps, duration_s, warmup: true }
    }
}

/// Fleet settings a workload prescribes (`None`: the command line's).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fleet {
    /// KV capacity per pod, tokens.
    pub kv_tokens: Option<usize>,
    /// Router (picker) replicas.
    pub routers: Option<usize>,
    /// Pods (engines).
    pub pods: Option<usize>,
    /// Requests each pod runs at once (vLLM `max_num_seqs`).
    pub max_num_seqs: Option<usize>,
}

/// A named list of requests sorted by arrival.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Short name (table headings, file names).
    pub name: String,
    /// One line for the report: the shape in numbers.
    pub description: String,
    /// Requests sorted by `arrival_us`.
    pub requests: Vec<SimRequest>,
    /// Load stages (one for single-rate workloads).
    pub stages: Vec<Stage>,
    /// The fleet it is defined on.
    pub fleet: Fleet,
}

impl Workload {
    /// Runs the workload behind `routers` router replicas instead of its own fleet's, and says so
    /// in its description (which names the replica count of the fleet it was defined on).
    pub fn set_routers(&mut self, routers: usize) {
        let phrase = |n: usize| if n == 1 { "one router".to_owned() } else { format!("{n} router replicas") };
        if let Some(own) = self.fleet.routers
            && own != routers
        {
            self.description = self.description.replace(&phrase(own), &phrase(routers));
        }
        self.fleet.routers = Some(routers);
    }
}

/// Characters per token in the text view (GIE's estimate).
pub const CHARS_PER_TOKEN: usize = 4;

/// Builds request chains from segment lists (`block_size` tokens per block).
#[derive(Clone, Debug)]
pub struct ChainBuilder {
    block_size: usize,
    tokens: Vec<u32>,
    text: String,
    codepoints: Vec<u32>,
    /// Text chains by (adapter, the segments the 256 chunks reach): requests sharing a long
    /// prefix share their whole text chain.
    text_memo: std::collections::HashMap<TextKey, Vec<BlockHash>>,
}

/// (adapter, the `(segment id, tokens)` the text view reaches).
type TextKey = (Option<String>, Vec<(u64, u32)>);

impl ChainBuilder {
    /// A builder for `block_size`-token blocks (vLLM default 16).
    pub fn new(block_size: usize) -> Self {
        ChainBuilder {
            block_size: block_size.max(1),
            tokens: Vec::new(),
            text: String::new(),
            codepoints: Vec::new(),
            text_memo: std::collections::HashMap::new(),
        }
    }

    /// The text chain of `segments` under `adapter` as approximate routing hashes it: each token
    /// as [`CHARS_PER_TOKEN`] letters, GIE's 64-character chunks, at most 256 of them.
    pub fn text_chain(&mut self, adapter: Option<&str>, segments: &[Segment]) -> Vec<BlockHash> {
        let limit = DEFAULT_BLOCK_CHARS * DEFAULT_MAX_BLOCKS;
        let mut key = Vec::new();
        let mut chars = 0usize;
        for s in segments {
            if chars >= limit {
                break;
            }
            let take = s.tokens.min(u32::try_from((limit - chars).div_ceil(CHARS_PER_TOKEN)).unwrap_or(u32::MAX));
            key.push((s.id, take));
            chars += take as usize * CHARS_PER_TOKEN;
        }
        let key = (adapter.map(str::to_string), key);
        if let Some(chain) = self.text_memo.get(&key) {
            return chain.clone();
        }
        let hasher = TextHasher::new(MODEL, adapter, DEFAULT_BLOCK_CHARS, DEFAULT_MAX_BLOCKS);
        self.text.clear();
        'outer: for s in segments {
            for off in 0..s.tokens {
                if self.text.len() >= limit {
                    break 'outer;
                }
                let t = synth_token(s.id, off);
                for k in 0..CHARS_PER_TOKEN {
                    self.text.push(char::from(b'a' + ((t >> (8 * k)) & 0xFF) as u8 % 26));
                }
            }
        }
        let mut out = Vec::new();
        hasher.hash_text(&self.text, &mut self.codepoints, &mut out);
        self.text_memo.insert(key, out.clone());
        out
    }

    /// The full-block chain of `segments` under `adapter` (a trailing partial block is ignored).
    pub fn chain(&mut self, adapter: Option<&str>, segments: &[Segment]) -> Vec<BlockHash> {
        self.tokens.clear();
        for s in segments {
            self.tokens.extend((0..s.tokens).map(|off| synth_token(s.id, off)));
        }
        let mut parent = root_hash(MODEL, adapter);
        let mut out = Vec::with_capacity(self.tokens.len() / self.block_size);
        for block in self.tokens.chunks_exact(self.block_size) {
            parent = hash_block(parent, block);
            out.push(parent);
        }
        out
    }
}

/// A deterministic token id for `(segment, offset)`.
fn synth_token(segment: u64, offset: u32) -> u32 {
    (splitmix64(segment ^ (u64::from(offset) << 40) ^ u64::from(offset)) & 0xFFFF_FFFF) as u32
}

/// splitmix64 finaliser.
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Exponential inter-arrival gap at `rate_rps`, in µs.
fn exp_gap_us(rng: &mut StdRng, rate_rps: f64) -> u64 {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    (-u.ln() / rate_rps * 1e6) as u64
}

struct Draft {
    arrival_us: u64,
    segments: Vec<Segment>,
    output_tokens: u32,
    adapter: Option<String>,
    session: Option<u64>,
    group: Option<u64>,
    stage: usize,
}

fn finish(name: &str, description: String, stages: Vec<Stage>, mut drafts: Vec<Draft>, block_size: usize) -> Workload {
    drafts.sort_by_key(|d| d.arrival_us);
    let mut cb = ChainBuilder::new(block_size);
    let requests = drafts
        .into_iter()
        .enumerate()
        .map(|(id, d)| SimRequest {
            id,
            arrival_us: d.arrival_us,
            prompt_tokens: d.segments.iter().map(|s| s.tokens).sum(),
            output_tokens: d.output_tokens,
            blocks: cb.chain(d.adapter.as_deref(), &d.segments),
            text_blocks: cb.text_chain(d.adapter.as_deref(), &d.segments),
            adapter: d.adapter,
            session: d.session,
            group: d.group,
            stage: d.stage,
            direct: false,
        })
        .collect();
    Workload { name: name.into(), description, requests, stages, fleet: Fleet::default() }
}

/// docs/design.md §10's routing-quality shape (llm-d's benchmark, scaled).
#[derive(Clone, Debug)]
pub struct SharedPrefixConfig {
    /// Prefix groups. Default 150.
    pub groups: u32,
    /// Shared prefix per group, tokens. Default 6 000.
    pub prefix_tokens: u32,
    /// Distinct questions per group. Default 5.
    pub questions_per_group: u32,
    /// Question length, tokens. Default 1 200.
    pub question_tokens: u32,
    /// Output tokens. Default 100.
    pub output_tokens: u32,
    /// Poisson stages, in order. Default 2, 4, 6, 8, 10 req/s × 60 s, all measured.
    pub stages: Vec<Stage>,
}

impl Default for SharedPrefixConfig {
    fn default() -> Self {
        SharedPrefixConfig {
            groups: 150,
            prefix_tokens: 6000,
            questions_per_group: 5,
            question_tokens: 1200,
            output_tokens: 100,
            stages: staged(&[2.0, 4.0, 6.0, 8.0, 10.0], 60.0),
        }
    }
}

/// Measured stages of `rates` req/s, `stage_s` seconds each.
pub fn staged(rates: &[f64], stage_s: f64) -> Vec<Stage> {
    rates.iter().map(|r| Stage::measured(*r, stage_s)).collect()
}

fn describe_stages(stages: &[Stage]) -> String {
    stages
        .iter()
        .map(|s| format!("{} req/s × {} s{}", s.rate_rps, s.duration_s, if s.warmup { " (warm-up)" } else { "" }))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Shared-prefix groups: each request is one group's prefix + one of its questions, both uniform.
pub fn shared_prefix(cfg: &SharedPrefixConfig, seed: u64, block_size: usize) -> Workload {
    shared_prefix_named("shared-prefix", cfg, seed, block_size)
}

fn shared_prefix_named(name: &str, cfg: &SharedPrefixConfig, seed: u64, block_size: usize) -> Workload {
    let mut rng = StdRng::seed_from_u64(seed);
    let drafts = shared_prefix_drafts(cfg, &mut rng);
    let description = format!(
        "{} groups × {}-token prefix × {} questions of {} tokens, {} output tokens; Poisson stages {}",
        cfg.groups,
        cfg.prefix_tokens,
        cfg.questions_per_group,
        cfg.question_tokens,
        cfg.output_tokens,
        describe_stages(&cfg.stages)
    );
    finish(name, description, cfg.stages.clone(), drafts, block_size)
}

/// The requests of a shared-prefix stream (see [`SharedPrefixConfig`]), unsorted.
fn shared_prefix_drafts(cfg: &SharedPrefixConfig, rng: &mut StdRng) -> Vec<Draft> {
    let mut drafts = Vec::new();
    let mut start_us = 0u64;
    for (stage, st) in cfg.stages.iter().enumerate() {
        let end_us = start_us + (st.duration_s * 1e6) as u64;
        let mut t = start_us + exp_gap_us(rng, st.rate_rps);
        while t < end_us {
            let g = u64::from(rng.random_range(0..cfg.groups.max(1)));
            let q = u64::from(rng.random_range(0..cfg.questions_per_group.max(1)));
            drafts.push(Draft {
                arrival_us: t,
                segments: vec![
                    Segment { id: 1 << 48 | g, tokens: cfg.prefix_tokens },
                    Segment { id: 2 << 48 | g << 16 | q, tokens: cfg.question_tokens },
                ],
                output_tokens: cfg.output_tokens,
                adapter: None,
                session: None,
                group: Some(g),
                stage,
            });
            t += exp_gap_us(rng, st.rate_rps);
        }
        start_us = end_us;
    }
    drafts
}

/// Multi-turn chat shape.
#[derive(Clone, Debug)]
pub struct ChatConfig {
    /// Conversations. Default 300.
    pub sessions: u32,
    /// Turns per conversation. Default 5.
    pub turns: u32,
    /// New conversations per second. Default 2.
    pub sessions_per_s: f64,
    /// The system prompt every conversation shares, tokens. Default 2 000.
    pub system_tokens: u32,
    /// User message per turn, tokens. Default 300.
    pub user_tokens: u32,
    /// Answer per turn, tokens (generated, and part of the next turn's prompt). Default 200.
    pub answer_tokens: u32,
    /// Mean think time between turns (exponential), seconds. Default 15.
    pub think_s: f64,
    /// Requests arriving before this many seconds are warm-up. Default 0.
    pub warmup_s: f64,
}

impl Default for ChatConfig {
    fn default() -> Self {
        ChatConfig {
            sessions: 300,
            turns: 5,
            sessions_per_s: 2.0,
            system_tokens: 2000,
            user_tokens: 300,
            answer_tokens: 200,
            think_s: 15.0,
            warmup_s: 0.0,
        }
    }
}

/// Multi-turn chat: every conversation starts with one shared system prompt; each turn appends the
/// previous answer and a new user message. Conversations start Poisson at `sessions_per_s`.
pub fn chat(sessions: u32, turns: u32, sessions_per_s: f64, seed: u64, block_size: usize) -> Workload {
    chat_with("chat", &ChatConfig { sessions, turns, sessions_per_s, ..ChatConfig::default() }, seed, block_size)
}

/// [`chat`] with every knob; requests before `warmup_s` form a warm-up stage (stage 0).
pub fn chat_with(name: &str, cfg: &ChatConfig, seed: u64, block_size: usize) -> Workload {
    let mut rng = StdRng::seed_from_u64(seed);
    let (system, user, answer) = (cfg.system_tokens, cfg.user_tokens, cfg.answer_tokens);
    let warm = cfg.warmup_s > 0.0;
    let warmup_us = (cfg.warmup_s * 1e6) as u64;
    let mut drafts = Vec::new();
    let mut t = 0u64;
    for s in 0..u64::from(cfg.sessions) {
        t += exp_gap_us(&mut rng, cfg.sessions_per_s);
        let mut segments = vec![Segment { id: 3 << 48, tokens: system }];
        let mut at = t;
        for k in 0..u64::from(cfg.turns) {
            segments.push(Segment { id: 4 << 48 | s << 8 | k, tokens: user });
            drafts.push(Draft {
                arrival_us: at,
                segments: segments.clone(),
                output_tokens: answer,
                adapter: None,
                session: Some(s),
                group: None,
                stage: usize::from(warm && at >= warmup_us),
            });
            segments.push(Segment { id: 5 << 48 | s << 8 | k, tokens: answer });
            at += exp_gap_us(&mut rng, 1.0 / cfg.think_s);
        }
    }
    let rate = cfg.sessions_per_s * f64::from(cfg.turns);
    let mut description = format!(
        "{} conversations × {} turns, shared {system}-token system prompt, {user}-token user turns, \
         {answer}-token answers, think time exp. mean {} s, {} new conversations/s",
        cfg.sessions, cfg.turns, cfg.think_s, cfg.sessions_per_s
    );
    let stages = if warm {
        description.push_str(&format!("; first {} s warm-up", cfg.warmup_s));
        vec![Stage::warmup(rate, cfg.warmup_s), Stage::measured(rate, 0.0)]
    } else {
        vec![Stage::measured(rate, 0.0)]
    };
    finish(name, description, stages, drafts, block_size)
}

/// W1 (docs/design.md §10): the shared-prefix stream on llm-d's benchmark pods
/// (307 328 KV tokens each) behind 3 router replicas; Poisson 5 then 10 req/s × 60 s warm-up,
/// then 10 req/s × 120 s measured.
pub fn w1(seed: u64, block_size: usize) -> Workload {
    let cfg = SharedPrefixConfig {
        stages: vec![Stage::warmup(5.0, 60.0), Stage::warmup(10.0, 60.0), Stage::measured(10.0, 120.0)],
        ..SharedPrefixConfig::default()
    };
    let mut w = shared_prefix_named("w1", &cfg, seed, block_size);
    w.fleet = Fleet { kv_tokens: Some(W1_KV_TOKENS), routers: Some(3), ..Fleet::default() };
    w.description.push_str("; 307 328 KV tokens per pod, 3 router replicas");
    w
}

/// Background traffic: W1's stream and stages, plus a Poisson stream of unrelated 6 000-token
/// prompts (no two share a block) at 2 req/s over the whole run, 100 output tokens each; 200 000
/// KV tokens per pod, 3 router replicas. The unrelated prompts cost the fleet prefill and cache
/// without any hit to win: where they land decides the W1 requests' queueing.
pub fn background(seed: u64, block_size: usize) -> Workload {
    let cfg = SharedPrefixConfig {
        stages: vec![Stage::warmup(5.0, 60.0), Stage::warmup(10.0, 60.0), Stage::measured(10.0, 120.0)],
        ..SharedPrefixConfig::default()
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut drafts = shared_prefix_drafts(&cfg, &mut rng);
    let mut start_us = 0u64;
    let mut n = 0u64;
    for (stage, st) in cfg.stages.iter().enumerate() {
        let end_us = start_us + (st.duration_s * 1e6) as u64;
        let mut t = start_us + exp_gap_us(&mut rng, BACKGROUND_RPS);
        while t < end_us {
            n += 1;
            drafts.push(Draft {
                arrival_us: t,
                segments: vec![Segment { id: 4 << 48 | n, tokens: BACKGROUND_TOKENS }],
                output_tokens: cfg.output_tokens,
                adapter: None,
                session: None,
                group: None,
                stage,
            });
            t += exp_gap_us(&mut rng, BACKGROUND_RPS);
        }
        start_us = end_us;
    }
    let description = format!(
        "W1's stream ({} groups × {}-token prefix × {} questions of {} tokens; Poisson stages {}) plus \
         unrelated {BACKGROUND_TOKENS}-token prompts at {BACKGROUND_RPS} req/s, {} output tokens; \
         {BACKGROUND_KV_TOKENS} KV tokens per pod, 3 router replicas",
        cfg.groups,
        cfg.prefix_tokens,
        cfg.questions_per_group,
        cfg.question_tokens,
        describe_stages(&cfg.stages),
        cfg.output_tokens,
    );
    let mut w = finish("background", description, cfg.stages.clone(), drafts, block_size);
    w.fleet = Fleet { kv_tokens: Some(BACKGROUND_KV_TOKENS), routers: Some(3), ..Fleet::default() };
    w
}

/// Background traffic's unrelated prompts: tokens each.
pub const BACKGROUND_TOKENS: u32 = 6000;
/// Background traffic's unrelated prompts: requests per second.
pub const BACKGROUND_RPS: f64 = 2.0;
/// KV tokens per pod of the background-traffic workload.
pub const BACKGROUND_KV_TOKENS: usize = 200_000;

/// KV tokens per pod of llm-d's benchmark pods (W1, W2, llm-d's shape).
pub const W1_KV_TOKENS: usize = 307_328;

/// W2, agent chat: 300 conversations × 5 turns on a shared 6 000-token system prompt, 300-token user
/// turns, 200-token answers, 2 new conversations/s, think time exp. mean 15 s; 307k KV per pod,
/// one router, 30 s warm-up.
pub fn w2(seed: u64, block_size: usize) -> Workload {
    let cfg = ChatConfig { system_tokens: 6000, warmup_s: 30.0, ..ChatConfig::default() };
    let mut w = chat_with("w2", &cfg, seed, block_size);
    w.fleet = Fleet { kv_tokens: Some(W1_KV_TOKENS), routers: Some(1), ..Fleet::default() };
    w.description.push_str("; 307 328 KV tokens per pod, one router");
    w
}

/// Pressure: W1's stream with 100 000 KV tokens per pod and one router (working set 2.25× the
/// fleet's cache).
pub fn pressure(seed: u64, block_size: usize) -> Workload {
    let mut w = w1(seed, block_size);
    w.name = "pressure".into();
    w.fleet = Fleet { kv_tokens: Some(100_000), routers: Some(1), ..Fleet::default() };
    w.description =
        w.description.replace("307 328 KV tokens per pod, 3 router replicas", "100 000 KV tokens per pod, one router");
    w
}

/// Cold start: W1's stream (its fleet: 307k KV per pod, 3 router replicas) begun at 15 req/s
/// on empty caches, 120 s, all measured.
pub fn cold_start(seed: u64, block_size: usize) -> Workload {
    let cfg = SharedPrefixConfig { stages: vec![Stage::measured(15.0, 120.0)], ..SharedPrefixConfig::default() };
    let mut w = shared_prefix_named("cold-start", &cfg, seed, block_size);
    w.fleet = Fleet { kv_tokens: Some(W1_KV_TOKENS), routers: Some(3), ..Fleet::default() };
    w.description.push_str("; empty caches, no warm-up; 307 328 KV tokens per pod, 3 router replicas");
    w
}

/// llm-d's benchmark shape: W1's groups with 1 000 output tokens (working set 1.8M tokens = 73 % of
/// the fleet's 8 × 307k KV), one router, Poisson `stages` rising to saturation.
pub fn llmd(stages: &[Stage], seed: u64, block_size: usize) -> Workload {
    let cfg = SharedPrefixConfig { output_tokens: 1000, stages: stages.to_vec(), ..SharedPrefixConfig::default() };
    let mut w = shared_prefix_named("llm-d", &cfg, seed, block_size);
    w.fleet = Fleet { kv_tokens: Some(W1_KV_TOKENS), routers: Some(1), ..Fleet::default() };
    w.description.push_str("; 307 328 KV tokens per pod (working set 73 % of the fleet's), one router");
    w
}

/// `chat-groups`: docs/benchmarks.md's end-to-end chat benchmark against SMG
/// (`tests/harness/src/bin/chat-bench.rs`) in the simulator: `groups` system prompts of
/// `system_tokens` (1 400 words ≈ 1 540 tokens), `users` conversations each, `turns` turns of
/// `turn_tokens` user message (100 words ≈ 110 tokens) whose answer (as long) is part of the
/// next turn's prompt; 16 output tokens. Arrivals are Poisson at `rate_rps`, each the next turn of
/// a conversation drawn among those with turns left (the benchmark's open-loop schedule); a turn
/// comes at least 1 s after the conversation's previous one (the benchmark never sends it before
/// the previous reply is in). Its fleet: 4 pods × 16 000 KV tokens (1 000 blocks; the working
/// set is ≈ 1.6× the fleet's), 16 running per pod, one router.
pub fn chat_groups(rate_rps: f64, seed: u64, block_size: usize) -> Workload {
    chat_groups_with(&ChatGroupsConfig::default(), rate_rps, seed, block_size)
}

/// The shape of [`chat_groups`].
#[derive(Clone, Debug)]
pub struct ChatGroupsConfig {
    /// System prompts. Default 24.
    pub groups: u32,
    /// Conversations per system prompt. Default 5.
    pub users: u32,
    /// Turns per conversation. Default 3.
    pub turns: u32,
    /// System prompt, tokens. Default 1 540.
    pub system_tokens: u32,
    /// User message and (stand-in) answer per turn, tokens each. Default 110.
    pub turn_tokens: u32,
    /// Output tokens. Default 16.
    pub output_tokens: u32,
}

impl Default for ChatGroupsConfig {
    fn default() -> Self {
        ChatGroupsConfig { groups: 24, users: 5, turns: 3, system_tokens: 1540, turn_tokens: 110, output_tokens: 16 }
    }
}

/// [`chat_groups`] with every knob (the fleet stays 4 × 16 000 KV tokens, 16 running per pod).
pub fn chat_groups_with(cfg: &ChatGroupsConfig, rate_rps: f64, seed: u64, block_size: usize) -> Workload {
    let mut rng = StdRng::seed_from_u64(seed);
    let conversations = u64::from(cfg.groups.max(1)) * u64::from(cfg.users);
    // (conversation, next turn, earliest arrival of that turn)
    let mut left: Vec<(u64, u32, u64)> = (0..conversations).map(|c| (c, 0, 0)).collect();
    let mut drafts = Vec::new();
    let mut t = 0u64;
    let rate = if rate_rps.is_finite() && rate_rps > 0.0 { rate_rps } else { 1.0 };
    while !left.is_empty() && cfg.turns > 0 {
        t += exp_gap_us(&mut rng, rate);
        let i = rng.random_range(0..left.len());
        let (c, turn, earliest) = left[i];
        let g = c % u64::from(cfg.groups.max(1));
        let mut segments = vec![Segment { id: 12 << 48 | g, tokens: cfg.system_tokens }];
        for k in 0..u64::from(turn) {
            segments.push(Segment { id: 13 << 48 | c << 8 | k, tokens: cfg.turn_tokens });
            segments.push(Segment { id: 14 << 48 | c << 8 | k, tokens: cfg.turn_tokens });
        }
        segments.push(Segment { id: 13 << 48 | c << 8 | u64::from(turn), tokens: cfg.turn_tokens });
        let at = t.max(earliest);
        drafts.push(Draft {
            arrival_us: at,
            segments,
            output_tokens: cfg.output_tokens,
            adapter: None,
            session: Some(c),
            group: Some(g),
            stage: 0,
        });
        if turn + 1 < cfg.turns {
            left[i] = (c, turn + 1, at + 1_000_000);
        } else {
            left.swap_remove(i);
        }
    }
    let description = format!(
        "the end-to-end chat benchmark's stream: {} system prompts × {} tokens, {} conversations each × {} turns \
         ({} + {} tokens per turn), {} output tokens, {rate} req/s Poisson; 4 pods × 16 000 KV tokens \
         (working set ≈ 1.6× the fleet's), 16 running per pod, one router",
        cfg.groups, cfg.system_tokens, cfg.users, cfg.turns, cfg.turn_tokens, cfg.turn_tokens, cfg.output_tokens
    );
    let mut w = finish("chat-groups", description, vec![Stage::measured(rate, 0.0)], drafts, block_size);
    w.fleet = Fleet { kv_tokens: Some(16_000), routers: Some(1), pods: Some(4), max_num_seqs: Some(16) };
    w
}

/// Thundering herd (docs/design.md §15): per wave, one warm-up request for a new prefix, then `herd`
/// requests for that same prompt arrive at one instant.
pub fn herd(waves: u32, herd: u32, prefix_tokens: u32, seed: u64, block_size: usize) -> Workload {
    let _ = seed;
    let mut drafts = Vec::new();
    for w in 0..u64::from(waves) {
        let base = w * 30_000_000;
        let segments = vec![Segment { id: 6 << 48 | w, tokens: prefix_tokens }];
        for (i, at) in std::iter::once(base).chain(std::iter::repeat_n(base + 10_000_000, herd as usize)).enumerate() {
            let _ = i;
            drafts.push(Draft {
                arrival_us: at,
                segments: segments.clone(),
                output_tokens: 50,
                adapter: None,
                session: None,
                group: None,
                stage: 0,
            });
        }
    }
    let description = format!(
        "{waves} waves: a warm-up request, then {herd} identical {prefix_tokens}-token requests at one instant 10 s later"
    );
    finish("herd", description, vec![Stage::measured(0.0, 0.0)], drafts, block_size)
}

/// Zipf(s) sampler over ranks 0..n (rank 0 most popular), by inverse CDF.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: u32, s: f64) -> Zipf {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n.max(1))
            .map(|k| {
                acc += 1.0 / f64::from(k).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    fn sample(&self, rng: &mut StdRng) -> u64 {
        let u: f64 = rng.random();
        self.cdf.partition_point(|c| *c < u) as u64
    }
}

/// Multi-tenant LoRA: `adapters` adapters with Zipf(1.0) popularity, each with its own 2 000-token
/// system prompt and unique 300-token questions.
pub fn lora(adapters: u32, rate_rps: f64, duration_s: f64, seed: u64, block_size: usize) -> Workload {
    let mut rng = StdRng::seed_from_u64(seed);
    let zipf = Zipf::new(adapters, 1.0);
    let mut drafts = Vec::new();
    let end = (duration_s * 1e6) as u64;
    let mut t = exp_gap_us(&mut rng, rate_rps);
    let mut n = 0u64;
    while t < end {
        let a = zipf.sample(&mut rng);
        drafts.push(Draft {
            arrival_us: t,
            segments: vec![Segment { id: 7 << 48 | a, tokens: 2000 }, Segment { id: 8 << 48 | n, tokens: 300 }],
            output_tokens: 100,
            adapter: Some(format!("tenant-{a}")),
            session: None,
            group: None,
            stage: 0,
        });
        n += 1;
        t += exp_gap_us(&mut rng, rate_rps);
    }
    let description = format!(
        "{adapters} LoRA adapters, Zipf(1.0) popularity, 2000-token per-tenant system prompt + unique 300-token question, \
         {rate_rps} req/s × {duration_s} s"
    );
    finish("lora", description, vec![Stage::measured(rate_rps, duration_s)], drafts, block_size)
}

/// Zipf-popular prefixes: `prefixes` documents of 3 000 tokens, Zipf(1.1), unique 200-token question.
pub fn zipf_prefixes(prefixes: u32, rate_rps: f64, duration_s: f64, seed: u64, block_size: usize) -> Workload {
    let mut rng = StdRng::seed_from_u64(seed);
    let zipf = Zipf::new(prefixes, 1.1);
    let mut drafts = Vec::new();
    let end = (duration_s * 1e6) as u64;
    let mut t = exp_gap_us(&mut rng, rate_rps);
    let mut n = 0u64;
    while t < end {
        let p = zipf.sample(&mut rng);
        drafts.push(Draft {
            arrival_us: t,
            segments: vec![Segment { id: 9 << 48 | p, tokens: 3000 }, Segment { id: 10 << 48 | n, tokens: 200 }],
            output_tokens: 100,
            adapter: None,
            session: None,
            group: None,
            stage: 0,
        });
        n += 1;
        t += exp_gap_us(&mut rng, rate_rps);
    }
    let description = format!(
        "{prefixes} 3000-token documents, Zipf(1.1) popularity, unique 200-token question, {rate_rps} req/s × {duration_s} s"
    );
    finish("zipf", description, vec![Stage::measured(rate_rps, duration_s)], drafts, block_size)
}

/// Unique-prefix pairs (docs/design.md §16's random-routing claim): `prefixes` distinct prompts, each sent
/// twice, the repeat `gap_s` seconds after the first; arrivals spaced `spacing_s` apart.
pub fn repeated_pairs(prefixes: u32, tokens: u32, spacing_s: f64, gap_s: f64, block_size: usize) -> Workload {
    let mut drafts = Vec::new();
    for p in 0..u64::from(prefixes) {
        let t = (p as f64 * spacing_s * 1e6) as u64;
        for at in [t, t + (gap_s * 1e6) as u64] {
            drafts.push(Draft {
                arrival_us: at,
                segments: vec![Segment { id: 11 << 48 | p, tokens }],
                output_tokens: 10,
                adapter: None,
                session: Some(p),
                group: None,
                stage: 0,
            });
        }
    }
    let description = format!("{prefixes} distinct {tokens}-token prompts, each repeated once {gap_s} s later");
    finish("pairs", description, vec![Stage::measured(2.0 / spacing_s, 0.0)], drafts, block_size)
}

/// One line of a JSONL trace.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceLine {
    /// Arrival, ms from the trace start.
    arrival_ms: f64,
    /// Prompt segments in order; equal `id`s mean equal tokens.
    segments: Vec<TraceSegment>,
    /// Tokens to generate.
    output_tokens: u32,
    #[serde(default)]
    adapter: Option<String>,
    #[serde(default)]
    session: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceSegment {
    id: String,
    tokens: u32,
}

/// Reads a JSONL trace: one object per line,
/// `{"arrival_ms": 0, "segments": [{"id": "sys", "tokens": 6000}, {"id": "q1", "tokens": 1200}],
/// "output_tokens": 100, "adapter": null, "session": null}`. Blank lines are skipped; a malformed
/// line is an error naming the line.
pub fn trace(path: &Path, block_size: usize) -> Result<Workload, SimError> {
    let file = std::fs::File::open(path).map_err(|source| SimError::TraceOpen { path: path.into(), source })?;
    let mut drafts = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| SimError::TraceOpen { path: path.into(), source })?;
        if line.trim().is_empty() {
            continue;
        }
        let t: TraceLine = serde_json::from_str(&line).map_err(|e| SimError::TraceLine {
            path: path.into(),
            line: i + 1,
            message: e.to_string(),
        })?;
        if !(t.arrival_ms.is_finite() && t.arrival_ms >= 0.0) {
            return Err(SimError::TraceLine {
                path: path.into(),
                line: i + 1,
                message: format!("arrival_ms must be a finite number ≥ 0, got {}", t.arrival_ms),
            });
        }
        let segments = t
            .segments
            .iter()
            .map(|s| Segment { id: splitmix64(kvroute_common::hash::root_hash(&s.id, None).0), tokens: s.tokens })
            .collect();
        drafts.push(Draft {
            arrival_us: (t.arrival_ms * 1000.0) as u64,
            segments,
            output_tokens: t.output_tokens,
            adapter: t.adapter,
            session: t.session,
            group: None,
            stage: 0,
        });
    }
    let description = format!("{} requests from {}", drafts.len(), path.display());
    let name = path.file_stem().map_or_else(|| "trace".into(), |s| s.to_string_lossy().into_owned());
    Ok(finish(&name, description, vec![Stage::measured(0.0, 0.0)], drafts, block_size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_share_chain_blocks_and_diverge_after() {
        let mut cb = ChainBuilder::new(16);
        let a = cb.chain(None, &[Segment { id: 1, tokens: 160 }, Segment { id: 2, tokens: 40 }]);
        let b = cb.chain(None, &[Segment { id: 1, tokens: 160 }, Segment { id: 3, tokens: 40 }]);
        assert_eq!(a.len(), 12);
        assert_eq!(a[..10], b[..10]);
        assert_ne!(a[10], b[10]);
        let c = cb.chain(Some("x"), &[Segment { id: 1, tokens: 160 }]);
        assert_ne!(c[0], a[0], "an adapter gives a disjoint chain");
    }

    /// Every shared-prefix request names its group, and requests of one group share its
    /// prefix blocks while different groups share none (what the group placement table reads).
    #[test]
    fn shared_prefix_requests_carry_their_group() {
        let cfg =
            SharedPrefixConfig { groups: 3, prefix_tokens: 64, question_tokens: 32, ..SharedPrefixConfig::default() };
        let w = shared_prefix(&SharedPrefixConfig { stages: staged(&[20.0], 5.0), ..cfg }, 7, 16);
        let mut first: std::collections::BTreeMap<u64, BlockHash> = std::collections::BTreeMap::new();
        for r in &w.requests {
            let g = r.group.expect("every shared-prefix request has a group");
            assert!(g < 3);
            assert_eq!(*first.entry(g).or_insert(r.blocks[0]), r.blocks[0], "group {g} shares its prefix");
        }
        assert_eq!(first.len(), 3, "20 req/s for 5 s reaches all three groups");
        let heads: std::collections::BTreeSet<_> = first.values().collect();
        assert_eq!(heads.len(), 3, "groups share no prefix block");
    }

    /// Background traffic is W1's stream plus ≈ 2 req/s of 6 000-token prompts that share no
    /// block with anything, on 200 000 KV tokens per pod; `set_routers` finds its replica count.
    #[test]
    fn background_adds_unrelated_prompts_beside_w1() {
        let (w, base) = (background(3, 16), w1(3, 16));
        assert_eq!(w.fleet.kv_tokens, Some(BACKGROUND_KV_TOKENS));
        let extra: Vec<&SimRequest> = w.requests.iter().filter(|r| r.prompt_tokens == BACKGROUND_TOKENS).collect();
        let seconds: f64 = w.stages.iter().map(|s| s.duration_s).sum();
        let rate = extra.len() as f64 / seconds;
        assert!((1.7..2.3).contains(&rate), "{rate} req/s");
        assert_eq!(w.requests.len(), base.requests.len() + extra.len());
        let mut seen = std::collections::HashSet::new();
        for r in &extra {
            assert_eq!(r.blocks.len(), BACKGROUND_TOKENS as usize / 16);
            assert!(r.blocks.iter().all(|b| seen.insert(*b)), "a background prompt shares a block");
        }
        assert!(w.requests.windows(2).all(|p| p[0].arrival_us <= p[1].arrival_us));
        assert!(w.description.contains("3 router replicas"), "{}", w.description);
    }

    #[test]
    fn a_router_override_is_what_the_description_says() {
        let mut w = w1(1, 16);
        assert!(w.description.contains("3 router replicas"), "{}", w.description);
        w.set_routers(1);
        assert!(w.description.contains("one router") && !w.description.contains("3 router"), "{}", w.description);
        assert_eq!(w.fleet.routers, Some(1));
        let mut p = pressure(1, 16);
        p.set_routers(4);
        assert!(p.description.contains("4 router replicas") && !p.description.contains("one router"));
    }

    #[test]
    fn generators_are_seeded_and_sorted() {
        let cfg = SharedPrefixConfig { stages: staged(&[5.0, 10.0], 10.0), ..SharedPrefixConfig::default() };
        let w1 = shared_prefix(&cfg, 7, 16);
        let w2 = shared_prefix(&cfg, 7, 16);
        assert_eq!(w1.requests.len(), w2.requests.len());
        assert!(w1.requests.windows(2).all(|p| p[0].arrival_us <= p[1].arrival_us));
        assert!(w1.requests.iter().zip(&w2.requests).all(|(a, b)| a.blocks == b.blocks));
        let per_stage = |s| w1.requests.iter().filter(|r| r.stage == s).count() as f64;
        assert!(per_stage(1) > 1.4 * per_stage(0), "rate doubles between stages");
        assert_eq!(w1.requests[0].prompt_tokens, 7200);
        assert_eq!(w1.requests[0].blocks.len(), 450);
    }

    #[test]
    fn bad_trace_line_is_named() {
        let dir = std::env::temp_dir().join(format!("kvroute-sim-trace-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let p = dir.join("t.jsonl");
        let ok = r#"{"arrival_ms": 5, "segments": [{"id": "sys", "tokens": 64}], "output_tokens": 3}"#;
        assert!(std::fs::write(&p, format!("{ok}\n\n{ok}\n{{\"arrival_ms\": 1}}\n")).is_ok());
        match trace(&p, 16) {
            Err(SimError::TraceLine { line, .. }) => assert_eq!(line, 4),
            other => panic!("expected a line error, got {other:?}"),
        }
        assert!(std::fs::write(&p, format!("{ok}\n{ok}\n")).is_ok());
        let w = trace(&p, 16);
        assert!(matches!(&w, Ok(w) if w.requests.len() == 2 && w.requests[0].blocks == w.requests[1].blocks));
    }

    #[test]
    fn text_chains_see_only_the_first_256_chunks() {
        let mut cb = ChainBuilder::new(16);
        let sys = Segment { id: 3 << 48, tokens: 6000 };
        let a = cb.text_chain(None, &[sys.clone(), Segment { id: 9, tokens: 300 }]);
        let b = cb.text_chain(None, &[sys, Segment { id: 10, tokens: 300 }]);
        assert_eq!(a.len(), 256, "16 384 characters ≈ 4 096 tokens");
        assert_eq!(a, b, "a 6 000-token system prompt hides what follows it");
        let short = cb.text_chain(None, &[Segment { id: 1, tokens: 160 }, Segment { id: 2, tokens: 40 }]);
        let other = cb.text_chain(None, &[Segment { id: 1, tokens: 160 }, Segment { id: 3, tokens: 40 }]);
        assert_eq!(short.len(), 200 * CHARS_PER_TOKEN / 64);
        assert_eq!(short[..10], other[..10]);
        assert_ne!(short[10], other[10]);
    }

    #[test]
    fn chat_groups_is_the_end_to_end_benchmark_stream() {
        let w = chat_groups(12.0, 1, 16);
        assert_eq!(w.requests.len(), 24 * 5 * 3);
        assert_eq!(w.fleet, Fleet { kv_tokens: Some(16_000), routers: Some(1), pods: Some(4), max_num_seqs: Some(16) });
        let mut last: std::collections::HashMap<u64, (u32, u64)> = std::collections::HashMap::new();
        for r in &w.requests {
            let (c, g) = (r.session.unwrap_or(u64::MAX), r.group.unwrap_or(u64::MAX));
            assert_eq!(g, c % 24, "conversation {c} belongs to system prompt {}", c % 24);
            let turn = (r.prompt_tokens - 1540 - 110) / 220;
            assert_eq!(r.prompt_tokens, 1540 + 110 + 220 * turn);
            match last.insert(c, (turn, r.arrival_us)) {
                None => assert_eq!(turn, 0),
                Some((t, at)) => {
                    assert_eq!(turn, t + 1, "conversation {c}'s turns in order");
                    assert!(r.arrival_us >= at + 1_000_000, "a turn at least 1 s after the previous one");
                }
            }
        }
        // Same group, same system prompt blocks; another group shares none of them.
        let same: Vec<_> = w.requests.iter().filter(|r| r.group == Some(3)).collect();
        assert!(same.windows(2).all(|p| p[0].blocks[..96] == p[1].blocks[..96]));
        let other = w.requests.iter().find(|r| r.group == Some(4)).map(|r| r.blocks[0]);
        assert_ne!(other, Some(same[0].blocks[0]));
        // 360 Poisson arrivals at 12/s: the last near 30 s.
        let end = w.requests.last().map_or(0, |r| r.arrival_us) as f64 / 1e6;
        assert!((22.0..40.0).contains(&end), "{end}");
    }

    #[test]
    fn december_workloads_have_their_fleet_and_warm_up() {
        let w = w1(1, 16);
        assert_eq!(w.fleet, Fleet { kv_tokens: Some(307_328), routers: Some(3), ..Fleet::default() });
        assert_eq!(w.stages.iter().filter(|s| s.warmup).count(), 2);
        let measured = w.requests.iter().filter(|r| r.stage == 2).count() as f64;
        assert!((measured - 1200.0).abs() < 120.0, "10 req/s × 120 s: {measured}");
        let c = w2(1, 16);
        assert_eq!(c.stages.len(), 2);
        assert!(c.requests.iter().all(|r| (r.stage == 0) == (r.arrival_us < 30_000_000)));
        assert_eq!(c.requests.iter().find(|r| r.session == Some(0)).map(|r| r.prompt_tokens), Some(6300));
        assert_eq!(pressure(1, 16).fleet.kv_tokens, Some(100_000));
        assert!(llmd(&staged(&[2.0], 10.0), 1, 16).requests.iter().all(|r| r.output_tokens == 1000));
        assert!(cold_start(1, 16).stages.iter().all(|s| !s.warmup));
    }
}
