//! The picker replicas an agent reports to, from the EndpointSlices (`discovery.k8s.io/v1`) of the
//! picker's headless Service, so scaling the pickers needs no agent change. docs/design.md §14.
//!
//! EndpointSlices of Service `S` carry the label `kubernetes.io/service-name=S`; a Service's
//! endpoints may be spread over several slices. Conditions as the API documents them: `ready`
//! and `serving` absent mean true, `terminating` absent means false. The picker's ingest Service
//! should set `publishNotReadyAddresses: true`: a starting picker is not Ready until agents have
//! reported to it (docs/design.md §14, "Readiness"), so agents must find it before it is Ready.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher;
use kube::{Api, Client};

use crate::watch::{Cache, Publisher, Watched, slim, watch_stream};

/// The label linking an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Most replicas one view holds.
pub const MAX_REPLICAS: usize = 1024;

/// One picker replica.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PickerReplica {
    /// Ingest address (`podIP:port`).
    pub addr: SocketAddr,
    /// The backing pod, when the slice names it.
    pub pod: Option<String>,
    /// Its node.
    pub node: Option<String>,
    /// `conditions.ready` (absent = true).
    pub ready: bool,
    /// `conditions.serving` (absent = true).
    pub serving: bool,
    /// `conditions.terminating` (absent = false).
    pub terminating: bool,
}

/// An immutable snapshot of the picker replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaView {
    /// The Service.
    pub service: String,
    /// Replicas, sorted and de-duplicated by address.
    pub replicas: Vec<PickerReplica>,
    /// The first complete list has been applied.
    pub synced: bool,
    /// Bumped on every published change.
    pub generation: u64,
}

crate::watch::snapshot_impl!(ReplicaView);

impl ReplicaView {
    /// Replicas worth connecting to: every one not terminating (ready or not: see the module doc).
    pub fn dialable(&self) -> impl Iterator<Item = &PickerReplica> {
        self.replicas.iter().filter(|r| !r.terminating)
    }

    /// Content equality, generation aside.
    pub fn same_content(&self, other: &Self) -> bool {
        self.synced == other.synced && self.service == other.service && self.replicas == other.replicas
    }
}

/// The replicas in `slices` on port `port_name` (or, with `None`, the slices' only port).
/// Slices of address type FQDN, without the port, or with several ports and no name given are
/// skipped.
pub fn replicas_from_slices<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    port_name: Option<&str>,
) -> Vec<PickerReplica> {
    let mut by_addr: BTreeMap<SocketAddr, PickerReplica> = BTreeMap::new();
    for slice in slices {
        if slice.address_type == "FQDN" {
            continue;
        }
        let ports = slice.ports.as_deref().unwrap_or(&[]);
        let port = match port_name {
            Some(n) => ports.iter().find(|p| p.name.as_deref() == Some(n)),
            None if ports.len() == 1 => ports.first(),
            None => None,
        };
        let Some(port) = port.and_then(|p| p.port).and_then(|p| u16::try_from(p).ok()).filter(|p| *p != 0) else {
            continue;
        };
        for ep in &slice.endpoints {
            let Some(ip) = ep.addresses.first().and_then(|a| a.parse::<IpAddr>().ok()) else { continue };
            if by_addr.len() >= MAX_REPLICAS {
                break;
            }
            let c = ep.conditions.as_ref();
            let addr = SocketAddr::new(ip, port);
            by_addr.insert(
                addr,
                PickerReplica {
                    addr,
                    pod: ep
                        .target_ref
                        .as_ref()
                        .filter(|r| r.kind.as_deref() == Some("Pod"))
                        .and_then(|r| r.name.clone()),
                    node: ep.node_name.clone(),
                    ready: c.and_then(|c| c.ready).unwrap_or(true),
                    serving: c.and_then(|c| c.serving).unwrap_or(true),
                    terminating: c.and_then(|c| c.terminating).unwrap_or(false),
                },
            );
        }
    }
    by_addr.into_values().collect()
}

/// Watches the EndpointSlices of Service `service` in `namespace` and publishes the replicas on
/// port `port_name`.
pub fn watch_picker_replicas(
    client: Client,
    namespace: &str,
    service: &str,
    port_name: Option<&str>,
) -> Watched<ReplicaView> {
    let empty = ReplicaView { service: service.into(), replicas: Vec::new(), synced: false, generation: 0 };
    let (publisher, watched) = Publisher::new(empty);
    let api: Api<EndpointSlice> = Api::namespaced(client, namespace);
    let what = crate::watch::resource_name::<EndpointSlice>(namespace);
    let config = watcher::Config::default().labels(&format!("{SERVICE_NAME_LABEL}={service}"));
    let (service, port_name) = (service.to_string(), port_name.map(str::to_string));
    tokio::spawn(async move {
        let stats = publisher.stats().clone();
        let mut events = watch_stream(api, config).boxed();
        let mut cache: Cache<EndpointSlice> = Cache::of(what.clone());
        loop {
            let changed = tokio::select! {
                () = publisher.closed() => return,
                ev = events.next() => match ev {
                    Some(Ok(ev)) => cache.apply(ev.modify(slim), &stats),
                    Some(Err(e)) => {
                        stats.error(&what, &e);
                        false
                    }
                    None => return,
                },
            };
            if changed {
                let replicas = replicas_from_slices(cache.live.values(), port_name.as_deref());
                publisher.publish(ReplicaView {
                    service: service.clone(),
                    replicas,
                    synced: cache.listed,
                    generation: 0,
                });
            }
        }
    });
    watched
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};

    fn slice(ports: &[(&str, i32)], eps: &[(&str, Option<bool>, Option<bool>)]) -> EndpointSlice {
        EndpointSlice {
            address_type: "IPv4".into(),
            ports: Some(
                ports
                    .iter()
                    .map(|(n, p)| EndpointPort { name: Some((*n).into()), port: Some(*p), ..Default::default() })
                    .collect(),
            ),
            endpoints: eps
                .iter()
                .map(|(ip, ready, terminating)| Endpoint {
                    addresses: vec![(*ip).into()],
                    conditions: Some(EndpointConditions { ready: *ready, serving: None, terminating: *terminating }),
                    target_ref: Some(ObjectReference {
                        kind: Some("Pod".into()),
                        name: Some(format!("picker-{ip}")),
                        ..Default::default()
                    }),
                    node_name: Some("n1".into()),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn replicas_merge_slices_and_read_conditions() {
        let a = slice(
            &[("ingest", 9003), ("ext-proc", 9002)],
            &[("10.0.0.1", Some(true), None), ("10.0.0.2", None, Some(true))],
        );
        let b = slice(
            &[("ingest", 9003), ("ext-proc", 9002)],
            &[("10.0.0.3", Some(false), None), ("10.0.0.1", Some(true), None)],
        );
        let r = replicas_from_slices([&a, &b], Some("ingest"));
        let got: Vec<_> = r.iter().map(|r| (r.addr.to_string(), r.ready, r.terminating)).collect();
        assert_eq!(
            got,
            [
                ("10.0.0.1:9003".into(), true, false),
                ("10.0.0.2:9003".into(), true, true),
                ("10.0.0.3:9003".into(), false, false)
            ]
        );
        assert_eq!(r[0].pod.as_deref(), Some("picker-10.0.0.1"));
        let view = ReplicaView { service: "s".into(), replicas: r, synced: true, generation: 1 };
        assert_eq!(view.dialable().count(), 2);
        assert!(replicas_from_slices([&a], None).is_empty(), "two ports and no name: ambiguous");
        let single = slice(&[("grpc", 9003)], &[("10.0.0.9", None, None)]);
        assert_eq!(replicas_from_slices([&single], None).len(), 1);
        let mut fqdn = single.clone();
        fqdn.address_type = "FQDN".into();
        assert!(replicas_from_slices([&fqdn], None).is_empty());
    }
}
