//! Nothing per node: an agent pod on any node, whatever it is called and however many there are,
//! finds every volume it mounts in the rendered objects. The DaemonSet's pod template is
//! instantiated for each node name (`$(VAR)` of a `subPathExpr` expanded from the downward API's
//! `spec.nodeName`), and each mount must resolve: its ConfigMap, Secret (rendered, or issued by a
//! rendered cert-manager Certificate) or PVC exists, and a sub-path lands on something the volume
//! projects. A layout with one Secret or one projected item per node fails for any node it does
//! not list.

use k8s_openapi::api::core::v1::{Container, KeyToPath, Volume};

use super::{Problem, Sink, containers};
use crate::objects::{Object, Rendered};

/// Checks the agent DaemonSet `agent` on every node of `nodes`.
pub fn agent_pods_on(r: &Rendered, agent: &str, nodes: &[String], out: &mut Vec<Problem>) {
    let Some(w) = r.workload(agent) else { return };
    let mut sink = Sink::new(out, format!("{}/{}", w.kind, w.name));
    let volumes = w.template.spec.as_ref().and_then(|s| s.volumes.as_deref()).unwrap_or(&[]);
    for c in containers(w.template) {
        for m in c.volume_mounts.as_deref().unwrap_or(&[]) {
            let Some(vol) = volumes.iter().find(|v| v.name == m.name) else { continue };
            let mut failed_on = Vec::new();
            for node in nodes {
                let sub = match (&m.sub_path, &m.sub_path_expr) {
                    (Some(p), _) => Some(p.clone()),
                    (None, Some(e)) => Some(expand(e, c, node)),
                    (None, None) => None,
                };
                if let Err(e) = resolves(r, vol, sub.as_deref()) {
                    failed_on.push(format!("{node}: {e}"));
                }
            }
            if !failed_on.is_empty() {
                let n = failed_on.len();
                sink.push(format!(
                    "mount {} at {} fails on {n} of {} nodes (first: {}): per-node objects",
                    m.name,
                    m.mount_path,
                    nodes.len(),
                    failed_on[0]
                ));
            }
        }
    }
}

/// `expr` with each `$(VAR)` replaced: VAR from the downward API's spec.nodeName → `node`, a literal
/// env value → that value, anything else left as is.
fn expand(expr: &str, c: &Container, node: &str) -> String {
    let mut s = expr.to_string();
    for e in c.env.as_deref().unwrap_or(&[]) {
        let pat = format!("$({})", e.name);
        let by_node =
            e.value_from.as_ref().and_then(|f| f.field_ref.as_ref()).is_some_and(|f| f.field_path == "spec.nodeName");
        if by_node {
            s = s.replace(&pat, node);
        } else if let Some(v) = &e.value {
            s = s.replace(&pat, v);
        }
    }
    s
}

fn secret_exists(r: &Rendered, name: &str) -> bool {
    r.objects.iter().any(|o| match o {
        Object::Certificate(c) => c.spec.secret_name == name,
        _ => false,
    })
}

fn items_reach(items: Option<&[KeyToPath]>, sub: Option<&str>) -> bool {
    match (items, sub) {
        (_, None) => true,
        // Without items every key is a file at the top: a sub-path with a `/` finds none.
        (None, Some(s)) => !s.contains('/'),
        (Some(items), Some(s)) => items.iter().any(|i| i.path == s || i.path.starts_with(&format!("{s}/"))),
    }
}

fn resolves(r: &Rendered, v: &Volume, sub: Option<&str>) -> Result<(), String> {
    if let Some(s) = &v.secret {
        let name = s.secret_name.as_deref().unwrap_or_default();
        if !secret_exists(r, name) {
            return Err(format!("Secret {name} is neither rendered nor issued by a rendered Certificate"));
        }
        return if items_reach(s.items.as_deref(), sub) {
            Ok(())
        } else {
            Err(format!("Secret {name} has nothing at {sub:?}"))
        };
    }
    if let Some(cm) = &v.config_map {
        if r.config_map(&cm.name).is_none() {
            return Err(format!("ConfigMap {} does not exist", cm.name));
        }
        return if items_reach(cm.items.as_deref(), sub) {
            Ok(())
        } else {
            Err(format!("ConfigMap {} has nothing at {sub:?}", cm.name))
        };
    }
    if let Some(pvc) = &v.persistent_volume_claim {
        return if r.has("PersistentVolumeClaim", &pvc.claim_name) {
            Ok(())
        } else {
            Err(format!("PVC {} does not exist", pvc.claim_name))
        };
    }
    if let Some(p) = &v.projected {
        let mut reached = sub.is_none();
        for src in p.sources.as_deref().unwrap_or(&[]) {
            if let Some(s) = &src.secret {
                if !secret_exists(r, &s.name) && s.optional != Some(true) {
                    return Err(format!(
                        "projected Secret {} is neither rendered nor issued by a rendered Certificate",
                        s.name
                    ));
                }
                reached |= items_reach(s.items.as_deref(), sub) && s.items.is_some();
            }
            if let Some(cm) = &src.config_map {
                if r.config_map(&cm.name).is_none() && cm.optional != Some(true) {
                    return Err(format!("projected ConfigMap {} does not exist", cm.name));
                }
                reached |= items_reach(cm.items.as_deref(), sub) && cm.items.is_some();
            }
            if let Some(t) = &src.service_account_token {
                reached |= sub.is_some_and(|s| t.path == s);
            }
        }
        return if reached { Ok(()) } else { Err(format!("projected volume {} has nothing at {sub:?}", v.name)) };
    }
    // hostPath, emptyDir, …: the same on every node.
    Ok(())
}
