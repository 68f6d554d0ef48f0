//! References between objects (ConfigMaps, PVCs, ServiceAccounts) and the pod security baseline
//! every workload here meets (read-only root filesystem, non-root, no privilege escalation,
//! resource requests, an API token only for a ServiceAccount bound to a read-only Role). Two
//! exceptions, each held to its narrowest form: a pod may run as uid 0 only to reach the kubelet's
//! root-only PodResources socket ([`root_for_pod_resources`]), and the one cluster-wide grant is
//! `create` on TokenReviews ([`tokenreview_only`]), with which the picker checks agents' tokens.

use k8s_openapi::api::core::v1::PodSpec;
use k8s_openapi::api::rbac::v1::PolicyRule;

use super::{Problem, Sink, containers, workload_id};
use crate::objects::{Object, Rendered};

pub(super) fn references(r: &Rendered, out: &mut Vec<Problem>) {
    for w in r.workloads() {
        let mut sink = Sink::new(out, workload_id(&w));
        let Some(spec) = &w.template.spec else {
            sink.push("pod template has no spec");
            continue;
        };
        for v in spec.volumes.as_deref().unwrap_or(&[]) {
            if let Some(cmv) = &v.config_map {
                match r.config_map(&cmv.name) {
                    None => sink.push(format!("volume {} names ConfigMap {}, which does not exist", v.name, cmv.name)),
                    Some(cm) => {
                        let data = cm.data.clone().unwrap_or_default();
                        for item in cmv.items.as_deref().unwrap_or(&[]) {
                            if !data.contains_key(&item.key) {
                                sink.push(format!(
                                    "volume {} projects key {} missing from ConfigMap {}",
                                    v.name, item.key, cmv.name
                                ));
                            }
                        }
                    }
                }
            }
            if let Some(pvc) = &v.persistent_volume_claim
                && !r.has("PersistentVolumeClaim", &pvc.claim_name)
            {
                sink.push(format!("volume {} claims PVC {}, which does not exist", v.name, pvc.claim_name));
            }
        }
        let volume_names: Vec<_> = spec.volumes.as_deref().unwrap_or(&[]).iter().map(|v| v.name.as_str()).collect();
        for c in &spec.containers {
            for m in c.volume_mounts.as_deref().unwrap_or(&[]) {
                if !volume_names.contains(&m.name.as_str()) {
                    sink.push(format!("container {} mounts volume {}, which the pod does not define", c.name, m.name));
                }
            }
            for e in c.env.as_deref().unwrap_or(&[]) {
                if let Some(k) = e.value_from.as_ref().and_then(|f| f.config_map_key_ref.as_ref()) {
                    let found =
                        r.config_map(&k.name).and_then(|cm| cm.data.as_ref()).is_some_and(|d| d.contains_key(&k.key));
                    if !found && k.optional != Some(true) {
                        sink.push(format!(
                            "env {} reads key {} of ConfigMap {}, which does not exist",
                            e.name, k.key, k.name
                        ));
                    }
                }
            }
            for ef in c.env_from.as_deref().unwrap_or(&[]) {
                if let Some(cm) = &ef.config_map_ref
                    && r.config_map(&cm.name).is_none()
                {
                    sink.push(format!("envFrom names ConfigMap {}, which does not exist", cm.name));
                }
            }
        }
        if let Some(sa) = &spec.service_account_name
            && !r.has("ServiceAccount", sa)
        {
            sink.push(format!("serviceAccountName {sa} does not exist"));
        }
    }
}

pub(super) fn security(r: &Rendered, out: &mut Vec<Problem>) {
    for w in r.workloads() {
        let mut sink = Sink::new(out, workload_id(&w));
        let Some(spec) = &w.template.spec else { continue };
        // Only a workload whose ServiceAccount is bound to a read-only Role may hold a token
        // (the picker and the agent watch the pool, docs/design.md §14); no other calls the API.
        let sa = spec.service_account_name.as_deref().unwrap_or("default");
        if spec.automount_service_account_token != Some(false) && !bound_read_only(r, sa) {
            sink.push(format!(
                "automountServiceAccountToken must be false unless ServiceAccount {sa} is bound to a read-only Role"
            ));
        }
        let pod_non_root = spec.security_context.as_ref().and_then(|s| s.run_as_non_root) == Some(true);
        let root_exception = match root_for_pod_resources(spec) {
            Ok(()) => true,
            Err(why) => {
                if !pod_non_root && spec.security_context.as_ref().and_then(|s| s.run_as_user) == Some(0) {
                    sink.push(format!("runs as uid 0 beyond the PodResources exception: {why}"));
                }
                false
            }
        };
        let pod_non_root = pod_non_root || root_exception;
        for c in containers(w.template) {
            let sc = c.security_context.as_ref();
            if sc.and_then(|s| s.read_only_root_filesystem) != Some(true) {
                sink.push(format!("container {}: readOnlyRootFilesystem must be true", c.name));
            }
            if sc.and_then(|s| s.allow_privilege_escalation) != Some(false) {
                sink.push(format!("container {}: allowPrivilegeEscalation must be false", c.name));
            }
            if !pod_non_root && sc.and_then(|s| s.run_as_non_root) != Some(true) {
                sink.push(format!("container {}: runAsNonRoot must be true", c.name));
            }
            let requests = c.resources.as_ref().and_then(|r| r.requests.as_ref());
            for res in ["cpu", "memory"] {
                if !requests.is_some_and(|q| q.contains_key(res)) {
                    sink.push(format!("container {}: no {res} request", c.name));
                }
            }
        }
    }
    for o in &r.objects {
        match o {
            Object::ServiceAccount(sa)
                if sa.automount_service_account_token != Some(false)
                    && !bound_read_only(r, sa.metadata.name.as_deref().unwrap_or_default()) =>
            {
                Sink::new(out, o.id()).push("automountServiceAccountToken must be false (no read-only Role binds it)");
            }
            Object::ClusterRole(cr) if !tokenreview_only(cr.rules.as_deref().unwrap_or(&[])) => {
                Sink::new(out, o.id())
                    .push("the one cluster-wide grant kvroute needs is create on authentication.k8s.io tokenreviews");
            }
            Object::ClusterRoleBinding(b) => {
                let granted = r.objects.iter().any(|o| match o {
                    Object::ClusterRole(cr) => {
                        cr.metadata.name.as_deref() == Some(b.role_ref.name.as_str())
                            && tokenreview_only(cr.rules.as_deref().unwrap_or(&[]))
                    }
                    _ => false,
                });
                if b.role_ref.kind != "ClusterRole" || !granted {
                    Sink::new(out, o.id()).push(format!(
                        "binds {} {}: kvroute binds cluster-wide only its TokenReview ClusterRole",
                        b.role_ref.kind, b.role_ref.name
                    ));
                }
                if b.subjects.as_deref().unwrap_or(&[]).iter().any(|s| s.kind != "ServiceAccount") {
                    Sink::new(out, o.id()).push("binds a user or group: only kvroute's ServiceAccounts");
                }
            }
            Object::Role(role) => {
                for rule in role.rules.as_deref().unwrap_or(&[]) {
                    if let Some(v) = rule.verbs.iter().find(|v| !READ_VERBS.contains(&v.as_str())) {
                        Sink::new(out, o.id()).push(format!("verb {v}: kvroute only reads (get, list, watch)"));
                    }
                    if rule.verbs.iter().any(|v| v == "*")
                        || rule.resources.as_deref().unwrap_or(&[]).iter().any(|x| x == "*")
                    {
                        Sink::new(out, o.id()).push("wildcard rule: list the verbs and resources needed");
                    }
                }
            }
            _ => {}
        }
    }
}

/// Whether ClusterRole `name` exists and grants only `create` on TokenReviews.
pub(super) fn token_review_role(r: &Rendered, name: &str) -> bool {
    r.objects.iter().any(|o| match o {
        Object::ClusterRole(c) => {
            c.metadata.name.as_deref() == Some(name) && tokenreview_only(c.rules.as_deref().unwrap_or(&[]))
        }
        _ => false,
    })
}

/// Whether `rules` grant exactly `create` on `authentication.k8s.io` `tokenreviews` and nothing else.
fn tokenreview_only(rules: &[PolicyRule]) -> bool {
    let only = |v: &Option<Vec<String>>, want: &str| v.as_deref().is_some_and(|v| v.len() == 1 && v[0] == want);
    !rules.is_empty()
        && rules.iter().all(|rule| {
            only(&rule.api_groups, "authentication.k8s.io")
                && only(&rule.resources, "tokenreviews")
                && rule.verbs.len() == 1
                && rule.verbs[0] == "create"
                && rule.resource_names.is_none()
                && rule.non_resource_urls.is_none()
        })
}

/// The host path whose socket is root-only on most nodes (the kubelet's PodResources API).
const POD_RESOURCES_DIR: &str = "/var/lib/kubelet/pod-resources";

/// Whether a pod that runs as uid 0 does so with the least privilege that reaches the kubelet's
/// PodResources socket: no host namespaces; the only hostPath is that directory, mounted read-only;
/// every container privileged false, no privilege escalation, all capabilities dropped and none
/// added, read-only root filesystem; seccomp RuntimeDefault (pod or container). Err says what breaks it.
fn root_for_pod_resources(spec: &PodSpec) -> Result<(), String> {
    if spec.host_network == Some(true) || spec.host_pid == Some(true) || spec.host_ipc == Some(true) {
        return Err("shares a host namespace".into());
    }
    let volumes = spec.volumes.as_deref().unwrap_or(&[]);
    let host_paths: Vec<&str> = volumes.iter().filter_map(|v| v.host_path.as_ref()).map(|h| h.path.as_str()).collect();
    if host_paths != [POD_RESOURCES_DIR] {
        return Err(format!("its hostPath volumes are {host_paths:?}, not only {POD_RESOURCES_DIR}"));
    }
    let pod_seccomp = spec.security_context.as_ref().and_then(|s| s.seccomp_profile.as_ref()).map(|p| p.type_.as_str());
    for c in &spec.containers {
        let sc = c.security_context.clone().unwrap_or_default();
        let caps = sc.capabilities.clone().unwrap_or_default();
        let drops_all = caps.drop.as_deref().unwrap_or(&[]).iter().any(|d| d == "ALL");
        if sc.privileged == Some(true)
            || sc.allow_privilege_escalation != Some(false)
            || !drops_all
            || caps.add.as_ref().is_some_and(|a| !a.is_empty())
            || sc.read_only_root_filesystem != Some(true)
        {
            return Err(format!(
                "container {} must drop ALL capabilities, add none, forbid privilege escalation and keep a read-only root filesystem",
                c.name
            ));
        }
        let seccomp = sc.seccomp_profile.as_ref().map(|p| p.type_.as_str()).or(pod_seccomp);
        if seccomp != Some("RuntimeDefault") {
            return Err(format!("container {} needs seccomp RuntimeDefault", c.name));
        }
        for m in c.volume_mounts.as_deref().unwrap_or(&[]) {
            let host = volumes.iter().any(|v| v.name == m.name && v.host_path.is_some());
            if host && m.read_only != Some(true) {
                return Err(format!("container {} mounts {} writable", c.name, m.mount_path));
            }
        }
    }
    Ok(())
}

/// The verbs kvroute's Roles may grant: it only reads the cluster.
const READ_VERBS: [&str; 3] = ["get", "list", "watch"];

/// Whether a RoleBinding binds ServiceAccount `sa` to an existing Role granting only [`READ_VERBS`].
fn bound_read_only(r: &Rendered, sa: &str) -> bool {
    r.objects.iter().any(|o| match o {
        Object::RoleBinding(b) => {
            b.subjects.as_deref().unwrap_or(&[]).iter().any(|s| s.kind == "ServiceAccount" && s.name == sa)
                && b.role_ref.kind == "Role"
                && r.objects.iter().any(|o| match o {
                    Object::Role(role) => {
                        role.metadata.name.as_deref() == Some(b.role_ref.name.as_str())
                            && role
                                .rules
                                .as_deref()
                                .unwrap_or(&[])
                                .iter()
                                .all(|rule| rule.verbs.iter().all(|v| READ_VERBS.contains(&v.as_str())))
                    }
                    _ => false,
                })
        }
        _ => false,
    })
}
