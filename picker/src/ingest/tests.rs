//! Ingest tests over a real tonic server on 127.0.0.1 (ephemeral port) and a client stream.

use std::sync::Arc;
use std::time::Duration;

use kvroute_proto::agent::v1::agent_ingest_client::AgentIngestClient;
use kvroute_proto::agent::v1::{
    AgentMessage, BlockChanges, BlockRun, Hello, PickerMessage, PodDelta, PodSnapshot, agent_message, picker_message,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::Streaming;

use super::IngestService;
use crate::pool::tests::{info, stats};
use crate::pool::{Pool, PoolConfig};

async fn serve(pool: Arc<Pool>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await;
    let Ok(l) = l else { panic!("bind: {l:?}") };
    let Ok(addr) = l.local_addr() else { panic!("addr") };
    let svc = IngestService::new(pool).into_server();
    tokio::spawn(tonic::transport::Server::builder().add_service(svc).serve_with_incoming(TcpListenerStream::new(l)));
    format!("http://{addr}")
}

async fn open(url: String) -> (mpsc::Sender<AgentMessage>, Streaming<PickerMessage>) {
    let client = AgentIngestClient::connect(url).await;
    let Ok(mut client) = client else { panic!("connect: {client:?}") };
    let (tx, rx) = mpsc::channel(1024);
    let resp = client.report(ReceiverStream::new(rx)).await;
    let Ok(resp) = resp else { panic!("report: {resp:?}") };
    (tx, resp.into_inner())
}

fn snapshot(pod: &str, seq: u64, hashes: Vec<u64>) -> AgentMessage {
    AgentMessage {
        msg: Some(agent_message::Msg::Snapshot(PodSnapshot {
            info: Some(info(pod, "m")),
            seq,
            stats: Some(stats(0.1, 0, 1.0)),
            blocks: vec![BlockRun { parent: 0, hashes }],
            offloaded_blocks: vec![],
        })),
    }
}

fn delta(pod: &str, seq: u64, stored: Vec<u64>, removed: Vec<u64>) -> AgentMessage {
    AgentMessage {
        msg: Some(agent_message::Msg::Delta(PodDelta {
            pod: pod.into(),
            seq,
            blocks: Some(BlockChanges {
                cleared: false,
                stored: vec![BlockRun { parent: 0, hashes: stored }],
                removed,
            }),
            stats: None,
            offloaded: None,
        })),
    }
}

async fn hello(tx: &mpsc::Sender<AgentMessage>, pods: &[&str]) {
    let hello = Hello {
        agent_id: "n1-1".into(),
        node_name: "n1".into(),
        protocol_version: 1,
        pods: pods.iter().map(|p| info(p, "m")).collect(),
    };
    send(tx, AgentMessage { msg: Some(agent_message::Msg::Hello(hello)) }).await;
}

async fn send(tx: &mpsc::Sender<AgentMessage>, m: AgentMessage) {
    assert!(tx.send(m).await.is_ok());
}

/// Next message from the picker, skipping Acks unless `acks`.
async fn next(rx: &mut Streaming<PickerMessage>, acks: bool) -> Option<picker_message::Msg> {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), rx.message()).await.ok()?.ok()??;
        match m.msg {
            Some(picker_message::Msg::Ack(_)) if !acks => continue,
            other => return other,
        }
    }
}

async fn until(pool: &Pool, what: impl Fn(&Pool) -> bool) -> bool {
    for _ in 0..200 {
        if what(pool) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[tokio::test]
async fn snapshot_then_deltas_are_applied_and_gaps_ask_for_resync() {
    let pool = Pool::new(PoolConfig::default());
    let (tx, mut rx) = open(serve(pool.clone()).await).await;
    let hello =
        Hello { agent_id: "n1-1".into(), node_name: "n1".into(), protocol_version: 1, pods: vec![info("a", "m")] };
    send(&tx, AgentMessage { msg: Some(agent_message::Msg::Hello(hello)) }).await;
    // Delta before any snapshot: resync.
    send(&tx, delta("a", 1, vec![9], vec![])).await;
    let Some(picker_message::Msg::Resync(r)) = next(&mut rx, false).await else { panic!("no resync") };
    assert_eq!(r.pod, "a");
    send(&tx, snapshot("a", 10, vec![1, 2, 3])).await;
    send(&tx, delta("a", 11, vec![4], vec![1])).await;
    assert!(until(&pool, |p| p.index_stats().entries == 3 && p.pods().first().is_some_and(|v| v.ready)).await);
    assert!(pool.index.load().pods_of(kvroute_common::BlockHash(1)).is_empty());
    assert!(!pool.index.load().pods_of(kvroute_common::BlockHash(4)).is_empty());
    // Gap: 13 after 11 → resync, and deltas are ignored until the next snapshot.
    send(&tx, delta("a", 13, vec![5], vec![])).await;
    let Some(picker_message::Msg::Resync(r)) = next(&mut rx, false).await else { panic!("no resync") };
    assert!(r.pod == "a" && r.reason.contains("expected 12"), "{r:?}");
    send(&tx, delta("a", 14, vec![6], vec![])).await;
    send(&tx, snapshot("a", 20, vec![7])).await;
    send(&tx, delta("a", 21, vec![8], vec![])).await;
    assert!(until(&pool, |p| p.index_stats().entries == 2).await, "{:?}", pool.index_stats());
    let snap = pool.index.load();
    for (h, want) in [(5u64, false), (6, false), (7, true), (8, true)] {
        assert_eq!(!snap.pods_of(kvroute_common::BlockHash(h)).is_empty(), want, "block {h}");
    }
    // Stream end → disconnected (grace period).
    drop(tx);
    assert!(until(&pool, |p| p.pods().first().is_some_and(|v| !v.connected)).await);
}

#[tokio::test]
async fn bad_messages_get_a_resync_and_the_stream_stays_open() {
    let pool = Pool::new(PoolConfig::default());
    let (tx, mut rx) = open(serve(pool.clone()).await).await;
    send(&tx, AgentMessage { msg: None }).await;
    let Some(picker_message::Msg::Resync(r)) = next(&mut rx, false).await else { panic!("no resync") };
    assert_eq!(r.pod, "");
    send(&tx, AgentMessage { msg: Some(agent_message::Msg::Snapshot(PodSnapshot::default())) }).await;
    let Some(picker_message::Msg::Resync(_)) = next(&mut rx, false).await else { panic!("no resync") };
    // Still usable afterwards.
    hello(&tx, &["b"]).await;
    send(&tx, snapshot("b", 0, vec![1])).await;
    assert!(until(&pool, |p| p.pods().len() == 1 && p.index_stats().entries == 1).await);
}

#[tokio::test]
async fn acks_report_the_applied_seq() {
    let pool = Pool::new(PoolConfig::default());
    let (tx, mut rx) = open(serve(pool.clone()).await).await;
    hello(&tx, &["a"]).await;
    send(&tx, snapshot("a", 0, vec![])).await;
    for seq in 1..=120 {
        send(&tx, delta("a", seq, vec![1000 + seq], vec![])).await;
    }
    let Some(picker_message::Msg::Ack(a)) = next(&mut rx, true).await else { panic!("no ack") };
    assert_eq!(a.pod, "a");
    // Ack after ACK_EVERY messages: the Hello and the snapshot count, so at seq 98 at the earliest.
    assert!((98..=120).contains(&a.seq), "{a:?}");
    // Everything acked is applied.
    assert!(pool.index_stats().entries >= a.seq);
}
