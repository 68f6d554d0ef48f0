//! Replica stream tests: wire conversion and its bounds; two real replicas over gRPC sharing
//! pending chains and in-flight counts; a replica that reaches itself stops dialing.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;

use super::*;
use crate::config::PickerConfig;
use crate::pending::ReplicaEvent;
use crate::pool::tests::{chain, put, stats};
use crate::score::RouteRequest;

#[test]
fn events_cross_the_wire_unchanged_and_bounds_hold() {
    let blocks: Arc<[BlockHash]> = chain(1, 5).into();
    let routed = ReplicaEvent::Routed { id: 7, pod: Arc::from("p"), routed_unix_ms: 123, blocks };
    let finished = ReplicaEvent::Finished { id: 7, pod: Arc::from("p") };
    let unreachable = ReplicaEvent::Unreachable { pod: Arc::from("p") };
    for ev in [routed, finished, unreachable] {
        assert_eq!(from_message(to_message(&ev)), Ok(Some(ev)));
    }
    let long = ReplicaEvent::Finished { id: 1, pod: Arc::from("x".repeat(MAX_POD_NAME_BYTES + 1)) };
    assert_eq!(from_message(to_message(&long)), Err(ReplicaError::PodName(MAX_POD_NAME_BYTES + 1)));
    let long = ReplicaEvent::Unreachable { pod: Arc::from("x".repeat(MAX_POD_NAME_BYTES + 1)) };
    assert_eq!(from_message(to_message(&long)), Err(ReplicaError::PodName(MAX_POD_NAME_BYTES + 1)));
    let empty = ReplicaEvent::Unreachable { pod: Arc::from("") };
    assert_eq!(from_message(to_message(&empty)), Err(ReplicaError::PodName(0)));
    let huge: Arc<[BlockHash]> = vec![BlockHash(1); MAX_EVENT_BLOCKS + 1].into();
    let big = ReplicaEvent::Routed { id: 1, pod: Arc::from("p"), routed_unix_ms: 0, blocks: huge };
    assert_eq!(from_message(to_message(&big)), Err(ReplicaError::Chain(MAX_EVENT_BLOCKS + 1)));
    assert_eq!(from_message(ReplicaMessage { msg: None }), Err(ReplicaError::Empty));
}

/// A replica serving `ReplicaSync` on an ephemeral port, with pods `a` and `b` registered.
async fn replica() -> (Arc<Gateway>, SocketAddr) {
    let gw = match Gateway::new(&PickerConfig::default()) {
        Ok(g) => Arc::new(g),
        Err(e) => panic!("{e}"),
    };
    put(&gw.pool, "a", "m", stats(0.1, 0, 1.0), &[]).await;
    put(&gw.pool, "b", "m", stats(0.1, 0, 1.0), &[]).await;
    let l = match TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => panic!("{e}"),
    };
    let addr = match l.local_addr() {
        Ok(a) => a,
        Err(e) => panic!("{e}"),
    };
    let svc = ReplicaService::new(gw.clone(), gw.replica.clone()).into_server();
    tokio::spawn(tonic::transport::Server::builder().add_service(svc).serve_with_incoming(TcpListenerStream::new(l)));
    (gw, addr)
}

/// Polls `f` every 10 ms for up to 5 s.
async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}

#[tokio::test]
async fn two_replicas_credit_each_others_pending_chains_and_count_their_requests() {
    let (gw_a, addr_a) = replica().await;
    let (gw_b, _addr_b) = replica().await;
    let (_peers_tx, peers) = watch::channel(vec![addr_a]);
    let (_stop_tx, stop) = watch::channel(false);
    tokio::spawn(run_peers(gw_b.clone(), gw_b.replica.clone(), peers, plaintext_dialer(), stop));
    eventually("B follows A", || gw_b.replica.counters.connected.load(Ordering::Relaxed) == 1).await;

    // A routes a prefix nobody holds; B never saw the request.
    let blocks = chain(100, 12);
    let req = RouteRequest { model: "m", adapter: None, block_hashes: &blocks, subset: None };
    let decision = match gw_a.router.route(&req) {
        Ok(d) => d,
        Err(e) => panic!("{e}"),
    };
    let pod = decision.pod.clone();
    eventually("B credits A's pending chain", || {
        let e = gw_b.router.explain(&req);
        e.candidates.iter().any(|c| *c.pod == *pod && c.matched_blocks == 12 && c.pending_blocks == 12)
    })
    .await;
    assert_eq!(gw_b.router.explain(&req).choice.as_deref(), Some(pod.as_str()), "B sends the prefix where A did");
    eventually("B counts A's request in flight", || gw_b.router.shared().lock().peers.len() == 1).await;

    // The request ends on A: B stops counting it.
    drop(decision);
    eventually("B forgets A's finished request", || gw_b.router.shared().lock().peers.is_empty()).await;
    assert!(gw_b.replica.counters.applied.load(Ordering::Relaxed) >= 2);
    assert_eq!(gw_b.replica.counters.refused.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn a_pod_envoy_could_not_reach_through_one_replica_leaves_every_replicas_candidates() {
    let (gw_a, addr_a) = replica().await;
    // A already holds `b` unreachable when C subscribes: C learns it from the snapshot.
    let mut slot = None;
    for _ in 0..64 {
        let blocks = chain(rand::random::<u64>() >> 8, 1);
        let req = RouteRequest { model: "m", adapter: None, block_hashes: &blocks, subset: None };
        let d = gw_a.router.route(&req).unwrap_or_else(|e| panic!("{e}"));
        if d.pod == "b" {
            slot = Some(d);
            break;
        }
    }
    let on_b = slot.expect("A routes some request to b");
    gw_a.endpoint_unreachable(&on_b.slot);
    let (gw_b, _addr_b) = replica().await;
    let (gw_c, _addr_c) = replica().await;
    let (_stop_tx, stop) = watch::channel(false);
    let (_peers_tx, peers) = watch::channel(vec![addr_a]);
    for gw in [&gw_b, &gw_c] {
        tokio::spawn(run_peers((*gw).clone(), gw.replica.clone(), peers.clone(), plaintext_dialer(), stop.clone()));
        eventually("follows A", || gw.replica.counters.connected.load(Ordering::Relaxed) == 1).await;
    }
    let unreachable = |gw: &Gateway, pod: &str| gw.pool.pods().iter().any(|p| p.name == pod && p.unreachable);
    eventually("B and C take b's mark from A's snapshot", || unreachable(&gw_b, "b") && unreachable(&gw_c, "b")).await;

    // Live: A's first failed connect to `a` reaches both; a second failure to the same pod is
    // not news and is not sent again.
    let applied = |gw: &Gateway| gw.replica.counters.applied.load(Ordering::Relaxed);
    let before = (applied(&gw_b), applied(&gw_c));
    let blocks = chain(900, 2);
    let req = RouteRequest { model: "m", adapter: None, block_hashes: &blocks, subset: None };
    let on_a = gw_a.router.route(&req).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(on_a.pod, "a", "b is not a candidate on A");
    gw_a.endpoint_unreachable(&on_a.slot);
    eventually("B and C stop routing to a", || unreachable(&gw_b, "a") && unreachable(&gw_c, "a")).await;
    gw_a.endpoint_unreachable(&on_a.slot);
    drop(on_a);
    drop(on_b);
    // The request on a's Routed and Finished, one Unreachable: the second mark sends nothing (the
    // request on b was routed before replication began, so its end is not news either).
    eventually("B and C apply A's request end", || applied(&gw_b) - before.0 == 3 && applied(&gw_c) - before.1 == 3)
        .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!((applied(&gw_b) - before.0, applied(&gw_c) - before.1), (3, 3), "a's Routed, Unreachable, Finished");
    assert!(gw_b.router.shared().lock().peers.is_empty() && gw_c.router.shared().lock().peers.is_empty());
    assert_eq!(gw_b.replica.counters.refused.load(Ordering::Relaxed), 0);
    // Both pods out everywhere: every replica degrades the same way.
    for gw in [&gw_a, &gw_b, &gw_c] {
        assert!(unreachable(gw, "a") && unreachable(gw, "b"));
    }
}

#[tokio::test]
async fn a_peers_unreachable_mark_names_a_known_pod_or_is_refused() {
    let (gw, _addr) = replica().await;
    let ev = |pod: &str| ReplicaEvent::Unreachable { pod: Arc::from(pod) };
    assert!(!gw.router.apply_peer(1, &ev("nobody")), "an unknown pod is refused");
    assert!(!gw.router.apply_peer(crate::pending::LOCAL, &ev("a")), "only peers' marks are applied");
    assert!(gw.pool.pods().iter().all(|p| !p.unreachable));
    assert!(gw.router.apply_peer(1, &ev("a")));
    assert!(gw.pool.pods().iter().any(|p| p.name == "a" && p.unreachable));
    // Until this replica's own probe connects (nothing listens at the test pods' endpoints).
    assert_eq!(gw.pool.probe_unreachable(Duration::from_millis(50)).await, 1);
    assert!(gw.pool.pods().iter().any(|p| p.name == "a" && p.unreachable));
}

#[tokio::test]
async fn a_replica_that_reaches_itself_stops_dialing_it() {
    let (gw, addr) = replica().await;
    let (_peers_tx, peers) = watch::channel(vec![addr]);
    let (stop_tx, stop) = watch::channel(false);
    let task = tokio::spawn(run_peers(gw.clone(), gw.replica.clone(), peers, plaintext_dialer(), stop));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(gw.replica.counters.connected.load(Ordering::Relaxed), 0);
    assert_eq!(gw.replica.counters.disconnects.load(Ordering::Relaxed), 0, "never subscribed to itself");
    let _ = stop_tx.send(true);
    assert!(tokio::time::timeout(Duration::from_secs(2), task).await.is_ok(), "run_peers stops when asked");
}

#[test]
fn peers_in_view_leave_out_this_replica_terminating_ones_and_wait_for_the_list() {
    use kvroute_cluster::{PickerReplica, ReplicaView};
    let replica = |addr: &str, ready, terminating| PickerReplica {
        addr: addr.parse().unwrap(),
        pod: None,
        node: None,
        ready,
        serving: true,
        terminating,
    };
    let mut view = ReplicaView {
        service: "peers".into(),
        replicas: vec![
            replica("10.0.0.1:9003", true, false),
            replica("10.0.0.2:9003", false, false),
            replica("10.0.0.3:9003", true, true),
            replica("10.0.0.4:9003", true, false),
        ],
        synced: false,
        generation: 1,
    };
    assert!(peers_in_view(&view, &[], None).is_empty(), "peers before the first complete list");
    view.synced = true;
    let addrs = |v: &[&str]| v.iter().map(|a| a.parse().unwrap()).collect::<Vec<SocketAddr>>();
    // Ready or starting, not terminating.
    assert_eq!(peers_in_view(&view, &[], None), addrs(&["10.0.0.1:9003", "10.0.0.2:9003", "10.0.0.4:9003"]));
    // This replica by its pod IP, or by its ingest address.
    assert_eq!(
        peers_in_view(&view, &[], Some("10.0.0.1".parse().unwrap())),
        addrs(&["10.0.0.2:9003", "10.0.0.4:9003"])
    );
    assert_eq!(peers_in_view(&view, &addrs(&["10.0.0.4:9003"]), None), addrs(&["10.0.0.1:9003", "10.0.0.2:9003"]));
}
