//! HTTP checks of one engine: `/metrics` (every scrape interval), `/health`, `/v1/models` and an
//! active 1-token completion probe with a deadline (every probe interval). A stuck engine still
//! answers `/health` but misses the probe's deadline.
//!
//! Every read is bounded (an endless chunked `/metrics` or a huge probe reply would otherwise
//! grow the agent's memory without limit, docs/decisions/0024-bounded-outside-input.md): each
//! endpoint has a byte limit ([`ReadLimits`]), a
//! `Content-Length` over it is refused before the body is read, and a body that grows past it is
//! dropped (closing the connection) with [`ScrapeError::TooLarge`]; the client's timeout bounds
//! the whole exchange. The parse of `/metrics` has its own line bound
//! ([`super::metrics::MAX_LINES`]). The first oversized answer of each endpoint is logged as a
//! warning, the ones after it at debug until that endpoint answers within its limit again.
//!
//! Stateless apart from the pooled reqwest client and those warning flags; safe to share.

use super::metrics::{EngineMetrics, MetricsError, parse_engine_metrics};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Byte limits of the answers read from one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimits {
    /// `/metrics` page. Default 4 MiB (vLLM's page is 10–300 KB: more with data-parallel ranks
    /// and adapters).
    pub metrics: usize,
    /// `/health` body. Default 64 KiB (vLLM sends an empty one).
    pub health: usize,
    /// `/v1/models` body. Default 4 MiB (about 300 bytes per model or adapter).
    pub models: usize,
    /// Probe completion (`max_tokens` 1). Default 64 KiB (vLLM's is under 1 KB).
    pub probe: usize,
}

impl Default for ReadLimits {
    fn default() -> Self {
        Self { metrics: 4 << 20, health: 64 << 10, models: 4 << 20, probe: 64 << 10 }
    }
}

/// The endpoints read, in the order of the warning flags.
#[derive(Debug, Clone, Copy)]
enum Endpoint {
    Metrics = 0,
    Health = 1,
    Models = 2,
    Probe = 3,
}

/// Scrape errors (logged and counted, never fatal).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScrapeError {
    /// Transport error or timeout.
    #[error("GET/POST {url}: {source}")]
    Http {
        /// URL.
        url: String,
        /// reqwest error.
        source: reqwest::Error,
    },
    /// Non-2xx status.
    #[error("{url} answered {status}")]
    Status {
        /// URL.
        url: String,
        /// HTTP status.
        status: u16,
    },
    /// `/metrics` page did not parse.
    #[error("{url}: {source}")]
    Metrics {
        /// URL.
        url: String,
        /// Parser error.
        source: MetricsError,
    },
    /// `/v1/models` is not the OpenAI shape.
    #[error("{0}: unexpected /v1/models body")]
    Models(String),
    /// The answer was larger than its limit: not read further (the connection is closed).
    #[error("{url}: answer larger than its limit of {limit} bytes: not read")]
    TooLarge {
        /// URL.
        url: String,
        /// The limit, bytes.
        limit: usize,
    },
}

impl ScrapeError {
    /// True when the request ran past its deadline (as opposed to failing or being refused).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Http { source, .. } if source.is_timeout())
    }

    /// Why the engine did not answer, for an operator: `connection refused` (nothing listens:
    /// engine down or wrong port), `DNS resolution failed` (wrong host name), `TLS handshake
    /// failed`, `timeout` (listening but not answering in time), `connection reset`, `connect
    /// failed` (other connect errors: unreachable network, ...), `transport error`, or the
    /// non-transport kinds `HTTP error status`, `unparsable /metrics`, `unexpected /v1/models body`,
    /// `answer over its size bound`.
    pub fn cause(&self) -> &'static str {
        let source = match self {
            Self::Http { source, .. } => source,
            Self::Status { .. } => return "HTTP error status",
            Self::Metrics { .. } => return "unparsable /metrics",
            Self::Models(_) => return "unexpected /v1/models body",
            Self::TooLarge { .. } => return "answer over its size bound",
        };
        if source.is_timeout() {
            return "timeout";
        }
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source);
        while let Some(e) = cause {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                match io.kind() {
                    std::io::ErrorKind::ConnectionRefused => return "connection refused",
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted => {
                        return "connection reset";
                    }
                    std::io::ErrorKind::TimedOut => return "timeout",
                    _ => {}
                }
            }
            let text = e.to_string().to_ascii_lowercase();
            if text.contains("dns error") || text.contains("failed to lookup address") {
                return "DNS resolution failed";
            }
            if text.contains("tls") || text.contains("certificate") || text.contains("handshake") {
                return "TLS handshake failed";
            }
            cause = e.source();
        }
        if source.is_connect() { "connect failed" } else { "transport error" }
    }
}

/// Client for one engine's HTTP endpoint (`ip:port`).
#[derive(Clone)]
pub struct EngineClient {
    http: reqwest::Client,
    base: String,
    limits: ReadLimits,
    /// Per [`Endpoint`]: its last answer was over the limit (and was warned about).
    oversized: Arc<[AtomicBool; 4]>,
}

impl EngineClient {
    /// `endpoint` is `ip:port`; `timeout` bounds the plain GETs (connect to end of body); the
    /// default [`ReadLimits`].
    pub fn new(endpoint: &str, timeout: Duration) -> Self {
        Self::with_limits(endpoint, timeout, ReadLimits::default())
    }

    /// As [`Self::new`], with the given byte limits.
    pub fn with_limits(endpoint: &str, timeout: Duration, limits: ReadLimits) -> Self {
        let http = reqwest::Client::builder().timeout(timeout).build().unwrap_or_default();
        Self { http, base: format!("http://{endpoint}"), limits, oversized: Arc::default() }
    }

    /// The byte limits in force.
    pub fn limits(&self) -> ReadLimits {
        self.limits
    }

    fn limit(&self, e: Endpoint) -> usize {
        match e {
            Endpoint::Metrics => self.limits.metrics,
            Endpoint::Health => self.limits.health,
            Endpoint::Models => self.limits.models,
            Endpoint::Probe => self.limits.probe,
        }
    }

    /// Reads `resp`'s body, at most the limit of `e` (see the module docs).
    async fn body(&self, e: Endpoint, url: String, mut resp: reqwest::Response) -> Result<Vec<u8>, ScrapeError> {
        let limit = self.limit(e);
        let result = async {
            if !resp.status().is_success() {
                return Err(ScrapeError::Status { url: url.clone(), status: resp.status().as_u16() });
            }
            let too_large = || ScrapeError::TooLarge { url: url.clone(), limit };
            if resp.content_length().is_some_and(|n| n > limit as u64) {
                return Err(too_large());
            }
            let mut body = Vec::with_capacity(resp.content_length().map_or(0, |n| n as usize));
            while let Some(chunk) =
                resp.chunk().await.map_err(|source| ScrapeError::Http { url: url.clone(), source })?
            {
                if body.len() + chunk.len() > limit {
                    return Err(too_large());
                }
                body.extend_from_slice(&chunk);
            }
            Ok(body)
        }
        .await;
        let flag = &self.oversized[e as usize];
        match &result {
            Err(err @ ScrapeError::TooLarge { .. }) => {
                if flag.swap(true, Ordering::Relaxed) {
                    tracing::debug!(error = %err, "engine answer over its limit");
                } else {
                    tracing::warn!(error = %err, "engine answer over its limit: dropped (logged once until it fits again)");
                }
            }
            Ok(_) => flag.store(false, Ordering::Relaxed),
            Err(_) => {}
        }
        result
    }

    async fn get(&self, e: Endpoint, path: &str) -> Result<Vec<u8>, ScrapeError> {
        let url = format!("{}{path}", self.base);
        let resp = self.http.get(&url).send().await.map_err(|source| ScrapeError::Http { url: url.clone(), source })?;
        self.body(e, url, resp).await
    }

    /// Reads and parses `/metrics`.
    pub async fn metrics(&self) -> Result<EngineMetrics, ScrapeError> {
        let body = self.get(Endpoint::Metrics, "/metrics").await?;
        let text = String::from_utf8_lossy(&body);
        parse_engine_metrics(&text)
            .map_err(|source| ScrapeError::Metrics { url: format!("{}/metrics", self.base), source })
    }

    /// `/health` answers 2xx.
    pub async fn health(&self) -> Result<(), ScrapeError> {
        self.get(Endpoint::Health, "/health").await.map(|_| ())
    }

    /// The first model id of `/v1/models` (the base model), `None` when the list is empty.
    pub async fn model(&self) -> Result<Option<String>, ScrapeError> {
        let body = self.get(Endpoint::Models, "/v1/models").await?;
        let v: serde_json::Value =
            serde_json::from_slice(&body).map_err(|_| ScrapeError::Models(format!("{}/v1/models", self.base)))?;
        let data = v["data"].as_array().ok_or_else(|| ScrapeError::Models(format!("{}/v1/models", self.base)))?;
        // Adapters are listed with a `parent`; the base model has none.
        Ok(data
            .iter()
            .find(|m| m.get("parent").is_none_or(|p| p.is_null()))
            .or(data.first())
            .and_then(|m| m["id"].as_str())
            .map(str::to_string))
    }

    /// Active probe: `POST /v1/completions {"model", "prompt": "ping", "max_tokens": 1}` with a
    /// `deadline`. Returns its latency.
    pub async fn probe(&self, model: &str, deadline: Duration) -> Result<Duration, ScrapeError> {
        let url = format!("{}/v1/completions", self.base);
        let body = serde_json::json!({"model": model, "prompt": "ping", "max_tokens": 1});
        let start = Instant::now();
        let http = |source| ScrapeError::Http { url: url.clone(), source };
        let resp = self.http.post(&url).timeout(deadline).json(&body).send().await.map_err(http)?;
        self.body(Endpoint::Probe, url, resp).await?;
        Ok(start.elapsed())
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod cause_tests {
    use super::*;

    /// Real failures, classified: nothing listening, a name that does not resolve, a listener
    /// that never answers, an HTTP error status.
    #[tokio::test]
    async fn connect_failures_name_their_cause() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let refused = EngineClient::new(&closed.to_string(), Duration::from_secs(2)).health().await.unwrap_err();
        assert_eq!(refused.cause(), "connection refused", "{refused}");
        let dns = EngineClient::new("no-such-engine.invalid:8000", Duration::from_secs(5)).health().await.unwrap_err();
        assert_eq!(dns.cause(), "DNS resolution failed", "{dns}");
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let slow = EngineClient::new(&addr.to_string(), Duration::from_millis(200)).health().await.unwrap_err();
        assert_eq!(slow.cause(), "timeout", "{slow}");
        let status = ScrapeError::Status { url: "u".into(), status: 503 };
        assert_eq!(status.cause(), "HTTP error status");
    }
}
