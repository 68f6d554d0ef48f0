//! Who may report what (docs/design.md §14, "Trust"): the agent's node identity, the scope of its
//! claims, pod ownership by the live stream, caps, and range checks of reported stats. Everything
//! refused is counted by reason (`epp_ingest_refusals_total{reason}`) and logged once per cause
//! (reason, node or peer).
//!
//! - **Identity.** The stream's node is the `node_name` of its `Hello`, accepted only when the
//!   agent proved it: with token identity (`agent_auth: token`, [`super::token`]) the node of the
//!   pod its ServiceAccount token is bound to, verified with TokenReview when the stream opens; with
//!   certificate identity (mTLS) a client certificate naming it as DNS SAN
//!   `<node>.agent.kvroute` ([`AGENT_SAN_SUFFIX`]), and no wildcard covering it. Without TLS
//!   (`--insecure-ingest`) the `Hello`'s node is taken on trust. Reports before an accepted
//!   `Hello` are refused.
//! - **Scope.** A pod is accepted from a stream only when the [`ReportScope`] admits it for the
//!   stream's node: with the pool view, the pod is in the InferencePool and `spec.nodeName` is
//!   that node ([`kvroute_cluster::PoolView::admits_report`]).
//! - **Ownership.** A pod belongs to the stream that claimed it first ([`Claims`]) until that
//!   stream ends or lists it no more; another stream naming it meanwhile is refused, so it can
//!   neither overwrite it nor, by closing, drop it. A released pod may be claimed by the next
//!   stream (an agent reconnecting, a pod rescheduled).
//! - **Caps.** At most `max_pods_per_stream` pods per stream and `max_pods` claimed pods in all
//!   (pods released less than a grace period ago still count).
//! - **Ranges.** `health_score`, `kv_cache_usage` and `gpu_utilization` are finite and in [0, 1];
//!   stats outside are refused whole (the pod keeps its previous stats, or stays unready), never
//!   clamped.
//!
//! Concurrency: [`Claims`] and the log-once set are short mutex sections shared by all streams;
//! counters are atomics.

use std::collections::{HashMap, HashSet};
use std::fmt::Display;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_cluster::{PoolView, Watched};
use kvroute_proto::agent::v1::{PodInfo, PodStats};
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rustls_pki_types::{CertificateDer, ServerName};
use tracing::warn;

use crate::metrics::ReasonLabel;
use crate::pool::StreamId;

/// Suffix of the DNS SAN that names an agent's node: `<node>.agent.kvroute`.
pub const AGENT_SAN_SUFFIX: &str = ".agent.kvroute";
/// The DNS SAN of a picker's certificate (the name agents verify), which a `ReplicaSync`
/// subscriber's client certificate must carry under mTLS.
pub const REPLICA_SAN: &str = "picker.kvroute";
/// First label of the probe name that tells a wildcard certificate apart.
const WILDCARD_PROBE: &str = "kvroute-wildcard-probe";
/// Default of [`Limits::max_pods_per_stream`]: far above any node's engines (8 GPUs × ranks).
pub const DEFAULT_MAX_PODS_PER_STREAM: usize = 256;
/// Default of [`Limits::max_pods`]: the pool view's own cap (`kvroute_cluster::pool::MAX_POOL_PODS`).
pub const DEFAULT_MAX_PODS: usize = kvroute_cluster::pool::MAX_POOL_PODS;
/// Longest engine name accepted, in bytes (a DNS subdomain plus `-rank-<i>`).
pub const MAX_POD_NAME_BYTES: usize = 320;
/// Most distinct refusal causes logged; later new causes are only counted.
const MAX_LOGGED_CAUSES: usize = 4096;

/// Why something an agent sent was refused (the `reason` label).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// TLS handshake without a client certificate.
    NoClientCertificate,
    /// Client certificate not chained to the configured CA (self-signed, another CA, expired).
    UntrustedCertificate,
    /// Other TLS handshake failure (plaintext on a TLS port, timeout, protocol error).
    TlsHandshake,
    /// The `Hello`'s node is not the one the client certificate names.
    NodeNotInCertificate,
    /// A pod report before any accepted `Hello` on the stream.
    NoHello,
    /// The pod is not in the InferencePool.
    NotInPool,
    /// The pod is in the pool but scheduled on another node.
    WrongNode,
    /// Another live stream owns the pod.
    OwnedByOtherStream,
    /// The stream already holds `max_pods_per_stream` pods.
    StreamPodCap,
    /// The picker already holds `max_pods` claimed pods.
    PodCap,
    /// Stats outside their range (not finite, or a ratio outside [0, 1]).
    InvalidStats,
    /// Pod info without a name, endpoint or model, or a name over [`MAX_POD_NAME_BYTES`].
    InvalidPodInfo,
    /// A `ReplicaSync` subscriber whose client certificate is not a picker's (DNS SAN
    /// [`REPLICA_SAN`]).
    NotAReplica,
    /// Token identity: a stream opened without `authorization: Bearer <token>`.
    NoToken,
    /// Token identity: TokenReview did not authenticate the token for the picker's audience
    /// (unknown, expired, another audience, its pod gone), or it is malformed.
    TokenRejected,
    /// Token identity: the token is another ServiceAccount's than the agents'.
    WrongServiceAccount,
    /// Token identity: the token is not bound to a (scheduled) pod.
    TokenNotPodBound,
    /// Token identity: the token's pod-uid is not the uid of the pod of that name.
    PodUidMismatch,
    /// Token identity: the API server did not answer the TokenReview (or the pod read) in time;
    /// the new stream is refused, open ones go on.
    TokenReviewUnavailable,
    /// Token identity: the `Hello`'s node is not the node of the token's pod.
    NodeNotInToken,
}

impl Refusal {
    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::NoClientCertificate => "no_client_certificate",
            Refusal::UntrustedCertificate => "untrusted_certificate",
            Refusal::TlsHandshake => "tls_handshake",
            Refusal::NodeNotInCertificate => "node_not_in_certificate",
            Refusal::NoHello => "no_hello",
            Refusal::NotInPool => "not_in_pool",
            Refusal::WrongNode => "wrong_node",
            Refusal::OwnedByOtherStream => "owned_by_other_stream",
            Refusal::StreamPodCap => "stream_pod_cap",
            Refusal::PodCap => "pod_cap",
            Refusal::InvalidStats => "invalid_stats",
            Refusal::InvalidPodInfo => "invalid_pod_info",
            Refusal::NotAReplica => "not_a_replica",
            Refusal::NoToken => "no_token",
            Refusal::TokenRejected => "token_rejected",
            Refusal::WrongServiceAccount => "wrong_service_account",
            Refusal::TokenNotPodBound => "token_not_pod_bound",
            Refusal::PodUidMismatch => "pod_uid_mismatch",
            Refusal::TokenReviewUnavailable => "token_review_unavailable",
            Refusal::NodeNotInToken => "node_not_in_token",
        }
    }
}

/// Counts refusals by reason and logs each cause (reason, who) once, with the first pod it
/// concerned: a rogue stream naming 65,536 pods writes one line, not 65,536.
#[derive(Clone, Debug)]
pub struct Refusals {
    counts: Family<ReasonLabel, Counter>,
    logged: Arc<Mutex<HashSet<(Refusal, String)>>>,
}

impl Refusals {
    /// Counting into `counts` (the registered `epp_ingest_refusals` family).
    pub fn new(counts: Family<ReasonLabel, Counter>) -> Self {
        Self { counts, logged: Arc::default() }
    }

    /// Counts one refusal; logs it at WARN if this (reason, who) was not logged before.
    /// `who` is the node (or the peer address before a node is known).
    pub fn refuse(&self, reason: Refusal, who: &str, pod: &str, detail: &dyn Display) {
        self.counts.get_or_create(&ReasonLabel { reason: reason.as_str() }).inc();
        let mut logged = self.logged.lock();
        if logged.len() >= MAX_LOGGED_CAUSES {
            return;
        }
        if logged.insert((reason, who.to_string())) {
            let last = logged.len() == MAX_LOGGED_CAUSES;
            drop(logged);
            warn!(reason = reason.as_str(), from = %who, %pod, %detail,
                "agent report refused (logged once per cause)");
            if last {
                warn!("too many distinct refusal causes: further ones are only counted (epp_ingest_refusals_total)");
            }
        }
    }

    /// How many refusals of `reason` were counted.
    pub fn count(&self, reason: Refusal) -> u64 {
        self.counts.get_or_create(&ReasonLabel { reason: reason.as_str() }).get()
    }
}

/// Which pods the agent on a node may report (docs/design.md §14): the pool view satisfies it.
pub trait ReportScope: Send + Sync {
    /// `Ok` when the agent on `node` may report the engine `engine` (`<pod>-rank-<i>`, or a pod
    /// name), else [`Refusal::NotInPool`] or [`Refusal::WrongNode`].
    fn admits(&self, engine: &str, node: &str) -> Result<(), Refusal>;
}

/// No pool view (the static demo): every pod is in scope; ownership, caps and ranges still apply.
#[derive(Debug, Clone, Copy, Default)]
pub struct AnyPod;

impl ReportScope for AnyPod {
    fn admits(&self, _engine: &str, _node: &str) -> Result<(), Refusal> {
        Ok(())
    }
}

/// The Kubernetes pod behind an engine name: the pool's endpoint of that name, the name itself,
/// or the name less its `-rank-<i>` suffix.
fn pool_pod<'a>(view: &'a PoolView, engine: &'a str) -> Option<&'a str> {
    if let Some(e) = view.endpoint(engine) {
        return Some(e.pod.as_str());
    }
    if view.pods.contains_key(engine) {
        return Some(engine);
    }
    let (pod, rank) = engine.rsplit_once("-rank-")?;
    (rank.parse::<u32>().is_ok() && view.pods.contains_key(pod)).then_some(pod)
}

impl ReportScope for PoolView {
    fn admits(&self, engine: &str, node: &str) -> Result<(), Refusal> {
        let pod = pool_pod(self, engine).ok_or(Refusal::NotInPool)?;
        if self.admits_report(pod, node) { Ok(()) } else { Err(Refusal::WrongNode) }
    }
}

impl ReportScope for Watched<PoolView> {
    fn admits(&self, engine: &str, node: &str) -> Result<(), Refusal> {
        self.current().admits(engine, node)
    }
}

/// The pool's membership: the pool view once the picker has a pool source, else every pod.
impl ReportScope for crate::pool::Pool {
    fn admits(&self, engine: &str, node: &str) -> Result<(), Refusal> {
        match self.membership() {
            Some(view) => view.admits(engine, node),
            None => Ok(()),
        }
    }
}

impl<F: Fn(&str, &str) -> Result<(), Refusal> + Send + Sync> ReportScope for F {
    fn admits(&self, engine: &str, node: &str) -> Result<(), Refusal> {
        self(engine, node)
    }
}

/// Whether the client certificate `leaf` names `node` (DNS SAN `<node>.agent.kvroute`) and no
/// wildcard covers it (a wildcard would name every node).
pub fn certificate_names_node(leaf: &CertificateDer<'_>, node: &str) -> bool {
    certificate_names(leaf, &format!("{node}{AGENT_SAN_SUFFIX}"))
}

/// Whether the client certificate `leaf` is a picker replica's: it names [`REPLICA_SAN`] and no
/// wildcard covers it (an agent's `<node>.agent.kvroute` certificate is not a replica's).
pub fn certificate_names_replica(leaf: &CertificateDer<'_>) -> bool {
    certificate_names(leaf, REPLICA_SAN)
}

/// Whether `leaf` is valid for DNS name `name` exactly, not through a wildcard.
fn certificate_names(leaf: &CertificateDer<'_>, name: &str) -> bool {
    let Ok(cert) = webpki::EndEntityCert::try_from(leaf) else { return false };
    let Ok(server_name) = ServerName::try_from(name) else { return false };
    if cert.verify_is_valid_for_subject_name(&server_name).is_err() {
        return false;
    }
    let rest = name.split_once('.').map_or(name, |(_, rest)| rest);
    let probe = format!("{WILDCARD_PROBE}.{rest}");
    ServerName::try_from(probe.as_str()).is_ok_and(|p| cert.verify_is_valid_for_subject_name(&p).is_err())
}

/// Caps on what agents may claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most pods one stream may hold. Default [`DEFAULT_MAX_PODS_PER_STREAM`].
    pub max_pods_per_stream: usize,
    /// Most pods held by all streams (released ones count until `grace` passed). Default
    /// [`DEFAULT_MAX_PODS`].
    pub max_pods: usize,
    /// How long a released pod still counts (the pool's grace period).
    pub grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_pods_per_stream: DEFAULT_MAX_PODS_PER_STREAM,
            max_pods: DEFAULT_MAX_PODS,
            grace: Duration::from_millis(crate::pool::DEFAULT_POD_GRACE_TTL_MS),
        }
    }
}

#[derive(Debug)]
struct Claim {
    stream: StreamId,
    /// When its stream ended or stopped listing it; `None` while held.
    released_at: Option<Instant>,
}

/// Pod → owning stream, shared by every stream of one picker (see the module doc).
#[derive(Debug)]
pub struct Claims {
    limits: Limits,
    claims: Mutex<HashMap<String, Claim>>,
}

impl Claims {
    /// Empty, with `limits`.
    pub fn new(limits: Limits) -> Self {
        Self { limits, claims: Mutex::default() }
    }

    /// Claims `pod` for `stream`, which holds `held` pods already. `Ok(true)` when newly claimed,
    /// `Ok(false)` when the stream held it already.
    pub fn claim(&self, pod: &str, stream: StreamId, held: usize) -> Result<bool, Refusal> {
        let mut claims = self.claims.lock();
        let now = Instant::now();
        if let Some(c) = claims.get_mut(pod) {
            if c.stream == stream && c.released_at.is_none() {
                return Ok(false);
            }
            if c.released_at.is_none() {
                return Err(Refusal::OwnedByOtherStream);
            }
            if held >= self.limits.max_pods_per_stream {
                return Err(Refusal::StreamPodCap);
            }
            *c = Claim { stream, released_at: None };
            return Ok(true);
        }
        if held >= self.limits.max_pods_per_stream {
            return Err(Refusal::StreamPodCap);
        }
        if claims.len() >= self.limits.max_pods {
            let grace = self.limits.grace;
            claims.retain(|_, c| c.released_at.is_none_or(|t| now.duration_since(t) < grace));
            if claims.len() >= self.limits.max_pods {
                return Err(Refusal::PodCap);
            }
        }
        claims.insert(pod.to_string(), Claim { stream, released_at: None });
        Ok(true)
    }

    /// Releases `pods` held by `stream` (the stream ended, or its `Hello` no longer lists them).
    pub fn release<'a>(&self, stream: StreamId, pods: impl IntoIterator<Item = &'a str>) {
        let mut claims = self.claims.lock();
        let now = Instant::now();
        for pod in pods {
            if let Some(c) = claims.get_mut(pod)
                && c.stream == stream
                && c.released_at.is_none()
            {
                c.released_at = Some(now);
            }
        }
    }

    /// The stream holding `pod`, if held.
    pub fn owner(&self, pod: &str) -> Option<StreamId> {
        self.claims.lock().get(pod).filter(|c| c.released_at.is_none()).map(|c| c.stream)
    }
}

/// `Err` with what is out of range when a ratio is not finite or outside [0, 1].
pub fn check_stats(s: &PodStats) -> Result<(), String> {
    for (name, v) in
        [("health_score", s.health_score), ("kv_cache_usage", s.kv_cache_usage), ("gpu_utilization", s.gpu_utilization)]
    {
        if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
            return Err(format!("{name} = {v} is outside [0, 1]"));
        }
    }
    if s.observed_at_unix_ms < 0 {
        return Err(format!("observed_at_unix_ms = {} is negative", s.observed_at_unix_ms));
    }
    Ok(())
}

/// `Err` when `info` lacks a name, endpoint or model, or its name is too long.
pub fn check_info(info: &PodInfo) -> Result<(), String> {
    if info.pod.is_empty() || info.endpoint.is_empty() || info.model.is_empty() {
        return Err("pod info without name, endpoint or model".into());
    }
    if info.pod.len() > MAX_POD_NAME_BYTES {
        return Err(format!("pod name of {} bytes (at most {MAX_POD_NAME_BYTES})", info.pod.len()));
    }
    Ok(())
}

/// Everything the ingest streams of one picker share to enforce the rules above.
#[derive(Clone)]
pub struct Trust {
    /// Whether streams arrive over mTLS (a `Hello`'s node must then be in the certificate).
    pub mtls: bool,
    /// Token identity: streams must carry a ServiceAccount token this verifies, and their
    /// `Hello`'s node must be its pod's (takes the place of `mtls`).
    pub tokens: Option<Arc<super::token::TokenVerifier>>,
    /// Which pods a node may report.
    pub scope: Arc<dyn ReportScope>,
    /// Ownership and caps.
    pub claims: Arc<Claims>,
    /// Refusal counters and log-once set.
    pub refusals: Refusals,
}

impl std::fmt::Debug for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trust")
            .field("mtls", &self.mtls)
            .field("tokens", &self.tokens)
            .field("claims", &self.claims)
            .finish_non_exhaustive()
    }
}

impl Trust {
    /// Plaintext streams, every pod in scope, default limits, refusals counted in `counts`.
    pub fn insecure(counts: Family<ReasonLabel, Counter>) -> Self {
        Self {
            mtls: false,
            tokens: None,
            scope: Arc::new(AnyPod),
            claims: Arc::new(Claims::new(Limits::default())),
            refusals: Refusals::new(counts),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_out_of_range_are_refused_not_clamped() {
        let ok = PodStats { health_score: 1.0, kv_cache_usage: 0.0, gpu_utilization: 0.5, ..Default::default() };
        assert!(check_stats(&ok).is_ok());
        for bad in [
            PodStats { health_score: 5.0, ..ok.clone() },
            PodStats { health_score: f64::NAN, ..ok.clone() },
            PodStats { kv_cache_usage: f64::INFINITY, ..ok.clone() },
            PodStats { gpu_utilization: -0.1, ..ok.clone() },
            PodStats { observed_at_unix_ms: -1, ..ok.clone() },
        ] {
            assert!(check_stats(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn claims_follow_the_live_stream_and_caps_hold() {
        let c = Claims::new(Limits { max_pods_per_stream: 2, max_pods: 3, grace: Duration::from_secs(60) });
        assert_eq!(c.claim("a", 1, 0), Ok(true));
        assert_eq!(c.claim("a", 1, 1), Ok(false));
        assert_eq!(c.claim("a", 2, 0), Err(Refusal::OwnedByOtherStream));
        assert_eq!(c.claim("b", 1, 1), Ok(true));
        assert_eq!(c.claim("c", 1, 2), Err(Refusal::StreamPodCap));
        assert_eq!(c.claim("c", 2, 0), Ok(true));
        assert_eq!(c.claim("d", 3, 0), Err(Refusal::PodCap), "released or not, three pods are held");
        c.release(2, ["a", "c"]);
        assert_eq!(c.owner("a"), Some(1), "stream 2 cannot release what stream 1 holds");
        assert_eq!(c.owner("c"), None);
        assert_eq!(c.claim("d", 3, 0), Err(Refusal::PodCap), "c still counts during its grace period");
        assert_eq!(c.claim("c", 3, 0), Ok(true), "a released pod goes to the next stream");
        c.release(1, ["a"]);
        assert_eq!(c.claim("a", 3, 1), Ok(true));
    }

    #[test]
    fn pool_view_scope_maps_engine_names_to_pods() {
        use kvroute_cluster::{PoolPod, PoolSpecView, Source};
        let pod = |name: &str, node: &str| PoolPod {
            name: name.into(),
            namespace: "ns".into(),
            uid: None,
            node: Some(node.into()),
            ip: Some("10.0.0.1".parse().unwrap()),
            ready: true,
            terminating: false,
            ports: vec![(0, 8000)],
            labels: Arc::default(),
            annotations: Arc::default(),
        };
        let spec = PoolSpecView { target_ports: vec![8000], ..Default::default() };
        let view = PoolView::build(Source::File("p".into()), Some(spec), [pod("a", "n1"), pod("b", "n2")], true);
        assert_eq!(view.admits("a-rank-0", "n1"), Ok(()));
        assert_eq!(view.admits("a", "n1"), Ok(()));
        assert_eq!(view.admits("a-rank-0", "n2"), Err(Refusal::WrongNode));
        assert_eq!(view.admits("zz-rank-0", "n1"), Err(Refusal::NotInPool));
        assert_eq!(view.admits("a-rank-x", "n1"), Err(Refusal::NotInPool));
    }
}
