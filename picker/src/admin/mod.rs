//! Admin HTTP server (axum): `GET /metrics` (Prometheus/OpenMetrics text), `GET /healthz`, and
//! `POST /explain` (docs/design.md §9: a request body in, every candidate's factor breakdown out, no routing,
//! no state change).
//!
//! Concurrency: handlers only read the shared [`Gateway`]; a scrape refreshes the pool-derived
//! gauges under the metrics' own scrape lock.

pub mod metrics;

use std::sync::Arc;

use axum::Router as HttpRouter;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;

use crate::decision::{DecisionInput, Rejection, explain};
use crate::gateway::Gateway;

/// The admin routes over `gateway`.
pub fn router(gateway: Arc<Gateway>) -> HttpRouter {
    HttpRouter::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/explain", post(explain_handler))
        .with_state(gateway)
}

async fn metrics_handler(State(gw): State<Arc<Gateway>>) -> Response {
    match gw.metrics.render_all(&gw.pool, gw.router.config().max_queue, gw.router.shared(), &gw.replica.counters) {
        Ok(text) => ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text)
            .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "metrics encoding failed");
            (StatusCode::INTERNAL_SERVER_ERROR, "metrics encoding failed\n").into_response()
        }
    }
}

/// `/explain?path=/v1/chat/completions`: which endpoint the body is for (default completions,
/// or chat when the body has `messages`).
#[derive(Debug, Deserialize)]
struct ExplainQuery {
    #[serde(default)]
    path: Option<String>,
}

async fn explain_handler(State(gw): State<Arc<Gateway>>, Query(q): Query<ExplainQuery>, body: Bytes) -> Response {
    if body.len() > gw.body_limit_bytes {
        return error(StatusCode::PAYLOAD_TOO_LARGE, "request body exceeds the limit".into());
    }
    let path = q.path.unwrap_or_default();
    let joined = tokio::task::spawn_blocking(move || explain_json(&gw, &path, &body)).await;
    match joined {
        Ok(Ok(v)) => axum::Json(v).into_response(),
        Ok(Err(rej)) => {
            error(StatusCode::from_u16(rej.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), rej.message)
        }
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, format!("explain task failed: {e}")),
    }
}

/// The decision pipeline's explanation of `body` as JSON.
fn explain_json(gw: &Gateway, path: &str, body: &[u8]) -> Result<serde_json::Value, Rejection> {
    let input = DecisionInput { request_id: "explain", path, body: Some(body), subset: None };
    let ex = explain(gw, &input)?;
    let (req, model) = (&ex.request, ex.request.model);
    let candidates: Vec<_> = ex
        .explanation
        .candidates
        .iter()
        .map(|c| {
            json!({"pod": c.pod, "endpoint": c.endpoint, "score": c.score, "cache": c.cache, "load": c.load,
                   "queue": c.queue, "health": c.health, "adapter": c.adapter, "matched_blocks": c.matched_blocks})
        })
        .collect();
    let excluded: Vec<_> =
        ex.explanation.excluded.iter().map(|(pod, reason)| json!({"pod": pod, "reason": reason})).collect();
    Ok(json!({
        "model": req.model_name,
        "target_model": model.target_model,
        "adapter": model.adapter,
        "mode": req.mode.as_str(),
        "input_tokens": req.tokens.len(),
        "total_blocks": req.block_hashes().len(),
        "choice": ex.explanation.choice,
        "candidates": candidates,
        "excluded": excluded,
    }))
}

fn error(status: StatusCode, message: String) -> Response {
    let body = json!({"error": {"message": message, "type": "invalid_request_error", "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}
