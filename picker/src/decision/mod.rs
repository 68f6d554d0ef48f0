//! One routing decision, the same for the request path (ext_proc) and `/explain` (admin).
//!
//! [`prepare`] turns a request into what the router needs: parse the body, resolve the model,
//! tokenize (precise mode), hash the block chain (token blocks; text blocks in approximate mode,
//! docs/design.md §6) and, in approximate mode, look the chain up in the model's `ApproxStore`.
//! [`decide`] routes the prepared request (and, in approximate mode, records the chosen pod as
//! holding the chain); [`explain`] scores it without routing. Both read the same chain and the
//! same matches, so `/explain` names the pod routing would choose.
//!
//! Synchronous and CPU-bound (JSON parse of up to `body_limit_bytes`, tokenization): callers run
//! it off the async workers (`block_in_place` / `spawn_blocking`). Block hashes go into a
//! per-thread buffer reused across requests. The pipeline computes; its logs and metrics are
//! [`observe`]'s.

pub mod observe;

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use kvroute_common::{BlockHash, BlockKeys, MmItem};

use crate::approx::{ApproxMatches, RoutingMode};
use crate::gateway::{Gateway, Resolution};
use crate::metrics::RequestRecord;
use crate::model::{ImagePlacement, ResolvedModel};
use crate::request::{
    ModelError, ParsedBody, PromptInput, chat_images, check_chat, needs_body, parse_body, take_image_urls,
};
use crate::score::{Decision, Explanation, PrefixMatches, RouteError, RouteRequest};
use observe::DecisionObserver;

thread_local! {
    /// Block hashes of this thread's current decision (see [`HashBuf`]).
    static HASHES: RefCell<Vec<BlockHash>> = RefCell::new(Vec::with_capacity(1024));
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
    /// The request's (client model, target model), when it got as far as resolving its model
    /// (for `inference_objective_request_error_total`).
    pub model: Option<(String, String)>,
}

/// Longest rejection message, in bytes: messages may quote the client's input (a model name, a
/// value the JSON parser refused), which is echoed into the error body and the log only this far
/// (a multi-megabyte model name must not be echoed whole into the 404 and the logs;
/// docs/decisions/0024-bounded-outside-input.md).
pub const MAX_MESSAGE_BYTES: usize = 512;

impl Rejection {
    /// A rejection with `status`, error `type` `kind` and a message for the client.
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, message: bounded_message(message.into()), model: None }
    }

    /// The same rejection, naming the request's client model and target model.
    #[must_use]
    pub fn for_model(mut self, model: &str, target: &str) -> Self {
        self.model = Some((model.to_owned(), target.to_owned()));
        self
    }
}

/// `message` cut to [`MAX_MESSAGE_BYTES`] at a character boundary (with the total length named),
/// control characters replaced by U+FFFD so a quoted input cannot forge log lines.
pub fn bounded_message(message: String) -> String {
    let clean = |s: &str| s.chars().map(|c| if c.is_control() { '\u{FFFD}' } else { c }).collect::<String>();
    if message.len() <= MAX_MESSAGE_BYTES {
        return if message.chars().any(char::is_control) { clean(&message) } else { message };
    }
    let mut end = MAX_MESSAGE_BYTES;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", clean(&message[..end]), message.len())
}

impl From<ModelError> for Rejection {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::UnknownModel(_) => Rejection::new(404, "not_found_error", e.to_string()),
            ModelError::TooLarge { .. } => Rejection::new(413, "request_too_large", e.to_string()),
            _ => Rejection::new(400, "invalid_request_error", e.to_string()),
        }
    }
}

impl From<RouteError> for Rejection {
    fn from(e: RouteError) -> Self {
        match e {
            RouteError::Shed { .. } => Rejection::new(429, "rate_limit_exceeded", e.to_string()),
            _ => Rejection::new(503, "service_unavailable", e.to_string()),
        }
    }
}

/// Longest client-sent name quoted in an error, in characters.
const MAX_ECHOED_NAME_CHARS: usize = 128;

/// A client-sent name as errors quote it: at most [`MAX_ECHOED_NAME_CHARS`] characters, control
/// characters replaced (the 404 for an unknown model quotes the name).
fn echo_name(name: &str) -> String {
    let mut out: String =
        name.chars().take(MAX_ECHOED_NAME_CHARS).map(|c| if c.is_control() { '\u{FFFD}' } else { c }).collect();
    if name.chars().nth(MAX_ECHOED_NAME_CHARS).is_some() {
        out.push('…');
    }
    out
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
    /// The InferenceObjective the request names (header `x-llm-d-inference-objective`), if any.
    pub objective: Option<&'a str>,
    /// GIE's TTFT objective (header [`SLO_TTFT_HEADER`]), ms, if any (docs/design.md §4 "Load
    /// and predicted TTFT").
    pub slo_ttft_ms: Option<f64>,
}

impl<'a> DecisionInput<'a> {
    /// A request with only an id, a `:path` and a body: no subset hint, objective or TTFT
    /// objective.
    pub fn new(request_id: &'a str, path: &'a str, body: Option<&'a [u8]>) -> Self {
        Self { request_id, path, body, subset: None, objective: None, slo_ttft_ms: None }
    }
}

/// GIE's time-to-first-token objective header, ms.
pub const SLO_TTFT_HEADER: &str = "x-slo-ttft-ms";

/// The TTFT objective of a request's [`SLO_TTFT_HEADER`] value: a positive finite number of
/// ms up to one hour; `None` (no objective) for anything else.
pub fn slo_ttft_ms(value: Option<&str>) -> Option<f64> {
    let v: f64 = value?.trim().parse().ok()?;
    (v.is_finite() && v > 0.0 && v <= 3_600_000.0).then_some(v)
}

/// A request ready for the router: its model, tokens and block chain, and (approximate mode) where
/// earlier routing sent that chain.
#[derive(Debug)]
pub struct PreparedRequest {
    /// The client-facing model name the request named (or the default model's).
    pub model_name: String,
    /// What that name resolved to (through the InferenceModelRewrite table with the Kubernetes
    /// pool source, docs/design.md §14).
    pub model: Arc<ResolvedModel>,
    /// The model id the engine must see, when a rewrite rule changed it: the request body's
    /// `model` is rewritten to it.
    pub model_rewrite: Option<String>,
    /// How the chain is matched.
    pub mode: RoutingMode,
    /// Token ids (precise mode), images expanded where the picker places them (docs/design.md
    /// §2); empty in approximate mode or when the prompt has none.
    pub tokens: Vec<u32>,
    /// Why the prompt cannot be prefix-matched (e.g. `cache_salt`, docs/design.md §2); "" when it can.
    pub unmatched_reason: &'static str,
    /// The priority of the request's InferenceObjective (0 without one; docs/design.md §14).
    /// Carried for logs, metrics and `/explain`; admission by priority is later work.
    pub priority: i32,
    hashes: HashBuf,
    approx_matches: Option<ApproxMatches>,
}

impl PreparedRequest {
    /// The chain of the prompt's full blocks.
    pub fn block_hashes(&self) -> &[BlockHash] {
        &self.hashes.0
    }

    /// The routing question, restricted to `subset` when Envoy gave one.
    pub fn route_request<'a>(&'a self, subset: Option<&'a [String]>) -> RouteRequest<'a> {
        RouteRequest {
            model: &self.model.target_model,
            adapter: self.model.adapter.as_deref(),
            block_hashes: &self.hashes.0,
            subset,
        }
    }

    /// The second source of matched blocks (approximate mode), for `Router::route_with` and
    /// `Router::explain_with`.
    pub fn matches(&self) -> Option<&dyn PrefixMatches> {
        self.approx_matches.as_ref().map(|m| m as &dyn PrefixMatches)
    }
}

/// The block-hash buffer of one decision: this thread's, taken for the decision and given back
/// when dropped, so a decision does not allocate its chain.
#[derive(Debug)]
struct HashBuf(Vec<BlockHash>);

impl HashBuf {
    fn take() -> Self {
        HashBuf(HASHES.with(|h| h.try_borrow_mut().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default()))
    }
}

impl Drop for HashBuf {
    fn drop(&mut self) {
        let mut v = std::mem::take(&mut self.0);
        v.clear();
        // `try_with`: the thread may be exiting; `try_borrow_mut`: never panic in a drop.
        let _ = HASHES.try_with(|h| {
            if let Ok(mut slot) = h.try_borrow_mut()
                && slot.capacity() < v.capacity()
            {
                *slot = v;
            }
        });
    }
}

/// Parse → model → tokens → chain → matches: everything a decision computes before scoring.
/// Errors: an invalid or empty body (400; an inference path without a body is empty), an
/// unknown model (404), no model for a body-less request (503).
pub fn prepare(gw: &Gateway, input: &DecisionInput<'_>) -> Result<PreparedRequest, Rejection> {
    static NEVER: AtomicBool = AtomicBool::new(false);
    prepare_cancellable(gw, input, &NEVER)
}

/// [`prepare`] whose tokenization stops once `cancel` is set: a 499 rejection (client closed
/// request, nginx's code), counted in `epp_tokenizations_cancelled_total`. Its steps, each a
/// function: read the body, resolve the model, tokenize, place images, hash the chain.
fn prepare_cancellable(
    gw: &Gateway,
    input: &DecisionInput<'_>,
    cancel: &AtomicBool,
) -> Result<PreparedRequest, Rejection> {
    // Steps of the decision, as child spans of the caller's `epp.decision` span (docs/design.md §9 traces).
    let parse_span = tracing::info_span!("epp.parse").entered();
    let ParsedBody { model: model_name, mut prompt, cache_salt, image_uuids } = read_body(gw, input)?;
    let Resolution { model, rewrite: model_rewrite } =
        gw.resolve(&model_name).map_err(|_| ModelError::UnknownModel(echo_name(&model_name)))?;
    if let PromptInput::Chat(chat) = &prompt {
        check_chat(chat, &gw.request_bounds.chat)?;
    }
    drop(parse_span);
    tracing::Span::current().record("model", model_name.as_str());
    let mode = if model.approx.is_some() { RoutingMode::Approximate } else { RoutingMode::Precise };
    let mut tokens = match mode {
        RoutingMode::Approximate => Vec::new(),
        RoutingMode::Precise => tokenize(gw, &model, &prompt, input.request_id, cancel)?,
    };
    let (placement, image_reason) = place_images(&model, &prompt, mode, image_uuids, &mut tokens);
    let ImagePlacement { items, claimable, deferred } = placement;
    let unmatched_reason = match &prompt {
        PromptInput::None(why) => *why,
        // Text chains carry no salt: a salted prompt must not match another tenant's text.
        _ if cache_salt.is_some() && mode == RoutingMode::Approximate => "cache_salt in approximate mode",
        _ if model.tokenizer.is_none() && mode == RoutingMode::Precise => "no tokenizer",
        _ if !image_reason.is_empty() => image_reason,
        _ => "",
    };
    let hashes = hash_chain(&model, mode, &prompt, &tokens[..claimable], cache_salt, items);
    read_images_later(gw, &model, &mut prompt, &deferred);
    let approx_matches = model.approx.as_ref().map(|a| a.store.match_chain(&hashes.0));
    let priority = gw.priority(input.objective);
    Ok(PreparedRequest {
        model_name,
        model,
        model_rewrite,
        mode,
        tokens,
        unmatched_reason,
        priority,
        hashes,
        approx_matches,
    })
}

/// The body's model and prompt; a request without a body is empty (400) on an inference path,
/// else for the default model (503 without one), unmatched.
fn read_body(gw: &Gateway, input: &DecisionInput<'_>) -> Result<ParsedBody, Rejection> {
    match input.body {
        Some(body) => Ok(parse_body(input.path, body)?),
        None if needs_body(input.path) => {
            Err(ModelError::EmptyBody(input.path.split('?').next().unwrap_or_default().to_owned()).into())
        }
        None => match &gw.default_model {
            Some(m) => Ok(ParsedBody {
                model: m.clone(),
                prompt: PromptInput::None("request without body"),
                cache_salt: None,
                image_uuids: false,
            }),
            None => Err(Rejection::new(503, "service_unavailable", "no model configured")),
        },
    }
}

/// The prompt's token ids (precise mode), or 499 once `cancel` is set.
fn tokenize(
    gw: &Gateway,
    model: &ResolvedModel,
    prompt: &PromptInput,
    request_id: &str,
    cancel: &AtomicBool,
) -> Result<Vec<u32>, Rejection> {
    let max_rendered = gw.request_bounds.max_rendered_prompt_bytes;
    let tokens = tracing::info_span!("epp.tokenize")
        .in_scope(|| model.tokens_cancellable(prompt, request_id, cancel, max_rendered));
    tokens.map_err(|stopped| match stopped {
        crate::model::Stopped::Cancelled => {
            gw.metrics.tokenizations_cancelled.inc();
            tracing::info!(request_id, "tokenization cancelled: the ext_proc stream ended or its deadline passed");
            Rejection::new(499, "request_cancelled", "the request was abandoned while it was tokenized")
        }
        crate::model::Stopped::TooLarge { limit, got } => ModelError::TooLarge {
            what: "bytes of rendered chat prompt",
            bound: "max_rendered_prompt_bytes",
            limit,
            got,
        }
        .into(),
    })
}

/// Images (docs/design.md §2): expanded in `tokens` and keyed as the engine does where the picker
/// can. Returns the placement (reproduced images, how many leading tokens may be claimed, the
/// images whose identifier is read later) and why nothing could be claimed ("" when something
/// could).
fn place_images(
    model: &ResolvedModel,
    prompt: &PromptInput,
    mode: RoutingMode,
    image_uuids: bool,
    tokens: &mut Vec<u32>,
) -> (ImagePlacement, &'static str) {
    let placement = match (prompt, mode) {
        (PromptInput::Chat(chat), RoutingMode::Precise) if !tokens.is_empty() => {
            chat_images(&chat.messages).and_then(|mut images| {
                if !image_uuids {
                    // mm_processor_kwargs enter every image's identifier on the engine (and may
                    // change its size): no image is reproducible.
                    images.iter_mut().for_each(|image| *image = Default::default());
                }
                model.place_images(&images, tokens)
            })
        }
        _ => Ok(ImagePlacement { items: Vec::new(), claimable: tokens.len(), deferred: Vec::new() }),
    };
    match placement {
        Ok(p) => (p, ""),
        Err(why) => (ImagePlacement::default(), why),
    }
}

/// Hands the inline images sized from their header (`deferred`, indices in the chat's images
/// with their payload keys) to the background reader (docs/decisions/0049-image-identifier-off-the-decision.md): their
/// URLs are moved out of the parsed prompt, which the decision no longer needs, and counted in
/// `epp_image_reads_deferred_total`, or `epp_image_reads_dropped_total` when the reader's queue
/// is full.
fn read_images_later(gw: &Gateway, model: &ResolvedModel, prompt: &mut PromptInput, deferred: &[(usize, [u8; 32])]) {
    let PromptInput::Chat(chat) = prompt else { return };
    if deferred.is_empty() {
        return;
    }
    let which: Vec<usize> = deferred.iter().map(|&(index, _)| index).collect();
    for (index, url) in take_image_urls(&mut chat.messages, &which) {
        let Some(&(_, key)) = deferred.iter().find(|&&(i, _)| i == index) else { continue };
        if model.read_later(url, key) {
            gw.metrics.image_reads_deferred.inc();
        } else {
            gw.metrics.image_reads_dropped.inc();
        }
    }
}

/// The request's block chain into a reused buffer: token blocks keyed with the salt and the
/// images (precise mode), text blocks (approximate mode), nothing for a salted prompt in
/// approximate mode.
fn hash_chain(
    model: &ResolvedModel,
    mode: RoutingMode,
    prompt: &PromptInput,
    claimable: &[u32],
    cache_salt: Option<String>,
    items: Vec<MmItem>,
) -> HashBuf {
    let mut hashes = HashBuf::take();
    tracing::info_span!("epp.hash", blocks = tracing::field::Empty).in_scope(|| {
        if cache_salt.is_some() && mode == RoutingMode::Approximate {
            hashes.0.clear();
        } else if mode == RoutingMode::Precise {
            // vLLM folds the salt into the first block's hash, so the whole chain is the tenant's
            // own, and each image's identifier into the blocks its placeholders cover
            // (docs/design.md §2); the agent re-hashes the engine's blocks the same way. Without
            // keys this is the plain chain.
            let keys = BlockKeys { cache_salt, items };
            model.hasher.hash_prompt_keyed(claimable, &keys, &mut hashes.0);
        } else {
            // Approximate mode: the model has its text hasher, so the chain is always written.
            let written = CODEPOINTS.with(|cp| match cp.try_borrow_mut() {
                Ok(mut cp) => model.approx_chain(prompt, &mut cp, &mut hashes.0),
                Err(_) => model.approx_chain(prompt, &mut Vec::new(), &mut hashes.0),
            });
            debug_assert!(written, "approximate mode without an approximate model");
        }
        tracing::Span::current().record("blocks", hashes.0.len());
    });
    hashes
}

/// Routes one request. On success the returned decision holds the pod's in-flight slot.
pub fn decide(gw: &Gateway, input: &DecisionInput<'_>) -> Result<Decision, Rejection> {
    static NEVER: AtomicBool = AtomicBool::new(false);
    decide_cancellable(gw, input, &NEVER).map(|(d, _, _)| d)
}

/// Routes one request like [`decide`], giving up once `cancel` is set (checked between
/// tokenization chunks: the request's ext_proc stream ended, so nobody waits for the answer), and
/// returns with the decision the model id the body's `model` must be rewritten to, when a rewrite
/// rule changed it (docs/design.md §14), and the request's record on GIE's per-request metrics
/// (running while it is held: keep it until the response ends, then `finish` it).
pub fn decide_cancellable(
    gw: &Gateway,
    input: &DecisionInput<'_>,
    cancel: &AtomicBool,
) -> Result<(Decision, Option<String>, RequestRecord), Rejection> {
    let received = Instant::now();
    let observer = DecisionObserver::start(&gw.metrics, input.request_id);
    let prepared = prepare_cancellable(gw, input, cancel)?;
    observer.received(&prepared);
    let t_route = Instant::now();
    let result = tracing::info_span!("epp.score")
        .in_scope(|| gw.router.route_slo(&prepared.route_request(input.subset), prepared.matches(), input.slo_ttft_ms));
    let route_elapsed = t_route.elapsed();
    observer.scored(route_elapsed);
    match result {
        Ok(decision) => {
            // Approximate mode: the chosen pod will hold this chain once it has served it.
            if let Some(a) = &prepared.model.approx {
                a.store.record(&decision.pod, prepared.block_hashes());
            }
            observer.routed(&prepared, &decision, route_elapsed);
            let target = prepared.model.adapter.as_ref().unwrap_or(&prepared.model.target_model);
            let record = gw.metrics.requests.start(
                &prepared.model_name,
                target,
                received,
                input.body.map_or(0, <[u8]>::len),
                prepared.tokens.len(),
            );
            Ok((decision, prepared.model_rewrite, record))
        }
        Err(e) => {
            observer.no_pod(&prepared, &e);
            // GIE's target model is what the engine serves: the adapter when there is one.
            let target = prepared.model.adapter.as_ref().unwrap_or(&prepared.model.target_model);
            Err(Rejection::from(e).for_model(&prepared.model_name, target))
        }
    }
}

/// What `/explain` reports: the prepared request and every candidate's scores.
#[derive(Debug)]
pub struct Explained {
    /// The request as [`decide`] would see it.
    pub request: PreparedRequest,
    /// Candidates, exclusions and the pod [`decide`] would choose now.
    pub explanation: Explanation,
}

/// Scores one request like [`decide`] (same chain, same matches) without routing it: no
/// reservation, no record, no metric.
pub fn explain(gw: &Gateway, input: &DecisionInput<'_>) -> Result<Explained, Rejection> {
    let request = prepare(gw, input)?;
    let explanation = gw.router.explain_slo(&request.route_request(input.subset), request.matches(), input.slo_ttft_ms);
    Ok(Explained { request, explanation })
}

#[cfg(test)]
mod tests;
