//! One routing decision: body → model → token ids → block hashes → `Router::route`; in
//! approximate mode (docs/design.md §6) body → model → text blocks → the model's `ApproxStore` matches →
//! `Router::route_with`, then the chosen pod is recorded as holding the chain.
//!
//! Synchronous and CPU-bound (JSON parse of up to `body_limit_bytes`, tokenization): the stream task
//! runs it with `block_in_place` (`spawn_blocking` on a current-thread runtime). Block hashes go
//! into a per-thread scratch buffer reused across requests. Emits the request's three INFO log lines (received, scored, selected) and the routing
//! metrics.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::time::Instant;

use kvroute_common::BlockHash;

use crate::Gateway;
use crate::model::{ModelError, PromptInput, parse_body};
use crate::score::{CandidateScore, Decision, PrefixMatches, RouteError, RouteRequest};

thread_local! {
    static SCRATCH: RefCell<Vec<BlockHash>> = RefCell::new(Vec::with_capacity(1024));
    /// Code points of an approximate-mode prompt.
    static CODEPOINTS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// A request the picker answers itself. `status` is the HTTP status; `kind` the error `type`.
#[derive(Debug)]
pub struct Rejection {
    /// HTTP status code.
    pub status: u16,
    /// OpenAI-style error `type`.
    pub kind: &'static str,
    /// Human message: what was wrong and what to do.
    pub message: String,
}

impl Rejection {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, message: message.into() }
    }
}

impl From<ModelError> for Rejection {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::UnknownModel(_) => Rejection::new(404, "not_found_error", e.to_string()),
            _ => Rejection::new(400, "invalid_request_error", e.to_string()),
        }
    }
}

/// What one stream needs to know about the request to make a decision.
#[derive(Debug)]
pub struct DecisionInput<'a> {
    /// Request id (for logs).
    pub request_id: &'a str,
    /// `:path`.
    pub path: &'a str,
    /// Full request body; `None` for a request without one.
    pub body: Option<&'a [u8]>,
    /// Envoy subset hint: allowed `ip:port`s.
    pub subset: Option<&'a [String]>,
}

/// Routes one request. On success the returned decision holds the pod's in-flight slot.
pub fn decide(gw: &Gateway, input: &DecisionInput<'_>) -> Result<Decision, Rejection> {
    let started = Instant::now();
    // Steps of the decision, as child spans of the caller's `epp.decision` span (docs/design.md §9 traces).
    let parse_span = tracing::info_span!("epp.parse").entered();
    let (model_name, prompt) = match input.body {
        Some(body) => {
            let parsed = parse_body(input.path, body)?;
            (parsed.model, parsed.prompt)
        }
        None => match &gw.default_model {
            Some(m) => (m.clone(), PromptInput::None("request without body")),
            None => return Err(Rejection::new(503, "service_unavailable", "no model configured")),
        },
    };
    let model = gw.models.resolve(&model_name).ok_or_else(|| ModelError::UnknownModel(model_name.clone()))?;
    drop(parse_span);
    tracing::Span::current().record("model", model_name.as_str());
    let approximate = model.approx.is_some();
    let tokens = if approximate {
        Vec::new()
    } else {
        tracing::info_span!("epp.tokenize").in_scope(|| model.tokens(&prompt, input.request_id))
    };
    // Why the prompt cannot be prefix-matched (e.g. `cache_salt`, docs/design.md §2); "" when it can.
    let unmatched_reason = match &prompt {
        PromptInput::None(why) => *why,
        _ if model.tokenizer.is_none() && !approximate => "no tokenizer",
        _ => "",
    };
    tracing::info!(
        request_id = input.request_id,
        model = %model_name,
        target_model = %model.target_model,
        adapter = model.adapter.as_deref().unwrap_or(""),
        input_tokens = tokens.len(),
        mode = if approximate { "approximate" } else { "precise" },
        unmatched_reason,
        "request received"
    );
    SCRATCH.with(|scratch| {
        let mut hashes = scratch.borrow_mut();
        tracing::info_span!("epp.hash", blocks = tracing::field::Empty).in_scope(|| {
            let done = CODEPOINTS.with(|cp| match cp.try_borrow_mut() {
                Ok(mut cp) => model.approx_chain(&prompt, &mut cp, &mut hashes),
                Err(_) => model.approx_chain(&prompt, &mut Vec::new(), &mut hashes),
            });
            if !done {
                model.hasher.hash_prompt(&tokens, &mut hashes);
            }
            tracing::Span::current().record("blocks", hashes.len());
        });
        let approx_matches = model.approx.as_ref().map(|a| a.store.match_chain(&hashes));
        let req = RouteRequest {
            model: &model.target_model,
            adapter: model.adapter.as_deref(),
            block_hashes: &hashes,
            subset: input.subset,
        };
        let t_route = Instant::now();
        let result = tracing::info_span!("epp.score").in_scope(|| {
            gw.router.route_with(&req, approx_matches.as_ref().map(|m| m as &dyn PrefixMatches))
        });
        let route_elapsed = t_route.elapsed();
        gw.metrics.scoring_latency_us.observe(route_elapsed.as_secs_f64() * 1e6);
        let decision = match result {
            Ok(d) => {
                // Approximate mode: the chosen pod will hold this chain once it has served it.
                if let Some(a) = &model.approx {
                    a.store.record(&d.pod, &hashes);
                }
                d
            }
            Err(e) => {
                let (status, kind) = match &e {
                    RouteError::Shed { .. } => (429, "rate_limit_exceeded"),
                    _ => (503, "service_unavailable"),
                };
                tracing::info!(request_id = input.request_id, model = %model_name, error = %e, status, "no pod selected");
                return Err(Rejection::new(status, kind, e.to_string()));
            }
        };
        if tracing::enabled!(tracing::Level::TRACE) {
            // The block walk: each candidate's matched prefix against the prompt's block hashes.
            let walk: Vec<String> = hashes.iter().map(|h| format!("{:016x}", h.0)).collect();
            for c in &decision.candidates {
                tracing::trace!(request_id = input.request_id, pod = %c.pod, matched_blocks = c.matched_blocks,
                    total_blocks = hashes.len(), "block walk");
            }
            tracing::trace!(request_id = input.request_id, blocks = ?walk, "block hashes");
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            for c in &decision.candidates {
                tracing::debug!(
                    request_id = input.request_id,
                    pod = %c.pod,
                    score = c.score,
                    cache = c.cache,
                    load = c.load,
                    queue = c.queue,
                    health = c.health,
                    adapter = c.adapter,
                    matched_blocks = c.matched_blocks,
                    "candidate"
                );
            }
            tracing::debug!(
                request_id = input.request_id,
                total_blocks = hashes.len(),
                route_us = route_elapsed.as_micros() as u64,
                decision_us = started.elapsed().as_micros() as u64,
                "timings"
            );
        }
        tracing::info!(
            request_id = input.request_id,
            candidates = decision.candidate_count,
            top = %top3(&decision.candidates),
            "request scored"
        );
        tracing::info!(
            request_id = input.request_id,
            pod = %decision.pod,
            endpoint = %decision.endpoint,
            score = decision.score,
            match_ratio = decision.match_ratio,
            matched_blocks = decision.matched_blocks,
            total_blocks = decision.total_blocks,
            "pod selected"
        );
        let m = &gw.metrics;
        m.routing_decisions.get_or_create(&crate::admin::metrics::ModelLabel { model: model_name.clone() }).inc();
        m.cache_match_ratio.observe(decision.match_ratio);
        m.composite_score.observe(decision.score);
        m.candidate_pods.set(i64::try_from(decision.candidate_count).unwrap_or(i64::MAX));
        if let Some(adapter) = &model.adapter
            && decision.candidates.iter().find(|c| *c.pod == *decision.pod).is_some_and(|c| c.adapter < 0.5)
        {
            m.adapter_loads_triggered
                .get_or_create(&crate::admin::metrics::AdapterLabel { adapter: adapter.clone() })
                .inc();
        }
        m.decision_latency_us.observe(started.elapsed().as_secs_f64() * 1e6);
        Ok(decision)
    })
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
