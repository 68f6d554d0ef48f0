//! `authentication.k8s.io/v1` TokenReview: the API server's answer to "who holds this bearer
//! token?", for ServiceAccount tokens the stand-in issued or a test registered.
//!
//! What the real server does, and so does this (checked against the Kubernetes documentation's
//! example response and the serviceaccount authenticator's rules):
//! - `POST /apis/authentication.k8s.io/v1/tokenreviews` with `spec.token` (and optionally
//!   `spec.audiences`) answers `201 Created` with the review echoed back and `status` filled in.
//!   An empty `spec.token` is `400 BadRequest`.
//! - The token is valid for the audiences it was issued for; `spec.audiences` absent means the
//!   API server's own ([`API_AUDIENCE`]). No audience in common, an expired token, an unknown token,
//!   or a token bound to a pod that no longer exists (or exists under another uid) is
//!   `status: {user: {}, error: "[invalid bearer token, …]"}` with `authenticated` left out
//!   (false).
//! - Authenticated: `status.authenticated: true`, `status.audiences` (the intersection),
//!   `status.user` with `username: system:serviceaccount:<ns>:<name>`, the ServiceAccount's uid,
//!   the groups `system:serviceaccounts`, `system:serviceaccounts:<ns>`, `system:authenticated`,
//!   and for a pod-bound token `extra` keys `authentication.kubernetes.io/pod-name`, `pod-uid`,
//!   `credential-id` (`JTI=…`) and, when the token carries its node (Kubernetes ≥ 1.30,
//!   `ServiceAccountTokenPodNodeInfo`), `node-name` and `node-uid`.
//!
//! Issued tokens are JWT-shaped (`header.payload.signature`, base64url JSON, the claims a
//! projected token carries: `aud`, `exp`, `iat`, `nbf`, `iss`, `sub`, `jti`, `kubernetes.io`); the
//! signature is random bytes and nothing verifies it: the stand-in looks tokens up.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use serde_json::{Value, json};

use super::ApiError;

/// The API server's own audience: what a review without `spec.audiences` checks against.
pub const API_AUDIENCE: &str = "https://kubernetes.default.svc.cluster.local";
/// Most tokens held; issuing more forgets the oldest-expiring first.
const MAX_TOKENS: usize = 100_000;

/// The pod a token is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundPod {
    /// Pod name (in the ServiceAccount's namespace).
    pub name: String,
    /// Pod uid (`metadata.uid`).
    pub uid: String,
}

/// What a ServiceAccount token stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSpec {
    /// The ServiceAccount's namespace.
    pub namespace: String,
    /// The ServiceAccount's name.
    pub service_account: String,
    /// Audiences the token was requested for (a projected volume's `audience`).
    pub audiences: Vec<String>,
    /// When the token stops being valid.
    pub expires_at: SystemTime,
    /// The pod it is bound to (projected tokens are); `None` for an unbound token.
    pub pod: Option<BoundPod>,
    /// The node of that pod, in the token's claims (Kubernetes ≥ 1.30); `None` plays an older
    /// API server, whose reviews carry no `node-name`.
    pub node: Option<String>,
}

impl TokenSpec {
    /// A token of `namespace/service_account` for `audience`, bound to pod `pod` (uid `uid`) on
    /// `node`, valid for an hour (a projected volume's default `expirationSeconds` is 3600).
    pub fn pod_bound(namespace: &str, service_account: &str, audience: &str, pod: &str, uid: &str, node: &str) -> Self {
        TokenSpec {
            namespace: namespace.into(),
            service_account: service_account.into(),
            audiences: vec![audience.into()],
            expires_at: SystemTime::now() + Duration::from_secs(3600),
            pod: Some(BoundPod { name: pod.into(), uid: uid.into() }),
            node: Some(node.into()),
        }
    }
}

/// Tokens known to the stand-in.
#[derive(Debug, Default)]
pub(crate) struct Tokens {
    known: Mutex<HashMap<String, TokenSpec>>,
    issued: AtomicU64,
    reviews: AtomicU64,
}

fn b64(v: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v)
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A deterministic uid for a name (the stand-in keeps no ServiceAccount objects).
fn uid_of(what: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in what.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}", h >> 32, (h >> 16) & 0xffff, h & 0xfff, (h >> 20) & 0xfff, h)
}

impl Tokens {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, TokenSpec>> {
        self.known.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Issues a JWT-shaped token for `spec` (see the module doc) and remembers it.
    pub(crate) fn issue(&self, spec: TokenSpec) -> String {
        let n = self.issued.fetch_add(1, Ordering::Relaxed);
        let now = SystemTime::now();
        let nanos = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let jti = format!("{:08x}-0000-4000-8000-{:012x}", nanos, n);
        let mut k8s = json!({
            "namespace": spec.namespace,
            "serviceaccount": {"name": spec.service_account, "uid": uid_of(&format!("sa/{}/{}", spec.namespace, spec.service_account))},
        });
        if let Some(pod) = &spec.pod {
            k8s["pod"] = json!({"name": pod.name, "uid": pod.uid});
        }
        if let Some(node) = &spec.node {
            k8s["node"] = json!({"name": node, "uid": uid_of(&format!("node/{node}"))});
        }
        let claims = json!({
            "aud": spec.audiences,
            "exp": unix(spec.expires_at),
            "iat": unix(now),
            "nbf": unix(now),
            "iss": API_AUDIENCE,
            "jti": jti,
            "kubernetes.io": k8s,
            "sub": format!("system:serviceaccount:{}:{}", spec.namespace, spec.service_account),
        });
        let header = json!({"alg": "RS256", "kid": "kube-apiserver-stand-in"});
        let signature: Vec<u8> = (0..64u64)
            .map(|i| (n.wrapping_mul(31).wrapping_add(u64::from(nanos)) >> (i % 8)) as u8 ^ i as u8)
            .collect();
        let token = format!(
            "{}.{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes()),
            b64(&signature)
        );
        self.register(&token, spec);
        token
    }

    /// Remembers `token` as standing for `spec` (any string: a test's own token).
    pub(crate) fn register(&self, token: &str, spec: TokenSpec) {
        let mut known = self.lock();
        if known.len() >= MAX_TOKENS && !known.contains_key(token) {
            let now = SystemTime::now();
            known.retain(|_, s| s.expires_at > now);
            if known.len() >= MAX_TOKENS
                && let Some(oldest) = known.iter().min_by_key(|(_, s)| s.expires_at).map(|(t, _)| t.clone())
            {
                known.remove(&oldest);
            }
        }
        known.insert(token.to_string(), spec);
    }

    /// Forgets `token` (it no longer authenticates).
    pub(crate) fn revoke(&self, token: &str) {
        self.lock().remove(token);
    }

    /// TokenReviews answered so far.
    pub(crate) fn reviews(&self) -> u64 {
        self.reviews.load(Ordering::Relaxed)
    }

    /// The answer to the review `body`; `pod_uid(ns, name)` is the uid of a pod now in the store.
    pub(crate) fn review(
        &self,
        body: &Value,
        pod_uid: impl Fn(&str, &str) -> Option<String>,
    ) -> Result<Value, ApiError> {
        self.reviews.fetch_add(1, Ordering::Relaxed);
        let token = body["spec"]["token"].as_str().unwrap_or("");
        if token.is_empty() {
            return Err(ApiError::bad_request("token is required for TokenReview in authentication"));
        }
        let requested: Vec<String> = match body["spec"]["audiences"].as_array() {
            Some(a) if !a.is_empty() => a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect(),
            _ => vec![API_AUDIENCE.to_string()],
        };
        let mut spec_out = json!({"token": token});
        if let Some(a) = body["spec"]["audiences"].as_array().filter(|a| !a.is_empty()) {
            spec_out["audiences"] = json!(a);
        }
        let status = match self.authenticate(token, &requested, pod_uid) {
            Ok(status) => status,
            Err(reason) => json!({"user": {}, "error": format!("[invalid bearer token, {reason}]")}),
        };
        Ok(json!({
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": null},
            "spec": spec_out,
            "status": status,
        }))
    }

    fn authenticate(
        &self,
        token: &str,
        requested: &[String],
        pod_uid: impl Fn(&str, &str) -> Option<String>,
    ) -> Result<Value, String> {
        let Some(spec) = self.lock().get(token).cloned() else {
            return Err("square/go-jose: error in cryptographic primitive".into());
        };
        let audiences: Vec<&String> = requested.iter().filter(|a| spec.audiences.contains(a)).collect();
        if audiences.is_empty() {
            return Err(format!(
                "token audiences {:?} is invalid for the target audiences {:?}",
                spec.audiences, requested
            ));
        }
        if SystemTime::now() >= spec.expires_at {
            return Err("service account token has expired".into());
        }
        let ns = &spec.namespace;
        let mut extra = serde_json::Map::new();
        if let Some(pod) = &spec.pod {
            match pod_uid(ns, &pod.name) {
                None => return Err(format!("pods \"{}\" not found", pod.name)),
                Some(uid) if uid != pod.uid => {
                    return Err(format!("pod UID ({uid}) does not match claim ({})", pod.uid));
                }
                Some(_) => {}
            }
            extra.insert("authentication.kubernetes.io/pod-name".into(), json!([pod.name]));
            extra.insert("authentication.kubernetes.io/pod-uid".into(), json!([pod.uid]));
        }
        if let Some(node) = &spec.node {
            extra.insert("authentication.kubernetes.io/node-name".into(), json!([node]));
            extra.insert("authentication.kubernetes.io/node-uid".into(), json!([uid_of(&format!("node/{node}"))]));
        }
        extra.insert("authentication.kubernetes.io/credential-id".into(), json!([format!("JTI={}", uid_of(token))]));
        let sa = &spec.service_account;
        Ok(json!({
            "authenticated": true,
            "user": {
                "username": format!("system:serviceaccount:{ns}:{sa}"),
                "uid": uid_of(&format!("sa/{ns}/{sa}")),
                "groups": ["system:serviceaccounts", format!("system:serviceaccounts:{ns}"), "system:authenticated"],
                "extra": extra,
            },
            "audiences": audiences,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reviews_follow_the_authenticator_rules() {
        let tokens = Tokens::default();
        let t = tokens.issue(TokenSpec::pod_bound("ops", "agent", "kvroute-picker", "agent-x", "u-1", "n1"));
        let pods = |ns: &str, name: &str| (ns == "ops" && name == "agent-x").then(|| "u-1".to_string());
        let review = |token: &str, aud: &[&str]| {
            tokens.review(&json!({"spec": {"token": token, "audiences": aud}}), pods).unwrap()["status"].clone()
        };
        let ok = review(&t, &["other", "kvroute-picker"]);
        assert_eq!(ok["authenticated"], true);
        assert_eq!(ok["audiences"], json!(["kvroute-picker"]));
        assert_eq!(ok["user"]["username"], "system:serviceaccount:ops:agent");
        assert_eq!(ok["user"]["extra"]["authentication.kubernetes.io/node-name"], json!(["n1"]));
        assert_eq!(ok["user"]["extra"]["authentication.kubernetes.io/pod-uid"], json!(["u-1"]));
        // The JWT's claims name the same pod and audience.
        let payload = t.split('.').nth(1).unwrap();
        let claims: Value =
            serde_json::from_slice(&base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload).unwrap()).unwrap();
        assert_eq!(claims["kubernetes.io"]["pod"]["name"], "agent-x");
        assert_eq!(claims["aud"], json!(["kvroute-picker"]));

        for (status, want) in [
            (review(&t, &["api"]), "is invalid for the target audiences"),
            (review(&t, &[]), "is invalid for the target audiences"),
            (review("nope", &["kvroute-picker"]), "invalid bearer token"),
        ] {
            assert!(status.get("authenticated").is_none(), "{status}");
            assert_eq!(status["user"], json!({}));
            assert!(status["error"].as_str().unwrap().contains(want), "{status}");
        }
        let mut expired = TokenSpec::pod_bound("ops", "agent", "kvroute-picker", "agent-x", "u-1", "n1");
        expired.expires_at = SystemTime::now() - Duration::from_secs(1);
        let e = tokens.issue(expired);
        assert!(review(&e, &["kvroute-picker"])["error"].as_str().unwrap().contains("expired"));
        // The bound pod must still exist under its uid.
        let gone = tokens.issue(TokenSpec::pod_bound("ops", "agent", "kvroute-picker", "agent-y", "u-2", "n1"));
        assert!(review(&gone, &["kvroute-picker"])["error"].as_str().unwrap().contains("not found"));
        let other = tokens.issue(TokenSpec::pod_bound("ops", "agent", "kvroute-picker", "agent-x", "u-9", "n1"));
        assert!(review(&other, &["kvroute-picker"])["error"].as_str().unwrap().contains("does not match"));
        assert!(tokens.review(&json!({"spec": {}}), pods).is_err());
    }
}
