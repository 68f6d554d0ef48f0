//! The HTTP side: vLLM's OpenAI server routes, `/metrics`, `/health`, LoRA management, `/tokenize`
//! and the emulator's own `/emulator/faults`.
//!
//! Errors are mapped to HTTP in exactly one place ([`ApiError`]'s `IntoResponse`), with vLLM's body
//! `{"error": {"message", "type", "param", "code"}}`. Every response carries `x-served-by: <pod>`
//! and echoes the request's `x-request-id`. Request bodies up to `--max-body-bytes` are read
//! (default 256 MiB, the largest body the picker can be configured to pass; vLLM itself has no
//! limit); a larger one is a 413 in the same shape.
//!
//! Concurrency: handlers share one [`AppState`]; the model table is a short `parking_lot` mutex;
//! generation runs in engine tasks, and a streaming response is fed by a pump task that ends (and
//! so aborts the request) when the client goes away.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvroute_common::image::{SmartResize, content_identifier, data_url_payload, decode_base64, image_size};
use kvroute_tokenize::{ChatRequest, ModelTokenizer};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::cache::{BlockKeys, MmPlaceholder};
use crate::engine::{Engine, GenerationEvent, GenerationRequest};
use crate::faults::{FaultState, FaultsPatch};
use crate::metrics::Metrics;
use crate::openai::{
    Api, ChatCompletionRequest, CompletionRequest, DEFAULT_MAX_TOKENS, LoraAdapterRequest, MAX_BATCH_PROMPTS, Prompt,
    ResponseMeta, ResponsesRequest, SSE_DONE, TokenizeRequest, Usage, error_body, responses_sse, responses_to_messages,
    sse,
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
    /// A request vLLM's validation refuses naming the parameter (400); the message ends with
    /// `(parameter=…, value=…)` as `VLLMValidationError` renders it.
    #[error("{message} (parameter={param}, value={value})")]
    Validation {
        /// What is wrong.
        message: String,
        /// The offending parameter, also the body's `param`.
        param: &'static str,
        /// Its value.
        value: u64,
    },
    /// The body is larger than `--max-body-bytes` (413).
    #[error("request body too large: {0}")]
    TooLarge(String),
    /// The engine stopped without finishing the request (500).
    #[error("the engine ended the request without finishing it")]
    EngineGone,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind, param) = match &self {
            ApiError::ModelNotFound(_) | ApiError::LoraNotFound(_) => (StatusCode::NOT_FOUND, "NotFoundError", None),
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "BadRequestError", None),
            ApiError::Validation { param, .. } => (StatusCode::BAD_REQUEST, "BadRequestError", Some(*param)),
            ApiError::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "RequestEntityTooLarge", None),
            ApiError::EngineGone => (StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", None),
        };
        tracing::info!(status = status.as_u16(), error = %self, "request refused");
        json_response(status, &error_body(&self.to_string(), kind, param, status.as_u16()))
    }
}

impl ApiError {
    fn validation(message: String, param: &'static str, value: u64) -> Self {
        ApiError::Validation { message, param, value }
    }
}

impl From<BytesRejection> for ApiError {
    fn from(rejection: BytesRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge(rejection.body_text())
        } else {
            ApiError::BadRequest(format!("reading the request body: {}", rejection.body_text()))
        }
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
    /// Image placeholder handling.
    pub mm: MmSettings,
    /// Largest request body read, bytes.
    pub max_body_bytes: usize,
}

type Shared = State<Arc<AppState>>;

/// The router with every route and the header middleware.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(list_models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/v1/load_lora_adapter", post(load_lora))
        .route("/v1/unload_lora_adapter", post(unload_lora))
        .route("/emulator/faults", get(get_faults).post(set_faults))
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
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

    /// vLLM's length checks (`TokenizeParams` of `vllm/renderers/params.py`), in its words:
    /// `requested` is the request's explicit output budget (`max_tokens`, `max_completion_tokens`,
    /// `max_output_tokens`; completions default to 16 as vLLM's do), `param` its name. The prompt
    /// may use at most `max_model_len − requested` tokens. Returns the tokens to generate: the
    /// request's budget, or without one the emulator's default 16 capped to what is left.
    fn check_lengths(&self, prompt_len: usize, requested: Option<u32>, param: &'static str) -> Result<u32, ApiError> {
        if prompt_len == 0 {
            return Err(ApiError::BadRequest("The decoder prompt cannot be empty".into()));
        }
        let total = u64::from(self.max_model_len);
        let output = u64::from(requested.unwrap_or(0));
        if output > total {
            return Err(ApiError::validation(
                format!(
                    "{param}={output} cannot be greater than max_model_len={total}. Please request fewer output tokens."
                ),
                param,
                output,
            ));
        }
        let max_input = total - output;
        if prompt_len as u64 > max_input {
            return Err(ApiError::validation(
                format!(
                    "You passed {prompt_len} input tokens and requested {output} output tokens. However, the model's \
                     context length is only {total} tokens, resulting in a maximum input length of {max_input} tokens. \
                     Please reduce the length of the input prompt."
                ),
                "input_tokens",
                prompt_len as u64,
            ));
        }
        match requested {
            Some(0) => Err(ApiError::BadRequest("max_tokens must be at least 1, got 0.".into())),
            Some(n) => Ok(n),
            None => {
                let left = u32::try_from(total - prompt_len as u64).unwrap_or(u32::MAX);
                if left == 0 {
                    return Err(ApiError::validation(
                        format!(
                            "This model's maximum context length is {total} tokens. However, your request has \
                             {prompt_len} input tokens. Please reduce the length of the input messages."
                        ),
                        "input_tokens",
                        prompt_len as u64,
                    ));
                }
                Ok(DEFAULT_MAX_TOKENS.min(left))
            }
        }
    }

    /// Renders `messages` with the chat template and expands each image placeholder to its
    /// token count, giving every image its [`MmPlaceholder`] ([`MmSettings::image`]: the part's
    /// `uuid` if given, as vLLM's `multi_modal_uuids`, else vLLM's content hash of an inline
    /// image, else [`image_identifier`] of its URL).
    fn encode_chat_mm(
        &self,
        messages: Vec<Value>,
        tools: Option<Vec<Value>>,
    ) -> Result<(Vec<u32>, Vec<MmPlaceholder>), ApiError> {
        let images = image_parts(&messages).map(|part| self.mm.image(part)).collect::<Result<Vec<_>, _>>()?;
        let rendered = self.encode_chat(messages, tools)?;
        if images.is_empty() {
            return Ok((rendered, Vec::new()));
        }
        let Some(pad) = self.mm.placeholder_token else {
            return Err(ApiError::BadRequest(
                "this model takes no images: its tokenizer has no image placeholder token".into(),
            ));
        };
        let found = rendered.iter().filter(|t| **t == pad).count();
        if found != images.len() {
            return Err(ApiError::BadRequest(format!(
                "the chat template rendered {found} image placeholders for {} images",
                images.len()
            )));
        }
        let expanded: usize = images.iter().map(|(_, n)| n).sum();
        let mut prompt = Vec::with_capacity(rendered.len() + expanded);
        let mut items = Vec::with_capacity(images.len());
        let mut next = images.into_iter();
        for token in rendered {
            if token == pad
                && let Some((identifier, length)) = next.next()
            {
                items.push(MmPlaceholder { identifier, offset: prompt.len(), length });
                prompt.extend(std::iter::repeat_n(pad, length));
            } else {
                prompt.push(token);
            }
        }
        Ok((prompt, items))
    }
}

/// Multimodal settings of the emulated model.
#[derive(Debug, Clone)]
pub struct MmSettings {
    /// Token id of the image placeholder (`<|image_pad|>` for Qwen), if the tokenizer has one.
    pub placeholder_token: Option<u32>,
    /// Placeholder tokens per image when the count is fixed, and for images the emulator cannot
    /// size (URLs it does not fetch).
    pub tokens_per_image: usize,
    /// With `--mm-vision`: inline images count as the Qwen2-VL processor resizes them.
    pub vision: Option<SmartResize>,
    /// The model id vLLM hashes into an inline image's identifier (the engine's `--model`).
    pub hash_model: String,
}

/// Largest inline image the emulator decodes, in bytes (the body limit bounds it first).
const MAX_INLINE_IMAGE_BYTES: usize = 256 << 20;

impl MmSettings {
    /// (identifier, placeholder tokens) of one image part as vLLM derives them (docs/design.md
    /// §2): the identifier is the `uuid` if given, else for a base64 `data:` URL vLLM's content
    /// hash of its bytes under [`MmSettings::hash_model`], else the [`image_identifier`]
    /// stand-in of the URL (vLLM would fetch and hash it). The count is
    /// [`MmSettings::tokens_per_image`], or with `vision` the Qwen2-VL count of an inline image's
    /// size. A data URL vLLM cannot load (not strict base64; with `vision`, not a PNG, JPEG,
    /// WebP, GIF or BMP of a size the processor takes) is a 400, as vLLM refuses it.
    fn image(&self, part: ImagePart<'_>) -> Result<(String, usize), ApiError> {
        let fixed = self.tokens_per_image.max(1);
        let Some(payload) = part.url.and_then(data_url_payload) else {
            let identifier = match part.uuid {
                Some(uuid) => uuid.to_owned(),
                None => image_identifier(part.url.unwrap_or_default()),
            };
            return Ok((identifier, fixed));
        };
        let refused = |why: &str| ApiError::BadRequest(format!("Failed to load image: {why}"));
        let bytes = decode_base64(payload, MAX_INLINE_IMAGE_BYTES).ok_or_else(|| refused("invalid base64 data"))?;
        let tokens = match self.vision {
            None => fixed,
            Some(vision) => {
                let (width, height) = image_size(&bytes)
                    .ok_or_else(|| refused("not a PNG, JPEG, WebP, GIF or BMP the emulator can size"))?;
                vision.tokens(width, height).ok_or_else(|| {
                    refused(&format!("a {width}x{height} image is refused (aspect ratio over 200 or too many pixels)"))
                })?
            }
        };
        let identifier = match part.uuid {
            Some(uuid) => uuid.to_owned(),
            None => content_identifier(&self.hash_model, &bytes),
        };
        Ok((identifier, tokens))
    }
}

/// The emulator's stand-in for vLLM's content hash of an image it fetched from a URL (the
/// emulator fetches nothing): XXH3-128 of the URL's bytes, 32 hex digits. Inline images get
/// vLLM's real identifier ([`MmSettings::image`]).
pub fn image_identifier(reference: &str) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(reference.as_bytes()))
}

/// One image content part: its `uuid` and its URL, where strings.
#[derive(Debug, Clone, Copy)]
struct ImagePart<'a> {
    uuid: Option<&'a str>,
    url: Option<&'a str>,
}

/// The image parts of `messages`, in the order the chat template renders them (messages in
/// order, parts in order): `image_url` / `image` / `input_image` parts.
fn image_parts(messages: &[Value]) -> impl Iterator<Item = ImagePart<'_>> {
    messages
        .iter()
        .filter_map(|message| match message.get("content") {
            Some(Value::Array(parts)) => Some(parts),
            _ => None,
        })
        .flatten()
        .filter(|part| matches!(part.get("type").and_then(Value::as_str), Some("image_url" | "image" | "input_image")))
        .map(|part| ImagePart {
            uuid: part.get("uuid").and_then(Value::as_str),
            url: match part.get("image_url").or_else(|| part.get("image")) {
                Some(Value::String(url)) => Some(url.as_str()),
                Some(Value::Object(o)) => o.get("url").and_then(Value::as_str),
                _ => None,
            },
        })
}

/// vLLM refuses an empty `cache_salt` ("Parameter 'cache_salt' must be a non-empty string if
/// provided.").
fn check_salt(salt: Option<String>) -> Result<Option<String>, ApiError> {
    match salt {
        Some(s) if s.is_empty() => Err(ApiError::validation(
            "Parameter 'cache_salt' must be a non-empty string if provided.".into(),
            "cache_salt",
            0,
        )),
        other => Ok(other),
    }
}

async fn completions(State(state): Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(&body?)?;
    let lora = state.resolve_model(&req.model)?;
    let cache_salt = check_salt(req.cache_salt)?;
    let prompts = match req.prompt {
        Prompt::Tokens(ids) => vec![ids],
        Prompt::Text(text) => vec![state.encode_text(&text)?],
        Prompt::TokensBatch(batch) => batch,
        Prompt::TextBatch(batch) => batch.iter().map(|t| state.encode_text(t)).collect::<Result<_, _>>()?,
    };
    if prompts.is_empty() {
        return Err(ApiError::BadRequest("The decoder prompt cannot be empty".into()));
    }
    if prompts.len() > MAX_BATCH_PROMPTS {
        return Err(ApiError::BadRequest(format!(
            "a batch of {} prompts is more than the emulator serves at once ({MAX_BATCH_PROMPTS})",
            prompts.len()
        )));
    }
    let requested = req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let mut requests = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let max_tokens = state.check_lengths(prompt.len(), Some(requested), "max_tokens")?;
        let keys = BlockKeys { cache_salt: cache_salt.clone(), ..BlockKeys::default() };
        requests.push(GenerationRequest { prompt, max_tokens, lora: lora.clone(), keys });
    }
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    serve(&state, ResponseMeta::new(Api::Completions, req.model), requests, req.stream, include_usage).await
}

async fn chat_completions(State(state): Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse(&body?)?;
    let lora = state.resolve_model(&req.model)?;
    let cache_salt = check_salt(req.cache_salt)?;
    let (prompt, mm) = state.encode_chat_mm(req.messages, req.tools)?;
    let (requested, param) = match (req.max_completion_tokens, req.max_tokens) {
        (Some(n), _) => (Some(n), "max_completion_tokens"),
        (None, n) => (n, "max_tokens"),
    };
    let max_tokens = state.check_lengths(prompt.len(), requested, param)?;
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    let request = GenerationRequest { prompt, max_tokens, lora, keys: BlockKeys { lora: None, mm, cache_salt } };
    serve(&state, ResponseMeta::new(Api::Chat, req.model), vec![request], req.stream, include_usage).await
}

/// `/v1/responses`: `instructions` + `input` rendered as a chat ([`responses_to_messages`]),
/// answered as a Responses API `response` (or its event stream).
async fn responses(State(state): Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body?;
    if body.is_empty() {
        return Err(ApiError::BadRequest("invalid request body: the body is empty".into()));
    }
    let req: ResponsesRequest = parse(&body)?;
    let lora = state.resolve_model(&req.model)?;
    let cache_salt = check_salt(req.cache_salt)?;
    if let Some(id) = req.previous_response_id {
        return Err(ApiError::BadRequest(format!(
            "previous_response_id {id:?}: the emulator stores no responses; send the whole conversation as `input`"
        )));
    }
    let messages = responses_to_messages(req.instructions.as_deref(), &req.input).map_err(ApiError::BadRequest)?;
    let (prompt, mm) = state.encode_chat_mm(messages, req.tools)?;
    let max_tokens = state.check_lengths(prompt.len(), req.max_output_tokens, "max_output_tokens")?;
    let meta = ResponseMeta::new(Api::Responses, req.model);
    let request = GenerationRequest { prompt, max_tokens, lora, keys: BlockKeys { lora: None, mm, cache_salt } };
    let events = state.engine.submit(request);
    if req.stream {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(pump_responses(events, meta, max_tokens, tx));
        let body = Body::from_stream(ReceiverStream::new(rx));
        return Ok(([(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")], body).into_response());
    }
    let message_id = format!("msg_{}", uuid::Uuid::new_v4().simple());
    let mut events = events;
    let mut text = String::new();
    while let Some(event) = events.recv().await {
        match event {
            GenerationEvent::Token { text: piece, .. } => text.push_str(&piece),
            GenerationEvent::Finished {
                prompt_tokens, cached_tokens, created_cache_tokens, completion_tokens, ..
            } => {
                let usage = Usage { prompt_tokens, completion_tokens, cached_tokens, created_cache_tokens };
                let body = meta.response_object(&message_id, Some(&text), Some(usage), max_tokens);
                return Ok(json_response(StatusCode::OK, &body));
            }
        }
    }
    Err(ApiError::EngineGone)
}

/// Serves `requests` (one per prompt of a batch) as one response; choice `i` is request `i`.
async fn serve(
    state: &AppState,
    meta: ResponseMeta,
    requests: Vec<GenerationRequest>,
    stream: bool,
    include_usage: bool,
) -> Result<Response, ApiError> {
    let budgets: Vec<u32> = requests.iter().map(|r| r.max_tokens).collect();
    let receivers: Vec<_> = requests.into_iter().map(|r| state.engine.submit(r)).collect();
    if stream {
        let die_mid_stream = state.faults.get().die_mid_stream;
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(pump(receivers, meta, budgets, include_usage, die_mid_stream, tx));
        let body = Body::from_stream(ReceiverStream::new(rx));
        return Ok(([(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")], body).into_response());
    }
    let mut choices = Vec::with_capacity(receivers.len());
    let mut usage = Usage::default();
    for mut events in receivers {
        let mut text = String::new();
        let mut finished = None;
        while let Some(event) = events.recv().await {
            match event {
                GenerationEvent::Token { text: piece, .. } => text.push_str(&piece),
                GenerationEvent::Finished {
                    prompt_tokens,
                    cached_tokens,
                    created_cache_tokens,
                    completion_tokens,
                    reason,
                } => {
                    usage.add(Usage { prompt_tokens, completion_tokens, cached_tokens, created_cache_tokens });
                    finished = Some(reason);
                    break;
                }
            }
        }
        let reason = finished.ok_or(ApiError::EngineGone)?;
        choices.push((text, reason.as_str()));
    }
    Ok(json_response(StatusCode::OK, &meta.full_response(&choices, usage)))
}

/// Turns engine events into SSE bytes; returning drops the receivers, which aborts the requests.
/// Choices of a batch stream one after another, each chunk naming its `index`.
async fn pump(
    receivers: Vec<mpsc::Receiver<GenerationEvent>>,
    meta: ResponseMeta,
    budgets: Vec<u32>,
    include_usage: bool,
    die_mid_stream: bool,
    out: mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    let send = |s: String| out.send(Ok(Bytes::from(s)));
    // vLLM sends the role chunk on its output stream's first item, which comes with the first
    // token (or the end): a stream's first byte is its first token, as routers time it.
    let mut role = meta.role_chunk();
    let mut usage = Usage::default();
    for (choice, (mut events, max_tokens)) in receivers.into_iter().zip(budgets).enumerate() {
        let mut finished = false;
        while let Some(event) = events.recv().await {
            if let Some(r) = role.take()
                && send(sse(&r)).await.is_err()
            {
                return;
            }
            match event {
                GenerationEvent::Token { index, text, .. } => {
                    let finish = (index + 1 == max_tokens).then_some("length");
                    if send(sse(&meta.token_chunk(choice, &text, finish))).await.is_err() {
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
                GenerationEvent::Finished {
                    prompt_tokens,
                    cached_tokens,
                    created_cache_tokens,
                    completion_tokens,
                    ..
                } => {
                    usage.add(Usage { prompt_tokens, completion_tokens, cached_tokens, created_cache_tokens });
                    finished = true;
                    break;
                }
            }
        }
        if !finished {
            let _ = out.send(Err(std::io::Error::other("engine ended the request without finishing it"))).await;
            return;
        }
    }
    if include_usage && send(sse(&meta.usage_chunk(usage))).await.is_err() {
        return;
    }
    let _ = send(SSE_DONE.to_string()).await;
}

/// The Responses API event stream: `response.created`, `response.in_progress`, the output item
/// and content part opening, one `response.output_text.delta` per token, their closing events and
/// `response.completed` with the whole response and usage.
async fn pump_responses(
    mut events: mpsc::Receiver<GenerationEvent>,
    meta: ResponseMeta,
    max_tokens: u32,
    out: mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    let message_id = format!("msg_{}", uuid::Uuid::new_v4().simple());
    let mut seq = 0u64;
    let mut next = |event: Value| {
        let s = responses_sse(event, seq);
        seq += 1;
        Bytes::from(s)
    };
    let shell = meta.response_object(&message_id, None, None, max_tokens);
    let opening = [
        json!({"type": "response.created", "response": shell}),
        json!({"type": "response.in_progress", "response": shell}),
        json!({"type": "response.output_item.added", "output_index": 0,
               "item": {"id": message_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}}),
        json!({"type": "response.content_part.added", "item_id": message_id, "output_index": 0, "content_index": 0,
               "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
    ];
    for event in opening {
        if out.send(Ok(next(event))).await.is_err() {
            return;
        }
    }
    let mut text = String::new();
    while let Some(event) = events.recv().await {
        match event {
            GenerationEvent::Token { text: piece, .. } => {
                let delta = json!({"type": "response.output_text.delta", "item_id": message_id, "output_index": 0,
                                   "content_index": 0, "delta": piece, "logprobs": []});
                text.push_str(&piece);
                if out.send(Ok(next(delta))).await.is_err() {
                    return;
                }
            }
            GenerationEvent::Finished {
                prompt_tokens, cached_tokens, created_cache_tokens, completion_tokens, ..
            } => {
                let usage = Usage { prompt_tokens, completion_tokens, cached_tokens, created_cache_tokens };
                let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                let closing = [
                    json!({"type": "response.output_text.done", "item_id": message_id, "output_index": 0,
                           "content_index": 0, "text": text, "logprobs": []}),
                    json!({"type": "response.content_part.done", "item_id": message_id, "output_index": 0,
                           "content_index": 0, "part": part}),
                    json!({"type": "response.output_item.done", "output_index": 0,
                           "item": meta.response_message(&message_id, &text, "completed")}),
                    json!({"type": "response.completed",
                           "response": meta.response_object(&message_id, Some(&text), Some(usage), max_tokens)}),
                ];
                for event in closing {
                    if out.send(Ok(next(event))).await.is_err() {
                        return;
                    }
                }
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
