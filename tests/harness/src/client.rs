//! An OpenAI-style client for the gateway that measures what a user feels: time to first token
//! (first streamed chunk with non-empty text, as inference-perf counts it), which pod served the
//! request (the engine's `x-served-by` header, else the upstream address the gateway reports) and the cached tokens the engine reported.

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// A client for one gateway base URL (`http://127.0.0.1:<port>`).
#[derive(Clone)]
pub struct GatewayClient {
    http: reqwest::Client,
    base: String,
    /// Upstream address (`ip:port`) → pod name, for engines that do not send `x-served-by`.
    endpoint_names: std::sync::Arc<std::collections::HashMap<String, String>>,
}

/// What one chat request came back with.
#[derive(Clone, Debug, Default)]
pub struct ChatOutcome {
    pub status: u16,
    /// Pod name from the engine's `x-served-by` response header.
    pub served_by: Option<String>,
    pub request_id: Option<String>,
    /// Concatenated streamed text (the assistant reply).
    pub text: String,
    /// Time to the first chunk with non-empty text.
    pub ttft: Option<Duration>,
    pub latency: Duration,
    pub prompt_tokens: u32,
    /// `usage.prompt_tokens_details.cached_tokens` of the final usage chunk.
    pub cached_tokens: u32,
    /// The JSON body of an error response.
    pub error: Option<Value>,
}

impl GatewayClient {
    pub fn new(base: impl Into<String>) -> Result<Self> {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
        Ok(Self { http, base: base.into(), endpoint_names: Default::default() })
    }

    /// Names the serving pod from the gateway's `x-upstream-endpoint` header (the upstream's
    /// `ip:port`, [`crate::fleet::UPSTREAM_HEADER`]) through `names` when the engine sends no
    /// `x-served-by` (real vLLM).
    pub fn with_endpoint_names(mut self, names: std::collections::HashMap<String, String>) -> Self {
        self.endpoint_names = std::sync::Arc::new(names);
        self
    }

    /// The gateway's base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Streams a `/v1/chat/completions` request with `stream_options.include_usage`.
    pub async fn chat(&self, model: &str, messages: &[Value], max_tokens: u32) -> Result<ChatOutcome> {
        let body = json!({
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        self.stream("/v1/chat/completions", serde_json::to_vec(&body)?, &[], |c| {
            c["choices"][0]["delta"]["content"].as_str().map(str::to_string)
        })
        .await
    }

    /// [`chat`](Self::chat) for callers that expect success: an error names the status and body
    /// when the request failed or never reached an engine (no `x-served-by` header).
    pub async fn chat_served(&self, model: &str, messages: &[Value], max_tokens: u32) -> Result<ChatOutcome> {
        let out = self.chat(model, messages, max_tokens).await?;
        if out.status != 200 {
            bail!("request failed with {}: {:?}", out.status, out.error);
        }
        if out.served_by.is_none() {
            bail!("no x-served-by header: the request did not reach an engine");
        }
        Ok(out)
    }

    /// Sends raw bytes to `path` with extra headers; for error-path tests.
    pub async fn post_raw(&self, path: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> Result<ChatOutcome> {
        self.stream(path, body, headers, |c| c["choices"][0]["text"].as_str().map(str::to_string)).await
    }

    async fn stream(
        &self,
        path: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
        text_of: impl Fn(&Value) -> Option<String>,
    ) -> Result<ChatOutcome> {
        let start = Instant::now();
        let mut req = self.http.post(format!("{}{path}", self.base)).header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.body(body).send().await.with_context(|| format!("POST {}{path}", self.base))?;
        let mut out = ChatOutcome { status: resp.status().as_u16(), ..Default::default() };
        let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        out.served_by = header("x-served-by")
            .or_else(|| header(crate::fleet::UPSTREAM_HEADER).and_then(|a| self.endpoint_names.get(&a).cloned()));
        out.request_id = header("x-request-id");
        let is_sse = header("content-type").is_some_and(|c| c.starts_with("text/event-stream"));
        if !is_sse {
            let bytes = resp.bytes().await?;
            out.latency = start.elapsed();
            let v: Value =
                serde_json::from_slice(&bytes).unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()));
            if out.status >= 400 {
                out.error = Some(v);
            } else {
                read_usage(&v, &mut out);
                out.text = text_of(&v).unwrap_or_default();
            }
            return Ok(out);
        }
        let mut buf = Vec::<u8>::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            buf.extend_from_slice(&chunk?);
            while let Some(pos) = find(&buf, b"\n\n") {
                let event: Vec<u8> = buf.drain(..pos + 2).collect();
                let line = String::from_utf8_lossy(&event);
                let Some(data) = line.trim().strip_prefix("data: ") else { continue };
                if data == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(data).with_context(|| format!("bad SSE chunk: {data}"))?;
                if let Some(t) = text_of(&v).filter(|t| !t.is_empty()) {
                    out.ttft.get_or_insert_with(|| start.elapsed());
                    out.text.push_str(&t);
                }
                read_usage(&v, &mut out);
            }
        }
        out.latency = start.elapsed();
        Ok(out)
    }
}

fn read_usage(v: &Value, out: &mut ChatOutcome) {
    let usage = &v["usage"];
    if let Some(p) = usage["prompt_tokens"].as_u64() {
        out.prompt_tokens = p as u32;
        out.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as u32;
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// POSTs `body` as JSON to `url` and returns the JSON answer. Errors: the request failed, the
/// answer was not JSON, or its status was not a success (the error names the URL, the status and
/// the answer).
pub async fn post_json(http: &reqwest::Client, url: &str, body: &Value) -> Result<Value> {
    let r = http.post(url).json(body).send().await.with_context(|| format!("POST {url}"))?;
    let status = r.status();
    let v: Value = r.json().await.with_context(|| format!("POST {url}: body"))?;
    if !status.is_success() {
        bail!("POST {url} answered {status}: {v}");
    }
    Ok(v)
}
