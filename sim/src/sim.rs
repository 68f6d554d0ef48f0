//! The discrete-event loop: arrivals → a router replica's policy (or straight to a pod) → pod
//! queues → engine steps → finish, with periodic reports that reach every replica after
//! `report_delay_us` (docs/design.md §7: block changes coalesced for `blockFlushMs`, stats on every
//! scrape).
//!
//! - **Router replicas**: `routers` independent instances of the policy; requests go to them in
//!   turn (as Envoy spreads requests over picker replicas). Each keeps its own view where the
//!   policy has one (approximate memories, in-flight counts); every replica receives every pod
//!   report (agents stream to all pickers).
//! - **Direct traffic**: a `direct_share` of the requests goes to a uniformly random pod without
//!   any router seeing it (clients or jobs that bypass the gateway); routers learn of it only from
//!   KV events and stats. Those requests are left out of the figures.
//! - **Cache resets**: every `cache_reset_interval_us`, the next pod in turn empties its prefix
//!   cache (an engine restart or `reset_prefix_cache`); KV-event consumers are told
//!   (AllBlocksCleared), approximate routers are not.
//!
//! Time is simulated (µs); events at the same instant run in the order they were scheduled, so a
//! run is a pure function of (workload, policies, config): deterministic.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use indicatif::ProgressBar;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::SimError;
use crate::engine::{CostModel, PodEngine};
use crate::policy::{PodReport, Policy, ReplicaEvent};
use crate::workload::Workload;

/// What a pod reports as its GPU utilization.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GpuUtilization {
    /// Running requests ÷ `max_batch`: a utilization that separates busy pods, which real GPUs
    /// do not report.
    Running,
    /// The share of the time since the pod's previous stats read that it spent in engine steps,
    /// as NVML's `utilization.gpu` counts time with a kernel executing: a pod that steps without
    /// pause reads 1 whether it runs one request or 200. Default.
    #[default]
    Busy,
}

/// Fleet, routers and reporting settings.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Pods in the fleet. Default 8 (docs/design.md §10).
    pub pods: usize,
    /// Engine timing and capacity.
    pub cost: CostModel,
    /// Block changes are flushed to the routers every this many µs. Default 10 000 (docs/design.md §7).
    pub kv_flush_us: u64,
    /// Stats (waiting, running, utilisation) are read every this many µs. Default 200 000
    /// (docs/design.md §7's /metrics scrape).
    pub stats_interval_us: u64,
    /// Delay from an engine read to the routers seeing it, µs. Default 20 000.
    pub report_delay_us: u64,
    /// Delay of the replica stream (a router replica's event to its peers), µs. Default 1 000.
    pub peer_delay_us: u64,
    /// Share of requests sent straight to a random pod, in [0,1]. Default 0.
    pub direct_share: f64,
    /// Every this many µs one pod (in turn) empties its prefix cache; 0 = never. Default 0.
    pub cache_reset_interval_us: u64,
    /// Seed of the direct-traffic choices.
    pub seed: u64,
    /// How the pods' reported GPU utilization is modelled. Default [`GpuUtilization::Busy`].
    pub gpu_utilization: GpuUtilization,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            pods: 8,
            cost: CostModel::llama_8b(),
            kv_flush_us: 10_000,
            stats_interval_us: 200_000,
            report_delay_us: 20_000,
            peer_delay_us: 1_000,
            direct_share: 0.0,
            cache_reset_interval_us: 0,
            seed: 1,
            gpu_utilization: GpuUtilization::Busy,
        }
    }
}

/// What happened to one request.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Pod it was routed to.
    pub pod: usize,
    /// Router replica that routed it (`None`: sent straight to the pod).
    pub router: Option<usize>,
    /// Time to first token, µs (queue + prefill of the uncached tokens, in steps shared with
    /// other requests).
    pub ttft_us: u64,
    /// Prompt blocks found cached when it was first admitted.
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
    /// Its stage is a warm-up (left out of the figures).
    pub warmup: bool,
    /// Conversation id, if any.
    pub session: Option<u64>,
    /// Prefix group (system prompt), if the workload has groups.
    pub group: Option<u64>,
}

impl Outcome {
    /// Counted in the figures: routed (not direct) and not warm-up.
    pub fn measured(&self) -> bool {
        self.router.is_some() && !self.warmup
    }
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
    /// Preemptions over all pods.
    pub preemptions: u64,
    /// Every pod's state at each of its stats reads, in time order.
    pub pod_samples: Vec<PodSample>,
}

/// One pod's state at a stats read: what its /metrics page would show, plus the preemptions so
/// far (vLLM's `num_preemptions_total`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PodSample {
    /// Simulated time of the read, µs.
    pub time_us: u64,
    /// Pod index.
    pub pod: usize,
    /// Requests waiting.
    pub waiting: u32,
    /// Requests running.
    pub running: u32,
    /// KV cache usage in [0,1].
    pub kv_usage: f64,
    /// Preemptions on this pod since the start.
    pub preemptions: u64,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Deliver(usize),
    Peer(usize),
    Arrival(usize),
    StepDone(usize),
    Reset(usize),
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
    /// Replica events in flight to the other replicas: (sender, event).
    peer_events: Vec<Option<(usize, ReplicaEvent)>>,
    next_stats_us: Vec<u64>,
    samples: Vec<PodSample>,
    /// Per pod, for [`GpuUtilization::Busy`]: the steps (start, end µs) not ended by the last
    /// stats read, and that read's time.
    steps: Vec<(Vec<(u64, u64)>, u64)>,
}

/// Share of `[from, now]` covered by `steps` ((start, end) µs, not overlapping), in [0, 1]; 0
/// for an empty window.
fn busy_share(steps: &[(u64, u64)], from: u64, now: u64) -> f64 {
    if now <= from {
        return 0.0;
    }
    let on: u64 = steps.iter().map(|&(a, b)| b.min(now).saturating_sub(a.max(from))).sum();
    (on as f64 / (now - from) as f64).min(1.0)
}

impl Loop<'_> {
    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((t, self.seq, ev)));
    }

    /// Starts the pod's next step if it is idle and has work.
    fn kick(&mut self, pod: usize, now: u64) -> Result<(), SimError> {
        let p = &mut self.pods[pod];
        if p.stepping {
            return Ok(());
        }
        match p.schedule(&self.w.requests) {
            Ok(Some(us)) => {
                if self.cfg.gpu_utilization == GpuUtilization::Busy {
                    self.steps[pod].0.push((now, now + us));
                }
                self.at(now + us, Ev::StepDone(pod));
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(message) => Err(SimError::Engine { pod, message }),
        }
    }

    /// Sends replica `from`'s new events to the other replicas after the stream's delay.
    fn forward_peer_events(&mut self, routers: &mut [Box<dyn Policy>], from: usize, now: u64) {
        if routers.len() < 2 {
            return;
        }
        for ev in routers[from].take_peer_events() {
            self.peer_events.push(Some((from, ev)));
            let idx = self.peer_events.len() - 1;
            self.at(now + self.cfg.peer_delay_us, Ev::Peer(idx));
        }
    }

    fn tick(&mut self, now: u64) {
        for pod in 0..self.pods.len() {
            let stats_due = now >= self.next_stats_us[pod];
            let p = &mut self.pods[pod];
            if !stats_due && p.stored.is_empty() && p.removed.is_empty() && !p.cleared {
                continue;
            }
            let steps = &mut self.steps[pod];
            let stats = stats_due.then(|| {
                let mut st = p.stats();
                self.samples.push(PodSample {
                    time_us: now,
                    pod,
                    waiting: st.waiting,
                    running: st.running,
                    kv_usage: st.kv_usage,
                    preemptions: p.preemptions,
                });
                if self.cfg.gpu_utilization == GpuUtilization::Busy {
                    st.gpu_utilization = busy_share(&steps.0, steps.1, now);
                    steps.0.retain(|&(_, end)| end > now);
                    steps.1 = now;
                }
                st
            });
            if stats_due {
                self.next_stats_us[pod] = now + self.cfg.stats_interval_us;
            }
            let report = PodReport {
                pod,
                engine_time_us: now,
                stored: std::mem::take(&mut p.stored),
                removed: std::mem::take(&mut p.removed),
                cleared: std::mem::take(&mut p.cleared),
                stats,
            };
            self.reports.push(Some(report));
            let idx = self.reports.len() - 1;
            self.at(now + self.cfg.report_delay_us, Ev::Deliver(idx));
        }
    }
}

/// Runs `workload` to completion (every request finished) with one router replica per element of
/// `routers` (all the same policy).
pub fn run(
    workload: &Workload,
    routers: &mut [Box<dyn Policy>],
    cfg: &SimConfig,
    progress: Option<&ProgressBar>,
) -> Result<RunResult, SimError> {
    let name = routers.first().map(|p| p.name().to_string()).ok_or(SimError::NoRouter)?;
    let n = workload.requests.len();
    let pods = cfg.pods.max(1);
    let mut l = Loop {
        w: workload,
        cfg,
        heap: BinaryHeap::new(),
        seq: 0,
        pods: (0..pods).map(|_| PodEngine::new(&cfg.cost)).collect(),
        outcomes: vec![Outcome::default(); n],
        reports: Vec::new(),
        peer_events: Vec::new(),
        next_stats_us: vec![0; pods],
        samples: Vec::new(),
        steps: vec![(Vec::new(), 0); pods],
    };
    let mut rng = StdRng::seed_from_u64(cfg.seed ^ 0xD1EC7);
    let mut direct = vec![false; n];
    for r in &workload.requests {
        direct[r.id] = cfg.direct_share > 0.0 && rng.random::<f64>() < cfg.direct_share;
        l.outcomes[r.id] = Outcome {
            arrival_us: r.arrival_us,
            total_blocks: r.blocks.len(),
            prompt_tokens: u64::from(r.prompt_tokens),
            stage: r.stage,
            warmup: workload.stages.get(r.stage).is_some_and(|s| s.warmup),
            session: r.session,
            group: r.group,
            ..Outcome::default()
        };
        l.at(r.arrival_us, Ev::Arrival(r.id));
    }
    l.at(0, Ev::Tick);
    if cfg.cache_reset_interval_us > 0 {
        l.at(cfg.cache_reset_interval_us, Ev::Reset(0));
    }
    let mut unfinished = n;
    let mut next_router = 0usize;
    while let Some(Reverse((now, _, ev))) = l.heap.pop() {
        match ev {
            Ev::Arrival(id) => {
                let req = &workload.requests[id];
                let (pod, router) = if direct[id] {
                    (rng.random_range(0..pods), None)
                } else {
                    let r = next_router % routers.len();
                    next_router += 1;
                    let pod = routers[r].pick(req, now)?;
                    if pod >= pods {
                        return Err(SimError::BadPick { policy: name.clone(), pod });
                    }
                    l.forward_peer_events(routers, r, now);
                    (pod, Some(r))
                };
                l.outcomes[id].pod = pod;
                l.outcomes[id].router = router;
                l.pods[pod].enqueue(id);
                l.kick(pod, now)?;
                if let Some(pb) = progress {
                    pb.inc(1);
                }
            }
            Ev::StepDone(pod) => {
                let result = l.pods[pod].complete(&workload.requests);
                for (req, hit) in result.admitted {
                    let r = &workload.requests[req];
                    let o = &mut l.outcomes[req];
                    o.hit_blocks = hit;
                    let per_block =
                        if r.blocks.is_empty() { 0 } else { u64::from(r.prompt_tokens) / r.blocks.len() as u64 };
                    o.cached_tokens = (hit as u64 * per_block).min(u64::from(r.prompt_tokens));
                }
                for req in result.first_token {
                    let ttft = now - workload.requests[req].arrival_us;
                    l.outcomes[req].ttft_us = ttft;
                    if let Some(r) = l.outcomes[req].router {
                        routers[r].on_first_token(&workload.requests[req], pod, now, ttft);
                    }
                }
                for req in result.finished {
                    l.outcomes[req].finish_us = now;
                    if let Some(r) = l.outcomes[req].router {
                        routers[r].on_finish(&workload.requests[req], pod, now);
                        l.forward_peer_events(routers, r, now);
                    }
                    unfinished -= 1;
                }
                l.kick(pod, now)?;
            }
            Ev::Deliver(idx) => {
                if let Some(report) = l.reports.get_mut(idx).and_then(Option::take) {
                    for r in routers.iter_mut() {
                        r.on_report(&report);
                    }
                }
            }
            Ev::Peer(idx) => {
                if let Some((from, ev)) = l.peer_events.get_mut(idx).and_then(Option::take) {
                    for (r, router) in routers.iter_mut().enumerate() {
                        if r != from {
                            router.on_peer_event(from, &ev, now);
                        }
                    }
                }
            }
            Ev::Reset(pod) => {
                l.pods[pod].reset_cache(&workload.requests);
                if unfinished > 0 {
                    l.at(now + cfg.cache_reset_interval_us, Ev::Reset((pod + 1) % pods));
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
    let preemptions = l.pods.iter().map(|p| p.preemptions).sum();
    Ok(RunResult { policy: name, pods, outcomes: l.outcomes, preemptions, pod_samples: l.samples })
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use super::*;
    use crate::policy;
    use crate::workload::{self, SharedPrefixConfig};

    fn small() -> Workload {
        let cfg = SharedPrefixConfig {
            groups: 10,
            prefix_tokens: 512,
            question_tokens: 64,
            stages: vec![workload::Stage::warmup(4.0, 5.0), workload::Stage::measured(4.0, 10.0)],
            ..SharedPrefixConfig::default()
        };
        workload::shared_prefix(&cfg, 3, 16)
    }

    fn replicas(name: &str, n: usize, pods: usize) -> Vec<Box<dyn Policy>> {
        (0..n)
            .map(|i| {
                match policy::build(
                    name,
                    pods,
                    &policy::PolicyOptions { seed: i as u64, ..policy::PolicyOptions::default() },
                ) {
                    Ok(p) => p,
                    Err(e) => panic!("{e}"),
                }
            })
            .collect()
    }

    /// NVML-like utilization counts a step in every read window it overlaps, not only in the one
    /// it started in: a 463 ms prefill step reads busy through two 200 ms windows.
    #[test]
    fn busy_share_splits_long_steps_over_windows() {
        let steps = [(0, 463_000), (463_000, 476_000)];
        assert_eq!(busy_share(&steps, 0, 200_000), 1.0);
        assert_eq!(busy_share(&steps, 200_000, 400_000), 1.0);
        assert!((busy_share(&steps, 400_000, 600_000) - 0.38).abs() < 1e-9);
        assert_eq!(busy_share(&steps, 600_000, 800_000), 0.0);
        assert_eq!(busy_share(&steps, 5, 5), 0.0);
    }

    /// With busy-time utilization a pod stepping without pause reads 1 with a handful of requests
    /// running, where the mock-NVML rule reads running ÷ 256.
    #[test]
    fn busy_utilization_reads_one_for_a_pod_that_never_pauses() {
        let w = small();
        let util = |gpu_utilization: GpuUtilization| {
            let cfg = SimConfig { pods: 1, gpu_utilization, ..SimConfig::default() };
            let recorded = Rc::default();
            let mut routers: Vec<Box<dyn Policy>> = vec![Box::new(Recorder(Rc::clone(&recorded)))];
            if let Err(e) = run(&w, &mut routers, &cfg, None) {
                panic!("{e}");
            }
            recorded.take()
        };
        let mock = util(GpuUtilization::Running);
        let busy = util(GpuUtilization::Busy);
        // Reads taken while requests were running.
        let running: Vec<(f64, u32)> = mock.iter().filter(|(_, n)| *n > 0).copied().collect();
        assert!(!running.is_empty());
        assert!(running.iter().all(|(u, n)| (u - f64::from(*n) / 256.0).abs() < 1e-12), "{running:?}");
        let busy_running: Vec<f64> = busy.iter().filter(|(_, n)| *n > 2).map(|(u, _)| *u).collect();
        assert!(!busy_running.is_empty());
        assert!(busy_running.iter().all(|u| *u > 0.99), "{busy_running:?}");
    }

    /// Sends everything to pod 0 and records each stats report's (utilization, running).
    struct Recorder(Rc<RefCell<Vec<(f64, u32)>>>);

    impl Policy for Recorder {
        fn name(&self) -> &str {
            "recorder"
        }
        fn pick(&mut self, _req: &workload::SimRequest, _now_us: u64) -> Result<usize, SimError> {
            Ok(0)
        }
        fn on_report(&mut self, report: &PodReport) {
            if let Some(s) = &report.stats {
                self.0.borrow_mut().push((s.gpu_utilization, s.running));
            }
        }
        fn on_finish(&mut self, _req: &workload::SimRequest, _pod: usize, _now_us: u64) {}
    }

    #[test]
    fn replicas_share_the_traffic_and_warm_up_is_marked() {
        let w = small();
        let cfg = SimConfig { pods: 4, ..SimConfig::default() };
        let mut routers = replicas("round-robin", 3, 4);
        let run = match run(&w, &mut routers, &cfg, None) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        };
        let per_router: Vec<usize> =
            (0..3).map(|r| run.outcomes.iter().filter(|o| o.router == Some(r)).count()).collect();
        assert!(per_router.iter().all(|c| c.abs_diff(run.outcomes.len() / 3) <= 1), "{per_router:?}");
        assert!(run.outcomes.iter().any(|o| o.warmup) && run.outcomes.iter().any(|o| o.measured()));
        assert!(run.outcomes.iter().all(|o| o.finish_us >= o.arrival_us + o.ttft_us));
    }

    #[test]
    fn direct_traffic_bypasses_the_routers() {
        let w = small();
        let cfg = SimConfig { pods: 4, direct_share: 0.5, ..SimConfig::default() };
        let mut routers = replicas("least-connections", 1, 4);
        let run = match run(&w, &mut routers, &cfg, None) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        };
        let direct = run.outcomes.iter().filter(|o| o.router.is_none()).count() as f64;
        let share = direct / run.outcomes.len() as f64;
        assert!((0.35..0.65).contains(&share), "{share}");
        assert!(run.outcomes.iter().filter(|o| o.router.is_none()).all(|o| !o.measured()));
    }

    /// The pod timeline follows each pod's stats reads: every pod is read on the stats interval,
    /// its preemption count never falls, and a pod too small for its traffic shows the
    /// preemptions the run counted, with its KV usage near full when they start.
    #[test]
    fn pod_samples_trace_kv_pressure_to_the_preempting_pod() {
        let w = small();
        let mut cost = CostModel::llama_8b();
        cost.kv_capacity_blocks = 120;
        let cfg = SimConfig { pods: 2, cost, ..SimConfig::default() };
        let mut routers: Vec<Box<dyn Policy>> = vec![Box::new(Recorder(Rc::default()))];
        let run = match run(&w, &mut routers, &cfg, None) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        };
        assert!(run.preemptions > 0, "40 prompt blocks each, 120 blocks: the pod must preempt");
        let pod = |p: usize| run.pod_samples.iter().filter(move |s| s.pod == p).copied().collect::<Vec<_>>();
        let (busy, idle) = (pod(0), pod(1));
        let span = w.requests.iter().map(|r| r.arrival_us).max().unwrap_or(0);
        for samples in [&busy, &idle] {
            assert!(samples.len() as u64 >= span / cfg.stats_interval_us, "{} reads", samples.len());
            assert!(samples.windows(2).all(|p| p[0].time_us < p[1].time_us && p[0].preemptions <= p[1].preemptions));
            assert!(samples.iter().all(|s| (0.0..=1.0).contains(&s.kv_usage)));
        }
        assert!(idle.iter().all(|s| s.running == 0 && s.preemptions == 0));
        let last = busy.last().map_or(0, |s| s.preemptions);
        assert!(last > 0 && last <= run.preemptions, "{last} of {}", run.preemptions);
        let first = busy.iter().find(|s| s.preemptions > 0).map_or(0.0, |s| s.kv_usage);
        assert!(first > 0.8, "KV usage {first} when the first preemption shows");
    }

    /// A reset empties a pod's cache: kvroute (told through KV events) forgets it; the requests
    /// after it on that pod prefill again.
    #[test]
    fn cache_resets_cost_hits() {
        let w = small();
        let hit = |interval_us: u64| {
            let cfg = SimConfig { pods: 4, cache_reset_interval_us: interval_us, ..SimConfig::default() };
            let mut routers = replicas("kvroute", 1, 4);
            let run = match run(&w, &mut routers, &cfg, None) {
                Ok(r) => r,
                Err(e) => panic!("{e}"),
            };
            run.outcomes.iter().map(|o| o.cached_tokens).sum::<u64>()
        };
        let (none, frequent) = (hit(0), hit(500_000));
        assert!(frequent < none * 9 / 10, "resets every 0.5 s: {frequent} vs {none} cached tokens");
    }
}
