//! OpenAI-compatible wire shapes exactly as vLLM's server writes them: request bodies (unknown
//! fields ignored, as vLLM does), error bodies, non-streaming responses and SSE chunks.
//!
//! Pure functions of their inputs: no I/O, no shared state.

use serde::Deserialize;
use serde_json::{Value, json};

/// A `prompt` field: text or token ids (a one-element batch of either is accepted too).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// A text prompt, tokenized with the model's tokenizer.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
    /// A batch of texts (only length 1 is served).
    TextBatch(Vec<String>),
    /// A batch of token-id lists (only length 1 is served).
    TokensBatch(Vec<Vec<u32>>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage` and empty `choices`.
    #[serde(default)]
    pub include_usage: bool,
}

/// A `/v1/completions` body (fields the emulator ignores are accepted and dropped).
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Served model or LoRA adapter name.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate; default 16 (vLLM's completions default).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Stream as SSE.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
}

/// A `/v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// Served model or LoRA adapter name.
    pub model: String,
    /// Chat messages (rendered by the chat template).
    pub messages: Vec<Value>,
    /// Tool definitions, if any.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// Tokens to generate; default 16 in the emulator.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Newer name of `max_tokens`; wins when both are set.
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    /// Stream as SSE.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
}

/// A `/tokenize` body: `prompt` or `messages`.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    /// Model name (checked like completions when present).
    #[serde(default)]
    pub model: Option<String>,
    /// Text to tokenize.
    #[serde(default)]
    pub prompt: Option<String>,
    /// Chat messages to render and tokenize.
    #[serde(default)]
    pub messages: Option<Vec<Value>>,
    /// Tools for the chat template.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
}

/// A `/v1/load_lora_adapter` or `/v1/unload_lora_adapter` body.
#[derive(Debug, Clone, Deserialize)]
pub struct LoraAdapterRequest {
    /// Adapter name.
    pub lora_name: String,
    /// Adapter path (load only).
    #[serde(default)]
    pub lora_path: Option<String>,
}

/// Default `max_tokens` when the request has none.
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// vLLM's error body: `{"object":"error","message","type","param":null,"code"}`.
pub fn error_body(message: &str, kind: &str, code: u16) -> Value {
    json!({"object": "error", "message": message, "type": kind, "param": null, "code": code})
}

/// Which endpoint a response belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// Token counts for `usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
}

impl Usage {
    /// The `usage` object, always with `prompt_tokens_details` (vLLM with
    /// `--enable-prompt-tokens-details`).
    pub fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// Identity of one response: id, creation time (unix seconds) and model.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// `cmpl-…` or `chatcmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model named in the request.
    pub model: String,
    /// Which API.
    pub api: Api,
}

impl ResponseMeta {
    /// A fresh id for `api`.
    pub fn new(api: Api, model: String) -> Self {
        let prefix = match api {
            Api::Completions => "cmpl",
            Api::Chat => "chatcmpl",
        };
        let created =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Self { id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()), created, model, api }
    }

    /// The non-streaming response body.
    pub fn full_response(&self, text: &str, finish_reason: &str, usage: Usage) -> Value {
        match self.api {
            Api::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason,
                             "stop_reason": null, "prompt_logprobs": null}],
                "service_tier": null, "system_fingerprint": null,
                "usage": usage.to_json(), "kv_transfer_params": null,
            }),
            Api::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0,
                             "message": {"role": "assistant", "content": text, "refusal": null,
                                         "annotations": null, "audio": null, "function_call": null,
                                         "tool_calls": [], "reasoning_content": null},
                             "logprobs": null, "finish_reason": finish_reason, "stop_reason": null}],
                "service_tier": null, "system_fingerprint": null,
                "usage": usage.to_json(), "prompt_logprobs": null, "kv_transfer_params": null,
            }),
        }
    }

    fn chunk(&self, choices: Value) -> Value {
        let object = match self.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices})
    }

    /// The first chat chunk: `delta.role` with empty content (completions have none).
    pub fn role_chunk(&self) -> Option<Value> {
        (self.api == Api::Chat).then(|| {
            self.chunk(json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": null, "finish_reason": null}]))
        })
    }

    /// A chunk carrying one token's text; `finish_reason` on the last one.
    pub fn token_chunk(&self, text: &str, finish_reason: Option<&str>) -> Value {
        match self.api {
            Api::Completions => self.chunk(json!([{"index": 0, "text": text, "logprobs": null,
                                                    "finish_reason": finish_reason, "stop_reason": null}])),
            Api::Chat => self.chunk(json!([{"index": 0, "delta": {"content": text}, "logprobs": null,
                                             "finish_reason": finish_reason, "stop_reason": null}])),
        }
    }

    /// The final usage chunk (`choices: []`), sent when `stream_options.include_usage` is true.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut chunk = self.chunk(json!([]));
        chunk["usage"] = usage.to_json();
        chunk
    }
}

/// One SSE event: `data: <json>\n\n`.
pub fn sse(data: &Value) -> String {
    format!("data: {data}\n\n")
}

/// The SSE terminator.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inference_perf_request_shape_parses() {
        let body = r#"{"model":"m","prompt":"hi","max_tokens":8,"ignore_eos":true,"stream":true,
                       "stream_options":{"include_usage":true},"temperature":0.0,"unknown":1}"#;
        let req: CompletionRequest = serde_json::from_str(body).unwrap();
        assert!(req.stream && req.stream_options.unwrap().include_usage);
        assert!(matches!(req.prompt, Prompt::Text(ref t) if t == "hi"));
        let req: CompletionRequest = serde_json::from_str(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert!(matches!(req.prompt, Prompt::Tokens(ref t) if t == &[1, 2, 3]));
    }

    #[test]
    fn chunks_have_vllm_shapes() {
        let meta = ResponseMeta::new(Api::Chat, "m".into());
        assert!(meta.id.starts_with("chatcmpl-"));
        let role = meta.role_chunk().unwrap();
        assert_eq!(role["object"], "chat.completion.chunk");
        assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
        let usage = meta.usage_chunk(Usage { prompt_tokens: 5, completion_tokens: 2, cached_tokens: 0 });
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["total_tokens"], 7);
        assert_eq!(sse(&json!({"a": 1})), "data: {\"a\":1}\n\n");
        assert!(ResponseMeta::new(Api::Completions, "m".into()).role_chunk().is_none());
    }
}
