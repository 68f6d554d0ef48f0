//! A fake node agent for picker tests: it reports pods over the real `AgentIngest` gRPC stream
//! (Hello, then one snapshot per pod, as the agent does on connect) and holds the stream open, so
//! a test controls exactly what the picker knows about each pod without running engines.
//!
//! The picker's replies (Acks, resync requests) are read and dropped by a background task.
//! Dropping the [`FakeAgent`] ends the stream (the pods then enter the picker's grace period).

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use kvroute_common::BlockHash;
use kvroute_proto::agent::v1::agent_ingest_client::AgentIngestClient;
use kvroute_proto::agent::v1::{AgentMessage, BlockRun, Hello, PodInfo, PodSnapshot, PodStats, agent_message};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// One pod as the fake agent reports it: ready, observed at connect time, KV-cache usage 0.1.
#[derive(Debug, Clone)]
pub struct FakePod {
    /// Pod name.
    pub name: String,
    /// `ip:port` the picker routes to.
    pub endpoint: String,
    /// Base model served.
    pub model: String,
    /// Blocks the pod holds, as one chain from the root.
    pub blocks: Vec<BlockHash>,
    /// GPU utilization in [0,1]. Default 0.
    pub gpu_utilization: f64,
    /// Requests waiting in the engine. Default 0.
    pub num_requests_waiting: u32,
    /// Health score in [0,1]. Default 1.
    pub health_score: f64,
}

impl FakePod {
    /// An idle, healthy pod of `model` holding no block.
    pub fn new(name: impl Into<String>, endpoint: impl ToString, model: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            endpoint: endpoint.to_string(),
            model: model.into(),
            blocks: Vec::new(),
            gpu_utilization: 0.0,
            num_requests_waiting: 0,
            health_score: 1.0,
        }
    }

    /// The pod holding `blocks`.
    pub fn with_blocks(mut self, blocks: Vec<BlockHash>) -> Self {
        self.blocks = blocks;
        self
    }

    /// The pod at GPU utilization `u`.
    pub fn with_gpu_utilization(mut self, u: f64) -> Self {
        self.gpu_utilization = u;
        self
    }

    /// The pod with `n` requests waiting.
    pub fn with_waiting(mut self, n: u32) -> Self {
        self.num_requests_waiting = n;
        self
    }

    /// The pod at health score `h`.
    pub fn with_health(mut self, h: f64) -> Self {
        self.health_score = h;
        self
    }

    fn info(&self) -> PodInfo {
        PodInfo {
            pod: self.name.clone(),
            endpoint: self.endpoint.clone(),
            model: self.model.clone(),
            block_size: 16,
            index_block_size: 16,
            annotations: Default::default(),
        }
    }

    fn snapshot(&self, observed_at_unix_ms: i64) -> PodSnapshot {
        let stats = PodStats {
            observed_at_unix_ms,
            num_requests_waiting: self.num_requests_waiting,
            kv_cache_usage: 0.1,
            gpu_utilization: self.gpu_utilization,
            health_score: self.health_score,
            ready: true,
            ..Default::default()
        };
        let blocks = if self.blocks.is_empty() {
            Vec::new()
        } else {
            vec![BlockRun { parent: 0, hashes: self.blocks.iter().map(|h| h.0).collect() }]
        };
        PodSnapshot { info: Some(self.info()), seq: 1, stats: Some(stats), blocks, offloaded_blocks: Vec::new() }
    }
}

/// A connected fake agent; keep it alive to stay connected.
#[derive(Debug)]
pub struct FakeAgent {
    _stream: mpsc::Sender<AgentMessage>,
}

impl FakeAgent {
    /// Connects to the picker's AgentIngest at `ingest` and reports `pods`. Returns once the
    /// messages are queued on the stream; wait for the picker to apply them with [`poll_until`].
    pub async fn connect(ingest: SocketAddr, pods: &[FakePod]) -> Result<Self> {
        let mut client = AgentIngestClient::connect(format!("http://{ingest}"))
            .await
            .with_context(|| format!("connecting to the picker's AgentIngest at {ingest}"))?;
        let (tx, rx) = mpsc::channel(pods.len() + 1);
        let hello = Hello {
            agent_id: "fake-agent".into(),
            node_name: "fake-node".into(),
            protocol_version: 1,
            pods: pods.iter().map(FakePod::info).collect(),
        };
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        let messages = std::iter::once(agent_message::Msg::Hello(hello))
            .chain(pods.iter().map(|p| agent_message::Msg::Snapshot(p.snapshot(now))));
        for msg in messages {
            tx.send(AgentMessage { msg: Some(msg) }).await.context("queueing a report")?;
        }
        let mut replies =
            client.report(ReceiverStream::new(rx)).await.context("opening the report stream")?.into_inner();
        tokio::spawn(async move { while let Ok(Some(_)) = replies.message().await {} });
        Ok(Self { _stream: tx })
    }
}

/// Polls `done` every 10 ms until it holds (true) or `timeout` passes (false).
pub async fn poll_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
