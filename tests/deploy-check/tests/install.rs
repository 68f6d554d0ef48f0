//! The operator's install (deploy/k8s/install): rendered with other values for its three inputs
//! (a pool in another namespace, other images) and nothing else edited, for each gateway overlay
//! and with the opt-in components; nothing per node (agent pods on 1 and 50 nodes); the
//! NetworkPolicies modelled against the connections kvroute needs; the Envoy Deployment and the
//! agent's privileges.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kvroute_deploy_check::checks::nodes::agent_pods_on;
use kvroute_deploy_check::checks::{FLEET_NODES, fleet};
use kvroute_deploy_check::render::split_documents;
use kvroute_deploy_check::{CheckContext, Object, Rendered, check_all, parse_all, render};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn ctx() -> CheckContext {
    CheckContext::new(repo_root())
}

/// The install's three values.
struct Values<'a> {
    namespace: &'a str,
    pool: &'a str,
    registry: &'a str,
    tag: &'a str,
}

const OTHER: Values<'static> =
    Values { namespace: "llm-prod", pool: "mixtral-8x7b", registry: "registry.example.com/ai", tag: "2.3.4" };

/// deploy/k8s/install/kustomization.yaml with `v` put in its three marked places, another gateway
/// overlay and `components`, written to target/ (kustomize paths rewritten for the new place) and
/// rendered. Fails if a marked line is not where the docs say.
fn install(name: &str, v: &Values<'_>, overlay: &str, components: &[&str]) -> (String, Rendered) {
    let src = repo_root().join("deploy/k8s/install");
    let text = std::fs::read_to_string(src.join("kustomization.yaml")).unwrap();
    let mut out = Vec::new();
    let mut marked = 0;
    let mut in_images = None::<String>;
    for line in text.lines() {
        let mut line = line.to_string();
        if line.starts_with("namespace: kvroute ") && line.contains("(1)") {
            line = format!("namespace: {}", v.namespace);
            marked += 1;
        } else if line.contains("- poolName=") && line.contains("(2)") {
            line = format!("      - poolName={}", v.pool);
            marked += 1;
        } else if let Some(image) = line.trim().strip_prefix("- name: ghcr.io/kvroute/") {
            in_images = Some(image.to_string());
            line = format!("{line}\n    newName: {}/{image}", v.registry);
            marked += 1;
        } else if line.trim().starts_with("newTag:") && in_images.take().is_some() {
            line = format!("    newTag: {}", v.tag);
        } else if line.trim() == "- ../overlays/standalone" {
            line = format!("  - ../../deploy/k8s/overlays/{overlay}");
        } else if line.trim() == "components: []" {
            let list: Vec<String> = components.iter().map(|c| format!("../../deploy/k8s/components/{c}")).collect();
            line = format!("components: [{}]", list.join(", "));
        }
        out.push(line);
    }
    assert_eq!(marked, 4, "the install's marked values (namespace, poolName, two images) moved:\n{text}");
    let dir = repo_root().join(format!("target/deploy-check-install-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kustomization.yaml"), out.join("\n")).unwrap();
    std::fs::copy(src.join("replacements.yaml"), dir.join("replacements.yaml")).unwrap();
    let text = render(&dir).unwrap_or_else(|e| panic!("{e}"));
    let r = parse_all(&split_documents(&text).unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
    (text, r)
}

fn assert_clean(what: &str, r: &Rendered) {
    let problems = check_all(r, &ctx());
    assert!(
        problems.is_empty(),
        "{what}:\n{}",
        problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")
    );
}

fn env_value(r: &Rendered, workload: &str, var: &str) -> Option<String> {
    let w = r.workload(workload).unwrap();
    w.template.spec.as_ref().unwrap().containers[0].env.as_ref()?.iter().find(|e| e.name == var)?.value.clone()
}

fn ids(r: &Rendered) -> Vec<String> {
    r.objects.iter().map(Object::id).collect()
}

#[test]
fn the_shipped_install_renders_clean_and_creates_neither_namespace_nor_pool() {
    let v = Values { namespace: "kvroute", pool: "vllm-qwen2-5-7b", registry: "ghcr.io/kvroute", tag: "0.1.0" };
    let (_, r) = install("shipped", &v, "standalone", &[]);
    assert_clean("install", &r);
    let all = ids(&r);
    // `kubectl delete -k` deletes what the render holds: never the operator's namespace or pool.
    assert!(!all.iter().any(|i| i.starts_with("Namespace/")), "{all:?}");
    assert!(!all.iter().any(|i| i.starts_with("InferencePool/")), "{all:?}");
    assert!(!all.iter().any(|i| i.starts_with("ConfigMap/kvroute-install")), "the values ConfigMap is local only");
    // Only with the opt-in component, and then named as the install's namespace.
    let (_, r) = install("namespace", &OTHER, "standalone", &["namespace"]);
    assert_clean("install + namespace", &r);
    assert!(ids(&r).contains(&"Namespace/llm-prod".to_string()), "{:?}", ids(&r));
}

#[test]
fn a_pool_in_another_namespace_needs_only_the_three_values() {
    for (overlay, components) in
        [("standalone", &[][..]), ("fail-open", &[][..]), ("gateway-api", &["tokenizers", "inferencepool"][..])]
    {
        let (text, r) = install(overlay, &OTHER, overlay, components);
        assert_clean(overlay, &r);
        // Every namespaced object in the pool's namespace (check_all: namespaces), and nothing
        // left naming the shipped one, in any field or config string.
        for o in &r.objects {
            let (kind, meta) = o.kind_meta();
            if !matches!(kind, "ClusterRole" | "ClusterRoleBinding" | "Namespace") {
                assert_eq!(meta.namespace.as_deref(), Some("llm-prod"), "{}", o.id());
            }
        }
        for stale in [".kvroute.svc", "namespace: kvroute\n", "tokenreview.kvroute"] {
            assert!(!text.contains(stale), "{overlay}: {stale:?} left in the render");
        }
        assert_eq!(env_value(&r, "kvroute-picker", "POOL_NAME").as_deref(), Some("mixtral-8x7b"));
        assert_eq!(env_value(&r, "kvroute-agent", "POOL_NAME").as_deref(), Some("mixtral-8x7b"));
        for w in r.workloads() {
            let image = w.template.spec.as_ref().unwrap().containers[0].image.clone().unwrap();
            if w.name.starts_with("kvroute-picker") || w.name.starts_with("kvroute-agent") {
                assert_eq!(image, format!("registry.example.com/ai/{}:2.3.4", w.name));
            }
        }
        match overlay {
            "gateway-api" => {
                assert!(text.contains("name: mixtral-8x7b"), "HTTPRoute and InferencePool follow poolName");
                assert!(ids(&r).contains(&"InferencePool/mixtral-8x7b".to_string()));
                assert!(ids(&r).contains(&"PersistentVolumeClaim/kvroute-tokenizers".to_string()));
            }
            _ => {
                assert!(text.contains("kvroute-picker.llm-prod.svc.cluster.local, port_value: 9002"), "{overlay}");
            }
        }
        if overlay == "fail-open" {
            assert!(text.contains("kvroute-pool.llm-prod.svc.cluster.local, port_value: 8000"));
        }
        assert!(text.contains("'*.kvroute-picker-peers.llm-prod.svc'"), "the pickers' certificate names");
        assert!(ids(&r).contains(&"ClusterRoleBinding/kvroute-picker-tokenreview.llm-prod".to_string()));
    }
}

#[test]
fn an_envoy_config_edit_that_moves_the_address_is_caught() {
    // What a stale replacement index does: the address keeps the shipped namespace.
    let (_, mut r) = install("stale-index", &OTHER, "standalone", &[]);
    for o in &mut r.objects {
        if let Object::ConfigMap(c) = o
            && let Some(text) = c.data.as_mut().and_then(|d| d.get_mut("envoy.yaml"))
        {
            *text = text.replace("kvroute-picker.llm-prod.svc", "kvroute-picker.kvroute.svc");
        }
    }
    let problems = check_all(&r, &ctx());
    assert!(
        problems.iter().any(|p| p.message.contains("not the picker Service kvroute-picker.llm-prod.svc.cluster.local")),
        "{problems:#?}"
    );
}

#[test]
fn tokenizers_component_switches_on_precise_mode_and_changes_nothing_else() {
    let (_, plain) = install("approximate", &OTHER, "standalone", &[]);
    let (_, precise) = install("precise", &OTHER, "standalone", &["tokenizers"]);
    assert_clean("precise", &precise);
    let picker_config = |r: &Rendered| -> serde_json::Value {
        let cm = r
            .objects
            .iter()
            .find_map(|o| match o {
                Object::ConfigMap(c) if c.metadata.name.as_deref().unwrap().starts_with("kvroute-picker-config") => {
                    Some(c)
                }
                _ => None,
            })
            .unwrap();
        serde_norway::from_str(&cm.data.as_ref().unwrap()["picker.yaml"]).unwrap()
    };
    let volumes = |r: &Rendered| -> Vec<String> {
        let w = r.workload("kvroute-picker").unwrap();
        w.template.spec.as_ref().unwrap().volumes.as_deref().unwrap_or(&[]).iter().map(|v| v.name.clone()).collect()
    };
    // Shipped: no tokenizer anywhere, no claim, no volume (approximate mode).
    let base = picker_config(&plain);
    assert!(base["models"].as_array().unwrap().iter().all(|m| m.get("tokenizer").is_none()));
    assert!(!ids(&plain).iter().any(|i| i.starts_with("PersistentVolumeClaim/")));
    assert!(!volumes(&plain).contains(&"tokenizers".to_string()));
    // With the component: every model has a tokenizer on the mounted claim ...
    let mut with = picker_config(&precise);
    assert!(
        with["models"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["tokenizer"].as_str().unwrap().starts_with("/models/tokenizers/"))
    );
    assert!(ids(&precise).contains(&"PersistentVolumeClaim/kvroute-tokenizers".to_string()));
    assert!(volumes(&precise).contains(&"tokenizers".to_string()));
    // ... and the config is otherwise the base's (the component's copy cannot drift).
    for m in with["models"].as_array_mut().unwrap() {
        m.as_object_mut().unwrap().remove("tokenizer");
    }
    assert_eq!(
        with, base,
        "components/tokenizers/picker.yaml differs from base/picker/picker.yaml beyond `tokenizer:`"
    );
}

#[test]
fn agent_pods_find_their_volumes_on_1_and_50_nodes() {
    let (text, r) = install("nodes", &OTHER, "standalone", &[]);
    // kustomize takes no node list: the render is the same whatever the fleet, so each size only
    // changes how many pods the one DaemonSet makes; every one must find what it mounts.
    for n in [1, FLEET_NODES] {
        let mut problems = Vec::new();
        agent_pods_on(&r, "kvroute-agent", &fleet(n), &mut problems);
        assert!(problems.is_empty(), "{n} nodes: {problems:#?}");
    }
    assert!(!text.contains("gpu-node"), "no object names a node");
    // The layout the cert-manager component once shipped: a Certificate and a projected source per
    // listed node, each pod mounting $(NODE_NAME)/. It works on the listed nodes only.
    let mut per_node = r.clone();
    let certs: Vec<_> = per_node
        .objects
        .iter()
        .filter_map(|o| match o {
            Object::Certificate(c) if c.metadata.name.as_deref() == Some("kvroute-picker-ingest") => Some(c.clone()),
            _ => None,
        })
        .collect();
    let mut sources = Vec::new();
    for node in ["gpu-node-1", "gpu-node-2"] {
        let mut c = certs[0].clone();
        c.metadata.name = Some(format!("kvroute-agent-{node}"));
        c.spec.secret_name = format!("kvroute-agent-tls-{node}");
        per_node.objects.push(Object::Certificate(c));
        sources.push(serde_json::json!({"secret": {"name": format!("kvroute-agent-tls-{node}"),
            "items": [{"key": "tls.crt", "path": format!("{node}/tls.crt")}]}}));
    }
    for o in &mut per_node.objects {
        if let Object::DaemonSet(d) = o {
            let spec = d.spec.as_mut().unwrap().template.spec.as_mut().unwrap();
            spec.volumes.as_mut().unwrap().push(
                serde_json::from_value(serde_json::json!({"name": "agent-tls", "projected": {"sources": sources}}))
                    .unwrap(),
            );
            spec.containers[0].volume_mounts.as_mut().unwrap().push(
                serde_json::from_value(serde_json::json!({"name": "agent-tls", "mountPath": "/etc/kvroute/agent-tls",
                    "subPathExpr": "$(NODE_NAME)", "readOnly": true}))
                .unwrap(),
            );
        }
    }
    let mut listed = Vec::new();
    agent_pods_on(&per_node, "kvroute-agent", &["gpu-node-1".into(), "gpu-node-2".into()], &mut listed);
    assert!(listed.is_empty(), "the listed nodes resolve: {listed:#?}");
    for n in [1, FLEET_NODES] {
        let mut problems = Vec::new();
        agent_pods_on(&per_node, "kvroute-agent", &fleet(n), &mut problems);
        assert!(
            problems.iter().any(|p| p.message.contains(&format!("fails on {n} of {n} nodes"))),
            "{n}: {problems:#?}"
        );
    }
}

// --- NetworkPolicies ------------------------------------------------------------------------

fn policy_mut<'a>(r: &'a mut Rendered, name: &str) -> &'a mut NetworkPolicy {
    r.objects
        .iter_mut()
        .find_map(|o| match o {
            Object::NetworkPolicy(p) if p.metadata.name.as_deref() == Some(name) => Some(p),
            _ => None,
        })
        .unwrap()
}

fn problems_after(edit: impl FnOnce(&mut Rendered)) -> Vec<String> {
    let (_, mut r) = install("netpol", &OTHER, "standalone", &[]);
    edit(&mut r);
    check_all(&r, &ctx()).iter().map(ToString::to_string).collect()
}

fn assert_problem(problems: &[String], needle: &str) {
    assert!(problems.iter().any(|p| p.contains(needle)), "expected {needle:?} in {problems:#?}");
}

#[test]
fn replica_sync_is_refused_by_an_ingest_rule_for_agents_only() {
    // The rule as once shipped: ingest from the agents alone.
    let problems = problems_after(|r| {
        let rule = &mut policy_mut(r, "kvroute-picker").spec.as_mut().unwrap().ingress.as_mut().unwrap()[1];
        rule.from.as_mut().unwrap().truncate(1);
    });
    assert_problem(&problems, "picker ↔ picker ReplicaSync (kvroute-picker → kvroute-picker port 9004/TCP) is refused");
    assert_eq!(problems.len(), 1, "{problems:#?}");
}

#[test]
fn an_open_rule_or_a_wrong_label_is_caught() {
    // A rule with no peers admits every pod on that port.
    let problems = problems_after(|r| {
        let rule = &mut policy_mut(r, "kvroute-picker").spec.as_mut().unwrap().ingress.as_mut().unwrap()[1];
        rule.from = None;
    });
    assert_problem(
        &problems,
        "an unlabelled pod in kvroute's namespace → kvroute-picker port 9004/TCP is not a connection kvroute needs",
    );
    assert_problem(&problems, "a pod in another namespace → kvroute-picker port 9004/TCP");
    // A rule with no ports admits its peers on every port: agents reach ext_proc and metrics.
    let problems = problems_after(|r| {
        let rule = &mut policy_mut(r, "kvroute-picker").spec.as_mut().unwrap().ingress.as_mut().unwrap()[1];
        rule.ports = None;
    });
    assert_problem(&problems, "kvroute-agent → kvroute-picker port 9002/TCP is not a connection kvroute needs");
    // A namespaceSelector that selects every namespace, alone, opens metrics to every pod.
    let problems = problems_after(|r| {
        let rule = &mut policy_mut(r, "kvroute-picker").spec.as_mut().unwrap().ingress.as_mut().unwrap()[2];
        rule.from.as_mut().unwrap()[0].namespace_selector = Some(LabelSelector::default());
    });
    assert_problem(&problems, "a pod in another namespace → kvroute-picker port 9090/TCP");
    // Monitoring by the wrong namespace label: no scrape gets through.
    let problems = problems_after(|r| {
        let rule = &mut policy_mut(r, "kvroute-agent").spec.as_mut().unwrap().ingress.as_mut().unwrap()[0];
        let sel = rule.from.as_mut().unwrap()[0].namespace_selector.as_mut().unwrap();
        sel.match_labels = Some([("monitoring".to_string(), "true".to_string())].into());
    });
    assert_problem(&problems, "Prometheus → agent metrics");
    // A policy without the default deny for Envoy: every port of Envoy's open, the admin one too.
    let problems = problems_after(|r| {
        r.objects.retain(|o| {
            !matches!(o, Object::NetworkPolicy(p) if p.metadata.name.as_deref() == Some("kvroute-envoy")
                || p.metadata.name.as_deref() == Some("kvroute-default-deny-ingress"))
        });
    });
    assert_problem(&problems, "→ kvroute-envoy port 9901/TCP is not a connection kvroute needs");
}

#[test]
fn an_egress_default_deny_breaks_the_api_server_and_the_engines() {
    let problems = problems_after(|r| {
        let mut deny = policy_mut(r, "kvroute-default-deny-ingress").clone();
        deny.metadata.name = Some("deny-egress".into());
        deny.spec.as_mut().unwrap().policy_types = Some(vec!["Egress".into()]);
        // Egress only to the pickers' ingest port: what a too-narrow egress policy would allow.
        deny.spec.as_mut().unwrap().egress = Some(vec![
            serde_json::from_value(serde_json::json!({
                "to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvroute-picker"}}}],
                "ports": [{"port": "ingest"}]
            }))
            .unwrap(),
        ]);
        r.objects.push(Object::NetworkPolicy(deny));
    });
    assert_problem(&problems, "picker → kube-apiserver");
    assert_problem(&problems, "agent → kube-apiserver");
    assert_problem(&problems, "agent → engines (KV events)");
    assert_problem(&problems, "Envoy → picker ext_proc");
    assert!(!problems.iter().any(|p| p.contains("agent → picker ingest")), "still admitted: {problems:#?}");
}

// --- Envoy and the agent's privileges ----------------------------------------------------------

#[test]
fn envoy_is_pinned_spread_and_budgeted() {
    let (_, r) = install("envoy", &OTHER, "standalone", &[]);
    let w = r.workload("kvroute-envoy").unwrap();
    let spec = w.template.spec.as_ref().unwrap();
    let image = spec.containers[0].image.as_deref().unwrap();
    let tag = image.strip_prefix("envoyproxy/envoy:v1.40.").expect(image);
    assert!(tag.parse::<u32>().is_ok(), "a release tag, not a moving one: {image}");
    let anti = spec.affinity.as_ref().and_then(|a| a.pod_anti_affinity.as_ref()).expect("anti-affinity");
    let term = &anti.preferred_during_scheduling_ignored_during_execution.as_ref().unwrap()[0].pod_affinity_term;
    assert_eq!(term.topology_key, "kubernetes.io/hostname");
    let labels = w.template.metadata.as_ref().unwrap().labels.clone().unwrap();
    let sel = term.label_selector.as_ref().unwrap().match_labels.clone().unwrap();
    assert!(sel.iter().all(|(k, v)| labels.get(k) == Some(v)), "anti-affinity selects Envoy's own pods");
    assert!(ids(&r).contains(&"PodDisruptionBudget/kvroute-envoy".to_string()));
    // A budget that blocks every drain is a problem (checks::ports).
    let mut r2 = r.clone();
    for o in &mut r2.objects {
        if let Object::PodDisruptionBudget(p) = o
            && p.metadata.name.as_deref() == Some("kvroute-envoy")
        {
            p.spec.as_mut().unwrap().max_unavailable =
                Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(0));
        }
    }
    assert!(check_all(&r2, &ctx()).iter().any(|p| p.to_string().contains("maxUnavailable 0")));
}

#[test]
fn the_agent_runs_as_root_only_with_nothing_else() {
    let (_, r) = install("agent-privileges", &OTHER, "standalone", &[]);
    let edit = |f: &dyn Fn(&mut k8s_openapi::api::core::v1::PodSpec)| {
        let mut r = r.clone();
        for o in &mut r.objects {
            if let Object::DaemonSet(d) = o {
                f(d.spec.as_mut().unwrap().template.spec.as_mut().unwrap());
            }
        }
        check_all(&r, &ctx()).iter().map(ToString::to_string).collect::<Vec<_>>()
    };
    let p = edit(&|s| {
        s.containers[0].security_context.as_mut().unwrap().capabilities.as_mut().unwrap().add =
            Some(vec!["SYS_ADMIN".into()]);
    });
    assert_problem(&p, "runs as uid 0 beyond the PodResources exception");
    let p = edit(&|s| {
        s.volumes
            .as_mut()
            .unwrap()
            .push(serde_json::from_value(serde_json::json!({"name": "root", "hostPath": {"path": "/"}})).unwrap());
    });
    assert_problem(&p, "its hostPath volumes are");
    let p = edit(&|s| {
        for m in s.containers[0].volume_mounts.as_mut().unwrap() {
            m.read_only = None;
        }
    });
    assert_problem(&p, "mounts /var/lib/kubelet/pod-resources writable");
    let p = edit(&|s| s.host_network = Some(true));
    assert_problem(&p, "shares a host namespace");
    // The cluster-wide grant is TokenReview create and nothing more.
    let mut r3 = r.clone();
    for o in &mut r3.objects {
        if let Object::ClusterRole(c) = o {
            c.rules.as_mut().unwrap()[0].verbs.push("list".into());
        }
    }
    let p: Vec<String> = check_all(&r3, &ctx()).iter().map(ToString::to_string).collect();
    assert_problem(&p, "the one cluster-wide grant kvroute needs is create on authentication.k8s.io tokenreviews");
    assert_problem(&p, "kvroute binds cluster-wide only its TokenReview ClusterRole");
}
