//! The request as it arrives, before any state of the picker is consulted: the InferenceObjective
//! header, which paths need a body, and the OpenAI body → the model it names and its prompt
//! ([`parse_body`]), plus rewriting the body's `model` after a rewrite rule chose another
//! (docs/design.md §5, §14).
//!
//! Bodies: `/v1/completions` `prompt` (a string; a token array; a one-element batch of either),
//! `/v1/chat/completions` `messages` (+ `tools`), and `/v1/responses` as the chat request the
//! engine renders from it. A shape the picker cannot match (a batch, `cache_salt` that is not a
//! non-empty string, a Responses item other than a text message) is [`PromptInput::None`]: routed
//! by load, never refused here. Only a missing body, one that is not a JSON object and one that
//! names no `model` are errors ([`ModelError`]).
//!
//! Layering: a leaf. It imports nothing else in the picker, so the ext_proc stream, the admin
//! server, the decision pipeline, model resolution and approximate mode can all use it.

use kvroute_tokenize::ChatRequest;
use serde_json::Value;

/// Errors turning a request into a routing input: its body ([`parse_body`]) or the model it names
/// (resolved by the gateway). Each maps to one HTTP status.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The body is not a JSON object (400).
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(String),
    /// `model` is absent or not a string (400).
    #[error("request body has no string field `model`")]
    MissingModel,
    /// `model` is not one of the configured InferenceModels (404).
    #[error("model `{0}` does not exist")]
    UnknownModel(String),
    /// An inference request (completions, chat, responses) came without a body (400).
    #[error("{0} needs a JSON request body; this request has none")]
    EmptyBody(String),
    /// The request is over one of the bounds checked before rendering and tokenizing (413).
    #[error("request too large: {got} {what}, over limits.{bound} ({limit})")]
    TooLarge {
        /// What was counted (`messages`, `content parts`, `tools`, `bytes of rendered prompt`).
        what: &'static str,
        /// The `limits:` key of the bound.
        bound: &'static str,
        /// The bound.
        limit: usize,
        /// What the request has (for the template output: how far rendering got).
        got: usize,
    },
}

/// Counts a chat request may hold before it is rendered and tokenized (the `limits:` keys
/// `max_messages`, `max_content_parts`, `max_tools`): rendering and tokenizing cost grows with
/// them, where the body's byte size alone lets 100,000 tiny messages through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatBounds {
    /// Most `messages` (Responses API: input items plus instructions).
    pub max_messages: usize,
    /// Most content parts over all messages (a string content counts as one).
    pub max_content_parts: usize,
    /// Most `tools`.
    pub max_tools: usize,
}

/// Checks `chat` against `bounds`: [`ModelError::TooLarge`] naming the first bound crossed.
pub fn check_chat(chat: &ChatRequest, bounds: &ChatBounds) -> Result<(), ModelError> {
    let over = |what, bound, limit, got| Err(ModelError::TooLarge { what, bound, limit, got });
    if chat.messages.len() > bounds.max_messages {
        return over("messages", "max_messages", bounds.max_messages, chat.messages.len());
    }
    let tools = chat.tools.as_ref().map_or(0, Vec::len);
    if tools > bounds.max_tools {
        return over("tools", "max_tools", bounds.max_tools, tools);
    }
    let parts: usize = chat
        .messages
        .iter()
        .map(|m| match m.get("content") {
            Some(Value::Array(a)) => a.len(),
            _ => 1,
        })
        .sum();
    if parts > bounds.max_content_parts {
        return over("content parts", "max_content_parts", bounds.max_content_parts, parts);
    }
    Ok(())
}

/// Longest image `uuid` the picker uses as an identifier, in bytes; an image with a longer one is
/// treated as one without (its blocks are not claimed).
pub const MAX_IMAGE_UUID_BYTES: usize = 256;

/// What a body asks for, before tokenization.
#[derive(Debug)]
pub enum PromptInput {
    /// `/v1/completions` prompt text.
    Text(String),
    /// `/v1/completions` prompt already given as token ids.
    Tokens(Vec<u32>),
    /// `/v1/chat/completions` messages and tools.
    Chat(ChatRequest),
    /// Nothing matchable (no prompt, `cache_salt`, unsupported shape): route by load.
    None(&'static str),
}

/// A parsed request body: the model it names and its prompt.
#[derive(Debug)]
pub struct ParsedBody {
    /// The `model` field.
    pub model: String,
    /// The prompt.
    pub prompt: PromptInput,
    /// The `cache_salt` field (a non-empty string; anything else makes the prompt unmatched).
    pub cache_salt: Option<String>,
    /// Whether the picker can reproduce an image's identifier: false when the request sets
    /// `mm_processor_kwargs` (vLLM then hashes them into every image's identifier, `uuid` or
    /// not, and they may change its token count; docs/design.md §2).
    pub image_uuids: bool,
}

/// The request's InferenceObjective name from `x-llm-d-inference-objective` (or its deprecated
/// `x-gateway-inference-objective` spelling), as the llm-d router reads it; empty = none.
pub fn objective_header(get: impl Fn(&str) -> Option<String>) -> Option<String> {
    [kvroute_cluster::models::OBJECTIVE_HEADER, kvroute_cluster::models::LEGACY_OBJECTIVE_HEADER]
        .into_iter()
        .find_map(|k| get(k).filter(|v| !v.is_empty() && v.len() <= 253))
}

/// True when `path` (the `:path` header, query string included) is the chat endpoint.
fn is_chat_path(path: &str) -> bool {
    path.split('?').next().is_some_and(|p| p.ends_with("/chat/completions"))
}

/// True when `path` is the OpenAI Responses endpoint (`POST /v1/responses`).
fn is_responses_path(path: &str) -> bool {
    path.split('?').next().is_some_and(|p| p.ends_with("/v1/responses"))
}

/// True when `path` is an inference endpoint whose request must carry a JSON body: completions,
/// chat completions and responses. Other paths (`/v1/models`, `/health`, ...) may come without.
pub fn needs_body(path: &str) -> bool {
    path.split('?').next().is_some_and(|p| p.ends_with("/completions") || p.ends_with("/v1/responses"))
}

/// The Responses API request (`/v1/responses`) as the chat request the engine renders from it
/// (vLLM's serving_responses builds chat messages and applies the chat template):
/// `instructions` becomes a leading system message; `input` is a string (one user message) or a
/// list of items, each a message (`{"role", "content"}`, `type` absent or `"message"`) whose
/// content is a string or a list of parts; `input_text`/`output_text` parts become chat `text`
/// parts. Function tools (`{"type":"function","name",...}`) become chat tools. Any other item
/// (function calls and their outputs, images, ...) makes the prompt unmatchable: it is routed by
/// load rather than by a prefix the engine would not see (docs/design.md §6).
fn responses_prompt(obj: &mut serde_json::Map<String, Value>) -> PromptInput {
    let mut messages = Vec::new();
    match obj.remove("instructions") {
        Some(Value::String(s)) => messages.push(serde_json::json!({"role": "system", "content": s})),
        None | Some(Value::Null) => {}
        Some(_) => return PromptInput::None("responses `instructions` is not a string"),
    }
    match obj.remove("input") {
        Some(Value::String(s)) => messages.push(serde_json::json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for item in items {
                match responses_message(item) {
                    Some(m) => messages.push(m),
                    None => return PromptInput::None("responses input item other than a text message"),
                }
            }
        }
        _ => return PromptInput::None("responses request without `input`"),
    }
    let tools = match obj.remove("tools") {
        Some(Value::Array(t)) => {
            let chat: Vec<Value> = t
                .into_iter()
                .filter(|t| t["type"] == "function")
                .map(|mut t| {
                    let mut function = serde_json::Map::new();
                    for k in ["name", "description", "parameters", "strict"] {
                        if let Some(v) = t.as_object_mut().and_then(|o| o.remove(k)) {
                            function.insert(k.to_owned(), v);
                        }
                    }
                    serde_json::json!({"type": "function", "function": function})
                })
                .collect();
            (!chat.is_empty()).then_some(chat)
        }
        _ => None,
    };
    PromptInput::Chat(ChatRequest { messages, tools })
}

/// One Responses `input` item as a chat message, if it is a text message.
fn responses_message(item: Value) -> Option<Value> {
    let Value::Object(mut o) = item else { return None };
    if o.get("type").is_some_and(|t| t != "message") {
        return None;
    }
    let role = o.remove("role")?;
    let content = match o.remove("content")? {
        Value::String(s) => Value::String(s),
        Value::Array(parts) => {
            let mut out = Vec::with_capacity(parts.len());
            for p in parts {
                let kind = p["type"].as_str()?;
                if kind == "input_image" {
                    // As the engine turns it into a chat image part (a URL string; a `file_id`
                    // names nothing the picker can see).
                    let mut part =
                        serde_json::json!({"type": "image_url", "image_url": {"url": p["image_url"].as_str()?}});
                    if let Some(uuid) = p.get("uuid") {
                        part["uuid"] = uuid.clone();
                    }
                    out.push(part);
                    continue;
                }
                if !matches!(kind, "input_text" | "output_text" | "text") {
                    return None;
                }
                out.push(serde_json::json!({"type": "text", "text": p["text"].as_str()?}));
            }
            Value::Array(out)
        }
        _ => return None,
    };
    Some(serde_json::json!({"role": role, "content": content}))
}

/// One image of a chat request, borrowed from its content part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChatImage<'a> {
    /// Its `uuid`, when a usable one (a non-empty string of at most [`MAX_IMAGE_UUID_BYTES`]
    /// bytes).
    pub uuid: Option<&'a str>,
    /// Its URL (`image_url.url`, or `image_url` / `image` as a string or `{url}`), when a string.
    pub url: Option<&'a str>,
}

/// The images of `messages` in the order the chat template renders them (messages in order,
/// parts in order): parts of type `image_url`, `image` or `input_image`, each with its `uuid` and
/// URL where usable. `Err` names a part that is neither text nor an image (audio, video,
/// embeddings, files): the picker cannot tell where the engine puts its tokens.
pub fn chat_images(messages: &[Value]) -> Result<Vec<ChatImage<'_>>, &'static str> {
    let mut out = Vec::new();
    for message in messages {
        let Some(Value::Array(parts)) = message.get("content") else { continue };
        for part in parts {
            match part.get("type").and_then(Value::as_str).unwrap_or("text") {
                "text" | "input_text" | "output_text" | "refusal" => {}
                "image_url" | "image" | "input_image" => {
                    let uuid = part
                        .get("uuid")
                        .and_then(Value::as_str)
                        .filter(|u| !u.is_empty() && u.len() <= MAX_IMAGE_UUID_BYTES);
                    let url = match part.get("image_url").or_else(|| part.get("image")) {
                        Some(Value::String(u)) => Some(u.as_str()),
                        Some(Value::Object(o)) => o.get("url").and_then(Value::as_str),
                        _ => None,
                    };
                    out.push(ChatImage { uuid, url });
                }
                _ => return Err("a content part other than text or an image"),
            }
        }
    }
    Ok(out)
}

/// The URLs of the images of `messages` at `which` (positions in [`chat_images`]' order), moved
/// out of their parts (an empty string left in place), each with its position, in message order:
/// what the picker reads of an image later without copying it. A position without a string URL,
/// or past the images, is skipped.
pub fn take_image_urls(messages: &mut [Value], which: &[usize]) -> Vec<(usize, String)> {
    let mut out = Vec::with_capacity(which.len());
    let mut index = 0;
    for message in messages {
        let Some(Value::Array(parts)) = message.get_mut("content") else { continue };
        for part in parts {
            let image = matches!(
                part.get("type").and_then(Value::as_str).unwrap_or("text"),
                "image_url" | "image" | "input_image"
            );
            if !image {
                continue;
            }
            if which.contains(&index) {
                let key = if part.get("image_url").is_some() { "image_url" } else { "image" };
                let url = match part.get_mut(key) {
                    Some(Value::String(u)) => Some(u),
                    Some(Value::Object(o)) => match o.get_mut("url") {
                        Some(Value::String(u)) => Some(u),
                        _ => None,
                    },
                    _ => None,
                };
                out.extend(url.map(|u| (index, std::mem::take(u))));
            }
            index += 1;
        }
    }
    out
}

/// Parses a body: the `model` and the prompt, by `:path` (`/v1/responses` as the Responses API,
/// `/chat/completions` as chat; for other paths by which of `messages`/`prompt` is present).
/// An empty body is [`ModelError::EmptyBody`].
pub fn parse_body(path: &str, body: &[u8]) -> Result<ParsedBody, ModelError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ModelError::EmptyBody(path.split('?').next().unwrap_or_default().to_owned()));
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| ModelError::InvalidJson(e.to_string()))?;
    let Value::Object(mut obj) = v else {
        return Err(ModelError::InvalidJson("expected a JSON object".into()));
    };
    let model = match obj.get("model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => return Err(ModelError::MissingModel),
    };
    let cache_salt = match obj.remove("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s),
        // vLLM refuses these (400); the picker routes them by load.
        Some(_) => {
            let prompt = PromptInput::None("cache_salt is not a non-empty string");
            return Ok(ParsedBody { model, prompt, cache_salt: None, image_uuids: false });
        }
    };
    let image_uuids = match obj.get("mm_processor_kwargs") {
        None | Some(Value::Null) => true,
        Some(Value::Object(o)) => o.is_empty(),
        Some(_) => false,
    };
    if is_responses_path(path) {
        return Ok(ParsedBody { model, prompt: responses_prompt(&mut obj), cache_salt, image_uuids });
    }
    let chat = is_chat_path(path) || (!obj.contains_key("prompt") && obj.contains_key("messages"));
    let prompt = if chat {
        let messages = match obj.remove("messages") {
            Some(Value::Array(m)) => m,
            _ => {
                let prompt = PromptInput::None("no messages array");
                return Ok(ParsedBody { model, prompt, cache_salt, image_uuids });
            }
        };
        let tools = match obj.remove("tools") {
            Some(Value::Array(t)) => Some(t),
            _ => None,
        };
        PromptInput::Chat(ChatRequest { messages, tools })
    } else {
        completion_prompt(obj.remove("prompt"))
    };
    Ok(ParsedBody { model, prompt, cache_salt, image_uuids })
}

/// `body` (a JSON object, already parsed once by [`parse_body`]) with its `model` set to `model`,
/// re-serialized as the GIE endpoint picker does after a rewrite (docs/design.md §14); `None`
/// (logged) if it no longer parses as an object.
pub fn rewrite_model(body: &[u8], model: &str) -> Option<Vec<u8>> {
    let mut v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %e, "request body not rewritten: not JSON");
            return None;
        }
    };
    let obj = v.as_object_mut()?;
    obj.insert("model".to_owned(), Value::String(model.to_owned()));
    serde_json::to_vec(&v).ok()
}

/// `prompt` of `/v1/completions`: a string, a token array, or a one-element batch of either.
fn completion_prompt(p: Option<Value>) -> PromptInput {
    match p {
        Some(Value::String(s)) => PromptInput::Text(s),
        Some(Value::Array(mut a)) => {
            if a.is_empty() {
                return PromptInput::None("empty prompt");
            }
            if a.iter().all(Value::is_number) {
                return tokens_of(&a);
            }
            if a.len() == 1 {
                return match a.pop() {
                    Some(Value::String(s)) => PromptInput::Text(s),
                    Some(Value::Array(inner)) if inner.iter().all(Value::is_number) => tokens_of(&inner),
                    _ => PromptInput::None("unsupported prompt shape"),
                };
            }
            PromptInput::None("batched prompts are routed by load")
        }
        _ => PromptInput::None("no prompt"),
    }
}

fn tokens_of(a: &[Value]) -> PromptInput {
    let mut out = Vec::with_capacity(a.len());
    for t in a {
        match t.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) => out.push(n),
            None => return PromptInput::None("prompt token ids must be u32"),
        }
    }
    PromptInput::Tokens(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_prompt_shapes() {
        let p = parse_body("/v1/completions", br#"{"model":"m","prompt":"hi"}"#).unwrap();
        assert_eq!(p.model, "m");
        assert!(matches!(p.prompt, PromptInput::Text(ref s) if s == "hi"));
        let p = parse_body("/v1/completions", br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert!(matches!(p.prompt, PromptInput::Tokens(ref t) if t == &[1, 2, 3]));
        let p = parse_body("/v1/completions", br#"{"model":"m","prompt":[[4,5]]}"#).unwrap();
        assert!(matches!(p.prompt, PromptInput::Tokens(ref t) if t == &[4, 5]));
        let p = parse_body("/v1/completions", br#"{"model":"m","prompt":[-1]}"#).unwrap();
        assert!(matches!(p.prompt, PromptInput::None(_)));
        let p = parse_body("/v1/completions", br#"{"model":"m","prompt":"x","cache_salt":"s"}"#).unwrap();
        assert!(matches!(p.prompt, PromptInput::Text(ref s) if s == "x"));
        assert_eq!(p.cache_salt.as_deref(), Some("s"));
        let p = parse_body("/v1/completions", br#"{"model":"m","prompt":"x","cache_salt":null}"#).unwrap();
        assert!(matches!(p.prompt, PromptInput::Text(_)) && p.cache_salt.is_none());
        for bad in ["\"\"", "7", "[\"s\"]"] {
            let body = format!("{{\"model\":\"m\",\"prompt\":\"x\",\"cache_salt\":{bad}}}");
            let p = parse_body("/v1/completions", body.as_bytes()).unwrap();
            assert!(matches!(p.prompt, PromptInput::None(_)) && p.cache_salt.is_none(), "{bad}");
        }
    }

    #[test]
    fn chat_body() {
        let p = parse_body(
            "/v1/chat/completions?x=1",
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}"#,
        )
        .unwrap();
        match p.prompt {
            PromptInput::Chat(c) => {
                assert_eq!(c.messages.len(), 1);
                assert_eq!(c.tools.map(|t| t.len()), Some(1));
            }
            other => panic!("expected chat, got {other:?}"),
        }
    }

    #[test]
    fn chat_images_in_render_order_with_bounded_uuids() {
        let long = "u".repeat(MAX_IMAGE_UUID_BYTES + 1);
        let messages = vec![
            serde_json::json!({"role": "system", "content": "plain"}),
            serde_json::json!({"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "u1"}, "uuid": "one"},
                {"type": "image", "image": "u2"},
                {"type": "input_image", "image_url": "u3", "uuid": long},
                {"type": "image_url", "image_url": {"url": "u4"}, "uuid": ""}]}),
        ];
        let want = [(Some("one"), Some("u1")), (None, Some("u2")), (None, Some("u3")), (None, Some("u4"))];
        let want: Vec<ChatImage<'_>> = want.iter().map(|&(uuid, url)| ChatImage { uuid, url }).collect();
        assert_eq!(chat_images(&messages), Ok(want));
        // The same images' URLs moved out by position, in every shape a URL comes in.
        let mut taken = messages.clone();
        assert_eq!(take_image_urls(&mut taken, &[1, 2, 3, 9]), [(1, "u2".into()), (2, "u3".into()), (3, "u4".into())]);
        let left: Vec<_> = chat_images(&taken).unwrap().iter().map(|i| i.url).collect();
        assert_eq!(left, [Some("u1"), Some(""), Some(""), Some("")]);
        let video =
            vec![serde_json::json!({"role": "user", "content": [{"type": "video_url", "video_url": {"url": "v"}}]})];
        assert!(chat_images(&video).is_err());
        let p = parse_body("/v1/chat/completions", br#"{"model":"m","messages":[],"mm_processor_kwargs":{"fps":1}}"#);
        assert!(!p.unwrap().image_uuids);
        let p = parse_body("/v1/chat/completions", br#"{"model":"m","messages":[],"mm_processor_kwargs":{}}"#);
        assert!(p.unwrap().image_uuids);
    }

    #[test]
    fn errors() {
        assert!(matches!(parse_body("/v1/completions", b"{nope"), Err(ModelError::InvalidJson(_))));
        assert!(matches!(parse_body("/v1/completions", b"[1]"), Err(ModelError::InvalidJson(_))));
        assert!(matches!(parse_body("/v1/completions", br#"{"prompt":"x"}"#), Err(ModelError::MissingModel)));
        assert!(matches!(parse_body("/v1/completions", br#"{"model":3}"#), Err(ModelError::MissingModel)));
    }

    #[test]
    fn chat_bounds_name_the_first_bound_crossed() {
        use super::{ChatBounds, ModelError, check_chat};
        let b = ChatBounds { max_messages: 3, max_content_parts: 4, max_tools: 1 };
        let msg = |content: serde_json::Value| serde_json::json!({"role": "user", "content": content});
        let chat = |messages: Vec<serde_json::Value>, tools: usize| kvroute_tokenize::ChatRequest {
            messages,
            tools: (tools > 0).then(|| vec![serde_json::json!({"type": "function"}); tools]),
        };
        let bound = |r: Result<(), ModelError>| match r {
            Err(ModelError::TooLarge { bound, limit, got, .. }) => Some((bound, limit, got)),
            _ => None,
        };
        assert_eq!(bound(check_chat(&chat(vec![msg("a".into()); 3], 1), &b)), None, "at the bounds");
        assert_eq!(bound(check_chat(&chat(vec![msg("a".into()); 4], 0), &b)), Some(("max_messages", 3, 4)));
        assert_eq!(bound(check_chat(&chat(vec![msg("a".into())], 2), &b)), Some(("max_tools", 1, 2)));
        let parts = serde_json::json!([{"type": "text"}, {"type": "text"}, {"type": "text"}]);
        assert_eq!(
            bound(check_chat(&chat(vec![msg(parts.clone()), msg(parts)], 0), &b)),
            Some(("max_content_parts", 4, 6))
        );
        let e = check_chat(&chat(vec![msg("a".into()); 4], 0), &b).unwrap_err();
        assert_eq!(e.to_string(), "request too large: 4 messages, over limits.max_messages (3)");
    }
}
