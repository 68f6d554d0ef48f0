//! Rogue agents against a live picker (docs/design.md §14, "Trust"): each attack
//! leaves the routing decision exactly as it was and is counted in `epp_ingest_refusals_total`.
//!
//! The picker runs in-process with mTLS (a CA made by rcgen) and a pool view of two pods:
//! `engine-0` on node-a (holding the prompt's blocks) and `engine-1` on node-b. Real agents are
//! stood in for by gRPC clients with node certificates; rogues by clients with no certificate, a
//! self-signed one, another node's, or a valid one used to claim what is not theirs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{E0, E0_ADDR, E1, E1_ADDR, ROGUE_ADDR, prompt};

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::discovery::v1::{Endpoint as K8sEndpoint, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kvroute_cluster::PoolView;
use kvroute_common::BlockHash;
use kvroute_harness::fake_agent::poll_until;
use kvroute_harness::tls::{self, Pem, TestCa};
use kvroute_kube_stand_in::ApiServer;
use kvroute_picker::RunningPicker;
use kvroute_picker::config::PickerConfig;
use kvroute_picker::ingest::Refusal;
use kvroute_picker::ingest::guard::AnyPod;
use kvroute_picker::score::RouteRequest;
use kvroute_proto::agent::v1::agent_ingest_client::AgentIngestClient;
use kvroute_proto::agent::v1::{
    AgentMessage, BlockChanges, BlockRun, Hello, PickerMessage, PodDelta, PodInfo, PodSnapshot, PodStats, agent_message,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

const MODEL: &str = "m";
const TIMEOUT: Duration = Duration::from_secs(5);

fn pool_view() -> PoolView {
    common::two_node_pool_view("ns")
}

struct Pki {
    dir: tempfile::TempDir,
    ca: TestCa,
    ca_file: PathBuf,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new("trust test CA").unwrap();
        let ca_file = dir.path().join("ca.crt");
        std::fs::write(&ca_file, ca.cert_pem()).unwrap();
        Pki { dir, ca, ca_file }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

async fn start(pki: &Pki, scoped: bool) -> RunningPicker {
    start_as(pki, scoped, "picker").await
}

/// [`start`] with the picker's certificate files named `name` (one per replica).
async fn start_as(pki: &Pki, scoped: bool, name: &str) -> RunningPicker {
    let picker = tls::write(pki.path(), name, &pki.ca.picker().unwrap()).unwrap();
    let yaml = format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\n\
         ingest_tls: {{ca_file: {}, cert_file: {}, key_file: {}}}\n",
        pki.ca_file.display(),
        picker.cert.display(),
        picker.key.display()
    );
    let config = PickerConfig::from_yaml(&yaml).unwrap();
    config.validate().unwrap();
    let scope: Arc<dyn kvroute_picker::ingest::ReportScope> =
        if scoped { Arc::new(pool_view()) } else { Arc::new(AnyPod) };
    kvroute_picker::start_with_scope(&config, Some(scope)).await.unwrap()
}

/// How a client authenticates: the CA it trusts for the picker, and its own certificate.
struct ClientAuth {
    ca: String,
    identity: Option<Pem>,
}

/// An open report stream: messages go in through `tx`; the picker's replies are drained.
struct Stream {
    tx: mpsc::Sender<AgentMessage>,
    replies: tokio::task::JoinHandle<Vec<PickerMessage>>,
}

/// Opens a report stream over mTLS; `Err` when the connection or the RPC is refused.
async fn open(picker: &RunningPicker, auth: &ClientAuth) -> Result<Stream, String> {
    let mut config =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&auth.ca)).domain_name(tls::PICKER_SERVER_NAME);
    if let Some(id) = &auth.identity {
        config = config.identity(Identity::from_pem(&id.cert, &id.key));
    }
    let endpoint = Endpoint::from_shared(format!("https://{}", picker.ingest_addr))
        .map_err(|e| e.to_string())?
        .tls_config(config)
        .map_err(|e| e.to_string())?;
    let channel = endpoint.connect().await.map_err(|e| format!("connect: {e:?}"))?;
    let mut client = AgentIngestClient::new(channel);
    let (tx, rx) = mpsc::channel(1024);
    let mut inbound = client.report(ReceiverStream::new(rx)).await.map_err(|e| format!("report: {e:?}"))?.into_inner();
    let replies = tokio::spawn(async move {
        let mut got = Vec::new();
        while let Ok(Some(m)) = inbound.message().await {
            got.push(m);
        }
        got
    });
    Ok(Stream { tx, replies })
}

fn info(pod: &str, endpoint: &str) -> PodInfo {
    PodInfo { pod: pod.into(), endpoint: endpoint.into(), model: MODEL.into(), block_size: 16, ..Default::default() }
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn stats(health: f64) -> PodStats {
    PodStats {
        observed_at_unix_ms: now_ms(),
        kv_cache_usage: 0.1,
        health_score: health,
        ready: true,
        ..Default::default()
    }
}

fn hello(node: &str, pods: Vec<PodInfo>) -> AgentMessage {
    AgentMessage {
        msg: Some(agent_message::Msg::Hello(Hello {
            agent_id: format!("{node}-1"),
            node_name: node.into(),
            protocol_version: 1,
            pods,
        })),
    }
}

fn snapshot(pod: &str, endpoint: &str, seq: u64, blocks: &[BlockHash], health: f64) -> AgentMessage {
    AgentMessage {
        msg: Some(agent_message::Msg::Snapshot(PodSnapshot {
            info: Some(info(pod, endpoint)),
            seq,
            stats: Some(stats(health)),
            blocks: vec![BlockRun { parent: 0, hashes: blocks.iter().map(|h| h.0).collect() }],
            offloaded_blocks: Vec::new(),
        })),
    }
}

fn delta(pod: &str, seq: u64, stored: &[BlockHash], stats: Option<PodStats>) -> AgentMessage {
    AgentMessage {
        msg: Some(agent_message::Msg::Delta(PodDelta {
            pod: pod.into(),
            seq,
            blocks: Some(BlockChanges {
                cleared: false,
                stored: vec![BlockRun { parent: 0, hashes: stored.iter().map(|h| h.0).collect() }],
                removed: vec![],
            }),
            stats,
            offloaded: None,
        })),
    }
}

/// Sends `msgs` on a fresh stream; the stream stays open while the returned value lives.
async fn report(picker: &RunningPicker, auth: &ClientAuth, msgs: Vec<AgentMessage>) -> Result<Stream, String> {
    let s = open(picker, auth).await?;
    for m in msgs {
        s.tx.send(m).await.map_err(|_| "stream closed".to_string())?;
    }
    Ok(s)
}

/// What routing would do for the prompt now: the choice and every candidate's
/// (pod, endpoint, matched blocks, score), plus every pod's (name, endpoint, connected).
type Routing = (Option<String>, Vec<(String, String, u32, String)>, Vec<(String, String, bool)>);

fn routing(picker: &RunningPicker) -> Routing {
    let hashes = prompt();
    let req = RouteRequest { model: MODEL, adapter: None, block_hashes: &hashes, subset: None };
    let ex = picker.gateway.router.explain(&req);
    let candidates = ex
        .candidates
        .iter()
        .map(|c| (c.pod.to_string(), c.endpoint.to_string(), c.matched_blocks, format!("{:.6}", c.score)))
        .collect();
    let mut pods: Vec<_> = picker.gateway.pool.pods().into_iter().map(|p| (p.name, p.endpoint, p.connected)).collect();
    pods.sort();
    (ex.choice, candidates, pods)
}

fn refusals(picker: &RunningPicker, reason: Refusal) -> u64 {
    kvroute_picker::ingest::Refusals::new(picker.gateway.metrics.ingest_refusals.clone()).count(reason)
}

/// Waits until `reason` was counted at least `n` times more than `before`.
async fn counted(picker: &RunningPicker, reason: Refusal, before: u64, n: u64) {
    let ok = poll_until(TIMEOUT, || refusals(picker, reason) >= before + n).await;
    assert!(ok, "{reason:?}: {} refusals, expected {before} + {n}", refusals(picker, reason));
}

/// The real fleet: node-a's agent reports engine-0 (holding the prompt), node-b's engine-1.
async fn real_fleet(picker: &RunningPicker, pki: &Pki) -> (Stream, Stream) {
    let auth = |node: &str| ClientAuth { ca: pki.ca.cert_pem(), identity: Some(pki.ca.agent(node).unwrap()) };
    let a = report(
        picker,
        &auth("node-a"),
        vec![hello("node-a", vec![info(E0, E0_ADDR)]), snapshot(E0, E0_ADDR, 1, &prompt(), 1.0)],
    )
    .await
    .unwrap();
    let b = report(
        picker,
        &auth("node-b"),
        vec![hello("node-b", vec![info(E1, E1_ADDR)]), snapshot(E1, E1_ADDR, 1, &[], 1.0)],
    )
    .await
    .unwrap();
    let up = || {
        let pods = picker.gateway.pool.pods();
        pods.len() == 2 && pods.iter().all(|p| p.ready && p.connected)
    };
    assert!(poll_until(TIMEOUT, up).await, "real fleet never came up: {:?}", picker.gateway.pool.pods());
    let r = routing(picker);
    assert_eq!(r.0.as_deref(), Some(E0), "engine-0 holds the prompt: {r:?}");
    (a, b)
}

/// Lets the picker apply whatever was sent, then checks that routing is still `before`.
async fn unchanged(picker: &RunningPicker, before: &Routing) {
    assert!(picker.gateway.pool.sync().await.is_ok());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(picker.gateway.pool.sync().await.is_ok());
    assert_eq!(&routing(picker), before);
}

#[tokio::test]
async fn connections_without_a_trusted_certificate_are_refused() {
    let pki = Pki::new();
    let picker = start(&pki, true).await;
    let _fleet = real_fleet(&picker, &pki).await;
    let before = routing(&picker);
    let attack = vec![
        hello("node-a", vec![info(E0, ROGUE_ADDR)]),
        snapshot(E0, ROGUE_ADDR, 1, &[BlockHash(99)], 1.0),
        snapshot("rogue-rank-0", ROGUE_ADDR, 1, &prompt(), 1.0),
    ];

    // No certificate at all.
    let n = refusals(&picker, Refusal::NoClientCertificate);
    let none = ClientAuth { ca: pki.ca.cert_pem(), identity: None };
    let s = report(&picker, &none, attack.clone()).await;
    if let Ok(s) = s {
        // TLS 1.3: the client learns of the refusal on its first read.
        let replies = tokio::time::timeout(TIMEOUT, s.replies).await.unwrap().unwrap();
        assert!(replies.is_empty());
    }
    counted(&picker, Refusal::NoClientCertificate, n, 1).await;
    unchanged(&picker, &before).await;

    // A self-signed certificate naming node-a.
    let n = refusals(&picker, Refusal::UntrustedCertificate);
    let forged =
        ClientAuth { ca: pki.ca.cert_pem(), identity: Some(tls::self_signed(&[tls::agent_san("node-a")]).unwrap()) };
    if let Ok(s) = report(&picker, &forged, attack.clone()).await {
        let replies = tokio::time::timeout(TIMEOUT, s.replies).await.unwrap().unwrap();
        assert!(replies.is_empty());
    }
    counted(&picker, Refusal::UntrustedCertificate, n, 1).await;

    // A certificate from another CA.
    let other = TestCa::new("another CA").unwrap();
    let n = refusals(&picker, Refusal::UntrustedCertificate);
    let foreign = ClientAuth { ca: pki.ca.cert_pem(), identity: Some(other.agent("node-a").unwrap()) };
    let _ = report(&picker, &foreign, attack).await;
    counted(&picker, Refusal::UntrustedCertificate, n, 1).await;
    unchanged(&picker, &before).await;
    picker.shutdown();
}

#[tokio::test]
async fn valid_certificates_only_report_their_own_nodes_pods() {
    let pki = Pki::new();
    let picker = start(&pki, true).await;
    let (a, _b) = real_fleet(&picker, &pki).await;
    let before = routing(&picker);

    // node-c's valid certificate, claiming to be node-a: the Hello is refused, and so is all that follows.
    let c = ClientAuth { ca: pki.ca.cert_pem(), identity: Some(pki.ca.agent("node-c").unwrap()) };
    let (n_cert, n_hello) = (refusals(&picker, Refusal::NodeNotInCertificate), refusals(&picker, Refusal::NoHello));
    let _s1 = report(
        &picker,
        &c,
        vec![
            hello("node-a", vec![info(E0, ROGUE_ADDR)]),
            snapshot(E0, ROGUE_ADDR, 1, &[BlockHash(99)], 1.0),
            delta(E0, 2, &[BlockHash(100)], None),
        ],
    )
    .await
    .unwrap();
    counted(&picker, Refusal::NodeNotInCertificate, n_cert, 1).await;
    counted(&picker, Refusal::NoHello, n_hello, 2).await;

    // node-c as itself: engine-0 is not on node-c; a pod outside the pool is not anyone's.
    let (n_wrong, n_pool) = (refusals(&picker, Refusal::WrongNode), refusals(&picker, Refusal::NotInPool));
    let _s2 = report(
        &picker,
        &c,
        vec![
            hello("node-c", vec![info(E0, ROGUE_ADDR), info("rogue-rank-0", ROGUE_ADDR)]),
            snapshot(E0, ROGUE_ADDR, 1, &[BlockHash(99)], 1.0),
            snapshot("rogue-rank-0", ROGUE_ADDR, 1, &prompt(), 1.0),
        ],
    )
    .await
    .unwrap();
    counted(&picker, Refusal::WrongNode, n_wrong, 2).await;
    counted(&picker, Refusal::NotInPool, n_pool, 2).await;

    // node-b's own, valid agent claiming node-a's pod (the prompt's blocks, offline-computed).
    let b = ClientAuth { ca: pki.ca.cert_pem(), identity: Some(pki.ca.agent("node-b").unwrap()) };
    let n_wrong = refusals(&picker, Refusal::WrongNode);
    let _s3 = report(
        &picker,
        &b,
        vec![
            hello("node-b", vec![info(E1, E1_ADDR), info(E0, E1_ADDR)]),
            snapshot(E0, E1_ADDR, 1, &prompt(), 1.0),
            delta(E0, 2, &prompt(), None),
        ],
    )
    .await
    .unwrap();
    counted(&picker, Refusal::WrongNode, n_wrong, 3).await;
    unchanged(&picker, &before).await;

    // The real agent is still heard: its next delta applies.
    assert!(a.tx.send(delta(E0, 2, &[BlockHash(9)], None)).await.is_ok());
    let grew = || picker.gateway.pool.pods().iter().any(|p| p.name == E0 && p.blocks == 9);
    assert!(poll_until(TIMEOUT, grew).await, "{:?}", picker.gateway.pool.pods());
    picker.shutdown();
}

#[tokio::test]
async fn a_stream_cannot_overwrite_or_drop_another_live_streams_pod() {
    // Without a pool view (every pod in scope), a second stream of the same node: only the live
    // owner's reports count.
    let pki = Pki::new();
    let picker = start(&pki, false).await;
    let (a, _b) = real_fleet(&picker, &pki).await;
    let before = routing(&picker);
    let auth = ClientAuth { ca: pki.ca.cert_pem(), identity: Some(pki.ca.agent("node-a").unwrap()) };

    // Overwrite engine-0's endpoint and blocks, then name it in a Hello and close.
    let n = refusals(&picker, Refusal::OwnedByOtherStream);
    let rogue = report(
        &picker,
        &auth,
        vec![hello("node-a", vec![info(E0, ROGUE_ADDR)]), snapshot(E0, ROGUE_ADDR, 1, &[BlockHash(99)], 1.0)],
    )
    .await
    .unwrap();
    counted(&picker, Refusal::OwnedByOtherStream, n, 2).await;
    unchanged(&picker, &before).await;
    drop(rogue.tx);
    let _ = tokio::time::timeout(TIMEOUT, rogue.replies).await;
    unchanged(&picker, &before).await;
    // engine-0 is still connected and its real agent's deltas still apply.
    assert!(a.tx.send(delta(E0, 2, &[BlockHash(9)], None)).await.is_ok());
    let grew = || picker.gateway.pool.pods().iter().any(|p| p.name == E0 && p.blocks == 9 && p.connected);
    assert!(poll_until(TIMEOUT, grew).await, "{:?}", picker.gateway.pool.pods());

    // Out-of-range stats from the owner itself are refused, not clamped: health stays 1.0.
    let n = refusals(&picker, Refusal::InvalidStats);
    for (seq, bad) in [(3, 5.0), (4, f64::INFINITY), (5, -0.5)] {
        assert!(a.tx.send(delta(E0, seq, &[], Some(stats(bad)))).await.is_ok());
    }
    counted(&picker, Refusal::InvalidStats, n, 3).await;
    assert!(picker.gateway.pool.sync().await.is_ok());
    let e0 = picker.gateway.pool.pods().into_iter().find(|p| p.name == E0).unwrap();
    assert_eq!(e0.health_score, 1.0);

    // Once the owner's stream ends, the pod may be claimed again (an agent reconnecting).
    drop(a.tx);
    let _ = tokio::time::timeout(TIMEOUT, a.replies).await;
    let again = report(
        &picker,
        &auth,
        vec![hello("node-a", vec![info(E0, E0_ADDR)]), snapshot(E0, E0_ADDR, 1, &prompt(), 1.0)],
    )
    .await
    .unwrap();
    let back = || picker.gateway.pool.pods().iter().any(|p| p.name == E0 && p.connected && p.blocks == 8);
    assert!(poll_until(TIMEOUT, back).await, "{:?}", picker.gateway.pool.pods());
    drop(again);
    picker.shutdown();
}

#[tokio::test]
async fn a_flood_of_pod_names_is_capped_and_real_pods_still_register() {
    let pki = Pki::new();
    let picker = start(&pki, false).await;
    let _fleet = real_fleet(&picker, &pki).await;
    let before = routing(&picker);
    let auth = ClientAuth { ca: pki.ca.cert_pem(), identity: Some(pki.ca.agent("node-z").unwrap()) };
    let n = refusals(&picker, Refusal::StreamPodCap);
    let names: Vec<PodInfo> = (0..65_536).map(|i| info(&format!("flood-{i}-rank-0"), ROGUE_ADDR)).collect();
    let _flood = report(&picker, &auth, vec![hello("node-z", names)]).await.unwrap();
    let cap = kvroute_picker::ingest::guard::DEFAULT_MAX_PODS_PER_STREAM as u64;
    counted(&picker, Refusal::StreamPodCap, n, 65_536 - cap).await;
    assert!(picker.gateway.pool.sync().await.is_ok());
    assert_eq!(picker.gateway.pool.pods().len() as u64, 2 + cap, "only the stream's cap got in (unready)");
    // The flooded names are not ready (no stats): routing is as before.
    assert_eq!(routing(&picker).0, before.0);
    assert_eq!(routing(&picker).1, before.1);

    // A real pod still registers.
    let late = ClientAuth { ca: pki.ca.cert_pem(), identity: Some(pki.ca.agent("node-d").unwrap()) };
    let _d = report(
        &picker,
        &late,
        vec![
            hello("node-d", vec![info("late-rank-0", "10.0.0.4:8000")]),
            snapshot("late-rank-0", "10.0.0.4:8000", 1, &[], 1.0),
        ],
    )
    .await
    .unwrap();
    let joined = || picker.gateway.pool.pods().iter().any(|p| p.name == "late-rank-0" && p.ready);
    assert!(poll_until(TIMEOUT, joined).await);
    picker.shutdown();
}

#[tokio::test]
async fn rotated_certificates_apply_to_new_connections() {
    let pki = Pki::new();
    let picker = start(&pki, false).await;
    let old_agent = ClientAuth { ca: pki.ca.cert_pem(), identity: Some(pki.ca.agent("node-a").unwrap()) };
    let before = report(&picker, &old_agent, vec![hello("node-a", vec![info(E0, E0_ADDR)])]).await;
    assert!(before.is_ok());
    let seen = || picker.gateway.pool.pods().iter().any(|p| p.name == E0);
    assert!(poll_until(TIMEOUT, seen).await);

    // The CA and the picker's certificate rotate in place (as a Secret update does).
    let ca2 = TestCa::new("rotated CA").unwrap();
    std::fs::write(&pki.ca_file, ca2.cert_pem()).unwrap();
    tls::write(pki.path(), "picker", &ca2.picker().unwrap()).unwrap();
    tokio::time::sleep(kvroute_picker::ingest::tls::RELOAD_CHECK + Duration::from_millis(200)).await;

    // Old-CA agents are now refused; new-CA agents are served with the new picker certificate.
    let n = refusals(&picker, Refusal::UntrustedCertificate);
    let stale = ClientAuth { ca: ca2.cert_pem(), identity: Some(pki.ca.agent("node-b").unwrap()) };
    let _ = report(&picker, &stale, vec![hello("node-b", vec![info(E1, E1_ADDR)])]).await;
    counted(&picker, Refusal::UntrustedCertificate, n, 1).await;
    let fresh = ClientAuth { ca: ca2.cert_pem(), identity: Some(ca2.agent("node-b").unwrap()) };
    let _b = report(&picker, &fresh, vec![hello("node-b", vec![info(E1, E1_ADDR)])]).await.unwrap();
    let joined = || picker.gateway.pool.pods().iter().any(|p| p.name == E1);
    assert!(poll_until(TIMEOUT, joined).await, "{:?}", picker.gateway.pool.pods());
    // An agent that still trusts only the old CA does not accept the new picker certificate.
    let distrustful = ClientAuth { ca: pki.ca.cert_pem(), identity: Some(ca2.agent("node-c").unwrap()) };
    assert!(report(&picker, &distrustful, vec![]).await.is_err());
    picker.shutdown();
}

#[tokio::test]
async fn ext_proc_serves_tls_when_configured() {
    let pki = Pki::new();
    let server = tls::write(pki.path(), "ext-proc", &pki.ca.picker().unwrap()).unwrap();
    let yaml = format!(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\ninsecure_ingest: true\n\
         ext_proc_tls: {{cert_file: {}, key_file: {}}}\n",
        server.cert.display(),
        server.key.display()
    );
    let picker = kvroute_picker::start(&PickerConfig::from_yaml(&yaml).unwrap()).await.unwrap();
    // A TLS client (no client certificate, as Envoy's UpstreamTlsContext) gets SERVING.
    let config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(pki.ca.cert_pem()))
        .domain_name(tls::PICKER_SERVER_NAME);
    let channel = Endpoint::from_shared(format!("https://{}", picker.ext_proc_addr))
        .unwrap()
        .tls_config(config)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = health.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.unwrap();
    assert_eq!(status.into_inner().status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
    // Plaintext h2c is not served there.
    let plain = Endpoint::from_shared(format!("http://{}", picker.ext_proc_addr)).unwrap().connect().await;
    let refused = match plain {
        Err(_) => true,
        Ok(ch) => tonic_health::pb::health_client::HealthClient::new(ch)
            .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
            .await
            .is_err(),
    };
    assert!(refused, "plaintext answered on the TLS ext_proc port");
    picker.shutdown();
}

/// A `ReplicaSync` subscription to `picker` over TLS with `identity`: the first message, or the
/// refusal.
async fn subscribe_replica(picker: &RunningPicker, ca: &str, identity: &Pem) -> Result<(), tonic::Status> {
    use kvroute_proto::replica::v1::SubscribeRequest;
    use kvroute_proto::replica::v1::replica_sync_client::ReplicaSyncClient;
    let config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name(tls::PICKER_SERVER_NAME)
        .identity(Identity::from_pem(&identity.cert, &identity.key));
    let endpoint =
        Endpoint::from_shared(format!("https://{}", picker.ingest_addr)).unwrap().tls_config(config).unwrap();
    let channel = endpoint.connect().await.map_err(|e| tonic::Status::unavailable(format!("{e:?}")))?;
    let mut client = ReplicaSyncClient::new(channel);
    let req = SubscribeRequest { replica_id: "test-subscriber".into(), protocol_version: 1 };
    let mut stream = client.subscribe(req).await?.into_inner();
    stream.message().await.map(|_| ())
}

/// docs/design.md §14: ReplicaSync rides the ingest listener's mTLS. Two replicas with picker
/// certificates follow each other and share decisions; an agent's valid certificate cannot
/// subscribe (it would read every routing decision), and is counted as `not_a_replica`.
#[tokio::test]
async fn replica_peers_authenticate_with_picker_certificates() {
    let pki = Pki::new();
    let a = start_as(&pki, true, "picker-a").await;
    let b = start_as(&pki, true, "picker-b").await;
    let _fleet_a = real_fleet(&a, &pki).await;
    let _fleet_b = real_fleet(&b, &pki).await;
    b.replica_peers.send(vec![a.ingest_addr]).unwrap();
    let following = || b.replica.counters.connected.load(std::sync::atomic::Ordering::Relaxed) == 1;
    assert!(poll_until(TIMEOUT, following).await, "replica b never followed a over mTLS");
    assert_eq!(refusals(&a, Refusal::NotAReplica), 0);

    // A decision on a reaches b as a pending chain on the same pod.
    let hashes = prompt();
    let req = RouteRequest { model: MODEL, adapter: None, block_hashes: &hashes, subset: None };
    let applied = b.replica.counters.applied.load(std::sync::atomic::Ordering::Relaxed);
    let d = a.gateway.router.route(&req).unwrap();
    assert_eq!(d.pod, E0);
    let shared = || b.replica.counters.applied.load(std::sync::atomic::Ordering::Relaxed) > applied;
    assert!(poll_until(TIMEOUT, shared).await, "a's decision never reached b");
    drop(d);

    // An agent's certificate (valid, same CA) is refused at the service.
    let n = refusals(&a, Refusal::NotAReplica);
    let agent = pki.ca.agent("node-a").unwrap();
    let refused = subscribe_replica(&a, &pki.ca.cert_pem(), &agent).await;
    assert_eq!(refused.map_err(|s| s.code()), Err(tonic::Code::Unauthenticated));
    counted(&a, Refusal::NotAReplica, n, 1).await;
    // A self-signed picker certificate does not pass the handshake.
    let n = refusals(&a, Refusal::UntrustedCertificate);
    let forged = tls::self_signed(&[tls::PICKER_SERVER_NAME.to_string()]).unwrap();
    assert!(subscribe_replica(&a, &pki.ca.cert_pem(), &forged).await.is_err());
    counted(&a, Refusal::UntrustedCertificate, n, 1).await;
    // Another picker certificate of the CA is served.
    assert!(subscribe_replica(&a, &pki.ca.cert_pem(), &pki.ca.picker().unwrap()).await.is_ok());
    a.shutdown();
    b.shutdown();
}

/// An EndpointSlice of the replicas' headless Service `service` holding one replica, `addr`, on
/// the port named `ingest` (one slice per replica: in-process replicas share 127.0.0.1).
fn replica_slice(service: &str, name: &str, addr: SocketAddr) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            labels: Some([("kubernetes.io/service-name".to_string(), service.to_string())].into()),
            ..Default::default()
        },
        address_type: "IPv4".into(),
        endpoints: vec![K8sEndpoint { addresses: vec![addr.ip().to_string()], ..Default::default() }],
        ports: Some(vec![EndpointPort {
            name: Some("ingest".into()),
            port: Some(i32::from(addr.port())),
            ..Default::default()
        }]),
    }
}

/// docs/design.md §4 "One view across replicas", on Kubernetes: two replicas that learn of each
/// other only from their headless Service's EndpointSlices (the API stand-in, real kube-rs watch)
/// follow each other over mTLS, a decision on one shows on the other as a peer request in flight
/// and a pending chain, and a replica removed from the slices is dropped: the subscription ends
/// and its requests in flight are forgotten, without restarting anything.
#[tokio::test]
async fn replicas_find_each_other_through_the_service_endpoint_slices() {
    use kvroute_picker::replicas::follow_service;
    use std::sync::atomic::Ordering::Relaxed;
    const SERVICE: &str = "kvroute-picker-peers";
    let pki = Pki::new();
    let a = start_as(&pki, true, "picker-a").await;
    let b = start_as(&pki, true, "picker-b").await;
    let _fleet_a = real_fleet(&a, &pki).await;
    let _fleet_b = real_fleet(&b, &pki).await;
    let server = ApiServer::start().await.unwrap();
    server.create(&replica_slice(SERVICE, "peers-a", a.ingest_addr)).unwrap();
    server.create(&replica_slice(SERVICE, "peers-b", b.ingest_addr)).unwrap();
    let (_stop, stop) = tokio::sync::watch::channel(false);
    for p in [&a, &b] {
        let view = kvroute_cluster::watch_picker_replicas(server.client("ns").unwrap(), "ns", SERVICE, Some("ingest"));
        tokio::spawn(follow_service(view, vec![p.ingest_addr], None, p.replica_peers.clone(), stop.clone()));
    }
    // Each follows the other, not itself.
    let following = || [&a, &b].iter().all(|p| p.replica.counters.connected.load(Relaxed) == 1);
    assert!(poll_until(TIMEOUT, following).await, "the replicas never followed each other from the slices");
    assert_eq!(*a.replica_peers.borrow(), [b.ingest_addr]);
    assert_eq!(*b.replica_peers.borrow(), [a.ingest_addr]);

    // A decision on a for the prompt and 4 blocks more: b counts a peer request in flight on E0
    // and holds a's pending chain (the 4 blocks E0 does not hold yet).
    let hashes: Vec<BlockHash> = (1..=12).map(BlockHash).collect();
    let req = RouteRequest { model: MODEL, adapter: None, block_hashes: &hashes, subset: None };
    let d = a.gateway.router.route(&req).unwrap();
    assert_eq!(d.pod, E0);
    let in_flight = |p: &RunningPicker| p.gateway.router.shared().lock().peers.len();
    assert!(poll_until(TIMEOUT, || in_flight(&b) == 1).await, "a's decision never reached b");
    let peer_chains: Vec<usize> = b
        .gateway
        .router
        .shared()
        .lock()
        .pending
        .chains()
        .filter(|(_, _, origin)| *origin != kvroute_picker::pending::LOCAL)
        .map(|(_, chain, _)| chain.len())
        .collect();
    assert_eq!(peer_chains, [4], "b does not hold a's pending chain");
    assert_eq!(in_flight(&a), 0, "a counts its own decision as a peer's");

    // a leaves the Service: b drops it (the subscription ends, a's request in flight is forgotten)
    // while a, still listing b, keeps following it.
    server.delete::<EndpointSlice>("ns", "peers-a").unwrap();
    assert!(poll_until(TIMEOUT, || b.replica_peers.borrow().is_empty()).await, "b kept a as a peer");
    assert!(poll_until(TIMEOUT, || b.replica.counters.connected.load(Relaxed) == 0).await, "b still follows a");
    assert!(poll_until(TIMEOUT, || in_flight(&b) == 0).await, "b kept a's request in flight");
    assert_eq!(a.replica.counters.connected.load(Relaxed), 1, "a stopped following b");
    drop(d);
    a.shutdown();
    b.shutdown();
}
