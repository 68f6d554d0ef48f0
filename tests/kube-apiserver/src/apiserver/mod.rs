//! A stand-in for the Kubernetes API server: the REST list/watch protocol that kube-rs and
//! client-go speak, over plain HTTP/1.1, for namespaced resources registered with it.
//!
//! What it implements, as the real server does (wire shapes checked against recorded v1.33
//! responses in `tests/fixtures/kube-apiserver`, see `tests/wire.rs`):
//! - `GET …/namespaces/{ns}/{plural}` and `GET /api(s)/…/{plural}` (all namespaces): a list with
//!   `metadata.resourceVersion`; `limit` + `continue` pagination over a consistent snapshot;
//!   `resourceVersion=0` served from "cache" (no pagination); `resourceVersionMatch=Exact`.
//! - `?watch=true`: a stream of `{"type":…,"object":…}` JSON lines (ADDED, MODIFIED, DELETED,
//!   BOOKMARK, ERROR); resume from `resourceVersion`; without one, synthetic ADDED for what exists;
//!   `sendInitialEvents=true` ends the initial events with a BOOKMARK annotated
//!   `k8s.io/initial-events-end`; `allowWatchBookmarks` (periodic BOOKMARKs); `timeoutSeconds`.
//!   A label or field selector turns a change into ADDED/DELETED when the object starts/stops
//!   matching. A resume from a compacted resourceVersion is `200 OK` with one ERROR event
//!   (`410`, reason `Expired`, "too old resource version: N (M)"), which is how the real server
//!   answers and what makes kube-rs relist.
//! - `labelSelector` (`=`, `==`, `!=`, `in`, `notin`, exists, `!`), `fieldSelector` with the
//!   resource's supported fields (pods: `spec.nodeName`, `status.phase`, …; unsupported = 400).
//! - `GET`, `POST`, `PUT` (also `/status`), `DELETE` of one object.
//! - `POST /apis/authentication.k8s.io/v1/tokenreviews` for ServiceAccount tokens it issued
//!   ([`ApiServer::issue_token`]) or a test registered ([`tokens`]).
//!
//! Not implemented: authentication of its own callers, discovery, PATCH, admission/defaulting, graceful deletion
//! (set `metadata.deletionTimestamp` with a modify, then delete, to play it).

mod http;
pub mod selector;
mod store;
pub mod tokens;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

pub use store::{EventType, RequestCounts, ResourceType, Store};
pub use tokens::{BoundPod, TokenSpec};

/// An API error, rendered as a `Status` object with its HTTP code.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiError {
    /// HTTP status code.
    pub code: u16,
    /// `Status.reason` (`NotFound`, `AlreadyExists`, `Expired`, …).
    pub reason: &'static str,
    /// `Status.message`.
    pub message: String,
}

impl ApiError {
    pub(crate) fn not_found_resource() -> Self {
        Self { code: 404, reason: "NotFound", message: "the server could not find the requested resource".into() }
    }
    pub(crate) fn not_found(res: &ResourceType, name: &str) -> Self {
        Self { code: 404, reason: "NotFound", message: format!("{} \"{name}\" not found", group_resource(res)) }
    }
    pub(crate) fn already_exists(res: &ResourceType, name: &str) -> Self {
        Self {
            code: 409,
            reason: "AlreadyExists",
            message: format!("{} \"{name}\" already exists", group_resource(res)),
        }
    }
    pub(crate) fn invalid(message: &str) -> Self {
        Self { code: 422, reason: "Invalid", message: message.into() }
    }
    pub(crate) fn bad_request(message: &str) -> Self {
        Self { code: 400, reason: "BadRequest", message: message.into() }
    }
    /// The `Status` object the API server sends for this error.
    pub fn status(&self) -> Value {
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        })
    }
}

fn group_resource(res: &ResourceType) -> String {
    if res.group.is_empty() { res.plural.clone() } else { format!("{}.{}", res.plural, res.group) }
}

/// Tunables of a stand-in instance.
#[derive(Debug, Clone)]
pub struct Options {
    /// Events kept for resuming watches (the watch cache's window). Default 1000.
    pub history: usize,
    /// Period of BOOKMARK events on watches that allow them. Default 60 s (upstream's
    /// bookmark frequency is about one a minute).
    pub bookmark_interval: Duration,
    /// Watch duration when the client sends no `timeoutSeconds`. Default 1800 s.
    pub default_watch_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            history: 1000,
            bookmark_interval: Duration::from_secs(60),
            default_watch_timeout: Duration::from_secs(1800),
        }
    }
}

/// A running stand-in: an HTTP server on loopback plus its store. Stops when dropped.
pub struct ApiServer {
    addr: SocketAddr,
    store: Arc<Store>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl ApiServer {
    /// Starts on `127.0.0.1:0` with default options and the resources kvroute reads registered
    /// (Pods, EndpointSlices; register custom resources with [`ApiServer::register`]).
    ///
    /// # Errors
    /// The listener could not bind.
    pub async fn start() -> std::io::Result<Self> {
        Self::start_with(SocketAddr::from(([127, 0, 0, 1], 0)), Options::default()).await
    }

    /// Starts on `addr` with `options`.
    ///
    /// # Errors
    /// The listener could not bind.
    pub async fn start_with(addr: SocketAddr, options: Options) -> std::io::Result<Self> {
        let store = Arc::new(Store::new(options.history));
        store.register(ResourceType::of::<k8s_openapi::api::core::v1::Pod>());
        store.register(ResourceType::of::<k8s_openapi::api::discovery::v1::EndpointSlice>());
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let app = http::router(store.clone(), options);
        let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let served = axum::serve(listener, app).with_graceful_shutdown(async {
                let _ = stop.await;
            });
            if let Err(e) = served.await {
                tracing::error!(error = %e, "kube-apiserver stand-in stopped");
            }
        });
        Ok(Self { addr, store, shutdown: Some(shutdown) })
    }

    /// Listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The store behind the server (mutations, counters, history control).
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// A kubeconfig file's text (YAML, no credentials) pointing at this server with `namespace` as
    /// default: what a binary under test reads through `KUBECONFIG`.
    pub fn kubeconfig(&self, namespace: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster: {{server: \"{}\"}}\n\
             users:\n- name: stand-in\n  user: {{}}\ncontexts:\n- name: stand-in\n  \
             context: {{cluster: stand-in, user: stand-in, namespace: \"{namespace}\"}}\ncurrent-context: stand-in\n",
            self.url()
        )
    }

    /// A kube-rs configuration pointing at this server with `namespace` as default.
    pub fn kube_config(&self, namespace: &str) -> kube::Config {
        // The URL is built from a socket address: always a valid URI.
        let uri = self.url().parse().unwrap_or_else(|_| http_uri_fallback());
        let mut config = kube::Config::new(uri);
        config.default_namespace = namespace.to_string();
        config
    }

    /// A kube-rs client for this server.
    ///
    /// # Errors
    /// kube could not build its HTTP stack.
    pub fn client(&self, namespace: &str) -> Result<kube::Client, kube::Error> {
        kube::Client::try_from(self.kube_config(namespace))
    }

    /// Registers the resource of `K` (a `#[derive(CustomResource)]` or k8s-openapi type).
    pub fn register<K: kube::Resource<DynamicType = ()>>(&self) {
        self.store.register(ResourceType::of::<K>());
    }

    /// Creates `obj` (namespace from its metadata, else `default`); returns it as stored.
    ///
    /// # Errors
    /// As [`Store::create`]; 400 if `obj` does not serialise.
    pub fn create<K: kube::Resource<DynamicType = ()> + Serialize + DeserializeOwned>(
        &self,
        obj: &K,
    ) -> Result<K, ApiError> {
        let v = to_value(obj)?;
        from_value(self.store.create(&ResourceType::of::<K>(), None, v)?)
    }

    /// Creates `obj`, or replaces it if it exists.
    ///
    /// # Errors
    /// As [`Store::create`] / [`Store::replace`].
    pub fn apply<K: kube::Resource<DynamicType = ()> + Serialize + DeserializeOwned>(
        &self,
        obj: &K,
    ) -> Result<K, ApiError> {
        let res = ResourceType::of::<K>();
        let v = to_value(obj)?;
        match self.store.create(&res, None, v.clone()) {
            Err(e) if e.code == 409 => from_value(self.store.replace(&res, None, v)?),
            other => from_value(other?),
        }
    }

    /// Changes the object `namespace/name` through `f` (typed read-modify-write).
    ///
    /// # Errors
    /// 404 if absent; 400 if it does not round-trip through `K`.
    pub fn modify<K: kube::Resource<DynamicType = ()> + Serialize + DeserializeOwned>(
        &self,
        namespace: &str,
        name: &str,
        f: impl FnOnce(&mut K),
    ) -> Result<K, ApiError> {
        let res = ResourceType::of::<K>();
        let current = self.store.get(&res, namespace, name).ok_or_else(|| ApiError::not_found(&res, name))?;
        let mut typed: K = from_value(current)?;
        f(&mut typed);
        from_value(self.store.replace(&res, Some(namespace), to_value(&typed)?)?)
    }

    /// Deletes the object `namespace/name`.
    ///
    /// # Errors
    /// 404 if absent.
    pub fn delete<K: kube::Resource<DynamicType = ()>>(&self, namespace: &str, name: &str) -> Result<(), ApiError> {
        self.store.delete(&ResourceType::of::<K>(), namespace, name).map(|_| ())
    }

    /// Issues a ServiceAccount token for `spec` (JWT-shaped, see [`tokens`]) that TokenReview
    /// authenticates until `spec.expires_at`, while its bound pod exists with its uid.
    pub fn issue_token(&self, spec: TokenSpec) -> String {
        self.store.tokens.issue(spec)
    }

    /// Makes `token` (any string) stand for `spec` in TokenReview.
    pub fn register_token(&self, token: &str, spec: TokenSpec) {
        self.store.tokens.register(token, spec);
    }

    /// Forgets `token`: later reviews answer unauthenticated.
    pub fn revoke_token(&self, token: &str) {
        self.store.tokens.revoke(token);
    }

    /// TokenReviews answered so far.
    pub fn token_reviews(&self) -> u64 {
        self.store.tokens.reviews()
    }

    /// Requests served for `K`'s resource.
    pub fn counts<K: kube::Resource<DynamicType = ()>>(&self) -> RequestCounts {
        self.store.counts(&ResourceType::of::<K>())
    }
}

impl Drop for ApiServer {
    /// Stops accepting, ends every watch stream and closes the connections.
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        self.store.resume();
        self.store.drop_watches();
    }
}

fn http_uri_fallback() -> axum::http::Uri {
    axum::http::Uri::from_static("http://127.0.0.1")
}

fn to_value<T: Serialize>(obj: &T) -> Result<Value, ApiError> {
    serde_json::to_value(obj).map_err(|e| ApiError::bad_request(&format!("object does not serialise: {e}")))
}

fn from_value<T: DeserializeOwned>(v: Value) -> Result<T, ApiError> {
    serde_json::from_value(v).map_err(|e| ApiError::bad_request(&format!("object does not deserialise: {e}")))
}
