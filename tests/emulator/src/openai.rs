//! OpenAI-compatible wire shapes exactly as vLLM's server writes them: request bodies (unknown
//! fields ignored, as vLLM does), error bodies, non-streaming responses and SSE chunks.
//!
//! Pure functions of their inputs: no I/O, no shared state.

use serde::Deserialize;
use serde_json::{Value, json};

/// A `prompt` field: text or token ids, or a batch of either (one choice per prompt, `index` in
/// batch order, as vLLM serves a batch).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// A text prompt, tokenized with the model's tokenizer.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
    /// A batch of texts.
    TextBatch(Vec<String>),
    /// A batch of token-id lists.
    TokensBatch(Vec<Vec<u32>>),
}

/// Most prompts one `/v1/completions` batch may carry (the emulator's bound; vLLM has none but
/// the body size).
pub const MAX_BATCH_PROMPTS: usize = 1024;

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
    /// Prefix-cache salt: folded into the first block's hash (vLLM's `cache_salt`).
    #[serde(default)]
    pub cache_salt: Option<String>,
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
    /// Prefix-cache salt (vLLM's `cache_salt`).
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// A `/v1/responses` body (OpenAI Responses API as vLLM serves it; fields the emulator does not
/// use are accepted and dropped).
#[derive(Debug, Clone, Deserialize)]
pub struct ResponsesRequest {
    /// Served model or LoRA adapter name.
    pub model: String,
    /// A user message as text, or a list of input items (messages with text/image parts).
    pub input: ResponsesInput,
    /// A system message put before the input.
    #[serde(default)]
    pub instructions: Option<String>,
    /// Tokens to generate; default 16 in the emulator.
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    /// Tool definitions, if any (rendered by the chat template).
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// Stream as SSE events.
    #[serde(default)]
    pub stream: bool,
    /// A stored earlier response to continue from; the emulator stores nothing (400).
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// Prefix-cache salt (vLLM's `cache_salt`).
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// `input` of a Responses request.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ResponsesInput {
    /// One user message.
    Text(String),
    /// Input items.
    Items(Vec<Value>),
}

/// Converts Responses `instructions` + `input` to chat messages as vLLM does: instructions
/// become a leading system message; a text input one user message; each message item
/// (`{"role", "content"}`, optionally `"type": "message"`) one message whose `input_text` /
/// `output_text` parts become text parts and `input_image` parts image parts. Other item types
/// (function calls, reasoning) are refused with the reason.
pub fn responses_to_messages(instructions: Option<&str>, input: &ResponsesInput) -> Result<Vec<Value>, String> {
    let mut messages = Vec::new();
    if let Some(text) = instructions {
        messages.push(json!({"role": "system", "content": text}));
    }
    match input {
        ResponsesInput::Text(text) => messages.push(json!({"role": "user", "content": text})),
        ResponsesInput::Items(items) => {
            for (i, item) in items.iter().enumerate() {
                let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
                if kind != "message" {
                    return Err(format!("input[{i}]: item type {kind:?} is not supported by the emulator"));
                }
                let role = item
                    .get("role")
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("input[{i}]: a message item needs a string `role`"))?;
                let content = match item.get("content") {
                    Some(Value::String(text)) => Value::String(text.clone()),
                    Some(Value::Array(parts)) => Value::Array(
                        parts.iter().enumerate().map(|(j, p)| responses_part(p, i, j)).collect::<Result<_, _>>()?,
                    ),
                    _ => return Err(format!("input[{i}]: `content` must be a string or a list of parts")),
                };
                messages.push(json!({"role": role, "content": content}));
            }
        }
    }
    Ok(messages)
}

fn responses_part(part: &Value, i: usize, j: usize) -> Result<Value, String> {
    let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
    match kind {
        "input_text" | "output_text" | "text" => {
            let text = part
                .get("text")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("input[{i}].content[{j}]: no `text`"))?;
            Ok(json!({"type": "text", "text": text}))
        }
        "input_image" => {
            let url = match part.get("image_url") {
                Some(Value::String(url)) => url.clone(),
                Some(Value::Object(o)) => o.get("url").and_then(Value::as_str).unwrap_or_default().to_string(),
                _ => String::new(),
            };
            if url.is_empty() {
                return Err(format!("input[{i}].content[{j}]: an input_image needs `image_url`"));
            }
            let mut out = json!({"type": "image_url", "image_url": {"url": url}});
            if let Some(uuid) = part.get("uuid") {
                out["uuid"] = uuid.clone();
            }
            Ok(out)
        }
        other => Err(format!("input[{i}].content[{j}]: part type {other:?} is not supported by the emulator")),
    }
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

/// vLLM's error body (`ErrorResponse` with an `ErrorInfo`):
/// `{"error": {"message", "type", "param", "code"}}`; `param` names the offending parameter
/// where vLLM's validation error names one, else null.
pub fn error_body(message: &str, kind: &str, param: Option<&str>, code: u16) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}

/// Which endpoint a response belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/responses`.
    Responses,
}

/// Token counts for `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
    /// Prompt tokens written to the prefix cache (full prompt blocks that were not hits).
    pub created_cache_tokens: u32,
}

impl Usage {
    /// Adds another request's counts (a completions batch reports their sums).
    pub fn add(&mut self, other: Usage) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.cached_tokens += other.cached_tokens;
        self.created_cache_tokens += other.created_cache_tokens;
    }

    /// The `usage` object of `api`, always with `prompt_tokens_details` (vLLM with
    /// `--enable-prompt-tokens-details`); chat's also has `created_cache_tokens` (vLLM 0.32's
    /// chat server; its completions server reports cached tokens only).
    pub fn to_json(self, api: Api) -> Value {
        let details = match api {
            Api::Completions => json!({"cached_tokens": self.cached_tokens}),
            Api::Chat | Api::Responses => json!({
                "cached_tokens": self.cached_tokens,
                "created_cache_tokens": self.created_cache_tokens,
                "multimodal_tokens": null,
            }),
        };
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": details,
        })
    }

    /// The Responses API `usage` object.
    pub fn to_responses_json(self) -> Value {
        json!({
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": self.created_cache_tokens},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
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
            Api::Responses => "resp",
        };
        let created =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        // vLLM: `cmpl-…`, `chatcmpl-…`, `resp_…`.
        let sep = if api == Api::Responses { '_' } else { '-' };
        Self { id: format!("{prefix}{sep}{}", uuid::Uuid::new_v4().simple()), created, model, api }
    }

    /// The non-streaming body of a chat or completions response: one choice per `(text,
    /// finish_reason)`, `index` in order (a completions batch has several).
    pub fn full_response(&self, choices: &[(String, &str)], usage: Usage) -> Value {
        match self.api {
            Api::Completions => {
                let choices: Vec<Value> = choices
                    .iter()
                    .enumerate()
                    .map(|(i, (text, finish))| {
                        json!({"index": i, "text": text, "logprobs": null, "finish_reason": finish,
                               "stop_reason": null, "prompt_logprobs": null})
                    })
                    .collect();
                json!({
                    "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": choices, "service_tier": null, "system_fingerprint": null,
                    "usage": usage.to_json(self.api), "kv_transfer_params": null,
                })
            }
            Api::Chat | Api::Responses => {
                let choices: Vec<Value> = choices
                    .iter()
                    .enumerate()
                    .map(|(i, (text, finish))| {
                        json!({"index": i,
                               "message": {"role": "assistant", "content": text, "refusal": null,
                                           "annotations": null, "audio": null, "function_call": null,
                                           "tool_calls": [], "reasoning_content": null},
                               "logprobs": null, "finish_reason": finish, "stop_reason": null})
                    })
                    .collect();
                json!({
                    "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "choices": choices, "service_tier": null, "system_fingerprint": null,
                    "usage": usage.to_json(self.api), "prompt_logprobs": null, "kv_transfer_params": null,
                })
            }
        }
    }

    fn chunk(&self, choices: Value) -> Value {
        let object = match self.api {
            Api::Completions => "text_completion",
            Api::Chat | Api::Responses => "chat.completion.chunk",
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

    /// A chunk carrying one token's text for choice `index`; `finish_reason` on the last one.
    pub fn token_chunk(&self, index: usize, text: &str, finish_reason: Option<&str>) -> Value {
        match self.api {
            Api::Completions => self.chunk(json!([{"index": index, "text": text, "logprobs": null,
                                                    "finish_reason": finish_reason, "stop_reason": null}])),
            Api::Chat | Api::Responses => self
                .chunk(json!([{"index": index, "delta": {"content": text}, "logprobs": null,
                                             "finish_reason": finish_reason, "stop_reason": null}])),
        }
    }

    /// The final usage chunk (`choices: []`), sent when `stream_options.include_usage` is true.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut chunk = self.chunk(json!([]));
        chunk["usage"] = usage.to_json(self.api);
        chunk
    }

    /// A Responses API `response` object. `text: None` is the in-progress shell of the stream's
    /// first events; with text, the output message and usage. Generation that reached
    /// `max_output_tokens` (the emulator never stops early) is `status: "incomplete"` with
    /// `incomplete_details.reason = "max_output_tokens"`, as vLLM reports a length finish.
    pub fn response_object(
        &self,
        message_id: &str,
        text: Option<&str>,
        usage: Option<Usage>,
        max_output_tokens: u32,
    ) -> Value {
        let (status, output, incomplete) = match text {
            None => ("in_progress", json!([]), Value::Null),
            Some(text) => (
                "incomplete",
                json!([self.response_message(message_id, text, "completed")]),
                json!({"reason": "max_output_tokens"}),
            ),
        };
        json!({
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status, "incomplete_details": incomplete, "error": null,
            "instructions": null, "max_output_tokens": max_output_tokens, "output": output,
            "parallel_tool_calls": true, "previous_response_id": null, "reasoning": null,
            "store": false, "temperature": 1.0, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": [], "top_p": 1.0, "truncation": "disabled",
            "usage": usage.map_or(Value::Null, Usage::to_responses_json), "user": null,
            "metadata": null,
        })
    }

    /// The assistant output message item of a Responses answer.
    pub fn response_message(&self, message_id: &str, text: &str, status: &str) -> Value {
        json!({"id": message_id, "type": "message", "role": "assistant", "status": status,
               "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": null}]})
    }
}

/// One Responses API stream event: `event: <type>\ndata: <json>\n\n`, with its
/// `sequence_number` set.
pub fn responses_sse(mut event: Value, sequence_number: u64) -> String {
    event["sequence_number"] = json!(sequence_number);
    let kind = event["type"].as_str().unwrap_or_default().to_string();
    format!("event: {kind}\ndata: {event}\n\n")
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
        let usage = meta.usage_chunk(Usage {
            prompt_tokens: 5,
            completion_tokens: 2,
            cached_tokens: 0,
            created_cache_tokens: 4,
        });
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["total_tokens"], 7);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["created_cache_tokens"], 4);
        assert_eq!(sse(&json!({"a": 1})), "data: {\"a\":1}\n\n");
        assert!(ResponseMeta::new(Api::Completions, "m".into()).role_chunk().is_none());
    }

    #[test]
    fn batches_parse_as_lists_of_prompts() {
        let req: CompletionRequest = serde_json::from_str(r#"{"model":"m","prompt":["a","b"]}"#).unwrap();
        assert!(matches!(req.prompt, Prompt::TextBatch(ref b) if b.len() == 2));
        let req: CompletionRequest = serde_json::from_str(r#"{"model":"m","prompt":[[1,2],[3]]}"#).unwrap();
        assert!(matches!(req.prompt, Prompt::TokensBatch(ref b) if b == &[vec![1, 2], vec![3]]));
    }

    #[test]
    fn responses_input_becomes_chat_messages() {
        let text = ResponsesInput::Text("hi".into());
        assert_eq!(
            responses_to_messages(Some("be brief"), &text).unwrap(),
            vec![json!({"role": "system", "content": "be brief"}), json!({"role": "user", "content": "hi"})]
        );
        let items: ResponsesInput = serde_json::from_value(json!([
            {"role": "user", "content": [{"type": "input_text", "text": "look"},
                                         {"type": "input_image", "image_url": "https://x/cat.png"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a cat"}]},
            {"role": "user", "content": "and?"}
        ]))
        .unwrap();
        let messages = responses_to_messages(None, &items).unwrap();
        assert_eq!(messages.len(), 3);
        assert_eq!(messages[0]["content"][1], json!({"type": "image_url", "image_url": {"url": "https://x/cat.png"}}));
        assert_eq!(messages[1], json!({"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}));
        let bad: ResponsesInput = serde_json::from_value(json!([{"type": "function_call", "name": "f"}])).unwrap();
        assert!(responses_to_messages(None, &bad).unwrap_err().contains("function_call"));
    }

    #[test]
    fn responses_objects_have_openai_shapes() {
        let meta = ResponseMeta::new(Api::Responses, "m".into());
        assert!(meta.id.starts_with("resp_"));
        let usage = Usage { prompt_tokens: 5, completion_tokens: 2, cached_tokens: 4, created_cache_tokens: 0 };
        let done = meta.response_object("msg_1", Some("hello"), Some(usage), 2);
        assert_eq!(done["object"], "response");
        assert_eq!(done["status"], "incomplete");
        assert_eq!(done["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(
            done["output"][0]["content"][0],
            json!({"type": "output_text", "text": "hello", "annotations": [], "logprobs": null})
        );
        assert_eq!(done["usage"]["input_tokens_details"]["cached_tokens"], 4);
        assert_eq!(done["usage"]["input_tokens_details"]["cache_write_tokens"], 0);
        assert_eq!(done["usage"]["total_tokens"], 7);
        let event = responses_sse(json!({"type": "response.output_text.delta", "delta": "x"}), 3);
        assert!(event.starts_with("event: response.output_text.delta\ndata: {"), "{event}");
        assert!(event.contains("\"sequence_number\":3") && event.ends_with("\n\n"));
    }
}
