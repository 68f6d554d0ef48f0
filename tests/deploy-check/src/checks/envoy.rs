//! The standalone Envoy's config against the file the end-to-end tests run: `deploy/envoy/envoy.yaml`
//! when it fails closed, `deploy/envoy/envoy-fail-open.yaml` when it fails open
//! (`failure_mode_allow: true`, GIE's FailOpen). Allowed differences, and nothing else: the
//! `kvroute_picker` cluster (in a cluster it resolves the picker Service by DNS; its address and
//! port must be that Service's ext-proc port) and, failing open, the address list of
//! `kvroute_endpoints` (a headless Service resolved by DNS, which must select the InferencePool's
//! pods on its target port, Ready ones only: Envoy's own balancing when the pickers are down must
//! cover the pool and nothing else). The gateway listener's port must be the Deployment's `http`
//! container port, and its per-connection buffer must exceed the picker's `body_limit_bytes`
//! (docs/design.md §5: the picker, not Envoy, answers 413). Envoy's stats must be scrapeable
//! without exposing its admin interface: a `stats` listener on the container port `stats` whose
//! only forwarding route is the exact path `/stats/prometheus` to the `envoy_admin` cluster (the
//! admin address), every other route a direct error; both are the Kubernetes files' own additions.

use serde_json::Value;

use kvroute_picker::config::PickerConfig;

use super::{CheckContext, Problem, Sink, config_arg, config_file, containers, named_port};
use crate::objects::{Rendered, Workload, diff};

const REFERENCE: &str = "deploy/envoy/envoy.yaml";
const REFERENCE_FAIL_OPEN: &str = "deploy/envoy/envoy-fail-open.yaml";
/// Fields of `kvroute_endpoints` that may differ from the fail-open reference (how its addresses
/// are found).
const ENDPOINT_ADDRESSING: [&str; 5] =
    ["type", "dns_lookup_family", "dns_refresh_rate", "respect_dns_ttl", "load_assignment"];

fn envoy_config(r: &Rendered, w: &Workload<'_>) -> Result<Value, String> {
    let c = containers(w.template).first().ok_or("no container")?;
    let args = c.args.as_deref().unwrap_or(&[]);
    let path = args
        .iter()
        .position(|a| a == "-c" || a == "--config-path")
        .and_then(|i| args.get(i + 1))
        .ok_or("envoy runs without -c <file>")?;
    let (_, _, text) = config_file(r, w.template, c, path)?;
    serde_norway::from_str(text).map_err(|e| format!("{path}: not YAML: {e}"))
}

/// `failure_mode_allow` of the standalone Envoy's ext_proc filter, if the overlay has one.
pub fn envoy_failure_mode_allow(r: &Rendered, ctx: &CheckContext) -> Option<bool> {
    let config = envoy_config(r, &r.workload(&ctx.envoy)?).ok()?;
    let mut found = None;
    walk_mut(&mut config.clone(), &mut |key, v| {
        if key == "failure_mode_allow" {
            found = v.as_bool();
        }
    });
    found
}

fn walk_mut(v: &mut Value, f: &mut impl FnMut(&str, &mut Value)) {
    match v {
        Value::Object(m) => {
            for (k, child) in m.iter_mut() {
                f(k, child);
                walk_mut(child, f);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|child| walk_mut(child, f)),
        _ => {}
    }
}

fn picker_cluster(config: &mut Value) -> Option<&mut Value> {
    cluster(config, "kvroute_picker")
}

fn cluster<'v>(config: &'v mut Value, name: &str) -> Option<&'v mut Value> {
    config["static_resources"]["clusters"].as_array_mut()?.iter_mut().find(|c| c["name"] == name)
}

/// The `stats` listener and `envoy_admin` cluster: checked, then removed from `config` (they are
/// not in the reference files).
fn check_and_strip_stats(config: &mut Value, stats_port: Option<i32>, sink: &mut Sink<'_>) {
    let admin = config["admin"]["address"]["socket_address"].clone();
    let Some(listeners) = config["static_resources"]["listeners"].as_array_mut() else { return };
    let Some(i) = listeners.iter().position(|l| l["name"] == "stats") else {
        return sink.push("no `stats` listener: Envoy's /stats/prometheus is not scrapeable (components/monitoring)");
    };
    let listener = listeners.remove(i);
    let port = listener["address"]["socket_address"]["port_value"].as_i64();
    if port.is_none() || port != stats_port.map(i64::from) {
        sink.push(format!("stats listener port {port:?} ≠ containerPort stats {stats_port:?}"));
    }
    let mut forwarded = 0;
    let mut routes = Vec::new();
    walk_mut(&mut listener.clone(), &mut |key, v| {
        if key == "routes"
            && let Some(a) = v.as_array()
        {
            routes.extend(a.iter().cloned());
        }
    });
    for r in &routes {
        if let Some(cluster) = r["route"]["cluster"].as_str() {
            forwarded += 1;
            let m = r["match"].as_object().cloned().unwrap_or_default();
            let exact = m.get("path").and_then(Value::as_str) == Some("/stats/prometheus")
                && !m.contains_key("prefix")
                && !m.contains_key("safe_regex")
                && !m.contains_key("path_separated_prefix");
            if !exact || cluster != "envoy_admin" {
                sink.push(format!("stats listener forwards {m:?} to {cluster}: only /stats/prometheus to envoy_admin"));
            }
        } else if r["direct_response"]["status"].as_u64().is_none_or(|s| s < 400) {
            sink.push(format!("stats listener route {} must forward /stats/prometheus or answer an error", r["match"]));
        }
    }
    if forwarded == 0 {
        sink.push("stats listener forwards nothing to envoy_admin");
    }
    match cluster(config, "envoy_admin") {
        None => sink.push("no envoy_admin cluster for the stats listener"),
        Some(c) => {
            let sa = &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
            if sa["address"] != admin["address"] || sa["port_value"] != admin["port_value"] {
                sink.push(format!("envoy_admin dials {sa}, not the admin address {admin}"));
            }
        }
    }
    if let Some(clusters) = config["static_resources"]["clusters"].as_array_mut() {
        clusters.retain(|c| c["name"] != "envoy_admin");
    }
}

/// Failing open, `kvroute_endpoints` must list the pool's Ready pods: a STRICT_DNS cluster on a
/// headless Service of the rendered set that selects what the InferencePool selects, on its
/// (first) target port, without publishing unready pods.
fn check_fail_open_endpoints(r: &Rendered, config: &mut Value, sink: &mut Sink<'_>) {
    let Some(c) = cluster(config, "kvroute_endpoints") else {
        return sink.push("envoy.yaml has no kvroute_endpoints cluster");
    };
    if c["type"].as_str() != Some("STRICT_DNS") {
        sink.push("failing open, cluster kvroute_endpoints must list the pool's pods by DNS (type STRICT_DNS)");
    }
    let sa = &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    let (host, port) = (sa["address"].as_str().unwrap_or_default(), sa["port_value"].as_i64());
    let pool = r.objects.iter().find_map(|o| match o {
        crate::objects::Object::InferencePool(p) => Some(p),
        _ => None,
    });
    let Some(pool) = pool else { return sink.push("failing open needs the InferencePool to check the pod list") };
    let svc = r.services().find(|s| {
        let ns = s.metadata.namespace.as_deref().unwrap_or("default");
        host == format!("{}.{ns}.svc.cluster.local", s.metadata.name.as_deref().unwrap_or_default())
    });
    let Some(svc) = svc else {
        return sink.push(format!("cluster kvroute_endpoints dials {host:?}, which is no Service of this overlay"));
    };
    let spec = svc.spec.clone().unwrap_or_default();
    if spec.cluster_ip.as_deref() != Some("None") {
        sink.push(format!("Service {host} must be headless (clusterIP: None): Envoy needs every pod's address"));
    }
    if spec.publish_not_ready_addresses == Some(true) {
        sink.push(format!("Service {host} publishes unready pods: Envoy would balance onto them"));
    }
    if spec.selector.as_ref() != Some(&pool.spec.selector.match_labels) {
        sink.push(format!(
            "Service {host} selects {:?}, the InferencePool selects {:?}",
            spec.selector, pool.spec.selector.match_labels
        ));
    }
    let target = pool.spec.target_ports.first().map(|p| i64::from(p.number));
    if port != target {
        sink.push(format!("cluster kvroute_endpoints port {port:?} ≠ the InferencePool's target port {target:?}"));
    }
}

/// The picker's `body_limit_bytes`, when its config can be read (configs.rs reports it otherwise).
fn picker_body_limit(r: &Rendered, ctx: &CheckContext) -> Option<usize> {
    let w = r.workload(&ctx.picker)?;
    let c = containers(w.template).iter().find(|c| config_arg(c).is_some())?;
    let (_, _, text) = config_file(r, w.template, c, config_arg(c)?).ok()?;
    PickerConfig::from_yaml(text).ok().map(|p| p.body_limit_bytes)
}

pub(super) fn check(r: &Rendered, ctx: &CheckContext, out: &mut Vec<Problem>) {
    let Some(w) = r.workload(&ctx.envoy) else { return };
    let mut sink = Sink::new(out, format!("{}/{}", w.kind, w.name));
    let mut config = match envoy_config(r, &w) {
        Ok(config) => config,
        Err(e) => return sink.push(e),
    };
    let fail_open = envoy_failure_mode_allow(r, ctx) == Some(true);
    let reference_name = if fail_open { REFERENCE_FAIL_OPEN } else { REFERENCE };
    let ref_path = ctx.repo_root.join(reference_name);
    let mut reference: Value = match std::fs::read_to_string(&ref_path)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_norway::from_str(&t).map_err(|e| e.to_string()))
    {
        Ok(v) => v,
        Err(e) => return sink.push(format!("cannot read {}: {e}", ref_path.display())),
    };

    // The picker cluster: must reach the picker Service's ext-proc port by DNS.
    let svc = r.service(&ctx.picker);
    let namespace = svc.and_then(|s| s.metadata.namespace.clone()).unwrap_or_else(|| "default".into());
    let svc_port = svc.and_then(|s| {
        s.spec.as_ref()?.ports.as_ref()?.iter().find(|p| p.name.as_deref() == Some("ext-proc")).map(|p| p.port)
    });
    let want_host = format!("{}.{namespace}.svc.cluster.local", ctx.picker);
    match picker_cluster(&mut config) {
        None => sink.push("envoy.yaml has no kvroute_picker cluster"),
        Some(cluster) => {
            if !matches!(cluster["type"].as_str(), Some("STRICT_DNS") | Some("LOGICAL_DNS")) {
                sink.push("cluster kvroute_picker must resolve the Service by DNS (type STRICT_DNS)");
            }
            let sa =
                &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
            if sa["address"].as_str() != Some(want_host.as_str()) {
                sink.push(format!(
                    "cluster kvroute_picker dials {}, not the picker Service {want_host}",
                    sa["address"]
                ));
            }
            if sa["port_value"].as_i64() != svc_port.map(i64::from) {
                sink.push(format!(
                    "cluster kvroute_picker port {} ≠ Service {} ext-proc port {svc_port:?}",
                    sa["port_value"], ctx.picker
                ));
            }
        }
    }

    // Listener port = container port `http`.
    let listen = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"].as_i64();
    let http = containers(w.template).first().and_then(|c| named_port(c, "http"));
    if listen.is_none() || listen != http.map(i64::from) {
        sink.push(format!("listener port {listen:?} ≠ containerPort http {http:?}"));
    }

    // Envoy must buffer more than the picker accepts, so that the picker (not Envoy) answers 413.
    if let Some(limit) = picker_body_limit(r, ctx) {
        let buffer = config["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"].as_u64();
        if buffer.is_none_or(|b| b <= limit as u64) {
            sink.push(format!(
                "listener per_connection_buffer_limit_bytes {buffer:?} must exceed the picker's body_limit_bytes {limit}"
            ));
        }
    }

    let stats_port = containers(w.template).first().and_then(|c| named_port(c, "stats"));
    check_and_strip_stats(&mut config, stats_port, &mut sink);

    if fail_open {
        check_fail_open_endpoints(r, &mut config, &mut sink);
        if let (Some(mine), Some(theirs)) =
            (cluster(&mut config, "kvroute_endpoints"), cluster(&mut reference, "kvroute_endpoints").cloned())
            && let (Some(mine), Some(theirs)) = (mine.as_object_mut(), theirs.as_object())
        {
            for key in ENDPOINT_ADDRESSING {
                match theirs.get(key) {
                    Some(v) => mine.insert(key.to_owned(), v.clone()),
                    None => mine.remove(key),
                };
            }
        }
    }

    // Everything else equals the reference.
    if let (Some(mine), Some(theirs)) = (picker_cluster(&mut config), picker_cluster(&mut reference).cloned()) {
        *mine = theirs;
    }
    let mut paths = Vec::new();
    diff("", &reference, &config, &mut paths);
    diff("", &config, &reference, &mut paths);
    if !paths.is_empty() {
        paths.sort();
        paths.dedup();
        sink.push(format!(
            "envoy.yaml differs from {reference_name} beyond the picker cluster{} at {paths:?}",
            if fail_open { " and the pool's addresses" } else { "" }
        ));
    }
}
