//! HTTP routes of the API stand-in: path parsing, list, watch, and single-object verbs.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use super::selector::{FieldSelector, LabelSelector};
use super::store::{EventType, StoredEvent};
use super::{ApiError, Options, ResourceType, Store};

/// Upper bound of a request body (`POST`/`PUT`).
const MAX_BODY: usize = 4 << 20;
/// Upper bound of `limit` honoured in one page.
const MAX_LIMIT: usize = 10_000;

#[derive(Clone)]
struct App {
    store: Arc<Store>,
    options: Options,
}

pub(crate) fn router(store: Arc<Store>, options: Options) -> Router {
    Router::new().fallback(handle).with_state(App { store, options })
}

/// What a path names.
struct Target {
    res: ResourceType,
    namespace: Option<String>,
    name: Option<String>,
}

fn parse_path(store: &Store, path: &str) -> Result<Target, ApiError> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return Err(ApiError::not_found_resource()),
    };
    let (namespace, plural, name) = match rest {
        ["namespaces", ns, plural] => (Some(*ns), *plural, None),
        ["namespaces", ns, plural, name] | ["namespaces", ns, plural, name, "status"] => {
            (Some(*ns), *plural, Some(*name))
        }
        [plural] => (None, *plural, None),
        _ => return Err(ApiError::not_found_resource()),
    };
    let res = store.resource(group, plural).ok_or_else(ApiError::not_found_resource)?;
    let version_ok = match segs.as_slice() {
        ["api", v, ..] | ["apis", _, v, ..] => *v == res.version,
        _ => false,
    };
    if !version_ok {
        return Err(ApiError::not_found_resource());
    }
    Ok(Target { res, namespace: namespace.map(str::to_string), name: name.map(str::to_string) })
}

async fn handle(State(app): State<App>, method: Method, uri: Uri, body: Body) -> Response {
    app.store.log_request(format!("{method} {uri}"));
    let mut paused = app.store.paused.subscribe();
    // Only errors when the store is gone, which cannot happen while it serves.
    let _ = paused.wait_for(|p| !*p).await;
    match route(&app, &method, &uri, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    }
}

fn error_response(e: &ApiError) -> Response {
    let code = StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(code, &e.status())
}

fn json_response(code: StatusCode, v: &Value) -> Response {
    (code, [(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

async fn read_body(body: Body) -> Result<Value, ApiError> {
    let bytes = axum::body::to_bytes(body, MAX_BODY).await.map_err(|e| ApiError::bad_request(&e.to_string()))?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::bad_request(&format!("invalid JSON body: {e}")))
}

/// The path of TokenReview's create (docs: `tokens.rs`).
const TOKEN_REVIEWS: &str = "/apis/authentication.k8s.io/v1/tokenreviews";

async fn route(app: &App, method: &Method, uri: &Uri, body: Body) -> Result<Response, ApiError> {
    if uri.path().trim_end_matches('/') == TOKEN_REVIEWS {
        if method != Method::POST {
            return Err(ApiError {
                code: 405,
                reason: "MethodNotAllowed",
                message: format!("{method} is not supported here"),
            });
        }
        let review = read_body(body).await?;
        let pods = ResourceType::of::<k8s_openapi::api::core::v1::Pod>();
        let pod_uid = |ns: &str, name: &str| {
            app.store.get(&pods, ns, name).and_then(|p| p["metadata"]["uid"].as_str().map(str::to_string))
        };
        let answer = app.store.tokens.review(&review, pod_uid)?;
        return Ok(json_response(StatusCode::CREATED, &answer));
    }
    let target = parse_path(&app.store, uri.path())?;
    let query: HashMap<String, String> = Query::try_from_uri(uri).map(|q| q.0).unwrap_or_default();
    let Target { res, namespace, name } = target;
    match (method.clone(), name) {
        (Method::GET, None) if query.get("watch").is_some_and(|w| w == "true" || w == "1") => {
            watch(app, res, namespace, &query)
        }
        (Method::GET, None) => {
            list(&app.store, &res, namespace.as_deref(), &query).map(|v| json_response(StatusCode::OK, &v))
        }
        (Method::GET, Some(name)) => {
            let ns = namespace.ok_or_else(ApiError::not_found_resource)?;
            let obj = app.store.get(&res, &ns, &name).ok_or_else(|| ApiError::not_found(&res, &name))?;
            Ok(json_response(StatusCode::OK, &obj))
        }
        (Method::POST, None) => {
            let obj = app.store.create(&res, namespace.as_deref(), read_body(body).await?)?;
            Ok(json_response(StatusCode::CREATED, &obj))
        }
        (Method::PUT, Some(name)) => {
            let obj = read_body(body).await?;
            if obj["metadata"]["name"].as_str() != Some(name.as_str()) {
                return Err(ApiError::bad_request("the name of the object does not match the name on the URL"));
            }
            let obj = app.store.replace(&res, namespace.as_deref(), obj)?;
            Ok(json_response(StatusCode::OK, &obj))
        }
        (Method::DELETE, Some(name)) => {
            let ns = namespace.ok_or_else(ApiError::not_found_resource)?;
            let last = app.store.delete(&res, &ns, &name)?;
            if res.builtin {
                Ok(json_response(StatusCode::OK, &last))
            } else {
                let details =
                    json!({"name": name, "group": res.group, "kind": res.plural, "uid": last["metadata"]["uid"]});
                let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details});
                Ok(json_response(StatusCode::OK, &status))
            }
        }
        _ => {
            Err(ApiError { code: 405, reason: "MethodNotAllowed", message: format!("{method} is not supported here") })
        }
    }
}

struct Filters {
    namespace: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
}

impl Filters {
    fn new(res: &ResourceType, namespace: Option<String>, query: &HashMap<String, String>) -> Result<Self, ApiError> {
        let labels = LabelSelector::parse(query.get("labelSelector").map_or("", String::as_str))
            .map_err(|e| ApiError::bad_request(&e.0))?;
        let fields = FieldSelector::parse(query.get("fieldSelector").map_or("", String::as_str), &res.field_labels)
            .map_err(|e| ApiError::bad_request(&e.0))?;
        Ok(Self { namespace, labels, fields })
    }
    fn matches(&self, obj: &Value) -> bool {
        let ns_ok = self.namespace.as_deref().is_none_or(|ns| obj["metadata"]["namespace"].as_str() == Some(ns));
        ns_ok && self.labels.matches(obj["metadata"]["labels"].as_object()) && self.fields.matches(obj)
    }
}

fn object_key(obj: &Value) -> String {
    format!(
        "{}/{}",
        obj["metadata"]["namespace"].as_str().unwrap_or(""),
        obj["metadata"]["name"].as_str().unwrap_or("")
    )
}

fn expired_continue() -> ApiError {
    ApiError {
        code: 410,
        reason: "Expired",
        message: "The provided continue parameter is too old to display a consistent list result. You can start a new \
                  list without the continue parameter, or use the continue token in this response to retrieve the \
                  remainder of the results. Continuing with the provided token results in an inconsistent list - objects \
                  that were created, modified, or deleted between the time the first chunk was returned and now may show \
                  up in the list."
            .into(),
    }
}

fn encode_continue(rv: u64, start: &str) -> String {
    let token = json!({"v": "meta.k8s.io/v1", "rv": rv, "start": start});
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(token.to_string())
}

fn decode_continue(token: &str) -> Option<(u64, String)> {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(token.trim_end_matches('=')).ok()?;
    let v: Value = serde_json::from_slice(&raw).ok()?;
    Some((v["rv"].as_u64()?, v["start"].as_str()?.to_string()))
}

fn parse_rv(s: &str) -> Result<u64, ApiError> {
    s.parse().map_err(|_| ApiError::bad_request(&format!("invalid resource version: {s:?}")))
}

fn list(
    store: &Store,
    res: &ResourceType,
    namespace: Option<&str>,
    query: &HashMap<String, String>,
) -> Result<Value, ApiError> {
    let filters = Filters::new(res, namespace.map(str::to_string), query)?;
    let limit = match query.get("limit").map(String::as_str) {
        None | Some("") | Some("0") => None,
        Some(l) => Some(l.parse::<usize>().map_err(|_| ApiError::bad_request("invalid limit"))?.min(MAX_LIMIT)),
    };
    let rv_param = query.get("resourceVersion").map(String::as_str).unwrap_or("");
    let exact = query.get("resourceVersionMatch").is_some_and(|m| m == "Exact");
    let mut inner = store.lock();
    inner.counts.entry((res.group.clone(), res.plural.clone())).or_default().lists += 1;
    let (snapshot, list_rv, start, paginate) = if let Some(token) = query.get("continue").filter(|t| !t.is_empty()) {
        let (rv, start) = decode_continue(token).ok_or_else(|| ApiError::bad_request("continue key is not valid"))?;
        let snap = Store::snapshot_at(&inner, res, namespace, rv).map_err(|()| expired_continue())?;
        (snap, rv, Some(start), true)
    } else if rv_param.is_empty() {
        (Store::snapshot_at(&inner, res, namespace, inner.rv).unwrap_or_default(), inner.rv, None, true)
    } else if rv_param == "0" {
        (Store::snapshot_at(&inner, res, namespace, inner.rv).unwrap_or_default(), inner.rv, None, false)
    } else {
        let rv = parse_rv(rv_param)?;
        if rv > inner.rv {
            return Err(ApiError {
                code: 504,
                reason: "Timeout",
                message: format!("Too large resource version: {rv}, current: {}", inner.rv),
            });
        }
        if exact {
            let snap = Store::snapshot_at(&inner, res, namespace, rv).map_err(|()| ApiError {
                code: 410,
                reason: "Expired",
                message: format!("too old resource version: {rv} ({})", inner.compacted_rv),
            })?;
            (snap, rv, None, true)
        } else {
            (Store::snapshot_at(&inner, res, namespace, inner.rv).unwrap_or_default(), inner.rv, None, true)
        }
    };
    drop(inner);
    let mut items: Vec<(String, Arc<Value>)> =
        snapshot.into_iter().filter(|o| filters.matches(o)).map(|o| (object_key(&o), o)).collect();
    items.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(start) = &start {
        items.retain(|(k, _)| k.as_str() >= start.as_str());
    }
    let mut continue_token = String::new();
    let mut remaining = None;
    if paginate && let Some(limit) = limit.filter(|l| *l < items.len()) {
        remaining = Some(items.len() - limit);
        items.truncate(limit);
        if let Some((last, _)) = items.last() {
            continue_token = encode_continue(list_rv, &format!("{last}\u{0}"));
        }
    }
    let items: Vec<Value> = items
        .into_iter()
        .map(|(_, o)| {
            let mut o = (*o).clone();
            if res.builtin
                && let Some(m) = o.as_object_mut()
            {
                m.remove("kind");
                m.remove("apiVersion");
            }
            o
        })
        .collect();
    let mut metadata = json!({"resourceVersion": list_rv.to_string()});
    if !continue_token.is_empty() {
        metadata["continue"] = json!(continue_token);
    } else if !res.builtin {
        metadata["continue"] = json!("");
    }
    if let Some(r) = remaining {
        metadata["remainingItemCount"] = json!(r);
    }
    Ok(
        json!({"kind": format!("{}List", res.kind), "apiVersion": res.api_version(), "metadata": metadata, "items": items}),
    )
}

/// Parameters of one watch request.
struct WatchRequest {
    res: ResourceType,
    filters: Filters,
    bookmarks: bool,
    timeout: Duration,
    bookmark_interval: Duration,
}

fn watch(
    app: &App,
    res: ResourceType,
    namespace: Option<String>,
    query: &HashMap<String, String>,
) -> Result<Response, ApiError> {
    let filters = Filters::new(&res, namespace, query)?;
    let flag = |k: &str| query.get(k).is_some_and(|v| v == "true" || v == "1");
    let bookmarks = flag("allowWatchBookmarks");
    let initial_events = flag("sendInitialEvents");
    if initial_events && !bookmarks {
        return Err(ApiError::invalid(
            "allowWatchBookmarks: Required value: allowWatchBookmarks must be set to true when sendInitialEvents is set",
        ));
    }
    let timeout = match query.get("timeoutSeconds") {
        Some(t) => Duration::from_secs(t.parse::<u64>().map_err(|_| ApiError::bad_request("invalid timeoutSeconds"))?),
        None => app.options.default_watch_timeout,
    };
    let rv_param = query.get("resourceVersion").map(String::as_str).unwrap_or("");
    let resume_from = match rv_param {
        "" | "0" => None,
        s => Some(parse_rv(s)?),
    };
    let store = app.store.clone();
    // Snapshot, backlog and subscription are taken under one lock so no write falls between them.
    let mut inner = store.lock();
    let res_key = (res.group.clone(), res.plural.clone());
    inner.counts.entry(res_key.clone()).or_default().watches += 1;
    let rx = store.subscribe();
    let stop = store.drop_epoch.subscribe();
    let start = match resume_from {
        Some(rv) if !initial_events && rv < inner.compacted_rv => {
            inner.counts.entry(res_key).or_default().expired += 1;
            let status = ApiError {
                code: 410,
                reason: "Expired",
                message: format!("too old resource version: {rv} ({})", inner.compacted_rv),
            };
            let line = format!("{}\n", json!({"type": "ERROR", "object": status.status()}));
            return Ok(stream_response(futures::stream::once(async move { Ok(Bytes::from(line)) })));
        }
        Some(rv) if !initial_events => {
            let backlog: Vec<Arc<StoredEvent>> = inner.log.iter().filter(|e| e.rv > rv).cloned().collect();
            Start::Resume { from: rv, backlog }
        }
        _ => {
            let objects = Store::snapshot_at(&inner, &res, filters.namespace.as_deref(), inner.rv).unwrap_or_default();
            Start::Initial { objects, at: inner.rv, end_bookmark: initial_events }
        }
    };
    drop(inner);
    let (tx, out) = mpsc::channel::<Result<Bytes, Infallible>>(256);
    let req = WatchRequest { res, filters, bookmarks, timeout, bookmark_interval: app.options.bookmark_interval };
    tokio::spawn(run_watch(req, start, rx, stop, tx));
    Ok(stream_response(ReceiverStream::new(out)))
}

fn stream_response<S>(stream: S) -> Response
where
    S: futures::Stream<Item = Result<Bytes, Infallible>> + Send + 'static,
{
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], Body::from_stream(stream)).into_response()
}

enum Start {
    Initial { objects: Vec<Arc<Value>>, at: u64, end_bookmark: bool },
    Resume { from: u64, backlog: Vec<Arc<StoredEvent>> },
}

fn line(kind: &str, object: &Value) -> Bytes {
    Bytes::from(format!("{}\n", json!({"type": kind, "object": object})))
}

/// The event a watcher with `filters` sees for `ev`: selector transitions become ADDED/DELETED.
fn visible(ev: &StoredEvent, req: &WatchRequest) -> Option<Bytes> {
    if ev.resource() != (req.res.group.clone(), req.res.plural.clone())
        || req.filters.namespace.as_deref().is_some_and(|ns| ns != ev.namespace())
    {
        return None;
    }
    let now = req.filters.matches(&ev.object);
    let before = ev.prev.as_ref().is_some_and(|p| req.filters.matches(p));
    match ev.kind {
        EventType::Added => now.then(|| line("ADDED", &ev.object)),
        EventType::Modified => match (before, now) {
            (true, true) => Some(line("MODIFIED", &ev.object)),
            (false, true) => Some(line("ADDED", &ev.object)),
            (true, false) => Some(line("DELETED", &ev.object)),
            (false, false) => None,
        },
        EventType::Deleted => before.then(|| line("DELETED", &ev.object)),
    }
}

async fn run_watch(
    req: WatchRequest,
    start: Start,
    mut rx: broadcast::Receiver<Arc<StoredEvent>>,
    mut stop: tokio::sync::watch::Receiver<u64>,
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
) {
    let send = |b: Bytes| {
        let tx = tx.clone();
        async move { tx.send(Ok(b)).await.is_ok() }
    };
    let mut last_rv = match start {
        Start::Initial { objects, at, end_bookmark } => {
            for o in objects.iter().filter(|o| req.filters.matches(o)) {
                if !send(line("ADDED", o)).await {
                    return;
                }
            }
            if end_bookmark {
                let mut ann = json!({"k8s.io/initial-events-end": "true"});
                if let Some(bp) = req.res.list_blueprint() {
                    ann["kubernetes.io/initial-events-list-blueprint"] = json!(bp);
                }
                if !send(line("BOOKMARK", &req.res.bookmark(at, Some(ann)))).await {
                    return;
                }
            }
            at
        }
        Start::Resume { from, backlog } => {
            let mut last = from;
            for ev in &backlog {
                last = ev.rv;
                if let Some(b) = visible(ev, &req)
                    && !send(b).await
                {
                    return;
                }
            }
            last
        }
    };
    let deadline = tokio::time::sleep(req.timeout);
    tokio::pin!(deadline);
    let mut ticker =
        tokio::time::interval_at(tokio::time::Instant::now() + req.bookmark_interval, req.bookmark_interval);
    loop {
        tokio::select! {
            // A dropped connection delivers nothing after the drop.
            biased;
            _ = stop.changed() => return,
            _ = tx.closed() => return,
            ev = rx.recv() => match ev {
                Ok(ev) => {
                    if ev.rv <= last_rv {
                        continue;
                    }
                    last_rv = ev.rv;
                    if let Some(b) = visible(&ev, &req) && !send(b).await {
                        return;
                    }
                }
                // A watcher that falls this far behind is closed, as the real server closes slow
                // watchers; the client resumes from its last resourceVersion.
                Err(broadcast::error::RecvError::Lagged(_)) | Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = ticker.tick(), if req.bookmarks => {
                // Everything written before the bookmark must be sent before it.
                loop {
                    let ev = match rx.try_recv() {
                        Ok(ev) => ev,
                        Err(broadcast::error::TryRecvError::Empty) => break,
                        Err(_) => return,
                    };
                    if ev.rv <= last_rv {
                        continue;
                    }
                    last_rv = ev.rv;
                    if let Some(b) = visible(&ev, &req) && !send(b).await {
                        return;
                    }
                }
                if !send(line("BOOKMARK", &req.res.bookmark(last_rv, None))).await {
                    return;
                }
            }
            _ = &mut deadline => return,
        }
    }
}
