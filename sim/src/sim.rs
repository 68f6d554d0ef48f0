//! The discrete-event loop: arrivals → policy → pod queues → prefill → decode → finish, with
//! periodic reports that reach the policy after `report_delay_us` (docs/design.md §7: block changes coalesced
//! for `blockFlushMs`, stats on every scrape).
//!
//! Time is simulated (µs); events at the same instant run in the order they were scheduled, so a
//! run is a pure function of (workload, policy, config): deterministic.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use indicatif::ProgressBar;

use crate::SimError;
use crate::engine::{CostModel, PodEngine};
use crate::policy::{PodReport, Policy};
use crate::workload::Workload;

/// Fleet and reporting settings.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Pods in the fleet. Default 8 (docs/design.md §10).
    pub pods: usize,
    /// Engine timing and capacity.
    pub cost: CostModel,
    /// Block changes are flushed to the router every this many µs. Default 10 000 (docs/design.md §7).
    pub kv_flush_us: u64,
    /// Stats (waiting, running, utilisation) are read every this many µs. Default 200 000
    /// (docs/design.md §7's /metrics scrape).
    pub stats_interval_us: u64,
    /// Delay from an engine read to the router seeing it, µs. Default 20 000.
    pub report_delay_us: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            pods: 8,
            cost: CostModel::llama_8b(),
            kv_flush_us: 10_000,
            stats_interval_us: 200_000,
            report_delay_us: 20_000,
        }
    }
}

/// What happened to one request.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Pod it was routed to.
    pub pod: usize,
    /// Time to first token, µs (queue + adapter load + prefill + one decode step).
    pub ttft_us: u64,
    /// Prompt blocks found cached when its prefill started.
    pub hit_blocks: usize,
    /// Full blocks in its prompt.
    pub total_blocks: usize,
    /// Prompt tokens served from cache.
    pub cached_tokens: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Arrival, µs.
    pub arrival_us: u64,
    /// End of its response, µs.
    pub finish_us: u64,
    /// Load stage.
    pub stage: usize,
    /// Conversation id, if any.
    pub session: Option<u64>,
}

/// One policy's run of one workload.
#[derive(Clone, Debug)]
pub struct RunResult {
    /// Policy name.
    pub policy: String,
    /// Pods in the fleet.
    pub pods: usize,
    /// Per request, by request id.
    pub outcomes: Vec<Outcome>,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Deliver(usize),
    Arrival(usize),
    PrefillDone { pod: usize, req: usize },
    Finish { pod: usize, req: usize },
    Tick,
}

struct Loop<'a> {
    w: &'a Workload,
    cfg: &'a SimConfig,
    heap: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    seq: u64,
    pods: Vec<PodEngine>,
    outcomes: Vec<Outcome>,
    reports: Vec<Option<PodReport>>,
    next_stats_us: Vec<u64>,
}

impl Loop<'_> {
    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((t, self.seq, ev)));
    }

    fn try_start(&mut self, pod: usize, now: u64) {
        let Some(p) = self.pods.get_mut(pod) else { return };
        if !p.can_start() {
            return;
        }
        let Some(&req) = p.waiting.front() else { return };
        let r = &self.w.requests[req];
        if let Some(a) = p.start_next(&r.blocks, r.prompt_tokens, r.adapter.as_deref(), &self.cfg.cost) {
            let o = &mut self.outcomes[a.req];
            o.hit_blocks = a.hit_blocks;
            let per_block = if r.blocks.is_empty() { 0 } else { u64::from(r.prompt_tokens) / r.blocks.len() as u64 };
            o.cached_tokens = (a.hit_blocks as u64 * per_block).min(u64::from(r.prompt_tokens));
            self.at(now + a.prefill_us, Ev::PrefillDone { pod, req: a.req });
        }
    }

    fn tick(&mut self, now: u64) {
        for pod in 0..self.pods.len() {
            let stats_due = now >= self.next_stats_us[pod];
            let p = &mut self.pods[pod];
            if !stats_due && p.stored.is_empty() && p.removed.is_empty() {
                continue;
            }
            let stats = stats_due.then(|| p.stats());
            if stats_due {
                self.next_stats_us[pod] = now + self.cfg.stats_interval_us;
            }
            let report = PodReport {
                pod,
                engine_time_us: now,
                stored: std::mem::take(&mut p.stored),
                removed: std::mem::take(&mut p.removed),
                stats,
            };
            self.reports.push(Some(report));
            let idx = self.reports.len() - 1;
            self.at(now + self.cfg.report_delay_us, Ev::Deliver(idx));
        }
    }
}

/// Runs `workload` under `policy` to completion (every request finished).
pub fn run(
    workload: &Workload,
    policy: &mut dyn Policy,
    cfg: &SimConfig,
    progress: Option<&ProgressBar>,
) -> Result<RunResult, SimError> {
    let n = workload.requests.len();
    let mut l = Loop {
        w: workload,
        cfg,
        heap: BinaryHeap::new(),
        seq: 0,
        pods: (0..cfg.pods.max(1)).map(|_| PodEngine::new(&cfg.cost)).collect(),
        outcomes: vec![Outcome::default(); n],
        reports: Vec::new(),
        next_stats_us: vec![0; cfg.pods.max(1)],
    };
    for r in &workload.requests {
        l.outcomes[r.id] = Outcome {
            arrival_us: r.arrival_us,
            total_blocks: r.blocks.len(),
            prompt_tokens: u64::from(r.prompt_tokens),
            stage: r.stage,
            session: r.session,
            ..Outcome::default()
        };
        l.at(r.arrival_us, Ev::Arrival(r.id));
    }
    l.at(0, Ev::Tick);
    let mut unfinished = n;
    while let Some(Reverse((now, _, ev))) = l.heap.pop() {
        match ev {
            Ev::Arrival(id) => {
                let req = &workload.requests[id];
                let pod = policy.pick(req, now)?;
                if pod >= l.pods.len() {
                    return Err(SimError::BadPick { policy: policy.name().to_string(), pod });
                }
                l.outcomes[id].pod = pod;
                l.pods[pod].waiting.push_back(id);
                l.try_start(pod, now);
                if let Some(pb) = progress {
                    pb.inc(1);
                }
            }
            Ev::PrefillDone { pod, req } => {
                let r = &workload.requests[req];
                l.pods[pod].prefill_done(&r.blocks);
                let step = (cfg.cost.decode_s_per_token * 1e6) as u64;
                l.outcomes[req].ttft_us = now + step - r.arrival_us;
                l.at(now + step * u64::from(r.output_tokens.max(1)), Ev::Finish { pod, req });
                l.try_start(pod, now);
            }
            Ev::Finish { pod, req } => {
                l.pods[pod].finish();
                l.outcomes[req].finish_us = now;
                policy.on_finish(&workload.requests[req], pod);
                unfinished -= 1;
                l.try_start(pod, now);
            }
            Ev::Deliver(idx) => {
                if let Some(report) = l.reports.get_mut(idx).and_then(Option::take) {
                    policy.on_report(&report);
                }
            }
            Ev::Tick => {
                l.tick(now);
                if unfinished > 0 {
                    l.at(now + cfg.kv_flush_us.max(1), Ev::Tick);
                }
            }
        }
    }
    Ok(RunResult { policy: policy.name().to_string(), pods: l.pods.len(), outcomes: l.outcomes })
}
