//! The picker and agent config files inside their ConfigMaps, checked with the binaries' own parsers
//! and `validate()`, and against the manifests: listen ports equal the declared container ports,
//! listeners bind all interfaces, tokenizer directories live on a mounted volume; picker and agents
//! follow one pool, `--pool-name` (docs/design.md §14; the InferencePool when the deployment
//! renders it, else the operator's own); the agents' one
//! config finds the pickers through the picker's headless Service (`publishNotReadyAddresses`)
//! and reads the PodResources socket from a read-only mount.
//!
//! Tokenizers: the picker's tokenizer volume (a PVC) is not in the repository, so each tokenizer
//! path is first checked to lie under one of the picker's volume mounts and then replaced by
//! [`CheckContext::tokenizer_fixture`] before `PickerConfig::validate` (which requires a
//! `tokenizer.json` there).

use std::net::SocketAddr;

use k8s_openapi::api::core::v1::Container;
use kvroute_agent::config::AgentConfig;
use kvroute_picker::config::PickerConfig;

use super::{CheckContext, Problem, Sink, config_arg, config_file, containers, named_port, workload_id};
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
    let sa = w.template.spec.as_ref().and_then(|s| s.service_account_name.as_deref()).unwrap_or("default");
    check_replica_peers(&mut sink, r, ctx, c, sa, &config);
    let pool = flag_value(c, "--pool-name");
    check_pool_name(&mut sink, r, pool.as_deref());
    config.apply_pool_flags(pool.as_deref(), None);
    if config.agent_auth() == kvroute_picker::ingest::token::AgentAuth::Token {
        check_token_identity(&mut sink, r, ctx, sa, &config);
    }
    if let Err(e) = config.validate().and_then(|()| config.require_pool_source()) {
        sink.push(format!("ConfigMap {cm} key {key} fails the picker's validation: {e}"));
    }
}

/// The picker's headless Service agents report to (the StatefulSet's governing Service) and its
/// ingest port's name, or why they cannot be known: headless, `publishNotReadyAddresses: true`
/// (agents stream to a picker before it is Ready: readiness waits for their reports), a port named
/// `ingest`.
fn expected_pickers(r: &Rendered, ctx: &CheckContext) -> Result<(String, String), String> {
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
        return Err(format!("governing Service {svc_name} must be headless (clusterIP: None)"));
    }
    if spec.publish_not_ready_addresses != Some(true) {
        return Err(format!(
            "Service {svc_name} must set publishNotReadyAddresses: true (a picker is Ready only after agents reported to it)"
        ));
    }
    let ingest = spec
        .ports
        .as_deref()
        .unwrap_or(&[])
        .iter()
        .find(|p| p.name.as_deref() == Some("ingest"))
        .ok_or_else(|| format!("Service {svc_name} has no port named ingest"))?;
    Ok((svc_name, ingest.name.clone().unwrap_or_default()))
}

pub(super) fn agent(r: &Rendered, ctx: &CheckContext, out: &mut Vec<Problem>) {
    let Some(w) = r.workload(&ctx.agent) else {
        Sink::new(out, format!("DaemonSet/{}", ctx.agent)).push("agent workload missing");
        return;
    };
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
    let path = config_arg(c).unwrap_or_default();
    if path.contains("$(NODE_NAME)") {
        sink.push(format!(
            "--config {path}: one config for every node; engines come from the pool, not per-node files"
        ));
    }
    let (cm, key, text) = match config_file(r, w.template, c, path) {
        Ok(found) => found,
        Err(e) => return sink.push(format!("--config {path}: {e}")),
    };
    let mut config: AgentConfig = match serde_norway::from_str(text) {
        Ok(config) => config,
        Err(e) => return sink.push(format!("ConfigMap {cm} key {key}: {e}")),
    };
    let pool = flag_value(c, "--pool-name");
    check_pool_name(&mut sink, r, pool.as_deref());
    let picker_pool = picker_pool_name(r, ctx);
    if let (Some(mine), Some(theirs)) = (&pool, &picker_pool)
        && mine != theirs
    {
        sink.push(format!("agent --pool-name {mine:?} ≠ the picker's {theirs:?}: agents would report pods the picker does not route to"));
    }
    if let Some(name) = pool {
        config.pool = Some(kvroute_agent::config::PoolConfig { name, namespace: None });
    }
    config.node_name.get_or_insert_with(|| "node-from-downward-api".into());
    if let Err(e) = config.validate() {
        sink.push(format!("ConfigMap {cm} key {key} fails the agent's validation: {e}"));
    }
    if config.pool.is_none() || !config.engines.is_empty() || config.engine_file.is_some() {
        sink.push("engines must come from the InferencePool (--pool-name), not a static list or engine file");
    }
    listener(&mut sink, c, "metrics_addr", config.metrics_addr, "metrics");
    match (&config.picker_service, expected_pickers(r, ctx)) {
        (Some(s), Ok((svc, port))) if s.name == svc && s.port == port => {}
        (Some(s), Ok((svc, port))) => sink.push(format!(
            "picker_service {}:{} must be the picker's headless Service {svc} and its port {port}",
            s.name, s.port
        )),
        (Some(_), Err(e)) => sink.push(format!("cannot check picker_service: {e}")),
        (None, _) => sink.push(
            "picker_service must name the picker's headless Service: a static pickers list breaks when pickers scale",
        ),
    }
    let socket_mounted = c.volume_mounts.as_deref().unwrap_or(&[]).iter().any(|m| {
        std::path::Path::new(&config.pod_resources_socket).starts_with(&m.mount_path) && m.read_only == Some(true)
    });
    if !socket_mounted {
        sink.push(format!(
            "the PodResources socket {} must be on a read-only volume mount",
            config.pod_resources_socket
        ));
    }
}

/// Replicas share one view (docs/design.md §4): `replicas.service` names the headless Service
/// agents find the pickers through, the container gets its pod IP (`POD_IP`, downward API) to
/// leave itself out, and the picker's ServiceAccount may list and watch EndpointSlices.
fn check_replica_peers(
    sink: &mut Sink<'_>,
    r: &Rendered,
    ctx: &CheckContext,
    c: &Container,
    sa: &str,
    config: &PickerConfig,
) {
    match (&config.replicas.service, expected_pickers(r, ctx)) {
        (Some(s), Ok((svc, port))) if s.name == svc && s.port == port => {}
        (Some(s), Ok((svc, port))) => sink.push(format!(
            "replicas.service {}:{} must be the picker's headless Service {svc} and its port {port}",
            s.name, s.port
        )),
        (Some(_), Err(e)) => sink.push(format!("cannot check replicas.service: {e}")),
        (None, _) => {
            return sink.push(
                "replicas.service must name the picker's headless Service: without it replicas route on separate views",
            );
        }
    }
    let pod_ip = c.env.as_deref().unwrap_or(&[]).iter().any(|e| {
        e.name == "POD_IP"
            && e.value_from.as_ref().and_then(|v| v.field_ref.as_ref()).is_some_and(|f| f.field_path == "status.podIP")
    });
    if !pod_ip {
        sink.push("replicas.service needs env POD_IP from fieldRef status.podIP (the replica leaves itself out)");
    }
    if !may_watch_endpoint_slices(r, sa) {
        sink.push(format!(
            "replicas.service needs ServiceAccount {sa} bound to a Role that may list and watch discovery.k8s.io endpointslices"
        ));
    }
}

/// Token identity (docs/design.md §14): the picker's ServiceAccount may create TokenReviews and
/// get pods; the agents run as `agent_token.service_account` and send a projected token for
/// `agent_token.audience` from the file `--picker-token-file` names.
fn check_token_identity(sink: &mut Sink<'_>, r: &Rendered, ctx: &CheckContext, sa: &str, config: &PickerConfig) {
    let reviews = r.objects.iter().any(|o| match o {
        Object::ClusterRoleBinding(b) => {
            b.role_ref.kind == "ClusterRole"
                && super::refs::token_review_role(r, &b.role_ref.name)
                && b.subjects.as_deref().unwrap_or(&[]).iter().any(|s| s.kind == "ServiceAccount" && s.name == sa)
        }
        _ => false,
    });
    if !reviews {
        sink.push(format!(
            "agent_auth token needs ServiceAccount {sa} bound (ClusterRoleBinding) to a ClusterRole granting \
             authentication.k8s.io tokenreviews create"
        ));
    }
    if !role_grants(r, sa, "", "pods", &["get"]) {
        sink.push(format!("agent_auth token needs ServiceAccount {sa} bound to a Role that may get pods"));
    }
    let Some(agent) = r.workload(&ctx.agent) else { return };
    let Some(spec) = agent.template.spec.as_ref() else { return };
    let want = &config.agent_token;
    if spec.service_account_name.as_deref() != Some(want.service_account.as_str()) {
        sink.push(format!(
            "agent_token.service_account {} is not the agent DaemonSet's serviceAccountName {:?}",
            want.service_account, spec.service_account_name
        ));
    }
    // Where the agent's projected token for the picker's audience is mounted.
    let mut token_paths = Vec::new();
    for v in spec.volumes.as_deref().unwrap_or(&[]) {
        for src in v.projected.as_ref().and_then(|p| p.sources.as_deref()).unwrap_or(&[]) {
            let Some(t) = &src.service_account_token else { continue };
            if t.audience.as_deref() != Some(want.audience.as_str()) {
                continue;
            }
            for c in &spec.containers {
                for m in c.volume_mounts.as_deref().unwrap_or(&[]).iter().filter(|m| m.name == v.name) {
                    token_paths.push(format!("{}/{}", m.mount_path.trim_end_matches('/'), t.path));
                }
            }
        }
    }
    let flag = spec
        .containers
        .iter()
        .flat_map(|c| c.args.as_deref().unwrap_or(&[]))
        .find_map(|a| a.strip_prefix("--picker-token-file=").map(str::to_string));
    match flag {
        Some(f) if token_paths.contains(&f) => {}
        Some(f) => sink.push(format!(
            "agent --picker-token-file={f} is not a mounted serviceAccountToken for audience {} (mounted: {token_paths:?})",
            want.audience
        )),
        None => sink.push(format!(
            "agent_auth token: the agent needs --picker-token-file=<a projected serviceAccountToken for audience {}>",
            want.audience
        )),
    }
}

/// Whether a RoleBinding binds ServiceAccount `sa` to a Role granting `verbs` on `resources` of
/// API group `group`.
fn role_grants(r: &Rendered, sa: &str, group: &str, resource: &str, verbs: &[&str]) -> bool {
    let grants = |role: &str| {
        r.objects.iter().any(|o| match o {
            Object::Role(ro) if ro.metadata.name.as_deref() == Some(role) => {
                ro.rules.as_deref().unwrap_or(&[]).iter().any(|rule| {
                    let has =
                        |v: &Option<Vec<String>>, want: &str| v.as_deref().unwrap_or(&[]).iter().any(|x| x == want);
                    has(&rule.api_groups, group)
                        && has(&rule.resources, resource)
                        && verbs.iter().all(|v| rule.verbs.iter().any(|x| x == v))
                })
            }
            _ => false,
        })
    };
    r.objects.iter().any(|o| match o {
        Object::RoleBinding(b) => {
            b.role_ref.kind == "Role"
                && b.subjects.as_deref().unwrap_or(&[]).iter().any(|s| s.kind == "ServiceAccount" && s.name == sa)
                && grants(&b.role_ref.name)
        }
        _ => false,
    })
}

/// Whether a RoleBinding binds ServiceAccount `sa` to a Role granting `list` and `watch` on
/// `discovery.k8s.io` `endpointslices`.
fn may_watch_endpoint_slices(r: &Rendered, sa: &str) -> bool {
    role_grants(r, sa, "discovery.k8s.io", "endpointslices", &["list", "watch"])
}

/// The value of `flag` in `c`'s args, with `$(VAR)` replaced by the container's literal env value.
fn flag_value(c: &Container, flag: &str) -> Option<String> {
    let args = c.args.as_deref().unwrap_or(&[]);
    let v = args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1))?;
    let env = c.env.as_deref().unwrap_or(&[]);
    Some(match v.strip_prefix("$(").and_then(|v| v.strip_suffix(')')) {
        Some(var) => env.iter().find(|e| e.name == var).and_then(|e| e.value.clone()).unwrap_or_default(),
        None => v.clone(),
    })
}

/// `--pool-name` must be set; when the deployment renders InferencePools (components/inferencepool)
/// it must name one of them, otherwise the pool is the operator's and exists outside the render.
fn check_pool_name(sink: &mut Sink<'_>, r: &Rendered, pool: Option<&str>) {
    let rendered_pools = r.objects.iter().any(|o| matches!(o, Object::InferencePool(_)));
    match pool {
        None => sink.push("no --pool-name: the pool's pods are the only engines and candidates (docs/design.md §14)"),
        Some("") => sink.push("--pool-name is empty: set poolName in the install's kvroute-install ConfigMap"),
        Some(p) if rendered_pools && !r.has("InferencePool", p) => {
            sink.push(format!("--pool-name {p:?} names no InferencePool of this deployment"))
        }
        Some(_) => {}
    }
}

/// The picker's `--pool-name` (its `$(VAR)` resolved), if the picker renders.
pub(super) fn picker_pool_name(r: &Rendered, ctx: &CheckContext) -> Option<String> {
    let w = r.workload(&ctx.picker)?;
    containers(w.template).iter().find(|c| config_arg(c).is_some()).and_then(|c| flag_value(c, "--pool-name"))
}
