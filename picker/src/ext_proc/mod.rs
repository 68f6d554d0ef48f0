//! Envoy ext_proc server: the picker's request path (docs/design.md §5, §11).
//!
//! One gRPC stream = one HTTP request. Each stream's response stream (polled by the task that
//! writes its replies) reads Envoy's messages and owns all of the request's state
//! ([`StreamState`]): path, request id, body being accumulated, the routing decision's in-flight
//! slot and the usage scanner. Nothing is shared between streams except the
//! read-only [`Gateway`] (router, models, metrics).
//!
//! Phases (Envoy `processing_mode`: request headers SEND, request body BUFFERED, response headers
//! SEND, response body STREAMED, trailers SKIP):
//! - request headers: remember `:path`, `x-request-id` (else a fresh UUID v4), `traceparent` and
//!   `tracestate` (the parent of the `epp.decision` span, whose own `traceparent` is set upstream);
//!   a request without a body (`end_of_stream`) is routed right there by load, holding no
//!   in-flight slot (no inference work); otherwise CONTINUE (nothing counted until the body).
//! - request body: accumulated until `end_of_stream` (one message in BUFFERED mode, several also
//!   accepted), decided exactly once. Over `body_limit_bytes` → 413 at once. A body that has not
//!   ended `body_timeout` after the headers (a peer that sends headers and then nothing, or part of
//!   a body and stalls) → 408, the body dropped and the stream ended.
//! - response headers: `x-request-id` added for the client.
//! - response body: each chunk answered at once; usage scanned; at end of stream the slot's
//!   predicted-vs-actual cached tokens are compared (stale routing counted) and the slot released.
//!
//! Invariants: every message that needs an answer gets exactly one; the in-flight slot is
//! released when the response ends or the stream ends in any way (it lives in the task's state,
//! dropped when the task returns); nothing here panics on bad input.

pub mod conn;
pub mod reply;
pub mod usage;

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse};
use envoy_types::pb::google::protobuf::value::Kind;
use futures::Stream;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status, Streaming};

use crate::decision::{DecisionInput, Rejection, decide_cancellable, observe};
use crate::gateway::Gateway;
use crate::metrics::RequestRecord;
use crate::pool::InFlightSlot;
use usage::UsageScanner;

/// Filter-metadata namespace and key of Envoy's subset hint (GIE protocol).
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint: a list (or comma string) of allowed `ip:port`s.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// The `ExternalProcessor` gRPC service.
#[derive(Debug, Clone)]
pub struct ExtProcService {
    gateway: Arc<Gateway>,
}

impl ExtProcService {
    /// A service routing through `gateway`.
    pub fn new(gateway: Arc<Gateway>) -> Self {
        Self { gateway }
    }

    /// The tonic server, with the receive limit raised above the body limit (docs/design.md §11: tonic's
    /// 4 MiB default would fail the stream on large prompts before the picker can answer 413).
    pub fn into_server(self, max_message_bytes: usize) -> ExternalProcessorServer<Self> {
        ExternalProcessorServer::new(self)
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes)
    }
}

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

    async fn process(
        &self,
        request: GrpcRequest<Streaming<ProcessingRequest>>,
    ) -> Result<GrpcResponse<Self::ProcessStream>, Status> {
        let stream = ProcessorStream {
            gateway: self.gateway.clone(),
            inbound: request.into_inner(),
            st: StreamState::default(),
            replies: VecDeque::with_capacity(2),
            ending: false,
        };
        Ok(GrpcResponse::new(Box::pin(futures::stream::unfold(stream, next_reply))))
    }
}

/// One ext_proc stream: its inbound messages, its state and the replies not yet sent.
///
/// The response stream itself reads the next message and handles it when tonic asks for the
/// next reply, on the task that writes the replies: no task of its own and no channel in
/// between, so each Envoy round trip wakes one task fewer. Envoy ending the stream drops it (and
/// with it the request's in-flight slot).
struct ProcessorStream {
    gateway: Arc<Gateway>,
    inbound: Streaming<ProcessingRequest>,
    st: StreamState,
    replies: VecDeque<ProcessingResponse>,
    /// The picker ends the stream once `replies` are sent (the body deadline passed).
    ending: bool,
}

/// The next reply of a stream, reading and handling messages until one is due; `None` ends it.
async fn next_reply(mut s: ProcessorStream) -> Option<(Result<ProcessingResponse, Status>, ProcessorStream)> {
    let mut out = Vec::with_capacity(2);
    loop {
        if let Some(r) = s.replies.pop_front() {
            return Some((Ok(r), s));
        }
        if s.ending {
            return None;
        }
        // While a request body is awaited, the wait is bounded by its deadline.
        let next = match s.st.body_deadline.filter(|_| !s.st.decided) {
            Some(deadline) => match tokio::time::timeout_at(deadline, s.inbound.message()).await {
                Ok(next) => next,
                Err(_) => {
                    let reply = body_timed_out(&s.gateway, &mut s.st);
                    s.ending = true;
                    return Some((Ok(reply), s));
                }
            },
            // Routed and not yet answered: the engine may freeze (crate::frozen).
            None => match s.st.slot.as_ref().map(|slot| slot.pod_name().clone()) {
                Some(pod) if s.st.decided => {
                    let mut frozen = s.gateway.frozen.subscribe();
                    loop {
                        if frozen.borrow_and_update().contains(&pod) {
                            let reply = engine_frozen(&s.gateway, &mut s.st, &pod);
                            s.ending = true;
                            return Some((Ok(reply), s));
                        }
                        tokio::select! {
                            next = s.inbound.message() => break next,
                            changed = frozen.changed() => if changed.is_err() {
                                break s.inbound.message().await;
                            },
                        }
                    }
                }
                _ => s.inbound.message().await,
            },
        };
        let msg = match next {
            Ok(Some(m)) => m,
            Ok(None) => return None,
            Err(status) => {
                tracing::debug!(request_id = %s.st.request_id, %status, "ext_proc stream ended with an error");
                return None;
            }
        };
        on_message(&s.gateway, &mut s.st, msg, &mut out).await;
        s.replies.extend(out.drain(..));
    }
}

/// The engine the request was routed to stopped answering: a 503 immediate response (Envoy
/// resets the upstream request, or the client's stream when the response had started); the
/// caller ends the stream after it.
fn engine_frozen(gw: &Gateway, st: &mut StreamState, pod: &str) -> ProcessingResponse {
    st.slot = None;
    let message = format!(
        "the engine of pod {pod} stopped answering (no answer to GET /health for {} ms); request abandoned",
        gw.frozen.after().as_millis()
    );
    tracing::warn!(request_id = %st.request_id, pod, "request abandoned: its engine is frozen");
    reply::immediate_error(503, "upstream_unavailable", &message, &st.request_id)
}

/// Everything known about one request.
#[derive(Default)]
struct StreamState {
    request_id: String,
    path: String,
    /// W3C `traceparent` / `tracestate` of the request (lower-case keys), the decision span's parent.
    trace_headers: HashMap<String, String>,
    subset: Option<Vec<String>>,
    /// The InferenceObjective header's value (docs/design.md §14).
    objective: Option<String>,
    /// GIE's `x-slo-ttft-ms`, ms (docs/design.md §4 "Load and predicted TTFT").
    slo_ttft_ms: Option<f64>,
    body: Vec<u8>,
    /// The request has been routed or rejected; later request-phase messages only CONTINUE.
    decided: bool,
    /// Envoy runs the request body in FULL_DUPLEX_STREAMED mode (from `protocol_config`): the
    /// headers answer is held until the decision and the body is sent back in streamed chunks.
    full_duplex: bool,
    slot: Option<InFlightSlot>,
    /// The request on GIE's per-request metrics, from its routing to the end of its response.
    record: Option<RequestRecord>,
    /// When the request was routed, until its first streamed response chunk: the TTFT the pod's
    /// model learns (docs/design.md §4 "Load and predicted TTFT").
    routed_at: Option<std::time::Instant>,
    usage: Option<UsageScanner>,
    response_status: Option<u16>,
    /// When the request body must have ended (set by request headers without `end_of_stream`).
    body_deadline: Option<tokio::time::Instant>,
}

/// The body deadline passed: drop what arrived of the body and answer 408 (the caller ends the
/// stream after it).
fn body_timed_out(gw: &Gateway, st: &mut StreamState) -> ProcessingResponse {
    st.decided = true;
    st.body = Vec::new();
    let message = format!("request body not received within {} ms", gw.body_timeout.as_millis());
    reject(gw, st, Rejection::new(408, "request_timeout", message))
}

/// Handles one message from Envoy; the replies it needs (none, one, or a decision and body chunks)
/// are pushed to `replies` in order.
async fn on_message(
    gateway: &Arc<Gateway>,
    st: &mut StreamState,
    msg: ProcessingRequest,
    replies: &mut Vec<ProcessingResponse>,
) {
    if let Some(pc) = &msg.protocol_config {
        st.full_duplex = pc.request_body_mode == BodySendMode::FullDuplexStreamed as i32;
    }
    if let Some(md) = &msg.metadata_context
        && let Some(subset) = subset_hint(md)
    {
        st.subset = Some(subset);
    }
    match msg.request {
        Some(Request::RequestHeaders(h)) => on_request_headers(gateway, st, h, replies).await,
        Some(Request::RequestBody(b)) => on_request_body(gateway, st, b, replies).await,
        Some(Request::RequestTrailers(_)) => on_request_trailers(gateway, st, replies).await,
        Some(Request::ResponseHeaders(h)) => replies.push(on_response_headers(gateway, st, &h)),
        Some(Request::ResponseBody(b)) => replies.push(on_response_body(gateway, st, &b)),
        Some(Request::ResponseTrailers(_)) => replies.push(reply::continue_trailers(false)),
        None => tracing::debug!(request_id = %st.request_id, "ext_proc message without a phase; ignored"),
    }
}

impl Drop for StreamState {
    fn drop(&mut self) {
        if self.slot.is_some() {
            tracing::debug!(request_id = %self.request_id, "stream ended before the response did; releasing slot");
        }
    }
}

async fn on_request_headers(
    gw: &Arc<Gateway>,
    st: &mut StreamState,
    h: HttpHeaders,
    out: &mut Vec<ProcessingResponse>,
) {
    let headers = h.headers.unwrap_or_default();
    st.path = header(&headers, ":path").unwrap_or_default();
    st.objective = crate::request::objective_header(|k| header(&headers, k));
    st.slo_ttft_ms = crate::decision::slo_ttft_ms(header(&headers, crate::decision::SLO_TTFT_HEADER).as_deref());
    for key in ["traceparent", "tracestate"] {
        if let Some(v) = header(&headers, key) {
            st.trace_headers.insert(key.to_owned(), v);
        }
    }
    st.request_id = header(&headers, reply::REQUEST_ID_HEADER)
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    if !h.end_of_stream {
        st.body_deadline = Some(tokio::time::Instant::now() + gw.body_timeout);
    }
    if h.end_of_stream {
        match route_request(gw, st, None).await {
            Routing::Routed { endpoint, trace, .. } => {
                // A request without a body (`GET /v1/models`) is no inference work: it must not
                // count in the pod's queue depth, nor hold a slot for as long as its stream stays
                // open (otherwise 100 such streams push queue depth past maxQueue).
                st.slot = None;
                st.record = None;
                out.push(reply::with_request_headers(reply::routed(&endpoint, &st.request_id, true), &trace));
            }
            Routing::Rejected(r) => out.push(*r),
        }
    } else if !st.full_duplex {
        out.push(reply::continue_request_headers());
    }
    // Full duplex: the headers answer waits for the decision (it carries the destination).
}

async fn on_request_body(gw: &Arc<Gateway>, st: &mut StreamState, b: HttpBody, out: &mut Vec<ProcessingResponse>) {
    if st.decided {
        // Only after a rejection (Envoy stops sending) or a stray chunk: pass it on untouched.
        out.push(if st.full_duplex {
            reply::streamed_body(b.body, b.end_of_stream)
        } else {
            reply::continue_request_body()
        });
        return;
    }
    if st.request_id.is_empty() {
        st.request_id = uuid::Uuid::new_v4().to_string();
    }
    // A body without headers first is bounded in time too.
    st.body_deadline.get_or_insert_with(|| tokio::time::Instant::now() + gw.body_timeout);
    if st.body.len() + b.body.len() > gw.body_limit_bytes {
        st.decided = true;
        st.body = Vec::new();
        let msg = format!("request body exceeds the limit of {} bytes", gw.body_limit_bytes);
        out.push(reject(gw, st, Rejection::new(413, "request_too_large", msg)));
        return;
    }
    if st.body.is_empty() && b.end_of_stream {
        st.body = b.body;
    } else {
        st.body.extend_from_slice(&b.body);
    }
    if b.end_of_stream {
        finish_request_body(gw, st, true, out).await;
    }
    // Otherwise more chunks follow; Envoy gets the answer with the decision.
}

/// Full duplex: trailers mark the end of a body that did not carry `end_of_stream`.
async fn on_request_trailers(gw: &Arc<Gateway>, st: &mut StreamState, out: &mut Vec<ProcessingResponse>) {
    if st.full_duplex && !st.decided {
        finish_request_body(gw, st, false, out).await;
        if out.iter().any(|r| matches!(r.response, Some(Response::ImmediateResponse(_)))) {
            return;
        }
    }
    out.push(reply::continue_trailers(true));
}

/// The whole body is in: decide once and answer. BUFFERED: one body answer with the decision.
/// Full duplex: the held headers answer with the decision, then the body re-emitted in chunks.
async fn finish_request_body(
    gw: &Arc<Gateway>,
    st: &mut StreamState,
    end_of_stream: bool,
    out: &mut Vec<ProcessingResponse>,
) {
    let body = std::mem::take(&mut st.body);
    match route_request(gw, st, Some(body)).await {
        Routing::Routed { endpoint, trace, body, rewritten } if st.full_duplex => {
            let body = body.unwrap_or_default();
            let mut resp = reply::with_request_headers(reply::routed(&endpoint, &st.request_id, true), &trace);
            if rewritten {
                resp = reply::with_replaced_body(resp, body.len(), None);
            }
            out.push(resp);
            reply::streamed_body_chunks(body, end_of_stream, out);
        }
        Routing::Routed { endpoint, trace, body, rewritten } => {
            let mut resp = reply::with_request_headers(reply::routed(&endpoint, &st.request_id, false), &trace);
            if rewritten && let Some(body) = body {
                resp = reply::with_replaced_body(resp, body.len(), Some(body));
            }
            out.push(resp);
        }
        Routing::Rejected(r) => out.push(*r),
    }
}

/// How the stream answers a routed request.
enum Routing {
    /// Send the request to `endpoint` with `trace` set upstream (the W3C headers naming the
    /// `epp.decision` span; empty when no trace is recorded). `body` is the request body given
    /// back (full duplex re-emits it). The in-flight slot is in the stream state.
    /// `rewritten`: `body` is the request body with its `model` rewritten (docs/design.md §14),
    /// to be sent instead of the original.
    Routed { endpoint: String, trace: HashMap<String, String>, body: Option<Vec<u8>>, rewritten: bool },
    /// Answer Envoy with this immediate response (already counted and logged).
    Rejected(Box<ProcessingResponse>),
}

/// Bodies from this size (bytes) are decided on the blocking pool where an ended stream cancels
/// their tokenization (≈ 30 ms of CPU per MiB in a release build); smaller ones in place.
pub const CANCELLABLE_BODY_BYTES: usize = 256 * 1024;

/// Bodies under this size (bytes; ≈ 4k tokens) are decided right on the tokio worker: a
/// decision of such a prompt takes ≈ 0.1 ms (docs/benchmarks.md "Picker latency"), less than
/// what [`tokio::task::block_in_place`]'s hand-off of the worker to another thread costs on a
/// machine whose cores sleep between requests.
pub const INLINE_BODY_BYTES: usize = 16 * 1024;

/// Sets its flag when dropped: the decision's future was dropped (its stream ended) before the
/// decision finished, or the decision finished and nobody reads the flag any more.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Runs [`decide`] once for the request, inside its `epp.decision` span (child of the request's
/// `traceparent`, if any), keeps the decision's in-flight slot in `st`, and says how to answer.
///
/// Parse + tokenize are CPU-bound (milliseconds for a cold 8 MiB body), so they must not stall the
/// async workers. Bodies under [`INLINE_BODY_BYTES`] (≈ 0.1 ms of work) are decided right on the
/// worker or event loop. Larger ones, on a multi-thread runtime, run in place with
/// [`tokio::task::block_in_place`]: the worker's other tasks move to a fresh worker and this thread
/// goes straight on, where `spawn_blocking` cost two thread wake-ups per request (a blocking-pool
/// thread, then this task again), each a scheduling delay on a busy machine. A current-thread
/// runtime (the ext_proc event loops, tests) cannot do that and uses `spawn_blocking`, as do bodies
/// of [`CANCELLABLE_BODY_BYTES`] or more, whose tokenization an ended stream cancels
/// (docs/decisions/0024-bounded-outside-input.md).
async fn route_request(gw: &Arc<Gateway>, st: &mut StreamState, body: Option<Vec<u8>>) -> Routing {
    st.decided = true;
    let span = tracing::info_span!(
        "epp.decision",
        otel.kind = "server",
        request_id = %st.request_id,
        path = %st.path,
        model = tracing::field::Empty,
        pod = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    kvroute_common::telemetry::extract_parent(&span, &st.trace_headers);
    // The decision inside `span`, recording the pod or the error on it; the trace headers name `span`.
    let run = move |gw: &Gateway, input: &DecisionInput<'_>, cancel: &AtomicBool| {
        let _entered = span.enter();
        let result = decide_cancellable(gw, input, cancel);
        match &result {
            Ok((d, _, _)) => span.record("pod", d.pod.as_str()),
            Err(_) => span.record("otel.status_code", "ERROR"),
        };
        result.map(|d| (d, kvroute_common::telemetry::inject(&span)))
    };
    let multi_thread = tokio::runtime::Handle::current().runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread;
    let len = body.as_ref().map_or(0, Vec::len);
    let large = len >= CANCELLABLE_BODY_BYTES;
    let (body, result) = if !large && (len < INLINE_BODY_BYTES || multi_thread) {
        let result = {
            let input = DecisionInput {
                request_id: &st.request_id,
                path: &st.path,
                body: body.as_deref(),
                subset: st.subset.as_deref(),
                objective: st.objective.as_deref(),
                slo_ttft_ms: st.slo_ttft_ms,
            };
            static NEVER: AtomicBool = AtomicBool::new(false);
            if len < INLINE_BODY_BYTES {
                run(gw, &input, &NEVER)
            } else {
                tokio::task::block_in_place(|| run(gw, &input, &NEVER))
            }
        };
        (body, result)
    } else {
        // Large bodies: at most `max_concurrent_tokenizations` at once (the rest wait their turn
        // here, on no thread), so huge bodies cannot take every core from the small decisions.
        // Mid-sized ones on a single-threaded event loop come here uncapped, as they would run
        // in place on a multi-threaded runtime, so that the loop's other connections go on.
        let bounds = &gw.request_bounds;
        let waited = async {
            if large {
                let permit = bounds.tokenize_permits.clone().acquire_owned().await;
                permit.map(Some)
            } else {
                Ok(None)
            }
        };
        let Ok(Ok(permit)) = tokio::time::timeout(bounds.tokenize_timeout, waited).await else {
            let message = format!(
                "the picker is deciding {} large requests and none finished within limits.max_tokenize_ms ({} ms); retry",
                bounds.tokenize_slots,
                bounds.tokenize_timeout.as_millis()
            );
            return Routing::Rejected(Box::new(reject(gw, st, Rejection::new(503, "service_unavailable", message))));
        };
        // On the blocking pool, cancellable: if Envoy ends the stream meanwhile, tonic drops this
        // future, the guard sets the flag and tokenization stops at its next chunk; so does the
        // deadline.
        let cancel = CancelOnDrop(Arc::new(AtomicBool::new(false)));
        let flag = cancel.0.clone();
        let timed_out = Arc::new(AtomicBool::new(false));
        let deadline = {
            let (flag, timed_out, after) = (flag.clone(), timed_out.clone(), bounds.tokenize_timeout);
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                timed_out.store(true, Ordering::Relaxed);
                flag.store(true, Ordering::Relaxed);
            })
        };
        let timeout_ms = bounds.tokenize_timeout.as_millis();
        let gw = gw.clone();
        let (request_id, path, subset) = (st.request_id.clone(), st.path.clone(), st.subset.clone());
        let (objective, slo_ttft_ms) = (st.objective.clone(), st.slo_ttft_ms);
        let joined = tokio::task::spawn_blocking(move || {
            let input = DecisionInput {
                request_id: &request_id,
                path: &path,
                body: body.as_deref(),
                subset: subset.as_deref(),
                objective: objective.as_deref(),
                slo_ttft_ms,
            };
            let result = run(&gw, &input, &flag);
            drop(permit);
            (body, result)
        })
        .await;
        deadline.abort();
        drop(cancel);
        let joined = joined.map(|(body, result)| match result {
            Err(rej) if rej.status == 499 && timed_out.load(Ordering::Relaxed) => {
                let message = format!("deciding the request took over limits.max_tokenize_ms ({timeout_ms} ms)");
                (body, Err(Rejection::new(413, "request_too_large", message)))
            }
            other => (body, other),
        });
        joined.unwrap_or_else(|e| {
            let message = format!("routing task failed: {e}");
            (None, Err(Rejection::new(500, "internal_error", message)))
        })
    };
    match result {
        Ok(((decision, rewrite, record), trace)) => {
            if let Some(tp) = trace.get("traceparent") {
                tracing::debug!(request_id = %st.request_id, traceparent = %tp, "trace context passed upstream");
            }
            st.slot = Some(decision.slot);
            st.record = Some(record);
            st.routed_at = Some(std::time::Instant::now());
            let (body, rewritten) = match (body, rewrite) {
                (Some(b), Some(model)) => match crate::request::rewrite_model(&b, &model) {
                    Some(new) => (Some(new), true),
                    None => (Some(b), false),
                },
                (body, _) => (body, false),
            };
            Routing::Routed { endpoint: decision.endpoint, trace, body, rewritten }
        }
        Err(rej) => Routing::Rejected(Box::new(reject(gw, st, rej))),
    }
}

fn reject(gw: &Gateway, st: &StreamState, rej: Rejection) -> ProcessingResponse {
    observe::rejected(&gw.metrics, &st.request_id, &rej);
    reply::immediate_error(rej.status, rej.kind, &rej.message, &st.request_id)
}

fn on_response_headers(gw: &Gateway, st: &mut StreamState, h: &HttpHeaders) -> ProcessingResponse {
    let (status, content_type, attempts) = match &h.headers {
        Some(headers) => {
            (header(headers, ":status"), header(headers, "content-type"), header(headers, UPSTREAM_ATTEMPTS_HEADER))
        }
        None => (None, None, None),
    };
    // More than one upstream attempt: the routes retry only a request that never reached an
    // engine (connect failure, reset before the request was sent), so the endpoint picked first
    // failed as Envoy's 503 would have said, had no retry served the request elsewhere.
    if attempts.and_then(|a| a.trim().parse::<u32>().ok()).is_some_and(|a| a > 1)
        && let Some(slot) = &st.slot
    {
        gw.endpoint_unreachable(slot);
        gw.metrics.upstream_connect_failures.inc();
        tracing::info!(request_id = %st.request_id, pod = slot.pod(),
            "Envoy could not reach the routed endpoint; a retry served the request elsewhere");
    }
    st.response_status = status.and_then(|s| s.parse().ok());
    let event_stream = content_type.map(|ct| ct.contains("text/event-stream"));
    st.usage = Some(UsageScanner::new(event_stream));
    // Only a streamed response's first chunk is its first token; a whole JSON body comes at
    // the end of the generation.
    if event_stream != Some(true) {
        st.routed_at = None;
    }
    if h.end_of_stream {
        st.slot = None;
        if let Some(r) = st.record.take() {
            r.finish(None);
        }
    }
    reply::response_headers(&st.request_id)
}

/// The response header in which deploy/'s routes with a retry policy give the number of upstream
/// attempts (`%UPSTREAM_REQUEST_ATTEMPT_COUNT%`); removed before the client sees the response.
pub const UPSTREAM_ATTEMPTS_HEADER: &str = "x-kvroute-upstream-attempts";

/// The start of the body of Envoy's own 503 when it could not connect to (or lost) the upstream
/// before its response headers ("upstream connect error or disconnect/reset before headers. reset
/// reason: connection failure ..."), plain or quoted inside deploy/'s JSON error body.
pub const UPSTREAM_CONNECT_ERROR: &[u8] = b"upstream connect error or disconnect/reset before headers";

fn on_response_body(gw: &Gateway, st: &mut StreamState, b: &HttpBody) -> ProcessingResponse {
    // Envoy's signal that the chosen endpoint is down: mark it at once (the agent may be silent;
    // docs/decisions/0016-unreachable-marks.md), a probe brings it back when it accepts
    // connections again.
    if st.response_status == Some(503)
        && let Some(slot) = &st.slot
        && b.body.windows(UPSTREAM_CONNECT_ERROR.len()).any(|w| w == UPSTREAM_CONNECT_ERROR)
    {
        gw.endpoint_unreachable(slot);
        gw.metrics.upstream_connect_failures.inc();
        tracing::info!(request_id = %st.request_id, pod = slot.pod(), "Envoy could not connect to the routed endpoint");
    }
    if let Some(r) = &mut st.record {
        r.response_bytes(b.body.len());
    }
    let ok = st.response_status.is_none_or(|s| s < 400);
    if ok
        && !b.body.is_empty()
        && let (Some(slot), Some(at)) = (st.slot.as_mut(), st.routed_at.take())
    {
        let seen = slot.observe_ttft(at.elapsed().as_secs_f64() * 1000.0);
        gw.router.shared().credit.count_ttft(seen);
    }
    if ok && (st.slot.is_some() || st.record.is_some()) {
        let scanner = st.usage.get_or_insert_with(|| UsageScanner::new(None));
        scanner.push(&b.body);
        // Judge as soon as the usage is seen: the final SSE chunk may precede end of stream.
        let found = if b.end_of_stream { scanner.finish() } else { scanner.found() };
        if let Some(cached) = found
            && let Some(slot) = st.slot.take()
        {
            if slot.observe_cached_tokens(cached) {
                gw.metrics.stale_cache_routing.inc();
                tracing::info!(request_id = %st.request_id, cached_tokens = cached, "stale cache routing");
            } else {
                tracing::debug!(request_id = %st.request_id, cached_tokens = cached, "usage seen");
            }
        }
    }
    if b.end_of_stream {
        st.slot = None;
        if let Some(r) = st.record.take() {
            r.finish(st.usage.as_ref().and_then(UsageScanner::completion_tokens));
        }
        st.usage = None;
    }
    reply::continue_response_body()
}

/// A header's value: `raw_value` bytes (what Envoy sends) or, failing that, `value`.
fn header(map: &HeaderMap, key: &str) -> Option<String> {
    let h = map.headers.iter().find(|h| h.key.eq_ignore_ascii_case(key))?;
    if h.raw_value.is_empty() { Some(h.value.clone()) } else { String::from_utf8(h.raw_value.clone()).ok() }
}

/// `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`: a list or a comma string.
fn subset_hint(md: &Metadata) -> Option<Vec<String>> {
    let v = md.filter_metadata.get(SUBSET_NAMESPACE)?.fields.get(SUBSET_KEY)?;
    let mut out = Vec::new();
    let mut push = |s: &str| {
        out.extend(s.split(',').map(str::trim).filter(|x| !x.is_empty()).map(str::to_owned));
    };
    match v.kind.as_ref()? {
        Kind::StringValue(s) => push(s),
        Kind::ListValue(l) => {
            for item in &l.values {
                if let Some(Kind::StringValue(s)) = &item.kind {
                    push(s);
                }
            }
        }
        _ => return None,
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};
    use std::collections::HashMap;

    fn md(v: Kind) -> Metadata {
        let s = Struct { fields: HashMap::from([(SUBSET_KEY.to_owned(), Value { kind: Some(v) })]) };
        Metadata { filter_metadata: HashMap::from([(SUBSET_NAMESPACE.to_owned(), s)]), ..Default::default() }
    }

    #[test]
    fn subset_hint_list_and_string() {
        let l = Kind::ListValue(ListValue {
            values: vec![Value { kind: Some(Kind::StringValue("10.0.0.1:8000".into())) }],
        });
        assert_eq!(subset_hint(&md(l)), Some(vec!["10.0.0.1:8000".to_owned()]));
        let s = Kind::StringValue("10.0.0.1:8000, 10.0.0.2:8000".into());
        assert_eq!(subset_hint(&md(s)).map(|v| v.len()), Some(2));
        assert_eq!(subset_hint(&Metadata::default()), None);
    }
}
