//! The picker and agent config files inside their ConfigMaps, checked with the binaries' own parsers
//! and `validate()`, and against the manifests: listen ports equal the declared container ports,
//! listeners bind all interfaces, tokenizer directories live on a mounted volume, every agent
//! lists exactly the picker StatefulSet's replicas by their per-pod DNS names, every engine's model
//! is a picker `target_model`, and every engine endpoint is on an InferencePool target port.
//!
//! Tokenizers: the picker's tokenizer volume (a PVC) is not in the repository, so each tokenizer
//! path is first checked to lie under one of the picker's volume mounts and then replaced by
//! [`CheckContext::tokenizer_fixture`] before `PickerConfig::validate` (which requires a
//! `tokenizer.json` there).

use std::net::SocketAddr;

use k8s_openapi::api::core::v1::Container;
use kvroute_agent::config::AgentConfig;
use kvroute_picker::config::PickerConfig;

use super::{CheckContext, Problem, Sink, config_arg, config_file, config_volume, containers, named_port, workload_id};
use crate::objects::{Object, Rendered};

fn listener(sink: &mut Sink<'_>, c: &Container, field: &str, addr: SocketAddr, port_name: &str) {
    if !addr.ip().is_unspecified() {
        sink.push(format!("{field} {addr} binds one interface only; use 0.0.0.0 so other pods reach it"));
    }
    match named_port(c, port_name) {
        Some(p) if p == i32::from(addr.port()) => {}
        Some(p) => sink.push(format!("{field} port {} ≠ containerPort {port_name} {p}", addr.port())),
        None => sink.push(format!("container {} declares no port named {port_name} for {field}", c.name)),
    }
}

pub(super) fn picker(r: &Rendered, ctx: &CheckContext, out: &mut Vec<Problem>) {
    let Some(w) = r.workload(&ctx.picker) else {
        Sink::new(out, format!("StatefulSet/{}", ctx.picker)).push("picker workload missing");
        return;
    };
    let mut sink = Sink::new(out, workload_id(&w));
    if w.kind != "StatefulSet" {
        sink.push("the picker must be a StatefulSet: agents name each replica by its per-pod DNS name");
    }
    let Some(c) = containers(w.template).iter().find(|c| config_arg(c).is_some()) else {
        sink.push("no container runs with --config <file>");
        return;
    };
    let path = config_arg(c).unwrap_or_default();
    let (cm, key, text) = match config_file(r, w.template, c, path) {
        Ok(found) => found,
        Err(e) => return sink.push(format!("--config {path}: {e}")),
    };
    let mut config = match PickerConfig::from_yaml(text) {
        Ok(config) => config,
        Err(e) => return sink.push(format!("ConfigMap {cm} key {key}: {e}")),
    };
    listener(&mut sink, c, "ext_proc_addr", config.ext_proc_addr, "ext-proc");
    listener(&mut sink, c, "ingest_addr", config.ingest_addr, "ingest");
    listener(&mut sink, c, "admin_addr", config.admin_addr, "admin");
    let mounts = c.volume_mounts.as_deref().unwrap_or(&[]);
    for m in &mut config.models {
        let Some(dir) = &m.tokenizer else { continue };
        let under_mount = dir.is_absolute() && mounts.iter().any(|v| dir.starts_with(&v.mount_path));
        if !under_mount {
            sink.push(format!(
                "model {:?}: tokenizer {} is not under a volume mount of {}",
                m.name,
                dir.display(),
                c.name
            ));
        }
        m.tokenizer = Some(ctx.tokenizer_fixture.clone());
    }
    if let Err(e) = config.validate() {
        sink.push(format!("ConfigMap {cm} key {key} fails the picker's validation: {e}"));
    }
}

/// `http://<sts>-<i>.<serviceName>:<ingest port>` for every replica, or why they cannot be known.
fn expected_pickers(r: &Rendered, ctx: &CheckContext) -> Result<Vec<String>, String> {
    let sts = r
        .objects
        .iter()
        .find_map(|o| match o {
            Object::StatefulSet(s) if s.metadata.name.as_deref() == Some(ctx.picker.as_str()) => s.spec.as_ref(),
            _ => None,
        })
        .ok_or_else(|| format!("no StatefulSet {}", ctx.picker))?;
    let svc_name = sts.service_name.clone().ok_or("picker StatefulSet has no serviceName")?;
    let svc = r.service(&svc_name).ok_or_else(|| format!("governing Service {svc_name} does not exist"))?;
    let spec = svc.spec.as_ref().ok_or("governing Service has no spec")?;
    if spec.cluster_ip.as_deref() != Some("None") {
        return Err(format!("governing Service {svc_name} must be headless (clusterIP: None) for per-pod DNS"));
    }
    let ingest = spec
        .ports
        .as_deref()
        .unwrap_or(&[])
        .iter()
        .find(|p| p.name.as_deref() == Some("ingest"))
        .ok_or_else(|| format!("Service {svc_name} has no port named ingest"))?;
    let replicas = sts.replicas.unwrap_or(1);
    Ok((0..replicas).map(|i| format!("http://{}-{i}.{svc_name}:{}", ctx.picker, ingest.port)).collect())
}

pub(super) fn agent(r: &Rendered, ctx: &CheckContext, out: &mut Vec<Problem>) {
    let Some(w) = r.workload(&ctx.agent) else {
        Sink::new(out, format!("DaemonSet/{}", ctx.agent)).push("agent workload missing");
        return;
    };
    let expected = expected_pickers(r, ctx);
    let served = picker_targets(r, ctx);
    let pools = pool_ports(r);
    let mut sink = Sink::new(out, workload_id(&w));
    if w.kind != "DaemonSet" {
        sink.push("the agent must be a DaemonSet (one per GPU node)");
    }
    let Some(spec) = &w.template.spec else { return sink.push("pod template has no spec") };
    let gpu_label = spec.node_selector.as_ref().and_then(|s| s.get("nvidia.com/gpu.present"));
    if gpu_label.map(String::as_str) != Some("true") {
        sink.push("nodeSelector must require nvidia.com/gpu.present=true (GPU nodes only)");
    }
    if !spec.tolerations.as_deref().unwrap_or(&[]).iter().any(|t| t.key.as_deref() == Some("nvidia.com/gpu")) {
        sink.push("must tolerate the nvidia.com/gpu taint");
    }
    if spec.runtime_class_name.as_deref() != Some("nvidia") {
        sink.push("runtimeClassName must be nvidia (the runtime mounts NVML)");
    }
    let Some(c) = containers(w.template).iter().find(|c| config_arg(c).is_some()) else {
        return sink.push("no container runs with --config <file>");
    };
    let node_name_env = c.env.as_deref().unwrap_or(&[]).iter().any(|e| {
        e.name == "NODE_NAME"
            && e.value_from.as_ref().and_then(|f| f.field_ref.as_ref()).map(|f| f.field_path.as_str())
                == Some("spec.nodeName")
    });
    if !node_name_env {
        sink.push(format!("container {}: NODE_NAME must come from the downward API (fieldRef spec.nodeName)", c.name));
    }
    let template = config_arg(c).unwrap_or_default();
    if !template.contains("$(NODE_NAME)") {
        sink.push(format!("--config {template} must contain $(NODE_NAME): each node reads its own engine list"));
        return;
    }
    // The ConfigMap behind the template's directory: every key is one node's config.
    let cm_name = match config_volume(w.template, c, template) {
        Ok((cmv, _)) => cmv.name.clone(),
        Err(e) => return sink.push(format!("--config {template}: {e}")),
    };
    let keys: Vec<String> =
        r.config_map(&cm_name).and_then(|cm| cm.data.as_ref()).map(|d| d.keys().cloned().collect()).unwrap_or_default();
    let (prefix, suffix) = template.split_once("$(NODE_NAME)").unwrap_or_default();
    let file_suffix = suffix.to_string();
    let nodes: Vec<&str> = keys.iter().filter_map(|k| k.strip_suffix(file_suffix.as_str())).collect();
    if nodes.is_empty() {
        sink.push(format!("ConfigMap {cm_name} has no <node>{file_suffix} key: no node can start an agent"));
    }
    for node in nodes {
        let path = format!("{prefix}{node}{suffix}");
        let text = match config_file(r, w.template, c, &path) {
            Ok((_, _, text)) => text,
            Err(e) => {
                sink.push(format!("node {node}: {e}"));
                continue;
            }
        };
        let config: AgentConfig = match serde_norway::from_str(text) {
            Ok(config) => config,
            Err(e) => {
                sink.push(format!("ConfigMap {cm_name} key {node}{file_suffix}: {e}"));
                continue;
            }
        };
        if let Err(e) = config.validate() {
            sink.push(format!("node {node}: fails the agent's validation: {e}"));
        }
        if let Some(n) = &config.node_name
            && n != node
        {
            sink.push(format!("node {node}: node_name {n} differs from its key; leave it out (NODE_NAME fills it)"));
        }
        listener(&mut sink, c, &format!("node {node}: metrics_addr"), config.metrics_addr, "metrics");
        match &expected {
            Ok(want) if *want != config.pickers => {
                sink.push(format!("node {node}: pickers {:?} must list every picker replica: {want:?}", config.pickers))
            }
            Ok(_) => {}
            Err(e) => sink.push(format!("node {node}: cannot derive the picker replicas: {e}")),
        }
        for e in &config.engines {
            if let (Some(model), Some(targets)) = (&e.model, &served)
                && !targets.contains(model)
            {
                sink.push(format!(
                    "node {node}: engine {} serves {model}, which no picker models[].target_model names \
                     (its blocks would hash under another root and never match)",
                    e.pod
                ));
            }
            let port = e.endpoint.rsplit_once(':').and_then(|(_, p)| p.parse::<i32>().ok());
            for (pool, ports) in &pools {
                if !port.is_some_and(|p| ports.contains(&p)) {
                    sink.push(format!(
                        "node {node}: engine {} endpoint {} is not on a targetPort {ports:?} of InferencePool {pool}",
                        e.pod, e.endpoint
                    ));
                }
            }
        }
    }
}

/// The base models the picker routes (`models[].target_model`), when its config can be read.
fn picker_targets(r: &Rendered, ctx: &CheckContext) -> Option<Vec<String>> {
    let w = r.workload(&ctx.picker)?;
    let c = containers(w.template).iter().find(|c| config_arg(c).is_some())?;
    let (_, _, text) = config_file(r, w.template, c, config_arg(c)?).ok()?;
    let config = PickerConfig::from_yaml(text).ok()?;
    Some(config.models.iter().map(|m| m.target().to_string()).collect())
}

/// Every InferencePool's name and target ports.
fn pool_ports(r: &Rendered) -> Vec<(String, Vec<i32>)> {
    r.objects
        .iter()
        .filter_map(|o| match o {
            Object::InferencePool(p) => Some((
                p.metadata.name.clone().unwrap_or_default(),
                p.spec.target_ports.iter().map(|t| t.number).collect(),
            )),
            _ => None,
        })
        .collect()
}
