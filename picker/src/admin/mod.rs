//! Admin HTTP server (axum): `GET /metrics` (Prometheus/OpenMetrics text), `GET /healthz`,
//! `GET /readyz` (200 once SERVING, docs/design.md §14), and
//! `POST /explain` (docs/design.md §9: a request body in, every candidate's factor breakdown out, no routing,
//! no state change).
//!
//! `/explain` says which pods hold a prompt's prefix, so it is closed by default
//! (docs/design.md §14): it answers callers on the loopback interface (a local operator,
//! `kubectl port-forward`), and others only with `Authorization: Bearer <token>` when a token is
//! configured (`explain_token_file`); anyone else gets 403. The server must be run with
//! `into_make_service_with_connect_info::<SocketAddr>()` for the loopback test (without it, only
//! the token opens `/explain`).
//!
//! Concurrency: handlers only read the shared [`Gateway`]; a scrape refreshes the pool-derived
//! gauges under the metrics' own scrape lock ([`Gateway::render_metrics`]).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router as HttpRouter;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::json;

use crate::decision::{DecisionInput, Rejection, explain};
use crate::gateway::Gateway;
use crate::request::objective_header;

/// The admin routes over `gateway`, `/explain` for loopback callers only.
pub fn router(gateway: Arc<Gateway>) -> HttpRouter {
    router_with_token(gateway, None)
}

/// The admin routes over `gateway`; `/explain` also opens to callers presenting `token` as a
/// bearer token. `/explain` accepts bodies up to the ext_proc limit (`body_limit_bytes`), not
/// axum's 2 MiB default, so any body the picker routes can be explained; a larger one gets 413.
pub fn router_with_token(gateway: Arc<Gateway>, token: Option<Arc<str>>) -> HttpRouter {
    let body_limit = gateway.body_limit_bytes;
    let explain = post(explain_handler).layer(DefaultBodyLimit::max(body_limit)).layer(axum::middleware::from_fn(
        move |req: Request, next: axum::middleware::Next| {
            let allowed = explain_allowed(&req, token.as_deref());
            async move {
                if allowed {
                    next.run(req).await
                } else {
                    error(
                        StatusCode::FORBIDDEN,
                        "/explain answers loopback callers, or others with the configured bearer token".into(),
                    )
                }
            }
        },
    ));
    HttpRouter::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz_handler))
        .route("/explain", explain)
        .with_state(gateway)
}

/// `/readyz`: 200 once the picker is SERVING (docs/design.md §14), 503 before.
async fn readyz_handler(State(gw): State<Arc<Gateway>>) -> Response {
    if gw.is_ready() {
        "ready\n".into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready: pool view not synced or agents below ready_coverage\n")
            .into_response()
    }
}

/// Loopback peer, or a bearer token equal to `token` (compared in constant time).
fn explain_allowed(req: &Request, token: Option<&str>) -> bool {
    let loopback = req.extensions().get::<ConnectInfo<SocketAddr>>().is_some_and(|c| c.0.ip().is_loopback());
    if loopback {
        return true;
    }
    let Some(token) = token else { return false };
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    presented.len() == token.len() && presented.bytes().zip(token.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

async fn metrics_handler(State(gw): State<Arc<Gateway>>) -> Response {
    match gw.render_metrics() {
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

async fn explain_handler(
    State(gw): State<Arc<Gateway>>,
    Query(q): Query<ExplainQuery>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    if body.len() > gw.body_limit_bytes {
        return error(StatusCode::PAYLOAD_TOO_LARGE, "request body exceeds the limit".into());
    }
    let path = q.path.unwrap_or_default();
    let objective = objective_header(|k| headers.get(k).and_then(|v| v.to_str().ok()).map(str::to_string));
    let slo_ttft_ms =
        crate::decision::slo_ttft_ms(headers.get(crate::decision::SLO_TTFT_HEADER).and_then(|v| v.to_str().ok()));
    let joined =
        tokio::task::spawn_blocking(move || explain_json(&gw, &path, &body, objective.as_deref(), slo_ttft_ms)).await;
    match joined {
        Ok(Ok(v)) => axum::Json(v).into_response(),
        Ok(Err(rej)) => {
            error(StatusCode::from_u16(rej.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), rej.message)
        }
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, format!("explain task failed: {e}")),
    }
}

/// The decision pipeline's explanation of `body` as JSON.
fn explain_json(
    gw: &Gateway,
    path: &str,
    body: &[u8],
    objective: Option<&str>,
    slo_ttft_ms: Option<f64>,
) -> Result<serde_json::Value, Rejection> {
    let input = DecisionInput { request_id: "explain", path, body: Some(body), subset: None, objective, slo_ttft_ms };
    let ex = explain(gw, &input)?;
    let (req, model) = (&ex.request, &ex.request.model);
    let candidates: Vec<_> = ex
        .explanation
        .candidates
        .iter()
        .map(|c| {
            json!({"pod": c.pod, "endpoint": c.endpoint, "score": c.score, "cache": c.cache, "load": c.load,
                   "queue": c.queue, "health": c.health, "adapter": c.adapter, "matched_blocks": c.matched_blocks,
                   "predicted_ttft_ms": c.predicted_ttft_ms})
        })
        .collect();
    let excluded: Vec<_> =
        ex.explanation.excluded.iter().map(|(pod, reason)| json!({"pod": pod, "reason": reason})).collect();
    Ok(json!({
        "model": req.model_name,
        "target_model": model.target_model,
        "adapter": model.adapter,
        "model_rewrite": req.model_rewrite,
        "mode": req.mode.as_str(),
        "priority": req.priority,
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    fn req(peer: Option<&str>, auth: Option<&str>) -> Request {
        let mut b = axum::http::Request::builder().method("POST").uri("/explain");
        if let Some(a) = auth {
            b = b.header(header::AUTHORIZATION, a);
        }
        let mut r = b.body(Body::empty()).unwrap();
        if let Some(p) = peer {
            r.extensions_mut().insert(ConnectInfo::<SocketAddr>(p.parse().unwrap()));
        }
        r
    }

    #[test]
    fn explain_opens_to_loopback_or_the_bearer_token_only() {
        assert!(explain_allowed(&req(Some("127.0.0.1:5000"), None), None));
        assert!(explain_allowed(&req(Some("[::1]:5000"), None), None));
        assert!(!explain_allowed(&req(Some("10.0.0.7:5000"), None), None));
        assert!(!explain_allowed(&req(None, Some("Bearer s3cret")), None), "no token configured: loopback only");
        let token = Some("s3cret");
        assert!(explain_allowed(&req(Some("10.0.0.7:5000"), Some("Bearer s3cret")), token));
        assert!(!explain_allowed(&req(Some("10.0.0.7:5000"), Some("Bearer s3cre")), token));
        assert!(!explain_allowed(&req(Some("10.0.0.7:5000"), Some("Bearer s3cret2")), token));
        assert!(!explain_allowed(&req(Some("10.0.0.7:5000"), Some("s3cret")), token));
        assert!(!explain_allowed(&req(Some("10.0.0.7:5000"), None), token));
    }
}
