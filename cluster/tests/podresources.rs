//! The PodResources client against the kubelet stand-in on a unix socket: `List` maps pods to GPU
//! UUIDs, the poller follows pods coming and going, and a kubelet restart is survived.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kvroute_cluster::{PodResourcesClient, watch_node_gpus};
use kvroute_kube_stand_in::kubelet::PodResourcesServer;

const BOUND: Duration = Duration::from_secs(2);

#[tokio::test]
async fn list_maps_pods_to_gpu_uuids() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("kubelet.sock");
    let kubelet = PodResourcesServer::start(&sock).await.unwrap();
    kubelet.set_gpu_pod("inference", "vllm-0", "vllm", &["GPU-11111111-2222-3333-4444-555555555555", "GPU-aaaa::2"]);
    kubelet.set_gpu_pod("inference", "vllm-1", "vllm", &["GPU-bbbb"]);

    let mut client = PodResourcesClient::connect(&sock).unwrap();
    let gpus = client.list().await.unwrap();
    let uuids: Vec<_> =
        gpus.of_pod("inference", "vllm-0", Some("vllm")).iter().filter_map(|g| g.uuid.clone()).collect();
    assert_eq!(uuids, ["GPU-11111111-2222-3333-4444-555555555555", "GPU-aaaa"], "time-slicing suffix dropped");
    assert_eq!(gpus.of_pod("inference", "vllm-1", None).len(), 1);
    assert!(gpus.of_pod("inference", "absent", None).is_empty());
    assert_eq!(kubelet.list_calls(), 1);
}

#[tokio::test]
async fn poller_follows_pods_and_survives_a_kubelet_restart() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("kubelet.sock");
    let kubelet = PodResourcesServer::start(&sock).await.unwrap();
    kubelet.set_gpu_pod("ns", "a", "vllm", &["GPU-a"]);
    let gpus = watch_node_gpus(&sock, Duration::from_millis(50)).unwrap();
    gpus.wait_for(BOUND, |g| g.synced && g.pods.len() == 1).await.expect("first list");

    kubelet.set_gpu_pod("ns", "b", "vllm", &["GPU-b0", "GPU-b1"]);
    gpus.wait_for(BOUND, |g| g.of_pod("ns", "b", None).len() == 2).await.expect("b added");
    kubelet.remove_pod("ns", "a");
    gpus.wait_for(BOUND, |g| g.of_pod("ns", "a", None).is_empty()).await.expect("a removed");

    // The kubelet restarts (socket removed and re-created); the last snapshot stays meanwhile.
    drop(kubelet);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(gpus.stats().errors.load(std::sync::atomic::Ordering::Relaxed) >= 1, "the outage is counted");
    assert_eq!(gpus.current().of_pod("ns", "b", None).len(), 2, "last good snapshot kept");
    let kubelet = PodResourcesServer::start(&sock).await.unwrap();
    kubelet.set_gpu_pod("ns", "c", "vllm", &["GPU-c"]);
    gpus.wait_for(Duration::from_secs(5), |g| g.pods.keys().map(|k| k.1.as_str()).collect::<Vec<_>>() == ["c"])
        .await
        .expect("after restart");
}
