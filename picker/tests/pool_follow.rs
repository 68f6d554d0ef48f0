//! The picker follows its InferencePool while traffic flows (docs/design.md §14), end to end: the
//! `kvroute-picker` binary started as in a cluster (`--pool-name` / `--pool-namespace`, client from
//! `$KUBECONFIG`) against the Kubernetes API stand-in (real kube-rs list/watch), a real Envoy 1.40
//! on the repository's `deploy/envoy/envoy.yaml`, and recording engines, each on its own loopback
//! "pod IP" with the pool's one target port. No agent runs: every pod is routed by load, which is
//! what a new pod gets before its agent reports.
//!
//! While clients keep sending requests: the pool scales up (a new Ready pod gets traffic) and down
//! (a deleted pod gets none after it left), a pod turns unready, a pod moves to a new IP, and an
//! agent reports a pod outside the pool (refused, counted, never routed to). Each change is
//! followed within [`FOLLOW`] without restarting anything, and no client sees a 5xx. The test
//! prints the measured delays (`pool-follow:` lines) for docs/operations.md.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use k8s_openapi::api::core::v1::{Pod, PodCondition, PodSpec, PodStatus};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kvroute_cluster::crd::{
    InferenceModelRewrite, InferenceModelRewriteRule, InferenceModelRewriteSpec, InferenceObjective, InferencePool,
    InferencePoolSpec, ModelMatch, PoolObjectReference, PoolPort, PoolSelector, RewriteMatch, RewriteTarget,
};
use kvroute_harness::{FakeAgent, FakePod};
use kvroute_kube_stand_in::ApiServer;
use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

const NS: &str = "kvroute";
const MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";
/// How fast routing must follow a pool change (docs/operations.md "Install", pool changes).
const FOLLOW: Duration = Duration::from_secs(2);
/// Pod IPs: p0..p3 start or join the pool; `MOVED` is p2's new address; `OUTSIDE` is never in it.
const IPS: [&str; 5] = ["127.0.0.41", "127.0.0.42", "127.0.0.43", "127.0.0.44", "127.0.0.45"];
const MOVED: usize = 3;
const OUTSIDE: usize = 4;

fn envoy_binary() -> PathBuf {
    if let Ok(p) = std::env::var("KVROUTE_ENVOY") {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/envoy/envoy/_bin/envoy");
    assert!(p.is_file(), "Envoy not installed: run scripts/install-envoy (scripts/test does)");
    p
}

/// A port free on every IP given.
fn free_port(ips: &[&str]) -> u16 {
    'next: for _ in 0..50 {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        for ip in ips {
            if std::net::TcpListener::bind((*ip, port)).is_err() {
                continue 'next;
            }
        }
        return port;
    }
    panic!("no port free on {ips:?}");
}

/// When each engine (by IP index) was hit, in ms since the test's epoch.
type Hits = Arc<Mutex<BTreeMap<usize, Vec<u64>>>>;

/// The body `model` of each request the engines received, in arrival order.
type Seen = Arc<Mutex<Vec<String>>>;

/// An OpenAI-shaped engine on `ip:port` that records each request's arrival time (and, in `seen`,
/// the model its body named).
async fn engine(ip: &str, port: u16, idx: usize, hits: Hits, epoch: Instant) {
    engine_seeing(ip, port, idx, hits, epoch, Seen::default()).await;
}

async fn engine_seeing(ip: &str, port: u16, idx: usize, hits: Hits, epoch: Instant, seen: Seen) {
    async fn answer(
        State((idx, hits, epoch, seen)): State<(usize, Hits, Instant, Seen)>,
        body: axum::Json<serde_json::Value>,
    ) -> axum::Json<serde_json::Value> {
        hits.lock().entry(idx).or_default().push(epoch.elapsed().as_millis() as u64);
        seen.lock().push(body["model"].as_str().unwrap_or("<none>").to_owned());
        axum::Json(serde_json::json!({
            "id": "cmpl-1", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
        }))
    }
    let app =
        axum::Router::new().route("/v1/completions", axum::routing::post(answer)).with_state((idx, hits, epoch, seen));
    let l = tokio::net::TcpListener::bind((ip, port)).await.unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
}

fn pool(port: u16) -> InferencePool {
    let mut p = InferencePool::new(
        "qwen",
        InferencePoolSpec {
            selector: PoolSelector { match_labels: [("app".to_string(), "vllm".to_string())].into() },
            target_ports: vec![PoolPort { number: i32::from(port) }],
            app_protocol: None,
            endpoint_picker_ref: None,
        },
    );
    p.metadata.namespace = Some(NS.into());
    p
}

fn pod(name: &str, ip: &str, ready: bool) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            uid: Some(format!("uid-{name}")),
            labels: Some([("app".to_string(), "vllm".to_string())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec { node_name: Some("n1".into()), ..Default::default() }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some(ip.into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
    }
}

/// One HTTP/1.1 completion through Envoy; the status (0 on an I/O error).
async fn post(gw: SocketAddr) -> u16 {
    post_model(gw, MODEL).await.0
}

/// One HTTP/1.1 completion for `model` through Envoy; the status (0 on an I/O error) and the
/// response body.
async fn post_model(gw: SocketAddr, model: &str) -> (u16, String) {
    let body = format!(r#"{{"model":"{model}","prompt":"hello pool","max_tokens":1}}"#);
    let run = async {
        let mut s = tokio::net::TcpStream::connect(gw).await?;
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await?;
        s.write_all(body.as_bytes()).await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        std::io::Result::Ok(out)
    };
    match tokio::time::timeout(Duration::from_secs(10), run).await {
        Ok(Ok(out)) => {
            let text = String::from_utf8_lossy(&out);
            let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
            (status, text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned())
        }
        _ => (0, String::new()),
    }
}

/// Kills a child process when the test ends, however it ends.
struct Kill(tokio::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.start_kill();
    }
}

async fn start_envoy(dir: &std::path::Path, ext_proc: u16) -> (Kill, SocketAddr) {
    let config = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/envoy/envoy.yaml"))
        .unwrap()
        .replace("port_value: 9002", &format!("port_value: {ext_proc}"));
    start_envoy_text(dir, config).await
}

/// Starts Envoy on `config` (deploy/envoy/envoy.yaml's text) with its listener and admin ports
/// rewritten; waits until it listens.
async fn start_envoy_text(dir: &std::path::Path, config: String) -> (Kill, SocketAddr) {
    let listener = free_port(&["127.0.0.1"]);
    let config = config.replace("port_value: 9901", &format!("port_value: {}", free_port(&["127.0.0.1"]))).replace(
        "{ address: 0.0.0.0, port_value: 8081 }",
        &format!("{{ address: 127.0.0.1, port_value: {listener} }}"),
    );
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, config).unwrap();
    let base_id = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos() % 1_000_000;
    let child = tokio::process::Command::new(envoy_binary())
        .args(["-c", path.to_str().unwrap(), "--concurrency", "1", "-l", "warn", "--base-id"])
        .arg(base_id.to_string())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("envoy.log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let gw: SocketAddr = format!("127.0.0.1:{listener}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(gw).await.is_err() {
        assert!(Instant::now() < deadline, "Envoy did not start listening");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (Kill(child), gw)
}

/// Waits up to `bound` for `pred` over the hits; returns the time it first held (ms since epoch).
async fn until(
    hits: &Hits,
    epoch: Instant,
    bound: Duration,
    mut pred: impl FnMut(&BTreeMap<usize, Vec<u64>>) -> bool,
) -> Option<u64> {
    let deadline = Instant::now() + bound;
    loop {
        if pred(&hits.lock()) {
            return Some(epoch.elapsed().as_millis() as u64);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn last_hit(hits: &Hits, idx: usize) -> Option<u64> {
    hits.lock().get(&idx).and_then(|v| v.last().copied())
}

fn first_hit_after(hits: &Hits, idx: usize, t: u64) -> Option<u64> {
    hits.lock().get(&idx).and_then(|v| v.iter().copied().find(|h| *h >= t))
}

async fn metric(admin: SocketAddr, needle: &str) -> Option<f64> {
    let run = async {
        let mut s = tokio::net::TcpStream::connect(admin).await?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        std::io::Result::Ok(out)
    };
    let text = run.await.ok()?;
    text.lines().find(|l| l.starts_with(needle)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok())
}

/// A `kvroute-picker` started as in a cluster: `--pool-name qwen --pool-namespace kvroute`, its
/// client from a kubeconfig naming the API stand-in `server`, `models: [MODEL]`, loopback ports,
/// plus `extra` config lines. Returned once it printed READY (listening; not necessarily SERVING).
struct K8sPicker {
    child: Kill,
    ext_proc: u16,
    ingest: u16,
    admin: u16,
}

async fn start_k8s_picker(dir: &std::path::Path, server: &ApiServer, extra: &str) -> K8sPicker {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig(NS)).unwrap();
    let (ext_proc, ingest, admin) = (free_port(&["127.0.0.1"]), free_port(&["127.0.0.1"]), free_port(&["127.0.0.1"]));
    let config = dir.join("picker.yaml");
    std::fs::write(
        &config,
        format!(
            "ext_proc_addr: 127.0.0.1:{ext_proc}\nhealth_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:{ingest}\nadmin_addr: 127.0.0.1:{admin}\n\
             insecure_ingest: true\nmodels: [{{name: {MODEL}}}]\n{extra}"
        ),
    )
    .unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvroute-picker"))
        .arg("--config")
        .arg(&config)
        .args(["--pool-name", "qwen", "--pool-namespace", NS, "--log-level", "info"])
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("picker.log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await.expect("READY in time");
    assert_eq!(ready.unwrap().as_deref(), Some("READY"));
    K8sPicker { child: Kill(child), ext_proc, ingest, admin }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_follows_the_pool_while_traffic_flows() {
    let epoch = Instant::now();
    let port = free_port(&IPS);
    let hits: Hits = Arc::default();
    for (i, ip) in IPS.iter().enumerate() {
        engine(ip, port, i, hits.clone(), epoch).await;
    }
    let server = ApiServer::start().await.unwrap();
    server.register::<InferencePool>();
    server.create(&pool(port)).unwrap();
    server.create(&pod("p0", IPS[0], true)).unwrap();
    server.create(&pod("p1", IPS[1], true)).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let picker = start_k8s_picker(dir.path(), &server, "ready_timeout_ms: 500\n").await;
    let (ext_proc, ingest, admin) = (picker.ext_proc, picker.ingest, picker.admin);
    let picker_pid = picker.child.0.id();
    let (_envoy, gw) = start_envoy(dir.path(), ext_proc).await;

    // Clients: 4 loops of sequential requests until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let statuses: Arc<Mutex<BTreeMap<u16, u64>>> = Arc::default();
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (stop, sent, failed, statuses) = (stop.clone(), sent.clone(), failed.clone(), statuses.clone());
        clients.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let status = post(gw).await;
                sent.fetch_add(1, Ordering::Relaxed);
                if status != 200 {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                *statuses.lock().entry(status).or_default() += 1;
            }
        }));
    }
    let both = until(&hits, epoch, Duration::from_secs(10), |h| h.contains_key(&0) && h.contains_key(&1)).await;
    assert!(both.is_some(), "p0 and p1 never both served: {:?}", hits.lock().keys().collect::<Vec<_>>());

    // Scale up: p2 created Ready → routed to within FOLLOW.
    let t_up = epoch.elapsed().as_millis() as u64;
    server.create(&pod("p2", IPS[2], true)).unwrap();
    let reached = until(&hits, epoch, FOLLOW, |h| h.get(&2).is_some_and(|v| v.iter().any(|t| *t >= t_up))).await;
    let first_p2 = first_hit_after(&hits, 2, t_up);
    assert!(reached.is_some(), "new Ready pod p2 got no request within {FOLLOW:?}");
    let ready_to_first = first_p2.unwrap() - t_up;

    // Scale down: p1 deleted → no request reaches it after FOLLOW.
    let t_del = epoch.elapsed().as_millis() as u64;
    server.delete::<Pod>(NS, "p1").unwrap();
    tokio::time::sleep(FOLLOW).await;
    let before = last_hit(&hits, 1).unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(last_hit(&hits, 1).unwrap_or(0), before, "a deleted pod kept getting requests");
    let delete_to_last = before.saturating_sub(t_del);
    assert!(before < t_del + FOLLOW.as_millis() as u64, "last request to p1 {delete_to_last} ms after deletion");

    // Unready: p0 turns NotReady → no request reaches it after FOLLOW.
    let t_unready = epoch.elapsed().as_millis() as u64;
    server.modify::<Pod>(NS, "p0", |p| p.status = pod("p0", IPS[0], false).status).unwrap();
    tokio::time::sleep(FOLLOW).await;
    let before = last_hit(&hits, 0).unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(last_hit(&hits, 0).unwrap_or(0), before, "an unready pod kept getting requests");
    let unready_to_last = before.saturating_sub(t_unready);

    // Re-addressed: p2 moves to a new IP → its traffic follows, none to the old address.
    let t_move = epoch.elapsed().as_millis() as u64;
    server.modify::<Pod>(NS, "p2", |p| p.status = pod("p2", IPS[MOVED], true).status).unwrap();
    let moved = until(&hits, epoch, FOLLOW, |h| h.get(&MOVED).is_some_and(|v| v.iter().any(|t| *t >= t_move))).await;
    assert!(moved.is_some(), "p2's new address got no request within {FOLLOW:?}");
    let move_to_first = first_hit_after(&hits, MOVED, t_move).unwrap() - t_move;
    tokio::time::sleep(FOLLOW).await;
    let before = last_hit(&hits, 2).unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(last_hit(&hits, 2).unwrap_or(0), before, "p2's old address kept getting requests");

    // A report for a pod outside the pool, claiming the outside engine with the request's whole
    // prefix cached and no load: refused, counted, never routed to.
    let outside: SocketAddr = format!("{}:{port}", IPS[OUTSIDE]).parse().unwrap();
    let agent = FakeAgent::connect(
        format!("127.0.0.1:{ingest}").parse().unwrap(),
        &[FakePod::new("intruder-rank-0", outside, MODEL), FakePod::new("p0-rank-0", outside, MODEL)],
    )
    .await
    .unwrap();
    let refused = async {
        for _ in 0..100 {
            if metric(
                format!("127.0.0.1:{admin}").parse().unwrap(),
                "epp_ingest_refusals_total{reason=\"not_in_pool\"}",
            )
            .await
            .is_some_and(|v| v >= 1.0)
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    };
    assert!(refused.await, "the outside pod's report was not counted as refused");
    tokio::time::sleep(FOLLOW).await;
    assert!(hits.lock().get(&OUTSIDE).is_none(), "a request reached an address no pool pod has");
    drop(agent);

    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let (sent, failed) = (sent.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    println!(
        "pool-follow: requests {sent}, non-200 {failed} {:?}; pod Ready → first request {ready_to_first} ms; \
         deleted → last request {delete_to_last} ms; unready → last request {unready_to_last} ms; \
         moved → first request at the new IP {move_to_first} ms",
        statuses.lock()
    );
    assert_eq!(failed, 0, "clients saw errors while the pool changed: {:?}", statuses.lock());
    assert!(sent > 50, "too little traffic to mean anything: {sent}");
    assert_eq!(picker.child.0.id(), picker_pid, "the picker was not restarted");
}

/// A picker started on `config` (its pool from the pool file the config names); READY awaited.
async fn spawn_picker(config: &std::path::Path, log: &std::path::Path) -> tokio::process::Child {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvroute-picker"))
        .arg("--config")
        .arg(config)
        .stdout(Stdio::piped())
        .stderr(std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await.expect("READY in time");
    assert_eq!(ready.unwrap().as_deref(), Some("READY"));
    child
}

/// A rolling restart of two picker replicas behind one Envoy while clients send requests, with
/// the repository's Envoy config and picker defaults (Envoy health-checks the ext_proc cluster;
/// a picker drains NOT_SERVING for `shutdown_drain_ms` after SIGTERM), against the same run
/// without either (no health check, no drain): the first must cost no request. Prints both
/// (`rolling-restart:`) for docs/operations.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_of_two_picker_replicas_costs_no_request() {
    let (total, failed, statuses) = rolling_restart(true, ["127.0.0.55", "127.0.0.56"], 1).await;
    println!("rolling-restart: one replica, restarted: {total} requests, non-200 {failed} {statuses:?}");
    let (total, failed, statuses) = rolling_restart(false, ["127.0.0.53", "127.0.0.54"], 2).await;
    println!("rolling-restart: without health check and drain: {total} requests, non-200 {failed} {statuses:?}");
    let (total, failed, statuses) = rolling_restart(true, ["127.0.0.51", "127.0.0.52"], 2).await;
    println!("rolling-restart: with health check and drain: {total} requests, non-200 {failed} {statuses:?}");
    assert_eq!(failed, 0, "a rolling restart of 2 replicas cost requests: {statuses:?}");
    assert!(total > 50, "too little traffic to mean anything: {total}");
}

/// `replicas` (1 or 2) picker replicas behind one Envoy (the ext_proc cluster lists each), two
/// engines from a pool file, 4 clients; each replica is stopped with SIGTERM and started again,
/// and must route again once back. `graceful`: deploy/envoy/envoy.yaml as is and the pickers' default drain;
/// otherwise its health check removed and `shutdown_drain_ms: 0`. Returns (requests, non-200,
/// statuses).
async fn rolling_restart(graceful: bool, ips: [&str; 2], replicas_n: usize) -> (u64, u64, BTreeMap<u16, u64>) {
    let epoch = Instant::now();
    let port = free_port(&ips);
    let hits: Hits = Arc::default();
    for (i, ip) in ips.iter().enumerate() {
        engine(ip, port, i, hits.clone(), epoch).await;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("pool.yaml"),
        format!(
            "pods:\n  - {{name: e0, ip: {}, ports: [{port}]}}\n  - {{name: e1, ip: {}, ports: [{port}]}}\n",
            ips[0], ips[1]
        ),
    )
    .unwrap();
    let mut replicas = Vec::new();
    for r in 0..replicas_n {
        let ports: Vec<u16> = (0..3).map(|_| free_port(&["127.0.0.1"])).collect();
        let config = dir.path().join(format!("picker-{r}.yaml"));
        std::fs::write(
            &config,
            format!(
                "ext_proc_addr: 127.0.0.1:{}\nhealth_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:{}\nadmin_addr: 127.0.0.1:{}\n\
                 insecure_ingest: true\nmodels: [{{name: {MODEL}}}]\npool_file: pool.yaml\nready_timeout_ms: 500\n{}",
                ports[0],
                ports[1],
                ports[2],
                if graceful { "" } else { "shutdown_drain_ms: 0\n" }
            ),
        )
        .unwrap();
        let child = spawn_picker(&config, &dir.path().join(format!("picker-{r}.log"))).await;
        replicas.push((config, ports, Some(child)));
    }
    // Envoy's picker cluster with both replicas.
    let one = "              - endpoint:\n                  address:\n                    socket_address: { address: 127.0.0.1, port_value: 9002 }\n";
    let envoy_yaml =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/envoy/envoy.yaml")).unwrap();
    assert!(envoy_yaml.contains(one), "deploy/envoy/envoy.yaml's picker endpoint entry changed");
    let both = if replicas_n == 1 {
        one.replace("9002", "PICKER_A")
    } else {
        format!("{}{}", one.replace("9002", "PICKER_A"), one.replace("9002", "PICKER_B"))
    };
    let mut patched = envoy_yaml.replace(one, &both);
    if !graceful {
        let start = patched.find("      # grpc.health.v1 on the ext_proc port").expect("the picker health check");
        let end = patched[start..].find("grpc_health_check: {}\n").expect("its end")
            + start
            + "grpc_health_check: {}\n".len();
        patched.replace_range(start..end, "");
    }
    let tmp = dir.path().join("envoy-src");
    std::fs::create_dir_all(&tmp).unwrap();
    let (_envoy, gw) = {
        let text = patched
            .replace("PICKER_A", &replicas[0].1[0].to_string())
            .replace("PICKER_B", &replicas.get(1).map_or(0, |r| r.1[0]).to_string());
        start_envoy_text(&tmp, text).await
    };

    let stop = Arc::new(AtomicBool::new(false));
    let statuses: Arc<Mutex<BTreeMap<u16, u64>>> = Arc::default();
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (stop, statuses) = (stop.clone(), statuses.clone());
        clients.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let status = post(gw).await;
                *statuses.lock().entry(status).or_default() += 1;
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let warm: u64 = statuses.lock().values().sum();
    assert!(warm > 10, "no traffic before the restart: {:?}", statuses.lock());
    for (r, (config, ports, child)) in replicas.iter_mut().enumerate() {
        let mut c = child.take().unwrap();
        let pid = c.id().unwrap().to_string();
        let _ = std::process::Command::new("kill").args(["-TERM", &pid]).status();
        let exit = tokio::time::timeout(Duration::from_secs(10), c.wait()).await.expect("stops on SIGTERM").unwrap();
        assert!(exit.success(), "replica {r} exited with {exit:?}");
        let restarted = spawn_picker(config, &dir.path().join(format!("picker-{r}.log"))).await;
        *child = Some(restarted);
        // Back: it routes again (Envoy spreads the ext_proc streams over both replicas).
        let admin: SocketAddr = format!("127.0.0.1:{}", ports[2]).parse().unwrap();
        let mut routed = false;
        for _ in 0..200 {
            if metric(admin, "epp_routing_decisions_total").await.is_some_and(|v| v >= 1.0) {
                routed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(routed, "replica {r} routed nothing after its restart");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let statuses = statuses.lock().clone();
    let total: u64 = statuses.values().sum();
    let failed: u64 = statuses.iter().filter(|(s, _)| **s != 200).map(|(_, n)| n).sum();
    let served = hits.lock().values().map(Vec::len).sum::<usize>() as u64;
    assert!(served >= total - failed, "answered requests that reached no engine: {served} < {}", total - failed);
    (total, failed, statuses)
}

fn rewrite_rule(model: &str, targets: &[(&str, Option<i32>)]) -> InferenceModelRewrite {
    let mut r = InferenceModelRewrite::new(
        "chat-split",
        InferenceModelRewriteSpec {
            pool_ref: Some(PoolObjectReference {
                group: Some("inference.networking.k8s.io".into()),
                kind: Some("InferencePool".into()),
                name: "qwen".into(),
            }),
            rules: vec![InferenceModelRewriteRule {
                matches: vec![RewriteMatch {
                    model: Some(ModelMatch { match_type: Some("Exact".into()), value: model.into() }),
                }],
                targets: targets
                    .iter()
                    .map(|(m, w)| RewriteTarget { weight: *w, model_rewrite: (*m).into() })
                    .collect(),
            }],
        },
    );
    r.metadata.namespace = Some(NS.into());
    r
}

/// Client model `chat` resolves through the InferenceModelRewrite objects of the pool, end to end
/// (docs/design.md §14): the picker on the API stand-in, the repository's Envoy, recording engines
/// that note the body's `model`. While other clients keep sending requests for the base model:
/// before any rewrite `chat` is unknown (404, the same answer as for any unknown model); a rewrite
/// created sends `chat` to its target, the engine seeing the rewritten name; a weighted split is
/// honoured within a tolerance; an update takes effect; the unknown model's answer is unchanged;
/// nothing restarts and the base model's traffic sees no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_rewrites_follow_the_api_while_traffic_flows() {
    const REWRITE_IPS: [&str; 2] = ["127.0.0.61", "127.0.0.62"];
    let epoch = Instant::now();
    let port = free_port(&REWRITE_IPS);
    let (hits, seen): (Hits, Seen) = (Arc::default(), Arc::default());
    for (i, ip) in REWRITE_IPS.iter().enumerate() {
        engine_seeing(ip, port, i, hits.clone(), epoch, seen.clone()).await;
    }
    let server = ApiServer::start().await.unwrap();
    server.register::<InferencePool>();
    server.register::<InferenceObjective>();
    server.register::<InferenceModelRewrite>();
    server.create(&pool(port)).unwrap();
    server.create(&pod("p0", REWRITE_IPS[0], true)).unwrap();
    server.create(&pod("p1", REWRITE_IPS[1], true)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let picker = start_k8s_picker(dir.path(), &server, "ready_timeout_ms: 500\n").await;
    let picker_pid = picker.child.0.id();
    let (_envoy, gw) = start_envoy(dir.path(), picker.ext_proc).await;
    let mut first = (0, String::new());
    for _ in 0..200 {
        first = post_model(gw, MODEL).await;
        if first.0 == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(first.0, 200, "the base model is not served: {}", first.1);

    // Unknown before any rewrite, with today's answer.
    let (status, unknown_before) = post_model(gw, "nope").await;
    assert_eq!(status, 404, "{unknown_before}");
    assert!(unknown_before.contains("model `nope` does not exist"), "{unknown_before}");
    let (status, body) = post_model(gw, "chat").await;
    assert_eq!(status, 404, "chat has no rewrite yet: {body}");

    // Base-model traffic throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let statuses: Arc<Mutex<BTreeMap<u16, u64>>> = Arc::default();
    let background = {
        let (stop, statuses) = (stop.clone(), statuses.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let (status, _) = post_model(gw, MODEL).await;
                *statuses.lock().entry(status).or_default() += 1;
            }
        })
    };
    let targets_seen = |seen: &Seen, from: usize| -> Vec<String> {
        seen.lock()[from..].iter().filter(|m| m.starts_with("target-")).cloned().collect()
    };
    // Sends `chat` until `target` reaches an engine; the delay since `t0`.
    let until_seen = |target: &'static str, t0: Instant| {
        let seen = seen.clone();
        async move {
            while t0.elapsed() < FOLLOW {
                let from = seen.lock().len();
                let (status, _) = post_model(gw, "chat").await;
                if status == 200 && seen.lock()[from..].iter().any(|m| m == target) {
                    return Some(t0.elapsed());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            None
        }
    };

    // Created: chat → target-a.
    let t0 = Instant::now();
    server.create(&rewrite_rule("chat", &[("target-a", None)])).unwrap();
    let created = until_seen("target-a", t0).await.expect("the new rewrite did not take effect within 2 s");
    let from = seen.lock().len();
    for _ in 0..10 {
        assert_eq!(post_model(gw, "chat").await.0, 200);
    }
    assert_eq!(targets_seen(&seen, from), vec!["target-a".to_owned(); 10], "engines saw another name");

    // Weighted split 80/20.
    let t0 = Instant::now();
    server
        .modify::<InferenceModelRewrite>(NS, "chat-split", |r| {
            r.spec.rules[0].targets =
                rewrite_rule("chat", &[("target-a", Some(80)), ("target-b", Some(20))]).spec.rules[0].targets.clone();
        })
        .unwrap();
    let split = until_seen("target-b", t0).await.expect("the weighted split did not take effect within 2 s");
    let from = seen.lock().len();
    const N: usize = 300;
    for _ in 0..N {
        assert_eq!(post_model(gw, "chat").await.0, 200);
    }
    let got = targets_seen(&seen, from);
    assert_eq!(got.len(), N, "every request reached an engine under a target name");
    let a = got.iter().filter(|m| *m == "target-a").count() as f64 / N as f64;
    // Binomial(300, 0.8): σ ≈ 0.023. The draw itself is unbiased (the χ² test of
    // `ModelRule::pick` in kvroute-cluster); ±0.12 is about 5σ, so a fair draw fails this about
    // once in two million runs while a lost weight (an even split, or target-b never drawn)
    // still fails at once.
    assert!((0.68..=0.92).contains(&a), "target-a share {a:.3}, want 0.80 ± 0.12");

    // Updated: chat → target-c only.
    let t0 = Instant::now();
    server
        .modify::<InferenceModelRewrite>(NS, "chat-split", |r| {
            r.spec.rules[0].targets = rewrite_rule("chat", &[("target-c", None)]).spec.rules[0].targets.clone();
        })
        .unwrap();
    let updated = until_seen("target-c", t0).await.expect("the update did not take effect within 2 s");
    let from = seen.lock().len();
    for _ in 0..10 {
        assert_eq!(post_model(gw, "chat").await.0, 200);
    }
    assert_eq!(targets_seen(&seen, from), vec!["target-c".to_owned(); 10], "the old targets are still used");
    // The same through Envoy's FULL_DUPLEX_STREAMED body mode (the body re-streamed rewritten).
    let duplex_dir = dir.path().join("duplex");
    std::fs::create_dir_all(&duplex_dir).unwrap();
    let duplex_config = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/envoy/envoy-full-duplex.yaml"),
    )
    .unwrap()
    .replace("port_value: 9002", &format!("port_value: {}", picker.ext_proc));
    let (_duplex_envoy, duplex_gw) = start_envoy_text(&duplex_dir, duplex_config).await;
    let from = seen.lock().len();
    for _ in 0..5 {
        let (status, body) = post_model(duplex_gw, "chat").await;
        assert_eq!(status, 200, "full duplex: {body}");
    }
    assert_eq!(targets_seen(&seen, from), vec!["target-c".to_owned(); 5], "full duplex: not rewritten");

    // The unknown model's answer is unchanged; the base model passes through unrewritten.
    let (status, unknown_after) = post_model(gw, "nope").await;
    assert_eq!((status, unknown_after.as_str()), (404, unknown_before.as_str()));
    stop.store(true, Ordering::Relaxed);
    background.await.unwrap();
    let statuses = statuses.lock().clone();
    let total: u64 = statuses.values().sum();
    assert!(total > 20 && statuses.get(&200) == Some(&total), "base-model traffic saw errors: {statuses:?}");
    assert!(seen.lock().iter().any(|m| m == MODEL), "the base model's requests were rewritten");
    assert_eq!(picker.child.0.id(), picker_pid, "the picker was not restarted");
    println!(
        "model-rewrite: created → first rewritten request {} ms; split → first target-b {} ms; \
         updated → first target-c {} ms; 80/20 split measured {:.1} % / {:.1} % over {N}; \
         base-model requests {total}, all 200",
        created.as_millis(),
        split.as_millis(),
        updated.as_millis(),
        a * 100.0,
        (1.0 - a) * 100.0
    );
}

/// gRPC health (the ext_proc service and "") and `/readyz` of a picker: `Some(true)` when both say
/// SERVING, `Some(false)` when both say NOT_SERVING, `None` when they disagree or do not answer.
async fn serving(ext_proc: u16, admin: u16) -> Option<bool> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let channel =
        tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{ext_proc}")).ok()?.connect().await.ok()?;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let mut grpc = Vec::new();
    for service in ["", "envoy.service.ext_proc.v3.ExternalProcessor"] {
        let r = health.check(tonic_health::pb::HealthCheckRequest { service: service.into() }).await.ok()?;
        grpc.push(r.into_inner().status == ServingStatus::Serving as i32);
    }
    let readyz = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", admin)).await?;
        s.write_all(b"GET /readyz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        std::io::Result::Ok(out.split(' ').nth(1) == Some("200"))
    };
    let http = readyz.await.ok()?;
    (grpc.iter().all(|g| *g == http)).then_some(http)
}

/// Polls [`serving`] until it reads `want` (or `bound` passes); the time that took.
async fn until_serving(p: &K8sPicker, want: bool, bound: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < bound {
        if serving(p.ext_proc, p.admin).await == Some(want) {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Asserts [`serving`] reads `want` throughout `d`.
async fn stays_serving(p: &K8sPicker, want: bool, d: Duration, what: &str) {
    let t0 = Instant::now();
    while t0.elapsed() < d {
        assert_eq!(serving(p.ext_proc, p.admin).await, Some(want), "{what} after {:?}", t0.elapsed());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A pool pod on the fake agent's node ([`FakeAgent`] reports as node `fake-node`).
fn fake_node_pod(name: &str, ip: &str) -> Pod {
    let mut p = pod(name, ip, true);
    p.spec.as_mut().unwrap().node_name = Some("fake-node".into());
    p
}

/// Readiness (docs/design.md §14), both ways it switches. With `ready_coverage: 1` and a long
/// `ready_timeout_ms`: NOT_SERVING (gRPC health and `/readyz`) while no agent reported and while
/// agents cover half of the Ready pods, SERVING once they cover all; NOT_SERVING again on SIGTERM
/// (draining). With a short `ready_timeout_ms` and no agent: NOT_SERVING while the API server is
/// unreachable (the pool view has not synced, even past the timeout), SERVING once it synced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_the_pool_view_and_agent_coverage() {
    const READY_IPS: [&str; 2] = ["127.0.0.71", "127.0.0.72"];
    let port = free_port(&READY_IPS);
    let server = ApiServer::start().await.unwrap();
    server.register::<InferencePool>();
    server.create(&pool(port)).unwrap();
    server.create(&fake_node_pod("p0", READY_IPS[0])).unwrap();
    server.create(&fake_node_pod("p1", READY_IPS[1])).unwrap();
    let endpoint = |i: usize| format!("{}:{port}", READY_IPS[i]);

    // Coverage.
    let dir = tempfile::tempdir().unwrap();
    let p = start_k8s_picker(dir.path(), &server, "ready_coverage: 1.0\nready_timeout_ms: 60000\n").await;
    stays_serving(&p, false, Duration::from_millis(1000), "SERVING without any agent report").await;
    let ingest: SocketAddr = format!("127.0.0.1:{}", p.ingest).parse().unwrap();
    let half = FakeAgent::connect(ingest, &[FakePod::new("p0-rank-0", endpoint(0), MODEL)]).await.unwrap();
    stays_serving(&p, false, Duration::from_millis(1000), "SERVING with agents covering half the pods").await;
    let rest = FakeAgent::connect(ingest, &[FakePod::new("p1-rank-0", endpoint(1), MODEL)]).await.unwrap();
    let covered = until_serving(&p, true, FOLLOW).await.expect("not SERVING once agents cover every Ready pod");
    // Draining: SIGTERM turns it NOT_SERVING while it still answers (shutdown_drain_ms, 2 s).
    let pid = p.child.0.id().unwrap().to_string();
    let _ = std::process::Command::new("kill").args(["-TERM", &pid]).status();
    let drained = until_serving(&p, false, Duration::from_millis(1500)).await.expect("still SERVING after SIGTERM");
    drop((half, rest));

    // Timeout, but only after the pool view synced.
    let dir = tempfile::tempdir().unwrap();
    server.store().pause();
    let p = start_k8s_picker(dir.path(), &server, "ready_timeout_ms: 500\n").await;
    stays_serving(&p, false, Duration::from_millis(1500), "SERVING before the pool view synced").await;
    let t_resume = Instant::now();
    server.store().resume();
    until_serving(&p, true, Duration::from_secs(5)).await.expect("not SERVING once synced past ready_timeout_ms");
    let synced_after = t_resume.elapsed();
    println!(
        "readiness: SERVING {} ms after agents covered every Ready pod; NOT_SERVING {} ms after SIGTERM; \
         SERVING {} ms after the API answered (past ready_timeout_ms)",
        covered.as_millis(),
        drained.as_millis(),
        synced_after.as_millis()
    );
}

/// An EndpointSlice of the replicas' Service `service` holding the replica on 127.0.0.1:`port`
/// (port name `ingest`; one slice per replica, since test replicas share an IP).
fn replica_slice(service: &str, name: &str, port: u16) -> EndpointSlice {
    kvroute_kube_stand_in::endpoint_slice(NS, name, service, &["127.0.0.1"], "ingest", port)
}

/// `replicas.service` wired in the binary (docs/design.md §4 "One view across replicas"): two
/// `kvroute-picker` processes in Kubernetes mode, told only the Service's name, follow each other
/// from its EndpointSlices (`epp_replica_peers` 1 on each, itself left out), and one whose
/// endpoint leaves the slices is dropped by the other (0) without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_replicas_follow_the_services_endpoint_slices() {
    const SERVICE: &str = "kvroute-picker-peers";
    let server = ApiServer::start().await.unwrap();
    server.register::<InferencePool>();
    server.create(&pool(free_port(&["127.0.0.1"]))).unwrap();
    let extra = format!("replicas: {{service: {{name: {SERVICE}}}}}\n");
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start_k8s_picker(dir_a.path(), &server, &extra).await;
    let b = start_k8s_picker(dir_b.path(), &server, &extra).await;
    server.create(&replica_slice(SERVICE, "peers-a", a.ingest)).unwrap();
    server.create(&replica_slice(SERVICE, "peers-b", b.ingest)).unwrap();
    let peers = |p: &K8sPicker| metric(SocketAddr::from(([127, 0, 0, 1], p.admin)), "epp_replica_peers ");
    // Each replica's peer count once it is `want`, polled up to `bound`; else the last seen.
    let settle = async |p: &K8sPicker, want: f64, bound: Duration| {
        let deadline = Instant::now() + bound;
        loop {
            let seen = peers(p).await;
            if seen == Some(want) || Instant::now() > deadline {
                return seen;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    assert_eq!(settle(&a, 1.0, FOLLOW * 5).await, Some(1.0), "a never followed b");
    assert_eq!(settle(&b, 1.0, FOLLOW).await, Some(1.0), "b never followed a");
    server.delete::<EndpointSlice>(NS, "peers-a").unwrap();
    assert_eq!(settle(&b, 0.0, FOLLOW).await, Some(0.0), "b still follows a after it left the slices");
    assert_eq!(peers(&a).await, Some(1.0), "a stopped following b");
}
