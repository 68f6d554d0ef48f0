//! Renders every overlay under deploy/k8s/overlays with `kubectl kustomize`, parses every object
//! into typed structs and runs every cross-reference check; then breaks the rendered objects on
//! purpose to show that each check can fail.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kvroute_deploy_check::checks::envoy_failure_mode_allow;
use kvroute_deploy_check::render::split_documents;
use kvroute_deploy_check::{CheckContext, Object, Rendered, check_all, parse_all, render};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn rendered(overlay: &str) -> Rendered {
    let dir = repo_root().join("deploy/k8s/overlays").join(overlay);
    let text = render(&dir).unwrap_or_else(|e| panic!("{e}"));
    parse_all(&split_documents(&text).unwrap()).unwrap_or_else(|e| panic!("{overlay}: {e}"))
}

/// Renders a kustomization written to `target/deploy-check-<name>/` (two levels below the
/// repository root: kustomize wants relative paths, so `../../deploy/k8s/…`), with `files` beside it.
fn rendered_custom(name: &str, kustomization: &str, files: &[(&str, &str)]) -> Rendered {
    let dir = repo_root().join(format!("target/deploy-check-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kustomization.yaml"), kustomization).unwrap();
    for (file, text) in files {
        std::fs::write(dir.join(file), text).unwrap();
    }
    let text = render(&dir).unwrap_or_else(|e| panic!("{e}"));
    parse_all(&split_documents(&text).unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// An overlay plus components, rendered as an operator would add them.
fn with_components(overlay: &str, components: &[&str]) -> Rendered {
    let list: Vec<String> = components.iter().map(|c| format!("../../deploy/k8s/components/{c}")).collect();
    rendered_custom(
        &format!("{overlay}-{}", components.join("-")),
        &format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: kvroute\nresources: [../../deploy/k8s/overlays/{overlay}]\ncomponents: [{}]\n",
            list.join(", ")
        ),
        &[],
    )
}

fn broken_in(mut r: Rendered, edit: impl FnOnce(&mut Rendered), needle: &str) {
    edit(&mut r);
    let problems = check_all(&r, &ctx());
    assert!(
        problems.iter().any(|p| p.to_string().contains(needle)),
        "expected a problem containing {needle:?}, got {problems:#?}"
    );
}

fn ctx() -> CheckContext {
    CheckContext::new(repo_root())
}

fn assert_clean(overlay: &str, r: &Rendered) {
    let problems = check_all(r, &ctx());
    assert!(
        problems.is_empty(),
        "{overlay}:\n{}",
        problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")
    );
}

fn kinds(r: &Rendered) -> Vec<String> {
    let mut k: Vec<_> = r.objects.iter().map(Object::id).collect();
    k.sort();
    k
}

/// Problems after `edit`, which must mention `needle`.
fn broken(overlay: &str, edit: impl FnOnce(&mut Rendered), needle: &str) {
    let mut r = rendered(overlay);
    edit(&mut r);
    let problems = check_all(&r, &ctx());
    assert!(
        problems.iter().any(|p| p.to_string().contains(needle)),
        "expected a problem containing {needle:?}, got {problems:#?}"
    );
}

#[test]
fn every_overlay_is_listed_here() {
    let mut found: Vec<_> = std::fs::read_dir(repo_root().join("deploy/k8s/overlays"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    found.sort();
    assert_eq!(found, ["fail-open", "gateway-api", "standalone"], "add new overlays to the tests below");
}

#[test]
fn standalone_renders_and_checks_clean() {
    let r = rendered("standalone");
    assert_clean("standalone", &r);
    let ids = kinds(&r);
    for want in [
        "DaemonSet/kvroute-agent",
        "StatefulSet/kvroute-picker",
        "Service/kvroute-picker",
        "Service/kvroute-picker-peers",
        "PodDisruptionBudget/kvroute-picker",
        "Deployment/kvroute-envoy",
        "Service/kvroute-gateway",
    ] {
        assert!(ids.iter().any(|i| i == want), "{want} missing from {ids:?}");
    }
    assert_eq!(envoy_failure_mode_allow(&r, &ctx()), Some(false), "standalone fails closed");
}

#[test]
fn envoy_stats_listener_exposes_only_prometheus_stats() {
    let edit = |from: &'static str, to: &'static str| {
        move |r: &mut Rendered| {
            let data = config_map_data(r, "kvroute-envoy-config");
            let text = data.get_mut("envoy.yaml").unwrap();
            assert!(text.contains(from), "{from:?} not in envoy.yaml");
            *text = text.replace(from, to);
        }
    };
    for overlay in ["standalone", "fail-open"] {
        broken(
            overlay,
            edit(r#"path: "/stats/prometheus""#, r#"prefix: "/""#),
            "only /stats/prometheus to envoy_admin",
        );
        broken(overlay, edit("- name: stats\n", "- name: metrics\n"), "no `stats` listener");
        broken(overlay, edit("port_value: 9902", "port_value: 9903"), "containerPort stats");
        broken(
            overlay,
            edit(
                "status: 404\n                            body: { inline_string: \"only",
                "status: 200\n                            body: { inline_string: \"only",
            ),
            "must forward /stats/prometheus or answer an error",
        );
    }
}

#[test]
fn fail_open_balances_over_the_pools_ready_pods() {
    let r = rendered("fail-open");
    assert_clean("fail-open", &r);
    assert_eq!(envoy_failure_mode_allow(&r, &ctx()), Some(true));
    assert!(kinds(&r).iter().any(|i| i == "Service/kvroute-pool"), "the pool's headless Service");
    // The pod list must be the pool's: same selector, same port, Ready pods only.
    fn service(r: &mut Rendered) -> &mut k8s_openapi::api::core::v1::ServiceSpec {
        r.objects
            .iter_mut()
            .find_map(|o| match o {
                Object::Service(s) if s.metadata.name.as_deref() == Some("kvroute-pool") => s.spec.as_mut(),
                _ => None,
            })
            .unwrap()
    }
    broken(
        "fail-open",
        |r| {
            service(r).selector = Some([("app".to_string(), "other".to_string())].into());
        },
        "the InferencePool selects",
    );
    broken("fail-open", |r| service(r).publish_not_ready_addresses = Some(true), "publishes unready pods");
    broken("fail-open", |r| service(r).cluster_ip = None, "must be headless");
    let envoy = |r: &mut Rendered, from: &str, to: &str| {
        let data = config_map_data(r, "kvroute-envoy-config");
        let text = data.get_mut("envoy.yaml").unwrap();
        assert!(text.contains(from), "{from:?} not in the fail-open envoy.yaml");
        *text = text.replace(from, to);
    };
    broken(
        "fail-open",
        |r| {
            envoy(
                r,
                "kvroute-pool.kvroute.svc.cluster.local, port_value: 8000",
                "kvroute-pool.kvroute.svc.cluster.local, port_value: 8001",
            )
        },
        "target port",
    );
    broken(
        "fail-open",
        |r| envoy(r, "kvroute-pool.kvroute.svc.cluster.local", "vllm.kvroute.svc.cluster.local"),
        "no Service of this overlay",
    );
    // Fail-open without a pool list (what the overlay shipped before: header-routed ORIGINAL_DST,
    // so a bypassed picker meant 503) is caught.
    broken(
        "standalone",
        |r| {
            let data = config_map_data(r, "kvroute-envoy-config");
            let text = data.get_mut("envoy.yaml").unwrap();
            *text = text.replace("failure_mode_allow: false", "failure_mode_allow: true");
        },
        "envoy-fail-open.yaml",
    );
}

#[test]
fn gateway_api_renders_and_checks_clean() {
    let r = rendered("gateway-api");
    assert_clean("gateway-api", &r);
    let ids = kinds(&r);
    for want in ["HTTPRoute/kvroute-inference", "Gateway/kvroute-inference"] {
        assert!(ids.iter().any(|i| i == want), "{want} missing from {ids:?}");
    }
    // The pool is the operator's: the HTTPRoute sends to the pool the picker follows.
    assert!(!ids.iter().any(|i| i.starts_with("InferencePool/")), "the pool is not kvroute's to create or delete");
    assert!(!ids.iter().any(|i| i == "Deployment/kvroute-envoy"), "no standalone Envoy with a Gateway");
    assert_eq!(r.workload("kvroute-picker").unwrap().replicas, Some(3));
}

// --- each check can fail ---------------------------------------------------------------------

fn picker_sts(r: &mut Rendered) -> &mut k8s_openapi::api::apps::v1::StatefulSet {
    r.objects
        .iter_mut()
        .find_map(|o| match o {
            Object::StatefulSet(s) => Some(s),
            _ => None,
        })
        .unwrap()
}

fn agent_ds(r: &mut Rendered) -> &mut k8s_openapi::api::apps::v1::DaemonSet {
    r.objects
        .iter_mut()
        .find_map(|o| match o {
            Object::DaemonSet(d) => Some(d),
            _ => None,
        })
        .unwrap()
}

fn config_map_data<'a>(r: &'a mut Rendered, prefix: &str) -> &'a mut std::collections::BTreeMap<String, String> {
    r.objects
        .iter_mut()
        .find_map(|o| match o {
            Object::ConfigMap(c) if c.metadata.name.as_deref().unwrap_or("").starts_with(prefix) => c.data.as_mut(),
            _ => None,
        })
        .unwrap()
}

#[test]
fn scaling_pickers_needs_no_agent_change_but_a_headless_service_that_publishes_not_ready() {
    let mut r = rendered("standalone");
    picker_sts(&mut r).spec.as_mut().unwrap().replicas = Some(5);
    assert_clean("standalone with 5 pickers", &r);
    broken(
        "standalone",
        |r| {
            for o in &mut r.objects {
                if let Object::Service(s) = o
                    && s.metadata.name.as_deref() == Some("kvroute-picker-peers")
                {
                    s.spec.as_mut().unwrap().publish_not_ready_addresses = None;
                }
            }
        },
        "publishNotReadyAddresses: true",
    );
}

#[test]
fn objects_outside_the_pools_namespace_fail() {
    // The mistake this deployment once shipped: components' objects without a namespace.
    broken(
        "gateway-api",
        |r| {
            for o in &mut r.objects {
                if let Object::HttpRoute(h) = o {
                    h.metadata.namespace = None;
                }
            }
        },
        "has no namespace",
    );
    broken(
        "standalone",
        |r| {
            for o in &mut r.objects {
                if let Object::Deployment(d) = o {
                    d.metadata.namespace = Some("default".into());
                }
            }
        },
        "namespace default ≠ the picker's kvroute",
    );
}

#[test]
fn routed_pool_without_endpoint_picker_and_wrong_pool_name_fail() {
    let gateway_with_pool = with_components("gateway-api", &["inferencepool"]);
    assert_clean("gateway-api + inferencepool", &gateway_with_pool);
    broken_in(
        gateway_with_pool,
        |r| {
            for o in &mut r.objects {
                if let Object::InferencePool(p) = o {
                    p.spec.endpoint_picker_ref = None;
                }
            }
        },
        "endpointPickerRef is missing",
    );
    let agent_pool = |r: &mut Rendered| {
        let c = &mut agent_ds(r).spec.as_mut().unwrap().template.spec.as_mut().unwrap().containers[0];
        for e in c.env.as_mut().unwrap() {
            if e.name == "POOL_NAME" {
                e.value = Some("other-pool".into());
            }
        }
    };
    // With the pool rendered (fail-open creates it) the name must be that pool's …
    broken("fail-open", agent_pool, "--pool-name \"other-pool\" names no InferencePool");
    // … and without it, picker and agents must still follow the same one.
    broken("standalone", agent_pool, "agent --pool-name \"other-pool\" ≠ the picker's \"vllm-qwen2-5-7b\"");
    broken(
        "gateway-api",
        |r| {
            for o in &mut r.objects {
                if let Object::HttpRoute(h) = o {
                    h.spec.rules[0].backend_refs[0].name = "another-pool".into();
                }
            }
        },
        "backendRef InferencePool another-pool is neither rendered nor the pool the picker follows",
    );
}

#[test]
fn service_port_without_container_port_fails() {
    broken(
        "standalone",
        |r| {
            let c = &mut picker_sts(r).spec.as_mut().unwrap().template.spec.as_mut().unwrap().containers[0];
            c.ports.as_mut().unwrap().retain(|p| p.name.as_deref() != Some("ingest"));
        },
        "targets String(\"ingest\")",
    );
}

#[test]
fn probe_on_undeclared_port_fails() {
    broken(
        "standalone",
        |r| {
            let c = &mut agent_ds(r).spec.as_mut().unwrap().template.spec.as_mut().unwrap().containers[0];
            c.liveness_probe.as_mut().unwrap().http_get.as_mut().unwrap().port = IntOrString::Int(9999);
        },
        "livenessProbe probes Int(9999)",
    );
}

#[test]
fn invalid_picker_config_fails_with_the_pickers_own_message() {
    broken(
        "standalone",
        |r| {
            let data = config_map_data(r, "kvroute-picker-config");
            let text = data.get("picker.yaml").unwrap().replace("cache: 0.60", "cache: 0.90");
            data.insert("picker.yaml".into(), text);
        },
        "fails the picker's validation: invalid config: scoring",
    );
}

#[test]
fn loopback_listener_and_port_mismatch_fail() {
    broken(
        "standalone",
        |r| {
            let data = config_map_data(r, "kvroute-picker-config");
            let text = data.get("picker.yaml").unwrap().replace("0.0.0.0:9004", "127.0.0.1:9014");
            data.insert("picker.yaml".into(), text);
        },
        "ingest_addr 127.0.0.1:9014 binds one interface only",
    );
}

#[test]
fn tokenizer_outside_a_volume_fails() {
    broken_in(
        with_components("standalone", &["tokenizers"]),
        |r| {
            let data = config_map_data(r, "kvroute-picker-config");
            let text = data.get("picker.yaml").unwrap().replace("/models/tokenizers/", "/opt/tok/");
            data.insert("picker.yaml".into(), text);
        },
        "is not under a volume mount",
    );
}

#[test]
fn invalid_agent_config_fails_with_the_agents_own_message() {
    broken(
        "standalone",
        |r| {
            let data = config_map_data(r, "kvroute-agent-config");
            let text = data.get("agent.yaml").unwrap().replace("scrape_interval_ms: 200", "scrape_interval_ms: 0");
            data.insert("agent.yaml".into(), text);
        },
        "fails the agent's validation",
    );
    broken(
        "standalone",
        |r| {
            let data = config_map_data(r, "kvroute-agent-config");
            let text = format!("{}engines: [{{pod: p, endpoint: 10.0.0.1:8000}}]\n", data.get("agent.yaml").unwrap());
            data.insert("agent.yaml".into(), text);
        },
        "engines must come from the InferencePool",
    );
}

#[test]
fn missing_configmap_key_and_node_name_env_fail() {
    broken(
        "standalone",
        |r| {
            let data = config_map_data(r, "kvroute-picker-config");
            let text = data.remove("picker.yaml").unwrap();
            data.insert("config.yaml".into(), text);
        },
        "key picker.yaml missing",
    );
    broken(
        "standalone",
        |r| {
            let c = &mut agent_ds(r).spec.as_mut().unwrap().template.spec.as_mut().unwrap().containers[0];
            c.env.as_mut().unwrap().retain(|e| e.name != "NODE_NAME");
        },
        "NODE_NAME must come from the downward API",
    );
}

#[test]
fn agent_without_gpu_scheduling_or_security_fails() {
    broken(
        "standalone",
        |r| agent_ds(r).spec.as_mut().unwrap().template.spec.as_mut().unwrap().runtime_class_name = None,
        "runtimeClassName must be nvidia",
    );
    broken(
        "standalone",
        |r| {
            let c = &mut agent_ds(r).spec.as_mut().unwrap().template.spec.as_mut().unwrap().containers[0];
            c.security_context.as_mut().unwrap().read_only_root_filesystem = Some(false);
        },
        "readOnlyRootFilesystem must be true",
    );
}

#[test]
fn inference_pool_pointing_at_the_wrong_port_fails() {
    broken(
        "fail-open",
        |r| {
            for o in &mut r.objects {
                if let Object::InferencePool(p) = o {
                    p.spec.endpoint_picker_ref.as_mut().unwrap().port.as_mut().unwrap().number = 9090;
                }
            }
        },
        "does not reach a container port named ext-proc",
    );
}

#[test]
fn envoy_config_drifting_from_deploy_envoy_fails() {
    broken(
        "standalone",
        |r| {
            let data = config_map_data(r, "kvroute-envoy-config");
            let text = data.get("envoy.yaml").unwrap().replace("message_timeout: 5s", "message_timeout: 7s");
            data.insert("envoy.yaml".into(), text);
        },
        "differs from deploy/envoy/envoy.yaml",
    );
}

#[test]
fn picker_body_limit_above_envoy_buffer_fails() {
    broken(
        "standalone",
        |r| {
            let data = config_map_data(r, "kvroute-picker-config");
            let text =
                data.get("picker.yaml").unwrap().replace("body_limit_bytes: 8388608", "body_limit_bytes: 33554432");
            data.insert("picker.yaml".into(), text);
        },
        "must exceed the picker's body_limit_bytes 33554432",
    );
}

/// components/monitoring added to the standalone overlay: its ServiceMonitor selects the picker's
/// Service and names a port that Service has; its PodMonitor selects the agent's pods and names a
/// container port they declare. (Prometheus Operator kinds are not in the typed model: read raw.)
#[test]
fn monitoring_component_targets_the_picker_service_and_agent_pods() {
    let dir = repo_root().join("target/deploy-check-monitoring");
    std::fs::create_dir_all(&dir).unwrap();
    // kustomize wants relative roots: `dir` is two levels below the repository root.
    std::fs::write(
        dir.join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
         resources: [../../deploy/k8s/overlays/standalone]\ncomponents: [../../deploy/k8s/components/monitoring]\n",
    )
    .unwrap();
    let docs = split_documents(&render(&dir).unwrap_or_else(|e| panic!("{e}"))).unwrap();
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{kind}/{name} not rendered"))
    };
    let matches = |selector: &serde_json::Value, labels: &serde_json::Value| {
        let sel = selector["matchLabels"].as_object().unwrap();
        !sel.is_empty() && sel.iter().all(|(k, v)| labels[k] == *v)
    };
    let sm = find("ServiceMonitor", "kvroute-picker");
    assert_eq!(sm["metadata"]["namespace"], "kvroute");
    let svc = find("Service", "kvroute-picker");
    assert!(matches(&sm["spec"]["selector"], &svc["metadata"]["labels"]), "{sm} does not select {svc}");
    let port = sm["spec"]["endpoints"][0]["port"].as_str().unwrap();
    assert!(svc["spec"]["ports"].as_array().unwrap().iter().any(|p| p["name"] == port), "no port {port} on {svc}");
    let pm = find("PodMonitor", "kvroute-envoy");
    let envoy = &find("Deployment", "kvroute-envoy")["spec"]["template"];
    assert!(matches(&pm["spec"]["selector"], &envoy["metadata"]["labels"]), "{pm} does not select the Envoy pods");
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["path"], "/stats/prometheus");
    let port = pm["spec"]["podMetricsEndpoints"][0]["port"].as_str().unwrap();
    assert!(
        envoy["spec"]["containers"][0]["ports"].as_array().unwrap().iter().any(|p| p["name"] == port),
        "Envoy pods declare no port {port}"
    );
    let pm = find("PodMonitor", "kvroute-agent");
    let ds = find("DaemonSet", "kvroute-agent");
    let pod = &ds["spec"]["template"];
    assert!(matches(&pm["spec"]["selector"], &pod["metadata"]["labels"]), "{pm} does not select the agent pods");
    let port = pm["spec"]["podMetricsEndpoints"][0]["port"].as_str().unwrap();
    let declared = pod["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| c["ports"].as_array().cloned().unwrap_or_default());
    assert!(declared.clone().any(|p| p["name"] == port), "agent pods declare no port {port}");
}

/// Replicas share one view on Kubernetes (docs/design.md §4): `replicas.service` names the
/// headless Service, the pod gets `POD_IP`, and its Role may watch EndpointSlices; each missing
/// piece is a problem.
#[test]
fn replica_peers_need_the_service_pod_ip_and_endpointslice_rbac() {
    let edit_config = |from: &'static str, to: &'static str| {
        move |r: &mut Rendered| {
            let data = config_map_data(r, "kvroute-picker-config");
            let text = data.get("picker.yaml").unwrap();
            assert!(text.contains(from), "picker.yaml lacks {from:?}");
            let text = text.replace(from, to);
            data.insert("picker.yaml".into(), text);
        }
    };
    broken(
        "standalone",
        edit_config("service: { name: kvroute-picker-peers, port: ingest }", "peers: []"),
        "replicas.service must name the picker's headless Service",
    );
    broken(
        "standalone",
        edit_config("name: kvroute-picker-peers, port: ingest", "name: kvroute-picker, port: ingest"),
        "replicas.service kvroute-picker:ingest must be the picker's headless Service kvroute-picker-peers",
    );
    broken(
        "standalone",
        |r| {
            let c = &mut picker_sts(r).spec.as_mut().unwrap().template.spec.as_mut().unwrap().containers[0];
            c.env.as_mut().unwrap().retain(|e| e.name != "POD_IP");
        },
        "replicas.service needs env POD_IP",
    );
    broken(
        "standalone",
        |r| {
            for o in &mut r.objects {
                if let Object::Role(role) = o {
                    for rule in role.rules.as_mut().unwrap() {
                        if let Some(res) = rule.resources.as_mut() {
                            res.retain(|x| x != "endpointslices");
                        }
                    }
                }
            }
        },
        "may list and watch discovery.k8s.io endpointslices",
    );
}

/// Agents prove their node with a projected ServiceAccount token (docs/design.md §14): the picker
/// may create TokenReviews (and nothing else cluster-wide) and get pods, the agent mounts a token
/// for the picker's audience where `--picker-token-file` points; each broken piece is a problem.
#[test]
fn token_identity_needs_tokenreview_rbac_and_the_agents_projected_token() {
    fn agent_spec(r: &mut Rendered) -> &mut k8s_openapi::api::core::v1::PodSpec {
        agent_ds(r).spec.as_mut().unwrap().template.spec.as_mut().unwrap()
    }
    let rendered_clean = rendered("standalone");
    assert!(
        !kinds(&rendered_clean).iter().any(|k| k.starts_with("Certificate/kvroute-agent")),
        "no Certificate per node: {:?}",
        kinds(&rendered_clean)
    );
    broken(
        "standalone",
        |r| r.objects.retain(|o| !matches!(o, Object::ClusterRoleBinding(_))),
        "bound (ClusterRoleBinding) to a ClusterRole granting authentication.k8s.io tokenreviews create",
    );
    broken(
        "standalone",
        |r| {
            for o in &mut r.objects {
                if let Object::ClusterRole(c) = o {
                    c.rules.as_mut().unwrap()[0].resources = Some(vec!["tokenreviews".into(), "secrets".into()]);
                }
            }
        },
        "the one cluster-wide grant kvroute needs is create on authentication.k8s.io tokenreviews",
    );
    broken(
        "standalone",
        move |r| {
            for v in agent_spec(r).volumes.as_mut().unwrap() {
                for s in v.projected.as_mut().and_then(|p| p.sources.as_mut()).into_iter().flatten() {
                    if let Some(t) = s.service_account_token.as_mut() {
                        t.audience = Some("https://kubernetes.default.svc".into());
                    }
                }
            }
        },
        "is not a mounted serviceAccountToken for audience kvroute-picker",
    );
    broken(
        "standalone",
        move |r| {
            let c = &mut agent_spec(r).containers[0];
            c.args.as_mut().unwrap().retain(|a| !a.starts_with("--picker-token-file"));
        },
        "the agent needs --picker-token-file",
    );
    broken(
        "standalone",
        move |r| agent_spec(r).service_account_name = Some("default".into()),
        "agent_token.service_account kvroute-agent is not the agent DaemonSet's serviceAccountName",
    );
}
