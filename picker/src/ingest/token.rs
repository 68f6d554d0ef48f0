//! Agent identity from a projected ServiceAccount token (docs/design.md §14, "Trust";
//! docs/decisions/0034-agent-identity-service-account-tokens.md).
//!
//! An agent sends its pod's projected, audience-bound ServiceAccount token as gRPC metadata
//! `authorization: Bearer <token>` when it opens its `Report` stream. The picker asks the
//! Kubernetes API who holds it (`authentication.k8s.io/v1` TokenReview with `spec.audiences:
//! [audience]`) and accepts the stream only when:
//! - the review is authenticated and `status.audiences` holds the picker's audience (a token
//!   meant for the API server or another service is refused, as is an expired or unknown one);
//! - the user is the configured agent ServiceAccount (`system:serviceaccount:<ns>:<name>`);
//! - the token is bound to a pod (`extra["authentication.kubernetes.io/pod-name"]`, `pod-uid`).
//!
//! The stream's node is `extra["authentication.kubernetes.io/node-name"]` where the API server
//! puts it there (Kubernetes ≥ 1.30); otherwise the picker reads the bound pod and takes its
//! `spec.nodeName`, after checking that its `metadata.uid` is the token's pod-uid (a pod of the
//! same name created since is another pod). The `Hello`'s `node_name` must then be that node.
//!
//! Positive results are cached (at most `cache_entries`, each for `cache_ttl_ms` and never past
//! the token's own `exp`), so an agent reconnecting does not cost a review each time; refusals are
//! not cached. At most [`MAX_CONCURRENT_REVIEWS`] reviews run at once and each is bounded by
//! `review_timeout_ms`; an API server that does not answer refuses the new stream as
//! `token_review_unavailable` while open streams go on (they were verified when they opened).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use k8s_openapi::api::core::v1::Pod;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::Semaphore;

use super::guard::Refusal;

/// Default `agent_token.audience`: what the agents' projected token volume asks for.
pub const DEFAULT_AUDIENCE: &str = "kvroute-picker";
/// Default `agent_token.service_account`: the agent DaemonSet's ServiceAccount.
pub const DEFAULT_AGENT_SERVICE_ACCOUNT: &str = "kvroute-agent";
/// Default `agent_token.cache_ttl_ms`: how long a positive review is reused.
pub const DEFAULT_CACHE_TTL_MS: u64 = 60_000;
/// Default `agent_token.cache_entries`.
pub const DEFAULT_CACHE_ENTRIES: usize = 4096;
/// Default `agent_token.review_timeout_ms`: one TokenReview (and the pod read, if any).
pub const DEFAULT_REVIEW_TIMEOUT_MS: u64 = 5_000;
/// Longest bearer token accepted, in bytes (a projected token is about 1 KiB).
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;
/// Most TokenReviews in flight at once; further new streams wait for one to finish.
pub const MAX_CONCURRENT_REVIEWS: usize = 16;

/// The `extra` key of the bound pod's name.
pub const POD_NAME_KEY: &str = "authentication.kubernetes.io/pod-name";
/// The `extra` key of the bound pod's uid.
pub const POD_UID_KEY: &str = "authentication.kubernetes.io/pod-uid";
/// The `extra` key of the bound pod's node (Kubernetes ≥ 1.30).
pub const NODE_NAME_KEY: &str = "authentication.kubernetes.io/node-name";

/// How agents prove their node (`agent_auth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AgentAuth {
    /// A projected ServiceAccount token, verified with TokenReview (this module). The ingest is
    /// server-authenticated TLS; client certificates are optional (ReplicaSync's).
    Token,
    /// A client certificate naming `<node>.agent.kvroute` (mTLS, one certificate per node).
    Certificate,
}

/// Settings of [`AgentAuth::Token`] (`agent_token`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentTokenConfig {
    /// The audience the agents' tokens must be for. Default [`DEFAULT_AUDIENCE`].
    pub audience: String,
    /// The agents' ServiceAccount. Default [`DEFAULT_AGENT_SERVICE_ACCOUNT`].
    pub service_account: String,
    /// Its namespace. Default: the pool's namespace.
    pub service_account_namespace: Option<String>,
    /// How long a positive review is reused, ms (never past the token's `exp`). Default
    /// [`DEFAULT_CACHE_TTL_MS`]; 0 disables the cache.
    pub cache_ttl_ms: u64,
    /// Most reviews cached. Default [`DEFAULT_CACHE_ENTRIES`].
    pub cache_entries: usize,
    /// Deadline of one review (TokenReview, plus the pod read without a node-name claim), ms.
    /// Default [`DEFAULT_REVIEW_TIMEOUT_MS`].
    pub review_timeout_ms: u64,
}

impl Default for AgentTokenConfig {
    fn default() -> Self {
        AgentTokenConfig {
            audience: DEFAULT_AUDIENCE.into(),
            service_account: DEFAULT_AGENT_SERVICE_ACCOUNT.into(),
            service_account_namespace: None,
            cache_ttl_ms: DEFAULT_CACHE_TTL_MS,
            cache_entries: DEFAULT_CACHE_ENTRIES,
            review_timeout_ms: DEFAULT_REVIEW_TIMEOUT_MS,
        }
    }
}

/// Who a verified token stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentPod {
    /// The pod's namespace (the ServiceAccount's).
    pub namespace: String,
    /// The agent pod's name.
    pub pod: String,
    /// Its uid.
    pub uid: String,
    /// The node it runs on: the stream's identity.
    pub node: String,
}

/// Why a token was not accepted: the refusal reason and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRefused {
    /// The `epp_ingest_refusals_total` reason.
    pub reason: Refusal,
    /// Detail for the log line.
    pub detail: String,
}

impl TokenRefused {
    fn new(reason: Refusal, detail: impl Into<String>) -> Self {
        TokenRefused { reason, detail: detail.into() }
    }
}

/// What the verifier needs from the API server: a TokenReview, and a pod's uid and node.
#[tonic::async_trait]
pub trait ReviewApi: Send + Sync {
    /// The review of `token` for `audience`; `Err` with what failed when the API did not answer.
    async fn review(&self, token: &str, audience: &str) -> Result<TokenReviewStatus, String>;
    /// The pod `namespace/name`'s `(uid, spec.nodeName)`; `Ok(None)` when it does not exist.
    async fn pod(&self, namespace: &str, name: &str) -> Result<Option<(String, Option<String>)>, String>;
}

/// [`ReviewApi`] over a kube-rs client (needs RBAC: `tokenreviews` create, `pods` get).
#[derive(Clone)]
pub struct KubeReviewApi(pub kube::Client);

#[tonic::async_trait]
impl ReviewApi for KubeReviewApi {
    async fn review(&self, token: &str, audience: &str) -> Result<TokenReviewStatus, String> {
        let api: kube::Api<TokenReview> = kube::Api::all(self.0.clone());
        let review = TokenReview {
            spec: TokenReviewSpec { token: Some(token.to_string()), audiences: Some(vec![audience.to_string()]) },
            ..Default::default()
        };
        let done = api
            .create(&kube::api::PostParams::default(), &review)
            .await
            .map_err(|e| format!("tokenreviews.authentication.k8s.io create: {e}"))?;
        Ok(done.status.unwrap_or_default())
    }

    async fn pod(&self, namespace: &str, name: &str) -> Result<Option<(String, Option<String>)>, String> {
        let api: kube::Api<Pod> = kube::Api::namespaced(self.0.clone(), namespace);
        let pod = api.get_opt(name).await.map_err(|e| format!("pods {namespace}/{name} get: {e}"))?;
        Ok(pod.map(|p| (p.metadata.uid.unwrap_or_default(), p.spec.and_then(|s| s.node_name))))
    }
}

struct Cached {
    pod: AgentPod,
    until: Instant,
}

/// Verifies agents' tokens (see the module doc). Shared by every stream of one picker.
pub struct TokenVerifier {
    api: Arc<dyn ReviewApi>,
    audience: String,
    /// `system:serviceaccount:<ns>:<name>` of the agents.
    username: String,
    namespace: String,
    cache_ttl: Duration,
    cache_entries: usize,
    timeout: Duration,
    cache: Mutex<HashMap<String, Cached>>,
    reviews: Semaphore,
}

impl std::fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenVerifier")
            .field("audience", &self.audience)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// The first value of `extra[key]`, if any.
fn extra<'a>(status: &'a TokenReviewStatus, key: &str) -> Option<&'a str> {
    let user = status.user.as_ref()?;
    user.extra.as_ref()?.get(key)?.first().map(String::as_str).filter(|v| !v.is_empty())
}

/// The token's `exp` claim (seconds since the epoch), read from its JWT payload; `None` without
/// one, or for one past what the system clock can hold. Only used to bound the cache: the token
/// was authenticated by the API server, so its claims are its own.
pub fn token_expiry(token: &str) -> Option<SystemTime> {
    let payload = token.split('.').nth(1)?;
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload.trim_end_matches('=')).ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&raw).ok()?;
    UNIX_EPOCH.checked_add(Duration::from_secs(claims["exp"].as_u64()?))
}

impl TokenVerifier {
    /// A verifier asking `api`, for agents of `config`'s ServiceAccount in `default_namespace`
    /// unless the config names one.
    pub fn new(api: Arc<dyn ReviewApi>, config: &AgentTokenConfig, default_namespace: &str) -> Self {
        let namespace = config.service_account_namespace.clone().unwrap_or_else(|| default_namespace.to_string());
        TokenVerifier {
            api,
            audience: config.audience.clone(),
            username: format!("system:serviceaccount:{namespace}:{}", config.service_account),
            namespace,
            cache_ttl: Duration::from_millis(config.cache_ttl_ms),
            cache_entries: config.cache_entries,
            timeout: Duration::from_millis(config.review_timeout_ms.max(1)),
            cache: Mutex::default(),
            reviews: Semaphore::new(MAX_CONCURRENT_REVIEWS),
        }
    }

    /// The pod and node `token` stands for, or why it is refused.
    pub async fn verify(&self, token: &str) -> Result<AgentPod, TokenRefused> {
        if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
            return Err(TokenRefused::new(
                Refusal::TokenRejected,
                format!("bearer token of {} bytes (1..={MAX_TOKEN_BYTES})", token.len()),
            ));
        }
        if let Some(c) = self.cache.lock().get(token).filter(|c| c.until > Instant::now()) {
            return Ok(c.pod.clone());
        }
        let unavailable = |d: String| TokenRefused::new(Refusal::TokenReviewUnavailable, d);
        let _permit = self.reviews.acquire().await.map_err(|e| unavailable(e.to_string()))?;
        let pod = tokio::time::timeout(self.timeout, self.review(token))
            .await
            .map_err(|_| unavailable(format!("no answer from the API server within {:?}", self.timeout)))??;
        self.remember(token, &pod);
        Ok(pod)
    }

    async fn review(&self, token: &str) -> Result<AgentPod, TokenRefused> {
        let status = self
            .api
            .review(token, &self.audience)
            .await
            .map_err(|e| TokenRefused::new(Refusal::TokenReviewUnavailable, e))?;
        let rejected = |d: String| TokenRefused::new(Refusal::TokenRejected, d);
        if status.authenticated != Some(true) {
            return Err(rejected(format!(
                "TokenReview: not authenticated: {}",
                status.error.as_deref().unwrap_or("(no error given)")
            )));
        }
        if !status.audiences.as_ref().is_some_and(|a| a.contains(&self.audience)) {
            return Err(rejected(format!(
                "TokenReview authenticated the token for {:?}, not for {:?}",
                status.audiences.unwrap_or_default(),
                self.audience
            )));
        }
        let username = status.user.as_ref().and_then(|u| u.username.as_deref()).unwrap_or("");
        if username != self.username {
            return Err(TokenRefused::new(
                Refusal::WrongServiceAccount,
                format!("token of {username:?}; agents run as {:?}", self.username),
            ));
        }
        let (Some(pod), Some(uid)) = (extra(&status, POD_NAME_KEY), extra(&status, POD_UID_KEY)) else {
            return Err(TokenRefused::new(
                Refusal::TokenNotPodBound,
                "the token is not bound to a pod (use a projected serviceAccountToken volume)",
            ));
        };
        let node = match extra(&status, NODE_NAME_KEY) {
            Some(node) => node.to_string(),
            None => self.node_of(pod, uid).await?,
        };
        Ok(AgentPod { namespace: self.namespace.clone(), pod: pod.to_string(), uid: uid.to_string(), node })
    }

    /// The node of pod `name` (in the agents' namespace), which must have uid `uid`.
    async fn node_of(&self, name: &str, uid: &str) -> Result<String, TokenRefused> {
        let found = self
            .api
            .pod(&self.namespace, name)
            .await
            .map_err(|e| TokenRefused::new(Refusal::TokenReviewUnavailable, e))?;
        match found {
            None => Err(TokenRefused::new(Refusal::TokenRejected, format!("the token's pod {name:?} does not exist"))),
            Some((actual, _)) if actual != uid => Err(TokenRefused::new(
                Refusal::PodUidMismatch,
                format!("pod {name:?} has uid {actual}, the token names {uid}"),
            )),
            Some((_, Some(node))) if !node.is_empty() => Ok(node),
            Some(_) => Err(TokenRefused::new(Refusal::TokenNotPodBound, format!("pod {name:?} has no node yet"))),
        }
    }

    fn remember(&self, token: &str, pod: &AgentPod) {
        if self.cache_ttl.is_zero() || self.cache_entries == 0 {
            return;
        }
        let Some(left) = token_expiry(token).and_then(|exp| exp.duration_since(SystemTime::now()).ok()) else {
            return;
        };
        let now = Instant::now();
        let until = now + self.cache_ttl.min(left);
        let mut cache = self.cache.lock();
        if cache.len() >= self.cache_entries && !cache.contains_key(token) {
            cache.retain(|_, c| c.until > now);
            if cache.len() >= self.cache_entries
                && let Some(first) = cache.iter().min_by_key(|(_, c)| c.until).map(|(t, _)| t.clone())
            {
                cache.remove(&first);
            }
        }
        cache.insert(token.to_string(), Cached { pod: pod.clone(), until });
    }

    /// Reviews cached now (expired ones included until evicted).
    pub fn cached(&self) -> usize {
        self.cache.lock().len()
    }
}

/// The bearer token of gRPC metadata `authorization: Bearer <token>`, if any.
pub fn bearer(metadata: &tonic::metadata::MetadataMap) -> Option<&str> {
    let value = metadata.get("authorization")?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::UserInfo;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A review answer per token, a pod table, and a count of reviews.
    #[derive(Default)]
    struct Fake {
        reviews: HashMap<String, TokenReviewStatus>,
        pods: HashMap<String, (String, Option<String>)>,
        asked: AtomicUsize,
        down: bool,
    }

    #[tonic::async_trait]
    impl ReviewApi for Fake {
        async fn review(&self, token: &str, _audience: &str) -> Result<TokenReviewStatus, String> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            if self.down {
                return Err("connection refused".into());
            }
            Ok(self.reviews.get(token).cloned().unwrap_or_default())
        }
        async fn pod(&self, _namespace: &str, name: &str) -> Result<Option<(String, Option<String>)>, String> {
            Ok(self.pods.get(name).cloned())
        }
    }

    /// A distinct JWT-shaped token expiring `exp_in` seconds from now.
    fn jwt(exp_in: i64) -> String {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        let b64 = |s: String| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let jti = NEXT.fetch_add(1, Ordering::Relaxed);
        format!("{}.{}.sig", b64("{}".into()), b64(format!("{{\"exp\":{},\"jti\":\"{jti}\"}}", now + exp_in)))
    }

    fn status(user: &str, extra: &[(&str, &str)], aud: &str) -> TokenReviewStatus {
        let extra: BTreeMap<String, Vec<String>> =
            extra.iter().map(|(k, v)| (k.to_string(), vec![v.to_string()])).collect();
        TokenReviewStatus {
            authenticated: Some(true),
            audiences: Some(vec![aud.into()]),
            user: Some(UserInfo { username: Some(user.into()), extra: Some(extra), ..Default::default() }),
            error: None,
        }
    }

    const AGENT: &str = "system:serviceaccount:ops:kvroute-agent";

    fn verifier(fake: Fake) -> (Arc<Fake>, TokenVerifier) {
        let fake = Arc::new(fake);
        (fake.clone(), TokenVerifier::new(fake, &AgentTokenConfig::default(), "ops"))
    }

    #[tokio::test]
    async fn the_node_comes_from_the_claim_or_the_checked_pod() {
        let (claimed, looked_up, moved, old_pod) = (jwt(3600), jwt(3600), jwt(3600), jwt(3600));
        let mut fake = Fake::default();
        let bound = |pod: &str, uid: &str| [(POD_NAME_KEY, pod.to_string()), (POD_UID_KEY, uid.to_string())];
        let with_node = [(POD_NAME_KEY, "a"), (POD_UID_KEY, "u-a"), (NODE_NAME_KEY, "n1")];
        fake.reviews.insert(claimed.clone(), status(AGENT, &with_node, DEFAULT_AUDIENCE));
        let b = bound("b", "u-b");
        let b: Vec<(&str, &str)> = b.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fake.reviews.insert(looked_up.clone(), status(AGENT, &b, DEFAULT_AUDIENCE));
        fake.pods.insert("b".into(), ("u-b".into(), Some("n2".into())));
        let c = bound("c", "u-c-old");
        let c: Vec<(&str, &str)> = c.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fake.reviews.insert(moved.clone(), status(AGENT, &c, DEFAULT_AUDIENCE));
        fake.pods.insert("c".into(), ("u-c-new".into(), Some("n3".into())));
        let d = bound("d", "u-d");
        let d: Vec<(&str, &str)> = d.iter().map(|(k, v)| (*k, v.as_str())).collect();
        fake.reviews.insert(old_pod.clone(), status(AGENT, &d, DEFAULT_AUDIENCE));
        let (_, v) = verifier(fake);
        assert_eq!(v.verify(&claimed).await.map(|p| p.node), Ok("n1".to_string()));
        assert_eq!(v.verify(&looked_up).await.map(|p| p.node), Ok("n2".to_string()));
        assert_eq!(v.verify(&moved).await.map_err(|e| e.reason), Err(Refusal::PodUidMismatch));
        assert_eq!(v.verify(&old_pod).await.map_err(|e| e.reason), Err(Refusal::TokenRejected));
    }

    #[tokio::test]
    async fn refusals_name_their_reason() {
        let (other_sa, wrong_aud, unbound, unknown) = (jwt(3600), jwt(3600), jwt(3600), jwt(3600));
        let bound = [(POD_NAME_KEY, "a"), (POD_UID_KEY, "u"), (NODE_NAME_KEY, "n1")];
        let mut fake = Fake::default();
        fake.reviews.insert(other_sa.clone(), status("system:serviceaccount:ops:default", &bound, DEFAULT_AUDIENCE));
        fake.reviews.insert(wrong_aud.clone(), status(AGENT, &bound, "https://kubernetes.default.svc"));
        fake.reviews.insert(unbound.clone(), status(AGENT, &[], DEFAULT_AUDIENCE));
        let (_, v) = verifier(fake);
        let reason = |r: Result<AgentPod, TokenRefused>| r.map_err(|e| e.reason).err();
        assert_eq!(reason(v.verify(&other_sa).await), Some(Refusal::WrongServiceAccount));
        assert_eq!(reason(v.verify(&wrong_aud).await), Some(Refusal::TokenRejected));
        assert_eq!(reason(v.verify(&unbound).await), Some(Refusal::TokenNotPodBound));
        assert_eq!(reason(v.verify(&unknown).await), Some(Refusal::TokenRejected));
        assert_eq!(reason(v.verify("").await), Some(Refusal::TokenRejected));
        assert_eq!(reason(v.verify(&"x".repeat(MAX_TOKEN_BYTES + 1)).await), Some(Refusal::TokenRejected));
        let (_, down) = verifier(Fake { down: true, ..Fake::default() });
        assert_eq!(reason(down.verify(&unknown).await), Some(Refusal::TokenReviewUnavailable));
        assert_eq!(v.cached(), 0, "refusals are not cached");
    }

    #[tokio::test]
    async fn positive_reviews_are_cached_within_bounds() {
        let bound = [(POD_NAME_KEY, "a"), (POD_UID_KEY, "u"), (NODE_NAME_KEY, "n1")];
        let (fresh, expired, opaque) = (jwt(3600), jwt(-10), "not-a-jwt".to_string());
        let mut fake = Fake::default();
        for t in [&fresh, &expired, &opaque] {
            fake.reviews.insert(t.clone(), status(AGENT, &bound, DEFAULT_AUDIENCE));
        }
        let extra: Vec<String> = (0..5).map(|i| jwt(3600 + i)).collect();
        for t in &extra {
            fake.reviews.insert(t.clone(), status(AGENT, &bound, DEFAULT_AUDIENCE));
        }
        let fake = Arc::new(fake);
        let config = AgentTokenConfig { cache_entries: 3, ..AgentTokenConfig::default() };
        let v = TokenVerifier::new(fake.clone(), &config, "ops");
        for _ in 0..3 {
            assert!(v.verify(&fresh).await.is_ok());
        }
        assert_eq!(fake.asked.load(Ordering::Relaxed), 1, "one review, then the cache");
        // Past its exp, or without a readable one, a token is reviewed every time.
        for t in [&expired, &opaque] {
            assert!(v.verify(t).await.is_ok());
            assert!(v.verify(t).await.is_ok());
        }
        assert_eq!(fake.asked.load(Ordering::Relaxed), 5);
        for t in &extra {
            assert!(v.verify(t).await.is_ok());
        }
        assert!(v.cached() <= 3, "{} cached", v.cached());
    }

    /// An `exp` past what `SystemTime` holds is no expiry, not a panic.
    #[test]
    fn expiry_past_the_clock_is_none() {
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let token = |exp: &str| format!("{}.{}.sig", b64("{}"), b64(&format!("{{\"exp\":{exp}}}")));
        assert_eq!(token_expiry(&token(&u64::MAX.to_string())), None);
        assert_eq!(token_expiry(&token("4102444800")), Some(UNIX_EPOCH + Duration::from_secs(4_102_444_800)));
        assert_eq!(token_expiry(&token("-1")), None);
    }

    #[test]
    fn bearer_metadata_is_parsed_strictly() {
        let mut m = tonic::metadata::MetadataMap::new();
        assert_eq!(bearer(&m), None);
        m.insert("authorization", "Bearer abc.def".parse().unwrap());
        assert_eq!(bearer(&m), Some("abc.def"));
        m.insert("authorization", "Basic abc".parse().unwrap());
        assert_eq!(bearer(&m), None);
        m.insert("authorization", "Bearer ".parse().unwrap());
        assert_eq!(bearer(&m), None);
    }
}
