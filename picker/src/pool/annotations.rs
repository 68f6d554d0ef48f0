//! Pod annotations as the pool keeps them: the agent's report merged under the pool view's (the
//! Pod object wins on a shared key), sorted, and the price parsed from [`COST_ANNOTATION`] once per
//! registration (docs/design.md §4 cost awareness). The cost scorer reads the parsed price from the
//! pod's status; it never parses annotations itself.

use kvroute_proto::agent::v1::PodInfo;

/// Annotation carrying a pod's price in $/hour.
pub const COST_ANNOTATION: &str = "kvroute.io/cost-per-hour";

/// The sorted annotations of `info` and its parsed price (docs/design.md §4 cost awareness). An invalid
/// price is logged and ignored (the pod then counts as unpriced).
pub(super) fn annotations_of(info: &PodInfo) -> (Vec<(String, String)>, Option<f64>) {
    let mut annotations: Vec<(String, String)> = info.annotations.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    annotations.sort();
    let cost = info.annotations.get(COST_ANNOTATION).and_then(|v| match v.trim().parse::<f64>() {
        Ok(c) if c.is_finite() && c > 0.0 => Some(c),
        _ => {
            tracing::warn!(pod = %info.pod, value = %v, annotation = COST_ANNOTATION,
                "pod price is not a positive number of $/hour: ignored");
            None
        }
    });
    (annotations, cost)
}

/// `info`'s annotations merged under the pool's (`pool` wins on a shared key), sorted, and the
/// parsed price.
pub(super) fn merged_annotations(info: &PodInfo, pool: &[(String, String)]) -> (Vec<(String, String)>, Option<f64>) {
    let (agent, _) = annotations_of(info);
    priced(&info.pod, merge(&agent, pool))
}

/// `base` with `over`'s entries added or replacing, sorted by key.
pub(super) fn merge(base: &[(String, String)], over: &[(String, String)]) -> Vec<(String, String)> {
    let mut map: std::collections::BTreeMap<&str, &str> = base.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    for (k, v) in over {
        map.insert(k, v);
    }
    map.into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// Sorted annotations and their parsed price (docs/design.md §4 cost awareness).
pub(super) fn priced(pod: &str, annotations: Vec<(String, String)>) -> (Vec<(String, String)>, Option<f64>) {
    let info =
        PodInfo { pod: pod.to_string(), annotations: annotations.iter().cloned().collect(), ..PodInfo::default() };
    let (_, cost) = annotations_of(&info);
    (annotations, cost)
}
