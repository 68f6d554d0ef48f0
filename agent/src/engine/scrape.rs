//! HTTP checks of one engine: `/metrics` (every scrape interval), `/health`, `/v1/models` and an
//! active 1-token completion probe with a deadline (every probe interval). A stuck engine still
//! answers `/health` but misses the probe's deadline.
//!
//! Stateless apart from the pooled reqwest client; safe to share.

use super::metrics::{EngineMetrics, MetricsError, parse_engine_metrics};
use std::time::{Duration, Instant};

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
    /// non-transport kinds `HTTP error status`, `unparsable /metrics`, `unexpected /v1/models body`.
    pub fn cause(&self) -> &'static str {
        let source = match self {
            Self::Http { source, .. } => source,
            Self::Status { .. } => return "HTTP error status",
            Self::Metrics { .. } => return "unparsable /metrics",
            Self::Models(_) => return "unexpected /v1/models body",
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
}

impl EngineClient {
    /// `endpoint` is `ip:port`; `timeout` bounds the plain GETs.
    pub fn new(endpoint: &str, timeout: Duration) -> Self {
        let http = reqwest::Client::builder().timeout(timeout).build().unwrap_or_default();
        Self { http, base: format!("http://{endpoint}") }
    }

    async fn get(&self, path: &str) -> Result<String, ScrapeError> {
        let url = format!("{}{path}", self.base);
        let http = |source| ScrapeError::Http { url: url.clone(), source };
        let resp = self.http.get(&url).send().await.map_err(http)?;
        if !resp.status().is_success() {
            return Err(ScrapeError::Status { url, status: resp.status().as_u16() });
        }
        resp.text().await.map_err(http)
    }

    /// Reads and parses `/metrics`.
    pub async fn metrics(&self) -> Result<EngineMetrics, ScrapeError> {
        let text = self.get("/metrics").await?;
        parse_engine_metrics(&text)
            .map_err(|source| ScrapeError::Metrics { url: format!("{}/metrics", self.base), source })
    }

    /// `/health` answers 2xx.
    pub async fn health(&self) -> Result<(), ScrapeError> {
        self.get("/health").await.map(|_| ())
    }

    /// The first model id of `/v1/models` (the base model), `None` when the list is empty.
    pub async fn model(&self) -> Result<Option<String>, ScrapeError> {
        let text = self.get("/v1/models").await?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|_| ScrapeError::Models(format!("{}/v1/models", self.base)))?;
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
        if !resp.status().is_success() {
            return Err(ScrapeError::Status { url, status: resp.status().as_u16() });
        }
        resp.bytes().await.map_err(http)?;
        Ok(start.elapsed())
    }
}

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
