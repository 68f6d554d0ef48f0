//! Builders shared by the watcher tests: Pods and InferencePools as a cluster would hold them.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, ContainerPort, Pod, PodCondition, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kvroute_cluster::crd::{InferencePool, InferencePoolSpec, PoolPort, PoolSelector};
use kvroute_kube_stand_in::ApiServer;

/// Every change must show within this bound: routing follows a pool change within 2 s
/// (docs/operations.md "Install", pool changes).
pub const BOUND: Duration = Duration::from_secs(2);
pub const NS: &str = "inference";

pub fn pool(name: &str, labels: &[(&str, &str)], ports: &[i32]) -> InferencePool {
    let mut p = InferencePool::new(
        name,
        InferencePoolSpec {
            selector: PoolSelector { match_labels: labels.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect() },
            target_ports: ports.iter().map(|n| PoolPort { number: *n }).collect(),
            app_protocol: None,
            endpoint_picker_ref: None,
        },
    );
    p.metadata.namespace = Some(NS.into());
    p
}

/// A vLLM pod: labels `app=vllm` unless overridden, scheduled on `node`, with `ip` (none = not
/// started yet) and the Ready condition.
pub fn pod(name: &str, node: &str, ip: Option<&str>, ready: bool) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            labels: Some([("app".to_string(), "vllm".to_string())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "vllm".into(),
                image: Some("vllm/vllm-openai:v0.33.0".into()),
                command: Some(vec!["vllm".into(), "serve".into(), "Qwen/Qwen2.5-7B-Instruct".into()]),
                args: Some(vec![
                    "--port".into(),
                    "8000".into(),
                    "--kv-events-config".into(),
                    r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}"#.into(),
                ]),
                ports: Some(vec![ContainerPort { container_port: 8000, name: Some("http".into()), ..Default::default() }]),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: ip.map(str::to_string),
            conditions: Some(vec![ready_condition(ready)]),
            ..Default::default()
        }),
    }
}

pub fn ready_condition(ready: bool) -> PodCondition {
    PodCondition { type_: "Ready".into(), status: if ready { "True" } else { "False" }.into(), ..Default::default() }
}

pub fn set_ready(p: &mut Pod, ready: bool) {
    p.status.get_or_insert_with(Default::default).conditions = Some(vec![ready_condition(ready)]);
}

pub fn set_ip(p: &mut Pod, ip: &str) {
    p.status.get_or_insert_with(Default::default).pod_ip = Some(ip.into());
}

pub async fn server() -> ApiServer {
    let server = ApiServer::start().await.unwrap();
    server.register::<InferencePool>();
    server.register::<kvroute_cluster::crd::InferenceObjective>();
    server.register::<kvroute_cluster::crd::InferenceModelRewrite>();
    server
}

/// Polls `cond` every 10 ms until it holds or [`BOUND`] passes.
pub async fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + BOUND;
    while tokio::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cond()
}
