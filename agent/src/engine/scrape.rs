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
