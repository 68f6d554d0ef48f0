//! Agent identity from ServiceAccount tokens (docs/design.md §14, "Trust"), end to end: a picker
//! with `agent_auth: token` asks the API stand-in's TokenReview (real kube-rs client, real wire
//! format) who holds each stream's token. Rogue streams are refused and counted in
//! `epp_ingest_refusals_total{reason}` and leave routing exactly as it was; an API outage refuses
//! new streams while open ones go on. The last test runs the real agent against the picker
//! through a CA rotation (trust bundle overlap).
//!
//! The pool view holds `engine-0` on node-a (with the prompt's blocks) and `engine-1` on node-b;
//! the agents' pods `agent-a` (node-a) and `agent-b` (node-b) exist in the stand-in, so tokens
//! bound to them authenticate.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{E0, E0_ADDR, E1, E1_ADDR, ROGUE_ADDR, prompt};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kvroute_cluster::PoolView;
use kvroute_common::BlockHash;
use kvroute_harness::fake_agent::poll_until;
use kvroute_harness::tls::{self, Pem, TestCa};
use kvroute_kube_stand_in::{ApiServer, BoundPod, TokenSpec};
use kvroute_picker::RunningPicker;
use kvroute_picker::config::PickerConfig;
use kvroute_picker::ingest::Refusal;
use kvroute_picker::score::RouteRequest;
use kvroute_proto::agent::v1::agent_ingest_client::AgentIngestClient;
use kvroute_proto::agent::v1::{
    AgentMessage, BlockChanges, BlockRun, Hello, PodDelta, PodInfo, PodSnapshot, PodStats, agent_message,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

const NS: &str = "ns";
const AGENT_SA: &str = "kvroute-agent";
const AUDIENCE: &str = "kvroute-picker";
const MODEL: &str = "m";
const TIMEOUT: Duration = Duration::from_secs(10);

fn pool_view() -> PoolView {
    common::two_node_pool_view(NS)
}

/// The stand-in with the agents' pods, a CA, and the picker's files.
struct Cluster {
    dir: tempfile::TempDir,
    ca: TestCa,
    api: ApiServer,
    /// Pod name → uid, as the stand-in assigned them.
    uids: std::collections::HashMap<String, String>,
}

impl Cluster {
    async fn new() -> Cluster {
        let api = ApiServer::start().await.unwrap();
        let mut uids = std::collections::HashMap::new();
        for (name, node) in [("agent-a", "node-a"), ("agent-b", "node-b")] {
            let pod = Pod {
                metadata: ObjectMeta { name: Some(name.into()), namespace: Some(NS.into()), ..Default::default() },
                spec: Some(PodSpec { node_name: Some(node.into()), ..Default::default() }),
                ..Default::default()
            };
            let created = api.create(&pod).unwrap();
            uids.insert(name.to_string(), created.metadata.uid.unwrap());
        }
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new("token test CA").unwrap();
        std::fs::write(dir.path().join("ca.crt"), ca.cert_pem()).unwrap();
        Cluster { dir, ca, api, uids }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A token of the agents' ServiceAccount for the picker, bound to `pod` on `node`.
    fn token(&self, pod: &str, node: &str) -> String {
        self.api.issue_token(TokenSpec::pod_bound(NS, AGENT_SA, AUDIENCE, pod, &self.uids[pod], node))
    }

    /// `token` with `change` applied to its spec first.
    fn token_with(&self, pod: &str, node: &str, change: impl FnOnce(&mut TokenSpec)) -> String {
        let mut spec = TokenSpec::pod_bound(NS, AGENT_SA, AUDIENCE, pod, &self.uids[pod], node);
        change(&mut spec);
        self.api.issue_token(spec)
    }

    /// A picker with token identity on 127.0.0.1, its certificate from `cert_ca`, reviewing
    /// through the stand-in; `ingest_addr` pins the port (a restart on the same address).
    async fn picker(&self, cert_ca: &TestCa, ingest_addr: &str) -> RunningPicker {
        let picker = tls::write(self.path(), "picker", &cert_ca.picker().unwrap()).unwrap();
        let yaml = format!(
            "ext_proc_addr: 127.0.0.1:0\ningest_addr: {ingest_addr}\nadmin_addr: 127.0.0.1:0\n\
             ingest_tls: {{ca_file: {}, cert_file: {}, key_file: {}}}\n\
             agent_auth: token\nagent_token: {{service_account_namespace: {NS}, review_timeout_ms: 1000}}\n",
            self.path().join("ca.crt").display(),
            picker.cert.display(),
            picker.key.display()
        );
        let config = PickerConfig::from_yaml(&yaml).unwrap();
        config.validate().unwrap();
        let scope: Arc<dyn kvroute_picker::ingest::ReportScope> = Arc::new(pool_view());
        kvroute_picker::start_with_kube(&config, Some(scope), Some(self.api.client(NS).unwrap())).await.unwrap()
    }
}

/// An open report stream: messages go in through `tx`.
struct Stream {
    tx: mpsc::Sender<AgentMessage>,
    _replies: tokio::task::JoinHandle<()>,
}

/// Opens a report stream over TLS (trusting `ca`) with `token` as bearer, and `identity` as
/// client certificate when given.
async fn open_with(
    picker: &RunningPicker,
    ca: &str,
    token: Option<&str>,
    identity: Option<&Pem>,
) -> Result<Stream, tonic::Status> {
    let mut config =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)).domain_name(tls::PICKER_SERVER_NAME);
    if let Some(id) = identity {
        config = config.identity(Identity::from_pem(&id.cert, &id.key));
    }
    let endpoint =
        Endpoint::from_shared(format!("https://{}", picker.ingest_addr)).unwrap().tls_config(config).unwrap();
    let channel = endpoint.connect().await.map_err(|e| tonic::Status::unavailable(format!("connect: {e:?}")))?;
    let mut client = AgentIngestClient::new(channel);
    let (tx, rx) = mpsc::channel(1024);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    if let Some(t) = token {
        request.metadata_mut().insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let mut inbound = client.report(request).await?.into_inner();
    let replies = tokio::spawn(async move { while let Ok(Some(_)) = inbound.message().await {} });
    Ok(Stream { tx, _replies: replies })
}

async fn open(c: &Cluster, picker: &RunningPicker, token: Option<&str>) -> Result<Stream, tonic::Status> {
    open_with(picker, &c.ca.cert_pem(), token, None).await
}

/// Opens a stream with `token` and sends `msgs`; the stream stays open while the value lives.
async fn report(c: &Cluster, picker: &RunningPicker, token: &str, msgs: Vec<AgentMessage>) -> Stream {
    let s = open(c, picker, Some(token)).await.unwrap();
    for m in msgs {
        s.tx.send(m).await.unwrap();
    }
    s
}

fn info(pod: &str, endpoint: &str) -> PodInfo {
    PodInfo { pod: pod.into(), endpoint: endpoint.into(), model: MODEL.into(), block_size: 16, ..Default::default() }
}

fn stats() -> PodStats {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    PodStats { observed_at_unix_ms: now, kv_cache_usage: 0.1, health_score: 1.0, ready: true, ..Default::default() }
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

fn snapshot(pod: &str, endpoint: &str, blocks: &[BlockHash]) -> AgentMessage {
    AgentMessage {
        msg: Some(agent_message::Msg::Snapshot(PodSnapshot {
            info: Some(info(pod, endpoint)),
            seq: 1,
            stats: Some(stats()),
            blocks: vec![BlockRun { parent: 0, hashes: blocks.iter().map(|h| h.0).collect() }],
            offloaded_blocks: Vec::new(),
        })),
    }
}

fn delta(pod: &str, seq: u64, stored: &[BlockHash]) -> AgentMessage {
    AgentMessage {
        msg: Some(agent_message::Msg::Delta(PodDelta {
            pod: pod.into(),
            seq,
            blocks: Some(BlockChanges {
                cleared: false,
                stored: vec![BlockRun { parent: 0, hashes: stored.iter().map(|h| h.0).collect() }],
                removed: vec![],
            }),
            stats: None,
            offloaded: None,
        })),
    }
}

type Routing = (Option<String>, Vec<(String, String, u32)>, Vec<(String, String, bool)>);

fn routing(picker: &RunningPicker) -> Routing {
    let hashes = prompt();
    let req = RouteRequest { model: MODEL, adapter: None, block_hashes: &hashes, subset: None };
    let ex = picker.gateway.router.explain(&req);
    let candidates =
        ex.candidates.iter().map(|c| (c.pod.to_string(), c.endpoint.to_string(), c.matched_blocks)).collect();
    let mut pods: Vec<_> = picker.gateway.pool.pods().into_iter().map(|p| (p.name, p.endpoint, p.connected)).collect();
    pods.sort();
    (ex.choice, candidates, pods)
}

fn refusals(picker: &RunningPicker, reason: Refusal) -> u64 {
    kvroute_picker::ingest::Refusals::new(picker.gateway.metrics.ingest_refusals.clone()).count(reason)
}

async fn counted(picker: &RunningPicker, reason: Refusal, before: u64, n: u64) {
    let ok = poll_until(TIMEOUT, || refusals(picker, reason) >= before + n).await;
    assert!(ok, "{reason:?}: {} refusals, expected {before} + {n}", refusals(picker, reason));
}

async fn unchanged(picker: &RunningPicker, before: &Routing) {
    assert!(picker.gateway.pool.sync().await.is_ok());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(picker.gateway.pool.sync().await.is_ok());
    assert_eq!(&routing(picker), before);
}

/// node-a's agent reports engine-0 (the prompt's blocks), node-b's engine-1. node-b's token
/// carries no node-name (an API server before 1.30): the picker reads the pod's node.
async fn real_fleet(c: &Cluster, picker: &RunningPicker) -> (Stream, Stream) {
    let a = report(
        c,
        picker,
        &c.token("agent-a", "node-a"),
        vec![hello("node-a", vec![info(E0, E0_ADDR)]), snapshot(E0, E0_ADDR, &prompt())],
    )
    .await;
    let b_token = c.token_with("agent-b", "node-b", |s| s.node = None);
    let b =
        report(c, picker, &b_token, vec![hello("node-b", vec![info(E1, E1_ADDR)]), snapshot(E1, E1_ADDR, &[])]).await;
    let up = || {
        let pods = picker.gateway.pool.pods();
        pods.len() == 2 && pods.iter().all(|p| p.ready && p.connected)
    };
    assert!(poll_until(TIMEOUT, up).await, "real fleet never came up: {:?}", picker.gateway.pool.pods());
    assert_eq!(routing(picker).0.as_deref(), Some(E0));
    (a, b)
}

#[tokio::test]
async fn tokens_that_do_not_prove_the_node_are_refused() {
    let c = Cluster::new().await;
    let picker = c.picker(&c.ca, "127.0.0.1:0").await;
    let (_a, _b) = real_fleet(&c, &picker).await;
    let before = routing(&picker);
    let attack = || vec![hello("node-a", vec![info(E0, ROGUE_ADDR)]), snapshot(E0, ROGUE_ADDR, &[BlockHash(99)])];

    // No token at all.
    let n = refusals(&picker, Refusal::NoToken);
    assert_eq!(open(&c, &picker, None).await.err().map(|s| s.code()), Some(tonic::Code::Unauthenticated));
    counted(&picker, Refusal::NoToken, n, 1).await;

    // Tokens TokenReview does not authenticate for the picker: another audience (the API
    // server's), expired, unknown, and one whose pod-uid is not the pod's (the stand-in, as the
    // real server, checks the bound pod).
    let wrong_audience = c.token_with("agent-a", "node-a", |s| {
        s.audiences = vec![kvroute_kube_stand_in::apiserver::tokens::API_AUDIENCE.into()]
    });
    let expired = c.token_with("agent-a", "node-a", |s| s.expires_at = SystemTime::now() - Duration::from_secs(1));
    let stale_uid = c.token_with("agent-a", "node-a", |s| {
        s.pod = Some(BoundPod { name: "agent-a".into(), uid: "uid-of-an-earlier-agent-a".into() });
        s.node = None;
    });
    let n = refusals(&picker, Refusal::TokenRejected);
    for t in [wrong_audience.as_str(), expired.as_str(), "not-a-token", stale_uid.as_str()] {
        let refused = open(&c, &picker, Some(t)).await.err().map(|s| s.code());
        assert_eq!(refused, Some(tonic::Code::Unauthenticated), "{t}");
    }
    counted(&picker, Refusal::TokenRejected, n, 4).await;

    // Another ServiceAccount's token, bound to a pod on node-a; a token bound to no pod.
    let n = refusals(&picker, Refusal::WrongServiceAccount);
    let other_sa = c.token_with("agent-a", "node-a", |s| s.service_account = "default".into());
    assert!(open(&c, &picker, Some(&other_sa)).await.is_err());
    counted(&picker, Refusal::WrongServiceAccount, n, 1).await;
    let n = refusals(&picker, Refusal::TokenNotPodBound);
    let unbound = c.token_with("agent-a", "node-a", |s| {
        s.pod = None;
        s.node = None;
    });
    assert!(open(&c, &picker, Some(&unbound)).await.is_err());
    counted(&picker, Refusal::TokenNotPodBound, n, 1).await;
    unchanged(&picker, &before).await;

    // node-a's valid token claiming node-b: the Hello is refused, and so is all that follows.
    let (n_node, n_hello) = (refusals(&picker, Refusal::NodeNotInToken), refusals(&picker, Refusal::NoHello));
    let _s1 = report(
        &c,
        &picker,
        &c.token("agent-a", "node-a"),
        vec![hello("node-b", vec![info(E1, ROGUE_ADDR)]), snapshot(E1, ROGUE_ADDR, &prompt())],
    )
    .await;
    counted(&picker, Refusal::NodeNotInToken, n_node, 1).await;
    counted(&picker, Refusal::NoHello, n_hello, 1).await;

    // node-a's valid token, as itself, reporting node-b's pod: out of its node's scope.
    let n = refusals(&picker, Refusal::WrongNode);
    let _s2 = report(
        &c,
        &picker,
        &c.token("agent-a", "node-a"),
        vec![hello("node-a", vec![info(E1, ROGUE_ADDR)]), snapshot(E1, ROGUE_ADDR, &prompt())],
    )
    .await;
    counted(&picker, Refusal::WrongNode, n, 2).await;

    // A second stream of node-a (same token) cannot take over the live stream's pod.
    let n = refusals(&picker, Refusal::OwnedByOtherStream);
    let _s3 = report(&c, &picker, &c.token("agent-a", "node-a"), attack()).await;
    counted(&picker, Refusal::OwnedByOtherStream, n, 2).await;
    unchanged(&picker, &before).await;
    picker.shutdown();
}

#[tokio::test]
async fn an_api_outage_refuses_new_streams_and_keeps_open_ones() {
    let c = Cluster::new().await;
    let picker = c.picker(&c.ca, "127.0.0.1:0").await;
    let a_token = c.token("agent-a", "node-a");
    let a =
        report(&c, &picker, &a_token, vec![hello("node-a", vec![info(E0, E0_ADDR)]), snapshot(E0, E0_ADDR, &prompt())])
            .await;
    assert!(poll_until(TIMEOUT, || picker.gateway.pool.pods().iter().any(|p| p.name == E0 && p.ready)).await);
    let fresh = c.token("agent-b", "node-b");
    let reviews = c.api.token_reviews();

    // The API server stops answering: a new token cannot be verified, the stream is refused as
    // unavailable (the agent retries) and counted.
    c.api.store().pause();
    let n = refusals(&picker, Refusal::TokenReviewUnavailable);
    let refused = open(&c, &picker, Some(&fresh)).await.err().map(|s| s.code());
    assert_eq!(refused, Some(tonic::Code::Unavailable));
    counted(&picker, Refusal::TokenReviewUnavailable, n, 1).await;
    // The open stream goes on: its next delta applies.
    a.tx.send(delta(E0, 2, &[BlockHash(9)])).await.unwrap();
    let grew = || picker.gateway.pool.pods().iter().any(|p| p.name == E0 && p.blocks == 9 && p.connected);
    assert!(poll_until(TIMEOUT, grew).await, "{:?}", picker.gateway.pool.pods());
    // A reconnect with the token reviewed before the outage is served from the cache.
    assert!(open(&c, &picker, Some(&a_token)).await.is_ok());

    // Back: the new token is reviewed and accepted.
    c.api.store().resume();
    assert!(open(&c, &picker, Some(&fresh)).await.is_ok());
    assert!(c.api.token_reviews() > reviews);
    picker.shutdown();
}

/// ReplicaSync keeps its identity scheme under token identity: a picker certificate is required
/// (client certificates are optional at the handshake, so the service checks).
#[tokio::test]
async fn replicas_still_need_a_picker_certificate() {
    use kvroute_proto::replica::v1::SubscribeRequest;
    use kvroute_proto::replica::v1::replica_sync_client::ReplicaSyncClient;
    let c = Cluster::new().await;
    let picker = c.picker(&c.ca, "127.0.0.1:0").await;
    let subscribe = |identity: Option<Pem>| {
        let addr = picker.ingest_addr;
        let ca = c.ca.cert_pem();
        async move {
            let mut config =
                ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)).domain_name(tls::PICKER_SERVER_NAME);
            if let Some(id) = identity {
                config = config.identity(Identity::from_pem(id.cert, id.key));
            }
            let channel = Endpoint::from_shared(format!("https://{addr}"))
                .unwrap()
                .tls_config(config)
                .unwrap()
                .connect()
                .await
                .unwrap();
            let req = SubscribeRequest { replica_id: "other".into(), protocol_version: 1 };
            let mut stream = ReplicaSyncClient::new(channel).subscribe(req).await?.into_inner();
            stream.message().await.map(|_| ())
        }
    };
    let n = refusals(&picker, Refusal::NotAReplica);
    assert_eq!(subscribe(None).await.map_err(|s| s.code()), Err(tonic::Code::Unauthenticated));
    counted(&picker, Refusal::NotAReplica, n, 1).await;
    assert!(subscribe(Some(c.ca.picker().unwrap())).await.is_ok());
    picker.shutdown();
}

/// Waits until `agent` has `n` picker streams open.
async fn connected(agent: &kvroute_agent::app::RunningAgent, n: i64) -> bool {
    poll_until(Duration::from_secs(20), || agent.metrics.pickers_connected.get() == n).await
}

/// A real agent with token identity, trusting the CA bundle in `ca_file`, reporting to `picker`.
async fn agent(picker: &RunningPicker, ca_file: &Path, token_file: &Path) -> kvroute_agent::app::RunningAgent {
    let yaml = format!(
        "node_name: node-a\npickers: [\"https://{}\"]\nmetrics_addr: 127.0.0.1:0\n\
         picker_tls: {{ca_file: {}}}\npicker_token: {{token_file: {}}}\n\
         engines: [{{pod: engine-0, endpoint: \"127.0.0.1:9\", model: {MODEL}}}]\n",
        picker.ingest_addr,
        ca_file.display(),
        token_file.display()
    );
    let config: kvroute_agent::config::AgentConfig = serde_norway::from_str(&yaml).unwrap();
    let scenario = format!("{}/../agent/scenarios/healthy.yaml", env!("CARGO_MANIFEST_DIR"));
    let gpu = Arc::new(kvroute_agent::gpu::mock::MockGpuSource::from_file(&scenario).unwrap());
    kvroute_agent::app::start(config, gpu).await.unwrap()
}

/// docs/operations.md "Rotating the picker CA": agents trust a bundle of the old and the new CA
/// while the picker's certificate moves from the old CA to the new one; then the old CA leaves the
/// bundle. The real agent reads its bundle and its (rotated) token file on every connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_ca_rotates_with_a_trust_bundle_overlap() {
    let c = Cluster::new().await;
    let old = &c.ca;
    let new = TestCa::new("rotated CA").unwrap();
    let bundle: PathBuf = c.path().join("agent-ca.crt");
    let token_file = c.path().join("token");
    std::fs::write(&bundle, format!("{}{}", old.cert_pem(), new.cert_pem())).unwrap();
    std::fs::write(&token_file, c.token("agent-a", "node-a")).unwrap();

    // 1. Old+new bundle, picker certificate from the old CA.
    let picker = c.picker(old, "127.0.0.1:0").await;
    let addr = picker.ingest_addr.to_string();
    let a1 = agent(&picker, &bundle, &token_file).await;
    assert!(connected(&a1, 1).await, "the bundle does not admit the old CA's picker");
    a1.shutdown().await;

    // 2. The picker's certificate comes from the new CA (reloaded for new connections); the
    //    kubelet rewrote the token, and the old one is revoked.
    tls::write(c.path(), "picker", &new.picker().unwrap()).unwrap();
    tokio::time::sleep(kvroute_picker::ingest::tls::RELOAD_CHECK + Duration::from_millis(300)).await;
    let old_token = std::fs::read_to_string(&token_file).unwrap();
    std::fs::write(&token_file, c.token("agent-a", "node-a")).unwrap();
    c.api.revoke_token(&old_token);
    let a2 = agent(&picker, &bundle, &token_file).await;
    assert!(connected(&a2, 1).await, "the bundle does not admit the new CA's picker");
    a2.shutdown().await;

    // 3. The old CA leaves the bundle: new-only agents connect; an agent still trusting only the
    //    old CA does not accept the picker's certificate any more.
    std::fs::write(&bundle, new.cert_pem()).unwrap();
    let a3 = agent(&picker, &bundle, &token_file).await;
    assert!(connected(&a3, 1).await, "the new CA alone does not admit the picker");
    a3.shutdown().await;
    let token = std::fs::read_to_string(&token_file).unwrap();
    assert!(open_with(&picker, &old.cert_pem(), Some(&token), None).await.is_err());
    assert_eq!(picker.ingest_addr.to_string(), addr);
    picker.shutdown();
}

/// The binary as deployed: `--pool-name` (a Kubernetes pool, so token identity by default),
/// `--ingest-tls-dir` holding the Secret's three files, the client from a kubeconfig naming the
/// stand-in, which also answers the TokenReviews. A token-less stream is refused and counted in
/// `/metrics`; the agent pod's token opens one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_binary_defaults_to_token_identity_on_kubernetes() {
    use kvroute_cluster::crd::{InferencePool, InferencePoolSpec, PoolPort, PoolSelector};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let c = Cluster::new().await;
    c.api.register::<InferencePool>();
    let mut pool = InferencePool::new(
        "qwen",
        InferencePoolSpec {
            selector: PoolSelector { match_labels: [("app".to_string(), "vllm".to_string())].into() },
            target_ports: vec![PoolPort { number: 8000 }],
            app_protocol: None,
            endpoint_picker_ref: None,
        },
    );
    pool.metadata.namespace = Some(NS.into());
    c.api.create(&pool).unwrap();
    let tls_dir = c.path().join("ingest-tls");
    std::fs::create_dir_all(&tls_dir).unwrap();
    let picker_pem = c.ca.picker().unwrap();
    std::fs::write(tls_dir.join("ca.crt"), c.ca.cert_pem()).unwrap();
    std::fs::write(tls_dir.join("tls.crt"), &picker_pem.cert).unwrap();
    std::fs::write(tls_dir.join("tls.key"), &picker_pem.key).unwrap();
    let kubeconfig = c.path().join("kubeconfig");
    std::fs::write(&kubeconfig, c.api.kubeconfig(NS)).unwrap();
    let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (ext_proc, ingest, admin) = (port(), port(), port());
    let config = c.path().join("picker.yaml");
    std::fs::write(
        &config,
        format!(
            "ext_proc_addr: 127.0.0.1:{ext_proc}\ningest_addr: 127.0.0.1:{ingest}\nadmin_addr: 127.0.0.1:{admin}\n"
        ),
    )
    .unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvroute-picker"))
        .arg("--config")
        .arg(&config)
        .args(["--pool-name", "qwen", "--pool-namespace", NS, "--ingest-tls-dir"])
        .arg(&tls_dir)
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(c.path().join("picker.log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await.expect("READY in time");
    assert_eq!(ready.unwrap().as_deref(), Some("READY"));

    let open_plain = |token: Option<String>| {
        let ca = c.ca.cert_pem();
        async move {
            let config =
                ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)).domain_name(tls::PICKER_SERVER_NAME);
            let channel = Endpoint::from_shared(format!("https://127.0.0.1:{ingest}"))
                .unwrap()
                .tls_config(config)
                .unwrap()
                .connect()
                .await
                .unwrap();
            let (tx, rx) = mpsc::channel::<AgentMessage>(4);
            let mut request = tonic::Request::new(ReceiverStream::new(rx));
            if let Some(t) = token {
                request.metadata_mut().insert("authorization", format!("Bearer {t}").parse().unwrap());
            }
            AgentIngestClient::new(channel).report(request).await.map(|r| (tx, r.into_inner()))
        }
    };
    let refused = open_plain(None).await.err().map(|s| s.code());
    assert_eq!(refused, Some(tonic::Code::Unauthenticated));
    let accepted = open_plain(Some(c.token("agent-a", "node-a"))).await;
    assert!(accepted.is_ok(), "{:?}", accepted.err());
    let metrics = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", admin)).await?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        std::io::Result::Ok(out)
    };
    let text = metrics.await.unwrap();
    assert!(text.lines().any(|l| l == "epp_ingest_refusals_total{reason=\"no_token\"} 1"), "{text}");
    assert!(c.api.token_reviews() >= 1);
}
