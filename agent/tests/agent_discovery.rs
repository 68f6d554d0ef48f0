//! The agent's engine and picker discovery (docs/design.md §14), end to end in one process: the
//! agent library against the Kubernetes API stand-in (real kube-rs list/watch), the kubelet
//! PodResources stand-in (real gRPC on a unix socket), emulated vLLM engines each on its own
//! loopback "pod IP", and recording pickers (the real `AgentIngest` service).
//!
//! - Kubernetes: a pod of the pool scheduled on the agent's node is scraped and reported (its KV
//!   events too); a pod on another node is not; a new pod starts an engine without restarting
//!   anything; a deleted pod's engine stops and the streams drop it; GPU UUIDs from PodResources
//!   drive the mock-NVML health of exactly the pod that holds them; picker replicas added to or
//!   removed from the picker Service's EndpointSlices get or lose their stream.
//! - File mode: edits of the engine file add and remove engines; a GPU UUID the node does not
//!   have is named in the pod's health reason.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kvroute_agent::app;
use kvroute_agent::config::AgentConfig;
use kvroute_agent::gpu::mock::MockGpuSource;
use kvroute_cluster::crd::InferencePool;
use kvroute_kube_stand_in::ApiServer;
use kvroute_kube_stand_in::kubelet::PodResourcesServer;
use std::sync::Arc;

const GOOD_GPU: &str = "GPU-11111111-aaaa-bbbb-cccc-000000000001";
const ECC_GPU: &str = "GPU-11111111-aaaa-bbbb-cccc-000000000002";

fn healthy(l: &StreamLog, pod: &str) -> bool {
    l.stats.get(pod).is_some_and(|s| s.ready && s.health_score >= 0.9)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_and_pickers_follow_the_cluster() {
    // Pod IPs: a and c on this node (n1), b on another; two picker replicas.
    let (ip_a, ip_b, ip_c, ip_p1, ip_p2) = ("127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.21", "127.0.0.22");
    let ports = free_port(&[ip_a, ip_b, ip_c]);
    let (http, kv, replay) = (ports, free_port(&[ip_a, ip_c]), free_port(&[ip_a, ip_c]));
    // Each emulator loads the Qwen2.5 tokenizer (seconds in a debug build): both at once.
    let (engine_a, engine_c) = tokio::join!(engine(ip_a, http, kv, replay), engine(ip_c, http, kv, replay));
    let picker_port = free_port(&[ip_p1, ip_p2]);
    let (p1, p2) = (Recorder::default(), Recorder::default());
    p1.serve(format!("{ip_p1}:{picker_port}").parse().unwrap()).await;
    p2.serve(format!("{ip_p2}:{picker_port}").parse().unwrap()).await;

    let server = ApiServer::start().await.unwrap();
    server.register::<InferencePool>();
    server.create(&pool("qwen", http)).unwrap();
    server.create(&vllm_pod("a", "n1", ip_a, http, kv, replay)).unwrap();
    server.create(&vllm_pod("b", "n2", ip_b, http, kv, replay)).unwrap();
    server.create(&slice("picker-x1", "kvroute-picker-ingest", &[ip_p1], picker_port)).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("kubelet.sock");
    let kubelet = PodResourcesServer::start(&sock).await.unwrap();
    kubelet.set_gpu_pod(NS, "a", "vllm", &[GOOD_GPU]);
    kubelet.set_gpu_pod(NS, "b", "vllm", &[ECC_GPU]);
    let gpus = scenario(dir.path(), &[GOOD_GPU, ECC_GPU], &[ECC_GPU]);

    let yaml = format!(
        "node_name: n1\npool: {{name: qwen, namespace: {NS}}}\npicker_service: {{name: kvroute-picker-ingest}}\ninsecure_ingest: true\n\
         metrics_addr: 127.0.0.1:0\nscrape_interval_ms: 50\nreport_interval_ms: 200\nprobe_interval_ms: 200\n\
         pod_resources_socket: {}\npod_resources_poll_ms: 200\n",
        sock.display()
    );
    let config: AgentConfig = serde_norway::from_str(&yaml).unwrap();
    let gpu = Arc::new(MockGpuSource::from_file(&gpus).unwrap());
    let agent = app::start_with(config, gpu, Some(server.client(NS).unwrap())).await.expect("agent starts");

    // Pod a (this node) is reported, scraped and healthy on its healthy GPU; b (n2) never.
    let l = p1.wait("a reported healthy", |l| l.pods() == ["a-rank-0"] && healthy(l, "a-rank-0")).await;
    assert!(l.hellos.iter().flatten().all(|p| !p.starts_with("b-")), "{:?}", l.hellos);
    // Its KV events reach the picker through the subscription the agent opened for it.
    complete(engine_a.http_addr, 64).await;
    p1.wait("a's blocks", |l| l.blocks.get("a-rank-0").is_some_and(|n| *n >= 4)).await;

    // A new pod on this node, holding the GPU with uncorrected ECC errors: it starts without a
    // restart, is excluded by its health, and a stays healthy.
    kubelet.set_gpu_pod(NS, "c", "vllm", &[ECC_GPU]);
    server.create(&vllm_pod("c", "n1", ip_c, http, kv, replay)).unwrap();
    let l = p1
        .wait("c reported, ECC", |l| {
            l.pods() == ["a-rank-0", "c-rank-0"]
                && l.stats.get("c-rank-0").is_some_and(|s| s.ready && s.health_reason == "uncorrected ECC errors")
        })
        .await;
    assert!(l.stats["c-rank-0"].health_score < 0.3, "{:?}", l.stats["c-rank-0"]);
    assert!(healthy(&l, "a-rank-0"), "only the pod holding the bad GPU is lowered: {:?}", l.stats["a-rank-0"]);
    assert_eq!(p1.logs().len(), 1, "the same stream, no reconnect");

    // Pod a deleted: its engine stops; the stream says goodbye (cleared, not ready) and drops it.
    server.delete::<Pod>(NS, "a").unwrap();
    let l = p1.wait("a dropped", |l| l.pods() == ["c-rank-0"]).await;
    assert!(l.farewells.contains(&"a-rank-0".to_string()), "{l:#?}");
    assert_eq!(l.blocks.get("a-rank-0"), Some(&0), "a's blocks cleared");
    assert!(agent.hub.pod("a-rank-0").is_none());
    let metrics_url = format!("http://{}/metrics", agent.metrics_addr);
    assert!(
        eventually_async(|| async {
            let m = reqwest::get(&metrics_url).await.unwrap().text().await.unwrap();
            m.contains("kvroute_agent_engines 1") && !m.contains("model_server_pod=\"a-rank-0\"")
        })
        .await,
        "a's metric series dropped"
    );

    // A second picker replica joins the Service: it gets its own stream with the full state.
    server
        .modify::<EndpointSlice>(NS, "picker-x1", |s| {
            *s = slice("picker-x1", "kvroute-picker-ingest", &[ip_p1, ip_p2], picker_port)
        })
        .unwrap();
    let l2 = p2.wait("p2 stream", |l| l.pods() == ["c-rank-0"] && l.snapshots.contains(&"c-rank-0".to_string())).await;
    assert!(!l2.ended);
    // The first leaves: its stream ends cleanly; p2's goes on.
    server
        .modify::<EndpointSlice>(NS, "picker-x1", |s| {
            *s = slice("picker-x1", "kvroute-picker-ingest", &[ip_p2], picker_port)
        })
        .unwrap();
    p1.wait("p1 stream closed", |l| l.ended).await;
    assert!(!p2.last().unwrap().ended);
    assert_eq!(p1.logs().len(), 1, "p1 is not dialed again");

    agent.shutdown().await;
    engine_a.shutdown().await;
    engine_c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_file_edits_add_and_remove_engines() {
    let (ip_e, ip_f) = ("127.0.0.31", "127.0.0.32");
    let http = free_port(&[ip_e, ip_f]);
    let (kv, replay) = (free_port(&[ip_e, ip_f]), free_port(&[ip_e, ip_f]));
    let (engine_e, engine_f) = tokio::join!(engine(ip_e, http, kv, replay), engine(ip_f, http, kv, replay));
    let picker = Recorder::default();
    let picker_addr = picker.serve("127.0.0.1:0".parse().unwrap()).await;

    let dir = tempfile::tempdir().unwrap();
    let gpus = scenario(dir.path(), &[GOOD_GPU], &[]);
    let file = dir.path().join("engines.yaml");
    let entry = |pod: &str, ip: &str, gpu: &str| {
        format!(
            "  - {{pod: {pod}, endpoint: '{ip}:{http}', kv_events: 'tcp://{ip}:{kv}', kv_replay: 'tcp://{ip}:{replay}', model: {MODEL}, gpus: [{gpu}]}}\n"
        )
    };
    // e names a GPU this node does not have.
    std::fs::write(&file, format!("engines:\n{}", entry("e", ip_e, "GPU-not-on-this-node"))).unwrap();
    let yaml = format!(
        "node_name: host-1\npickers: [\"http://{picker_addr}\"]\ninsecure_ingest: true\nengine_file: {}\nengine_file_poll_ms: 50\n\
         metrics_addr: 127.0.0.1:0\nscrape_interval_ms: 50\nreport_interval_ms: 200\nprobe_interval_ms: 200\n",
        file.display()
    );
    let config: AgentConfig = serde_norway::from_str(&yaml).unwrap();
    let agent = app::start(config, Arc::new(MockGpuSource::from_file(&gpus).unwrap())).await.expect("agent starts");
    assert!(agent.hub.pod("e-rank-0").is_some(), "the file's engines run when start returns");
    let l = picker
        .wait("e reported with its missing GPU", |l| {
            l.stats.get("e-rank-0").is_some_and(|s| s.ready && s.health_reason == "GPU not found on this node")
        })
        .await;
    assert!((0.3..1.0).contains(&l.stats["e-rank-0"].health_score), "not silently healthy: {:?}", l.stats["e-rank-0"]);

    // Added (atomic rename, as editors and ConfigMap updates write).
    let tmp = dir.path().join("engines.tmp");
    let both = format!("engines:\n{}{}", entry("e", ip_e, "GPU-not-on-this-node"), entry("f", ip_f, GOOD_GPU));
    std::fs::write(&tmp, both).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    picker.wait("f added", |l| l.pods() == ["e-rank-0", "f-rank-0"] && healthy(l, "f-rank-0")).await;
    complete(engine_f.http_addr, 48).await;
    picker.wait("f's blocks", |l| l.blocks.get("f-rank-0").is_some_and(|n| *n >= 3)).await;

    // Removed (in place).
    std::fs::write(&file, format!("engines:\n{}", entry("f", ip_f, GOOD_GPU))).unwrap();
    let l = picker.wait("e removed", |l| l.pods() == ["f-rank-0"]).await;
    assert!(l.farewells.contains(&"e-rank-0".to_string()));
    assert_eq!(picker.logs().len(), 1, "one stream throughout");

    // A broken edit keeps the engines running.
    std::fs::write(&file, "engines: [{pod: f}]\n").unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(agent.hub.pod("f-rank-0").is_some());
    assert_eq!(picker.last().unwrap().pods(), ["f-rank-0"]);

    agent.shutdown().await;
    engine_e.shutdown().await;
    engine_f.shutdown().await;
}

/// Polls an async condition every 50 ms for at most [`BOUND`].
async fn eventually_async<F: std::future::Future<Output = bool>>(mut cond: impl FnMut() -> F) -> bool {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        if cond().await {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// The binary on a node with no engine yet: it starts (READY), stays up and healthy instead of
/// crash-looping, reports to the picker found in the Service's EndpointSlices, picks up a pod
/// scheduled later, and stops cleanly. Kubernetes access as in a real deployment: the client
/// from `$KUBECONFIG`, the pool from `--pool-name`/`--pool-namespace`, the node from `NODE_NAME`;
/// no PodResources socket (the pod's GPUs are then reported unknown, nothing fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_idles_on_an_empty_node_and_picks_up_pods() {
    use std::process::Stdio;
    use tokio::io::AsyncBufReadExt;
    let server = ApiServer::start().await.unwrap();
    server.register::<InferencePool>();
    server.create(&pool("qwen", 8000)).unwrap();
    let picker = Recorder::default();
    let ip_p = "127.0.0.23";
    let picker_port = free_port(&[ip_p]);
    picker.serve(format!("{ip_p}:{picker_port}").parse().unwrap()).await;
    server.create(&slice("picker-b1", "kvroute-picker-ingest", &[ip_p], picker_port)).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig(NS)).unwrap();
    let config = dir.path().join("agent.yaml");
    std::fs::write(
        &config,
        format!(
            "picker_service: {{name: kvroute-picker-ingest, namespace: {NS}}}\ninsecure_ingest: true\nmetrics_addr: 127.0.0.1:0\n\
             gpu_source: \"mock:{}/scenarios/healthy.yaml\"\npod_resources_socket: {}\nreport_interval_ms: 200\n",
            env!("CARGO_MANIFEST_DIR"),
            dir.path().join("no-kubelet.sock").display()
        ),
    )
    .unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvroute-agent"))
        .arg("--config")
        .arg(&config)
        .args(["--pool-name", "qwen", "--pool-namespace", NS])
        .env("NODE_NAME", "n1")
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("starts");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(BOUND, lines.next_line()).await.expect("READY in time").unwrap();
    assert_eq!(ready.as_deref(), Some("READY"));

    // No pod on n1: a stream with an empty Hello, and the process stays up.
    picker.wait("empty Hello", |l| l.hellos.last().is_some_and(Vec::is_empty)).await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(child.try_wait().unwrap().is_none(), "the agent must idle, not exit");

    // A pod scheduled on n1 (its engine not up): reported at once, its GPUs named unknown.
    server.create(&vllm_pod("x", "n1", "127.0.0.24", 8000, 5557, 5558)).unwrap();
    picker.wait("x reported", |l| l.pods() == ["x-rank-0"]).await;

    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let code = tokio::time::timeout(BOUND, child.wait()).await.expect("exits in time").unwrap();
    assert!(code.success(), "{code}");
    picker.wait("stream ended", |l| l.ended).await;
}
