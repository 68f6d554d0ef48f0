//! Builders of the objects tests put into the [`ApiServer`](crate::ApiServer) stand-in, where
//! more than one test crate needs the same shape.

use std::collections::BTreeMap;

use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// An IPv4 EndpointSlice `name` in `namespace` belonging to Service `service` (the
/// `kubernetes.io/service-name` label), one ready and serving endpoint per address in `ips`, and
/// one TCP port `port_name` = `port`.
pub fn endpoint_slice(
    namespace: &str,
    name: &str,
    service: &str,
    ips: &[&str],
    port_name: &str,
    port: u16,
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([("kubernetes.io/service-name".to_string(), service.to_string())])),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: ips
            .iter()
            .map(|ip| Endpoint {
                addresses: vec![(*ip).into()],
                conditions: Some(EndpointConditions { ready: Some(true), serving: Some(true), terminating: None }),
                ..Default::default()
            })
            .collect(),
        ports: Some(vec![EndpointPort {
            name: Some(port_name.into()),
            port: Some(i32::from(port)),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
    }
}
