//! What a set of `networking.k8s.io/v1` NetworkPolicies admits, evaluated without a cluster.
//!
//! Semantics (Kubernetes API reference, NetworkPolicy; written out in docs/operations.md
//! "NetworkPolicies"):
//! - A policy applies to the pods its `podSelector` selects in its own namespace (an empty selector
//!   selects every pod there). It covers Ingress, Egress or both: `policyTypes` when given, else
//!   Ingress, plus Egress when it has `egress` rules.
//! - A pod that no policy covers for a direction admits everything in that direction. A covered
//!   pod admits a connection only when some rule of some covering policy admits it (rules add up;
//!   a policy with no rules denies).
//! - A connection from A to B on port P needs both: A's egress admits it and B's ingress admits it.
//! - A rule admits when one of its peers (`from` / `to`; none listed = every peer) matches and one of
//!   its ports matches (none listed = every port). A peer with only `podSelector` matches pods of
//!   the policy's namespace; with only `namespaceSelector`, every pod of the selected namespaces;
//!   with both, the selected pods of the selected namespaces; `ipBlock` matches an address in its
//!   CIDR and outside its `except` (used here only for endpoints outside the pod network).
//! - A port matches by protocol (default TCP) and number, up to `endPort` when given; a named port
//!   matches when the destination pod declares a container port of that name, protocol and number.
//! - Label selectors: `matchLabels` and `matchExpressions` (In, NotIn, Exists, DoesNotExist) must all
//!   hold; an empty selector matches everything.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use k8s_openapi::api::networking::v1::{IPBlock, NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// One end of a connection: a pod (namespace, labels, declared ports) or an address outside the
/// pod network (the API server, a client on the Internet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// For messages, e.g. `kvroute-picker`.
    pub name: String,
    /// `Some` for a pod.
    pub pod: Option<PodInfo>,
    /// The address, for `ipBlock` peers (outside endpoints only).
    pub ip: Option<Ipv4Addr>,
}

/// A pod's identity as NetworkPolicies see it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodInfo {
    /// Its namespace.
    pub namespace: String,
    /// Its namespace's labels (`kubernetes.io/metadata.name` included).
    pub namespace_labels: BTreeMap<String, String>,
    /// Its own labels.
    pub labels: BTreeMap<String, String>,
    /// Declared container ports: (name, number, protocol).
    pub ports: Vec<(Option<String>, i32, String)>,
}

impl Endpoint {
    /// A pod in `namespace` whose namespace carries `namespace_labels` (the automatic
    /// `kubernetes.io/metadata.name` label is added).
    pub fn pod(
        name: &str,
        namespace: &str,
        namespace_labels: &[(&str, &str)],
        labels: BTreeMap<String, String>,
        ports: Vec<(Option<String>, i32, String)>,
    ) -> Self {
        let mut ns_labels: BTreeMap<String, String> =
            namespace_labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        ns_labels.insert("kubernetes.io/metadata.name".into(), namespace.into());
        Endpoint {
            name: name.into(),
            pod: Some(PodInfo { namespace: namespace.into(), namespace_labels: ns_labels, labels, ports }),
            ip: None,
        }
    }

    /// An address outside the pod network.
    pub fn outside(name: &str, ip: Ipv4Addr) -> Self {
        Endpoint { name: name.into(), pod: None, ip: Some(ip) }
    }
}

/// Why a connection is admitted or refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Admitted; names the policies whose rules admit it on each side (empty: no policy covers
    /// that side).
    Admitted {
        /// Policies admitting the source's egress.
        egress_by: Vec<String>,
        /// Policies admitting the destination's ingress.
        ingress_by: Vec<String>,
    },
    /// Refused; names the side and the policies covering it, none of which admits it.
    Refused {
        /// `egress` of the source or `ingress` of the destination.
        side: &'static str,
        /// The covering policies.
        covering: Vec<String>,
    },
}

impl Verdict {
    /// Whether the connection goes through.
    pub fn admitted(&self) -> bool {
        matches!(self, Verdict::Admitted { .. })
    }
}

/// What `policies` make of a connection from `src` to `dst` on `port`/`protocol`.
pub fn evaluate(policies: &[NetworkPolicy], src: &Endpoint, dst: &Endpoint, port: i32, protocol: &str) -> Verdict {
    let egress = side(policies, src, "Egress", |rule_peers, rule_ports, policy_ns| {
        peers_match(rule_peers, dst, policy_ns) && ports_match(rule_ports, dst, port, protocol)
    });
    let egress_by = match egress {
        Ok(by) => by,
        Err(covering) => return Verdict::Refused { side: "egress", covering },
    };
    let ingress = side(policies, dst, "Ingress", |rule_peers, rule_ports, policy_ns| {
        peers_match(rule_peers, src, policy_ns) && ports_match(rule_ports, dst, port, protocol)
    });
    match ingress {
        Ok(ingress_by) => Verdict::Admitted { egress_by, ingress_by },
        Err(covering) => Verdict::Refused { side: "ingress", covering },
    }
}

type Rule<'a> = (Option<&'a [NetworkPolicyPeer]>, Option<&'a [NetworkPolicyPort]>);

/// For `subject`'s `direction`: Ok(policies admitting) or Err(covering policies, none admitting).
fn side(
    policies: &[NetworkPolicy],
    subject: &Endpoint,
    direction: &str,
    rule_admits: impl Fn(Option<&[NetworkPolicyPeer]>, Option<&[NetworkPolicyPort]>, &str) -> bool,
) -> Result<Vec<String>, Vec<String>> {
    let Some(pod) = &subject.pod else { return Ok(Vec::new()) };
    let mut covering = Vec::new();
    let mut admitting = Vec::new();
    for p in policies {
        let ns = p.metadata.namespace.as_deref().unwrap_or("default");
        let Some(spec) = &p.spec else { continue };
        if ns != pod.namespace || !selector_matches(&spec.pod_selector.clone().unwrap_or_default(), &pod.labels) {
            continue;
        }
        if !policy_types(p).iter().any(|t| t == direction) {
            continue;
        }
        let name = p.metadata.name.clone().unwrap_or_default();
        covering.push(name.clone());
        let rules: Vec<Rule<'_>> = if direction == "Ingress" {
            spec.ingress.as_deref().unwrap_or(&[]).iter().map(|r| (r.from.as_deref(), r.ports.as_deref())).collect()
        } else {
            spec.egress.as_deref().unwrap_or(&[]).iter().map(|r| (r.to.as_deref(), r.ports.as_deref())).collect()
        };
        if rules.iter().any(|(peers, ports)| rule_admits(*peers, *ports, ns)) {
            admitting.push(name);
        }
    }
    if covering.is_empty() || !admitting.is_empty() { Ok(admitting) } else { Err(covering) }
}

/// `policyTypes`, or its default: Ingress, plus Egress when the policy has egress rules.
pub fn policy_types(p: &NetworkPolicy) -> Vec<String> {
    let Some(spec) = &p.spec else { return Vec::new() };
    match &spec.policy_types {
        Some(t) => t.clone(),
        None => {
            let mut t = vec!["Ingress".to_string()];
            if spec.egress.as_ref().is_some_and(|e| !e.is_empty()) {
                t.push("Egress".into());
            }
            t
        }
    }
}

fn peers_match(peers: Option<&[NetworkPolicyPeer]>, other: &Endpoint, policy_ns: &str) -> bool {
    match peers {
        None | Some([]) => true,
        Some(peers) => peers.iter().any(|peer| peer_matches(peer, other, policy_ns)),
    }
}

fn peer_matches(peer: &NetworkPolicyPeer, other: &Endpoint, policy_ns: &str) -> bool {
    if let Some(block) = &peer.ip_block {
        return other.pod.is_none() && other.ip.is_some_and(|ip| in_block(block, ip));
    }
    let Some(pod) = &other.pod else { return false };
    let ns_ok = match &peer.namespace_selector {
        Some(sel) => selector_matches(sel, &pod.namespace_labels),
        None => pod.namespace == policy_ns,
    };
    let pod_ok = peer.pod_selector.as_ref().is_none_or(|sel| selector_matches(sel, &pod.labels));
    // A peer with neither selector nor ipBlock is invalid for the API server; it matches nothing here.
    (peer.namespace_selector.is_some() || peer.pod_selector.is_some()) && ns_ok && pod_ok
}

fn ports_match(ports: Option<&[NetworkPolicyPort]>, dst: &Endpoint, port: i32, protocol: &str) -> bool {
    match ports {
        None | Some([]) => true,
        Some(ports) => ports.iter().any(|p| {
            let proto = p.protocol.as_deref().unwrap_or("TCP");
            proto == protocol
                && match &p.port {
                    None => true,
                    Some(IntOrString::Int(n)) => (*n..=p.end_port.unwrap_or(*n)).contains(&port),
                    Some(IntOrString::String(name)) => dst.pod.as_ref().is_some_and(|pod| {
                        pod.ports.iter().any(|(n, number, pr)| {
                            n.as_deref() == Some(name.as_str()) && *number == port && pr == protocol
                        })
                    }),
                }
        }),
    }
}

/// Whether `labels` satisfy `sel` (an empty selector matches everything; an unknown operator
/// matches nothing).
pub fn selector_matches(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_labels = sel.match_labels.as_ref().is_none_or(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)));
    let by_expressions = sel.match_expressions.as_deref().unwrap_or(&[]).iter().all(|e| {
        let values = e.values.as_deref().unwrap_or(&[]);
        match e.operator.as_str() {
            "In" => labels.get(&e.key).is_some_and(|v| values.contains(v)),
            "NotIn" => labels.get(&e.key).is_none_or(|v| !values.contains(v)),
            "Exists" => labels.contains_key(&e.key),
            "DoesNotExist" => !labels.contains_key(&e.key),
            _ => false,
        }
    });
    by_labels && by_expressions
}

fn in_block(block: &IPBlock, ip: Ipv4Addr) -> bool {
    let within = |cidr: &str| {
        let Some((net, len)) = cidr.split_once('/') else { return false };
        let (Ok(net), Ok(len)) = (net.parse::<Ipv4Addr>(), len.parse::<u32>()) else { return false };
        if len > 32 {
            return false;
        }
        let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
        u32::from(ip) & mask == u32::from(net) & mask
    };
    within(&block.cidr) && !block.except.as_deref().unwrap_or(&[]).iter().any(|e| within(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(ns: &str, yaml: &str) -> NetworkPolicy {
        let mut p: NetworkPolicy = serde_norway::from_str(yaml).unwrap();
        p.metadata.namespace = Some(ns.into());
        p
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn pod(name: &str, ns: &str, ns_labels: &[(&str, &str)], l: &[(&str, &str)]) -> Endpoint {
        Endpoint::pod(name, ns, ns_labels, labels(l), vec![(Some("web".into()), 8080, "TCP".into())])
    }

    const DENY_ALL_INGRESS: &str =
        "metadata: {name: deny}\nspec: {podSelector: {matchLabels: {app: db}}, policyTypes: [Ingress]}";

    #[test]
    fn uncovered_pods_admit_everything_and_a_covering_policy_without_rules_denies() {
        let db = pod("db", "a", &[], &[("app", "db")]);
        let web = pod("web", "a", &[], &[("app", "web")]);
        assert!(evaluate(&[], &web, &db, 8080, "TCP").admitted());
        let deny = policy("a", DENY_ALL_INGRESS);
        let v = evaluate(std::slice::from_ref(&deny), &web, &db, 8080, "TCP");
        assert_eq!(v, Verdict::Refused { side: "ingress", covering: vec!["deny".into()] });
        // The same policy in another namespace does not cover the pod.
        assert!(evaluate(&[policy("b", DENY_ALL_INGRESS)], &web, &db, 8080, "TCP").admitted());
        // Egress of `web` is not covered by an Ingress-only policy.
        assert!(evaluate(&[deny], &db, &web, 8080, "TCP").admitted());
    }

    #[test]
    fn pod_and_namespace_selectors_in_one_peer_are_and_in_two_peers_or() {
        let db = pod("db", "a", &[], &[("app", "db")]);
        let and = policy(
            "a",
            "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  ingress:\n  \
             - from: [{namespaceSelector: {matchLabels: {team: x}}, podSelector: {matchLabels: {role: api}}}]",
        );
        let or = policy(
            "a",
            "metadata: {name: p}\nspec:\n  podSelector: {matchLabels: {app: db}}\n  ingress:\n  \
             - from: [{namespaceSelector: {matchLabels: {team: x}}}, {podSelector: {matchLabels: {role: api}}}]",
        );
        let api_in_x = pod("api", "x", &[("team", "x")], &[("role", "api")]);
        let other_in_x = pod("other", "x", &[("team", "x")], &[("role", "batch")]);
        let api_in_a = pod("api", "a", &[], &[("role", "api")]);
        let api_in_y = pod("api", "y", &[], &[("role", "api")]);
        let run =
            |p: &NetworkPolicy, src: &Endpoint| evaluate(std::slice::from_ref(p), src, &db, 8080, "TCP").admitted();
        assert!(run(&and, &api_in_x));
        assert!(!run(&and, &other_in_x));
        assert!(!run(&and, &api_in_a));
        assert!(run(&or, &other_in_x));
        assert!(run(&or, &api_in_a), "a podSelector alone means the policy's namespace");
        assert!(!run(&or, &api_in_y), "... and not another namespace");
    }

    #[test]
    fn ports_by_number_range_name_and_protocol() {
        let db = Endpoint::pod(
            "db",
            "a",
            &[],
            labels(&[("app", "db")]),
            vec![(Some("sql".into()), 5432, "TCP".into()), (Some("stats".into()), 9187, "UDP".into())],
        );
        let any = pod("any", "a", &[], &[]);
        let with_ports = |ports: &str| {
            policy("a", &format!("metadata: {{name: p}}\nspec:\n  podSelector: {{}}\n  ingress:\n  - ports: {ports}"))
        };
        let run = |p: NetworkPolicy, port: i32, proto: &str| evaluate(&[p], &any, &db, port, proto).admitted();
        assert!(run(with_ports("[{port: 5432}]"), 5432, "TCP"));
        assert!(!run(with_ports("[{port: 5432}]"), 5432, "UDP"), "protocol defaults to TCP");
        assert!(run(with_ports("[{port: 5000, endPort: 6000}]"), 5432, "TCP"));
        assert!(!run(with_ports("[{port: 5000, endPort: 5400}]"), 5432, "TCP"));
        assert!(run(with_ports("[{port: sql}]"), 5432, "TCP"));
        assert!(!run(with_ports("[{port: sql}]"), 5433, "TCP"), "a name means the port the pod declares");
        assert!(!run(with_ports("[{port: stats}]"), 9187, "TCP"), "the named port is UDP");
        assert!(run(with_ports("[{protocol: UDP}]"), 9187, "UDP"), "no number: every port of the protocol");
    }

    #[test]
    fn egress_defaults_ip_blocks_and_both_sides() {
        let api = Endpoint::outside("apiserver", Ipv4Addr::new(192, 0, 2, 10));
        let app = pod("app", "a", &[], &[("app", "x")]);
        // Egress rules without policyTypes make the policy cover egress too.
        let egress = policy(
            "a",
            "metadata: {name: out}\nspec:\n  podSelector: {}\n  egress:\n  \
             - to: [{ipBlock: {cidr: 192.0.2.0/24, except: [192.0.2.128/25]}}]\n    ports: [{port: 443}]",
        );
        assert_eq!(policy_types(&egress), ["Ingress", "Egress"]);
        let run = |dst: &Endpoint, port| evaluate(std::slice::from_ref(&egress), &app, dst, port, "TCP");
        assert!(run(&api, 443).admitted());
        assert!(!run(&api, 80).admitted());
        assert!(!run(&Endpoint::outside("other", Ipv4Addr::new(192, 0, 2, 200)), 443).admitted(), "except");
        assert!(!run(&pod("peer", "a", &[], &[]), 443).admitted(), "an ipBlock does not match a pod here");
        // The egress policy above also covers ingress (default types) with no ingress rules.
        let v = evaluate(std::slice::from_ref(&egress), &pod("c", "b", &[], &[]), &app, 8080, "TCP");
        assert_eq!(v, Verdict::Refused { side: "ingress", covering: vec!["out".into()] });
    }

    #[test]
    fn match_expressions() {
        let sel: LabelSelector = serde_norway::from_str(
            "matchExpressions: [{key: tier, operator: In, values: [a, b]}, {key: canary, operator: DoesNotExist}]",
        )
        .unwrap();
        assert!(selector_matches(&sel, &labels(&[("tier", "a")])));
        assert!(!selector_matches(&sel, &labels(&[("tier", "c")])));
        assert!(!selector_matches(&sel, &labels(&[("tier", "b"), ("canary", "1")])));
        let odd: LabelSelector = serde_norway::from_str("matchExpressions: [{key: k, operator: Near}]").unwrap();
        assert!(!selector_matches(&odd, &labels(&[("k", "v")])));
        assert!(selector_matches(&LabelSelector::default(), &labels(&[])));
    }
}
