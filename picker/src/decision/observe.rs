//! What a routing decision reports (docs/design.md §9): the request's three INFO log lines
//! (received, scored, selected), the DEBUG candidate and timing lines, the TRACE block walk, the
//! routing metrics, and the count and log line of every request the picker answers itself.
//! The pipeline ([`super`]) computes and calls this; nothing here changes a decision.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use super::{PreparedRequest, Rejection};
use crate::metrics::{AdapterLabel, Metrics, ModelLabel, ObjectiveLabel, PriorityLabel};
use crate::score::{CandidateScore, Decision, RouteError};

/// Reports one decision, from its start (for the decision-latency metric).
#[derive(Debug)]
pub struct DecisionObserver<'a> {
    metrics: &'a Metrics,
    request_id: &'a str,
    started: Instant,
}

impl<'a> DecisionObserver<'a> {
    /// A decision of request `request_id` starting now.
    pub fn start(metrics: &'a Metrics, request_id: &'a str) -> Self {
        Self { metrics, request_id, started: Instant::now() }
    }

    /// The request is prepared: "request received".
    pub fn received(&self, p: &PreparedRequest) {
        tracing::info!(
            request_id = self.request_id,
            model = %p.model_name,
            target_model = %p.model.target_model,
            adapter = p.model.adapter.as_deref().unwrap_or(""),
            input_tokens = p.tokens.len(),
            mode = p.mode.as_str(),
            unmatched_reason = p.unmatched_reason,
            "request received"
        );
    }

    /// The router ran (routed or not) in `route_elapsed`.
    pub fn scored(&self, route_elapsed: Duration) {
        self.metrics.scoring_latency_us.observe(route_elapsed.as_secs_f64() * 1e6);
        self.metrics.scheduler_e2e_seconds.observe(route_elapsed.as_secs_f64());
    }

    /// No pod could take the request.
    pub fn no_pod(&self, p: &PreparedRequest, e: &RouteError) {
        let status = match e {
            RouteError::Shed { .. } => 429,
            _ => 503,
        };
        tracing::info!(request_id = self.request_id, model = %p.model_name, error = %e, status, "no pod selected");
    }

    /// The request was routed: log lines and routing metrics.
    pub fn routed(&self, p: &PreparedRequest, decision: &Decision, route_elapsed: Duration) {
        let request_id = self.request_id;
        let hashes = p.block_hashes();
        if tracing::enabled!(tracing::Level::TRACE) {
            // The block walk: each candidate's matched prefix against the prompt's block hashes.
            let walk: Vec<String> = hashes.iter().map(|h| format!("{:016x}", h.0)).collect();
            for c in &decision.candidates {
                tracing::trace!(request_id, pod = %c.pod, matched_blocks = c.matched_blocks,
                    total_blocks = hashes.len(), "block walk");
            }
            tracing::trace!(request_id, blocks = ?walk, "block hashes");
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            for c in &decision.candidates {
                tracing::debug!(
                    request_id,
                    pod = %c.pod,
                    score = c.score,
                    cache = c.cache,
                    load = c.load,
                    queue = c.queue,
                    health = c.health,
                    adapter = c.adapter,
                    matched_blocks = c.matched_blocks,
                    predicted_ttft_ms = c.predicted_ttft_ms,
                    "candidate"
                );
            }
            tracing::debug!(
                request_id,
                total_blocks = hashes.len(),
                route_us = route_elapsed.as_micros() as u64,
                decision_us = self.started.elapsed().as_micros() as u64,
                "timings"
            );
        }
        tracing::info!(
            request_id,
            candidates = decision.candidate_count,
            top = %top3(&decision.candidates),
            "request scored"
        );
        tracing::info!(
            request_id,
            pod = %decision.pod,
            endpoint = %decision.endpoint,
            score = decision.score,
            match_ratio = decision.match_ratio,
            matched_blocks = decision.matched_blocks,
            total_blocks = decision.total_blocks,
            priority = p.priority,
            "pod selected"
        );
        let m = self.metrics;
        m.routing_decisions.get_or_create(&ModelLabel { model: p.model_name.clone() }).inc();
        m.requests_by_priority.get_or_create(&PriorityLabel { priority: p.priority }).inc();
        m.objective_requests
            .get_or_create(&ObjectiveLabel {
                model_name: p.model_name.clone(),
                target_model_name: p.model.adapter.as_ref().unwrap_or(&p.model.target_model).clone(),
            })
            .inc();
        m.cache_match_ratio.observe(decision.match_ratio);
        m.composite_score.observe(decision.score);
        m.candidate_pods.set(i64::try_from(decision.candidate_count).unwrap_or(i64::MAX));
        if let Some(adapter) = &p.model.adapter
            && decision.candidates.iter().find(|c| *c.pod == *decision.pod).is_some_and(|c| c.adapter < 0.5)
        {
            m.adapter_loads_triggered.get_or_create(&AdapterLabel { adapter: adapter.clone() }).inc();
        }
        m.decision_latency_us.observe(self.started.elapsed().as_secs_f64() * 1e6);
    }
}

/// A request the picker answers itself (`rej`): counted by status and logged.
pub fn rejected(metrics: &Metrics, request_id: &str, rej: &Rejection) {
    metrics.count_error(rej.status, rej.model.as_ref().map(|(m, t)| (m.as_str(), t.as_str())));
    tracing::info!(request_id, status = rej.status, kind = rej.kind, message = %rej.message, "request rejected");
}

/// `pod(score: cache/load/queue/health/adapter, matched)` for the best three candidates.
fn top3(c: &[CandidateScore]) -> String {
    let mut s = String::new();
    for (i, c) in c.iter().take(3).enumerate() {
        if i > 0 {
            s.push_str("; ");
        }
        let _ = write!(
            s,
            "{}={:.4} (cache {:.3}, load {:.3}, queue {:.3}, health {:.3}, adapter {:.3}, matched {})",
            c.pod, c.score, c.cache, c.load, c.queue, c.health, c.adapter, c.matched_blocks
        );
    }
    s
}
