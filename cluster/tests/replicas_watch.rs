//! The picker-replica watcher against the API stand-in: EndpointSlices of the picker's headless
//! Service, across slices, following scale-up, readiness, termination and slice deletion.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kvroute_cluster::watch_picker_replicas;

fn slice(name: &str, service: &str, ips: &[&str]) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            labels: Some(
                [
                    ("kubernetes.io/service-name".to_string(), service.to_string()),
                    (
                        "endpointslice.kubernetes.io/managed-by".to_string(),
                        "endpointslice-controller.k8s.io".to_string(),
                    ),
                ]
                .into(),
            ),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: ips.iter().map(|ip| endpoint(ip, Some(true), Some(false))).collect(),
        ports: Some(vec![
            EndpointPort {
                name: Some("ext-proc".into()),
                port: Some(9002),
                protocol: Some("TCP".into()),
                ..Default::default()
            },
            EndpointPort {
                name: Some("ingest".into()),
                port: Some(9003),
                protocol: Some("TCP".into()),
                ..Default::default()
            },
        ]),
    }
}

fn endpoint(ip: &str, ready: Option<bool>, terminating: Option<bool>) -> Endpoint {
    Endpoint {
        addresses: vec![ip.into()],
        conditions: Some(EndpointConditions { ready, serving: ready, terminating }),
        node_name: Some("n1".into()),
        target_ref: Some(ObjectReference {
            kind: Some("Pod".into()),
            name: Some(format!("picker-{ip}")),
            namespace: Some(NS.into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn addrs(v: &kvroute_cluster::ReplicaView) -> Vec<String> {
    v.dialable().map(|r| r.addr.to_string()).collect()
}

#[tokio::test]
async fn replicas_follow_the_endpoint_slices() {
    let server = server().await;
    server.create(&slice("picker-abc", "kvroute-picker", &["10.1.0.1"])).unwrap();
    server.create(&slice("unrelated-xyz", "other-svc", &["10.9.9.9"])).unwrap();
    let view = watch_picker_replicas(server.client(NS).unwrap(), NS, "kvroute-picker", Some("ingest"));
    let v = view.wait_for(BOUND, |v| v.synced).await.expect("synced");
    assert_eq!(addrs(&v), ["10.1.0.1:9003"]);

    // Scale up: a second replica in a second slice, a third, not yet Ready (published anyway).
    server.create(&slice("picker-def", "kvroute-picker", &["10.1.0.2"])).unwrap();
    server
        .modify::<EndpointSlice>(NS, "picker-abc", |s| s.endpoints.push(endpoint("10.1.0.3", Some(false), Some(false))))
        .unwrap();
    let v = view.wait_for(BOUND, |v| v.replicas.len() == 3).await.expect("scaled up");
    assert_eq!(addrs(&v), ["10.1.0.1:9003", "10.1.0.2:9003", "10.1.0.3:9003"]);
    assert!(!v.replicas[2].ready);

    // Rolling restart: the old replica terminates, then its slice goes away.
    server
        .modify::<EndpointSlice>(NS, "picker-def", |s| s.endpoints[0] = endpoint("10.1.0.2", Some(false), Some(true)))
        .unwrap();
    view.wait_for(BOUND, |v| addrs(v) == ["10.1.0.1:9003", "10.1.0.3:9003"]).await.expect("terminating");
    server.delete::<EndpointSlice>(NS, "picker-def").unwrap();
    view.wait_for(BOUND, |v| v.replicas.len() == 2).await.expect("slice deleted");

    // A dropped watch.
    server.store().drop_watches();
    server.modify::<EndpointSlice>(NS, "picker-abc", |s| s.endpoints.truncate(1)).unwrap();
    view.wait_for(BOUND, |v| addrs(v) == ["10.1.0.1:9003"]).await.expect("after reconnect");
}
