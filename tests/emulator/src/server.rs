//! The HTTP side: vLLM's OpenAI server routes, `/metrics`, `/health`, LoRA management, `/tokenize`
//! and the emulator's own `/emulator/faults`.
//!
//! Errors are mapped to HTTP in exactly one place ([`ApiError`]'s `IntoResponse`), with vLLM's body
//! `{"object":"error","message","type","param":null,"code"}`. Every response carries
//! `x-served-by: <pod>` and echoes the request's `x-request-id`.
//!
//! Concurrency: handlers share one [`AppState`]; the model table is a short `parking_lot` mutex;
//! generation runs in engine tasks, and a streaming response is fed by a pump task that ends (and
//! so aborts the request) when the client goes away.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvroute_tokenize::{ChatRequest, ModelTokenizer};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::engine::{Engine, GenerationEvent, GenerationRequest};
use crate::faults::{FaultState, FaultsPatch};
use crate::metrics::Metrics;
use crate::openai::{
    Api, ChatCompletionRequest, CompletionRequest, DEFAULT_MAX_TOKENS, LoraAdapterRequest, Prompt, ResponseMeta,
    SSE_DONE, TokenizeRequest, Usage, error_body, sse,
};

/// A request the server refuses, with its HTTP status and vLLM error type.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// `model` names neither the served model nor a loaded adapter (404).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// Unknown LoRA adapter on unload (404).
    #[error("The lora adapter '{0}' cannot be found.")]
    LoraNotFound(String),
    /// Malformed or invalid request (400).
    #[error("{0}")]
    BadRequest(String),
    /// The engine stopped without finishing the request (500).
    #[error("the engine ended the request without finishing it")]
    EngineGone,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind) = match &self {
            ApiError::ModelNotFound(_) | ApiError::LoraNotFound(_) => (StatusCode::NOT_FOUND, "NotFoundError"),
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "BadRequestError"),
            ApiError::EngineGone => (StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError"),
        };
        tracing::info!(status = status.as_u16(), error = %self, "request refused");
        json_response(status, &error_body(&self.to_string(), kind, status.as_u16()))
    }
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest(format!("invalid request body: {e}")))
}

/// A LoRA adapter being served.
#[derive(Debug, Clone)]
struct Adapter {
    id: u32,
    path: String,
}

/// Served model and adapters.
#[derive(Debug)]
pub struct Models {
    base: String,
    created: u64,
    adapters: BTreeMap<String, Adapter>,
    next_lora_id: u32,
}

impl Models {
    /// The base model with adapters `(name, path)` numbered 1, 2, … in order.
    pub fn new(base: String, adapters: impl IntoIterator<Item = (String, String)>) -> Self {
        let created =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let mut models = Self { base, created, adapters: BTreeMap::new(), next_lora_id: 1 };
        for (name, path) in adapters {
            models.adapters.insert(name, Adapter { id: models.next_lora_id, path });
            models.next_lora_id += 1;
        }
        models
    }
}

/// Everything the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// The engine.
    pub engine: Arc<Engine>,
    /// The tokenizer, or why it is unavailable.
    pub tokenizer: Result<Arc<ModelTokenizer>, String>,
    /// Served model and adapters.
    pub models: Mutex<Models>,
    /// Fault switches.
    pub faults: Arc<FaultState>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// `x-served-by` value.
    pub pod_name: HeaderValue,
    /// Maximum prompt + output tokens.
    pub max_model_len: u32,
}

type Shared = State<Arc<AppState>>;

/// The router with every route and the header middleware.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(list_models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/v1/load_lora_adapter", post(load_lora))
        .route("/v1/unload_lora_adapter", post(unload_lora))
        .route("/emulator/faults", get(get_faults).post(set_faults))
        .layer(middleware::from_fn_with_state(state.clone(), served_by))
        .with_state(state)
}

async fn served_by(State(state): Shared, request: Request, next: Next) -> Response {
    let request_id = request.headers().get("x-request-id").cloned();
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(HeaderName::from_static("x-served-by"), state.pod_name.clone());
    if let Some(id) = request_id {
        headers.insert(HeaderName::from_static("x-request-id"), id);
    }
    response
}

impl AppState {
    fn resolve_model(&self, model: &str) -> Result<Option<(u32, String)>, ApiError> {
        let models = self.models.lock();
        if model == models.base {
            return Ok(None);
        }
        models
            .adapters
            .get(model)
            .map(|a| Some((a.id, model.to_string())))
            .ok_or_else(|| ApiError::ModelNotFound(model.to_string()))
    }

    fn tokenizer(&self) -> Result<&ModelTokenizer, ApiError> {
        self.tokenizer.as_deref().map_err(|why| {
            ApiError::BadRequest(format!(
                "text prompts need a tokenizer and none is loaded ({why}); send token ids or start with --tokenizer DIR"
            ))
        })
    }

    fn encode_text(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.tokenizer()?.encode_prompt(text).map_err(|e| ApiError::BadRequest(format!("tokenizing the prompt: {e}")))
    }

    fn encode_chat(&self, messages: Vec<Value>, tools: Option<Vec<Value>>) -> Result<Vec<u32>, ApiError> {
        self.tokenizer()?
            .encode_chat(&ChatRequest { messages, tools })
            .map_err(|e| ApiError::BadRequest(format!("rendering the chat template: {e}")))
    }

    fn check_lengths(&self, prompt_len: usize, max_tokens: u32) -> Result<(), ApiError> {
        if prompt_len == 0 {
            return Err(ApiError::BadRequest("The decoder prompt cannot be empty".into()));
        }
        if max_tokens == 0 {
            return Err(ApiError::BadRequest("max_tokens must be at least 1, got 0.".into()));
        }
        if prompt_len as u64 + u64::from(max_tokens) > u64::from(self.max_model_len) {
            return Err(ApiError::BadRequest(format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the \
                 messages, {} in the completion). Please reduce the length of the messages or completion.",
                self.max_model_len,
                prompt_len as u64 + u64::from(max_tokens),
                prompt_len,
                max_tokens
            )));
        }
        Ok(())
    }
}

async fn completions(State(state): Shared, body: Bytes) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(&body)?;
    let lora = state.resolve_model(&req.model)?;
    let prompt = match req.prompt {
        Prompt::Tokens(ids) => ids,
        Prompt::Text(text) => state.encode_text(&text)?,
        Prompt::TokensBatch(mut batch) if batch.len() == 1 => batch.remove(0),
        Prompt::TextBatch(batch) if batch.len() == 1 => state.encode_text(&batch[0])?,
        Prompt::TokensBatch(_) | Prompt::TextBatch(_) => {
            return Err(ApiError::BadRequest("the emulator serves one prompt per request, not a batch".into()));
        }
    };
    let max_tokens = req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    serve(
        &state,
        Api::Completions,
        req.model,
        GenerationRequest { prompt, max_tokens, lora },
        req.stream,
        include_usage,
    )
    .await
}

async fn chat_completions(State(state): Shared, body: Bytes) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse(&body)?;
    let lora = state.resolve_model(&req.model)?;
    let prompt = state.encode_chat(req.messages, req.tools)?;
    let max_tokens = req.max_completion_tokens.or(req.max_tokens).unwrap_or(DEFAULT_MAX_TOKENS);
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    serve(&state, Api::Chat, req.model, GenerationRequest { prompt, max_tokens, lora }, req.stream, include_usage).await
}

async fn serve(
    state: &AppState,
    api: Api,
    model: String,
    request: GenerationRequest,
    stream: bool,
    include_usage: bool,
) -> Result<Response, ApiError> {
    state.check_lengths(request.prompt.len(), request.max_tokens)?;
    let max_tokens = request.max_tokens;
    let meta = ResponseMeta::new(api, model);
    let events = state.engine.submit(request);
    if stream {
        let die_mid_stream = state.faults.get().die_mid_stream;
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(pump(events, meta, max_tokens, include_usage, die_mid_stream, tx));
        let body = Body::from_stream(ReceiverStream::new(rx));
        return Ok(([(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")], body).into_response());
    }
    let mut events = events;
    let mut text = String::new();
    while let Some(event) = events.recv().await {
        match event {
            GenerationEvent::Token { text: piece, .. } => text.push_str(&piece),
            GenerationEvent::Finished { prompt_tokens, cached_tokens, completion_tokens, reason } => {
                let usage = Usage { prompt_tokens, completion_tokens, cached_tokens };
                return Ok(json_response(StatusCode::OK, &meta.full_response(&text, reason.as_str(), usage)));
            }
        }
    }
    Err(ApiError::EngineGone)
}

/// Turns engine events into SSE bytes; returning drops `events`, which aborts the request.
async fn pump(
    mut events: mpsc::Receiver<GenerationEvent>,
    meta: ResponseMeta,
    max_tokens: u32,
    include_usage: bool,
    die_mid_stream: bool,
    out: mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    let send = |s: String| out.send(Ok(Bytes::from(s)));
    if let Some(role) = meta.role_chunk()
        && send(sse(&role)).await.is_err()
    {
        return;
    }
    while let Some(event) = events.recv().await {
        match event {
            GenerationEvent::Token { index, text, .. } => {
                let finish = (index + 1 == max_tokens).then_some("length");
                if send(sse(&meta.token_chunk(&text, finish))).await.is_err() {
                    return;
                }
                if die_mid_stream {
                    tracing::info!(id = %meta.id, "fault injection: cutting the stream after its first chunk");
                    // Let hyper flush the chunk first: an error right behind it aborts the
                    // connection before the buffered chunk is written.
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    let _ = out.send(Err(std::io::Error::other("fault injection: die_mid_stream"))).await;
                    return;
                }
            }
            GenerationEvent::Finished { prompt_tokens, cached_tokens, completion_tokens, .. } => {
                if include_usage {
                    let usage = Usage { prompt_tokens, completion_tokens, cached_tokens };
                    if send(sse(&meta.usage_chunk(usage))).await.is_err() {
                        return;
                    }
                }
                let _ = send(SSE_DONE.to_string()).await;
                return;
            }
        }
    }
    let _ = out.send(Err(std::io::Error::other("engine ended the request without finishing it"))).await;
}

async fn list_models(State(state): Shared) -> Response {
    let models = state.models.lock();
    let mut data = vec![json!({
        "id": models.base, "object": "model", "created": models.created, "owned_by": "vllm",
        "root": models.base, "parent": null, "max_model_len": state.max_model_len, "permission": [],
    })];
    for (name, adapter) in &models.adapters {
        data.push(json!({
            "id": name, "object": "model", "created": models.created, "owned_by": "vllm",
            "root": adapter.path, "parent": models.base, "max_model_len": null, "permission": [],
        }));
    }
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

async fn health(State(state): Shared) -> StatusCode {
    if state.faults.get().unhealthy { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK }
}

async fn metrics(State(state): Shared) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], state.metrics.render()).into_response()
}

async fn tokenize(State(state): Shared, body: Bytes) -> Result<Response, ApiError> {
    let req: TokenizeRequest = parse(&body)?;
    if let Some(model) = &req.model {
        state.resolve_model(model)?;
    }
    let tokens = match (req.prompt, req.messages) {
        (Some(prompt), None) => state.encode_text(&prompt)?,
        (None, Some(messages)) => state.encode_chat(messages, req.tools)?,
        _ => return Err(ApiError::BadRequest("send exactly one of `prompt` or `messages`".into())),
    };
    let body =
        json!({"count": tokens.len(), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": null});
    Ok(json_response(StatusCode::OK, &body))
}

async fn reset_prefix_cache(State(state): Shared) -> StatusCode {
    state.engine.reset_prefix_cache();
    StatusCode::OK
}

async fn load_lora(State(state): Shared, body: Bytes) -> Result<Response, ApiError> {
    let req: LoraAdapterRequest = parse(&body)?;
    let Some(path) = req.lora_path else {
        return Err(ApiError::BadRequest("Both 'lora_name' and 'lora_path' must be provided.".into()));
    };
    let mut models = state.models.lock();
    if models.adapters.contains_key(&req.lora_name) || req.lora_name == models.base {
        return Err(ApiError::BadRequest(format!("The lora adapter '{}' has already been loaded.", req.lora_name)));
    }
    let id = models.next_lora_id;
    models.next_lora_id += 1;
    models.adapters.insert(req.lora_name.clone(), Adapter { id, path });
    tracing::info!(adapter = %req.lora_name, id, "LoRA adapter loaded");
    Ok(format!("Success: LoRA adapter '{}' added successfully.", req.lora_name).into_response())
}

async fn unload_lora(State(state): Shared, body: Bytes) -> Result<Response, ApiError> {
    let req: LoraAdapterRequest = parse(&body)?;
    if state.models.lock().adapters.remove(&req.lora_name).is_none() {
        return Err(ApiError::LoraNotFound(req.lora_name));
    }
    tracing::info!(adapter = %req.lora_name, "LoRA adapter unloaded");
    Ok(format!("Success: LoRA adapter '{}' removed successfully.", req.lora_name).into_response())
}

async fn get_faults(State(state): Shared) -> Response {
    json_response(StatusCode::OK, &json!(state.faults.get()))
}

async fn set_faults(State(state): Shared, body: Bytes) -> Result<Response, ApiError> {
    let patch: FaultsPatch = parse(&body)?;
    let now = state.faults.apply(&patch);
    tracing::info!(faults = ?now, "fault setting changed");
    Ok(json_response(StatusCode::OK, &json!(now)))
}
