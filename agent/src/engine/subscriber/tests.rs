//! The reader thread over real ZeroMQ sockets with damaged batches built from the captured vLLM
//! fixtures: what can be kept is kept, and only what cannot be trusted is cleared.

use super::*;
use crate::engine::blocks::BlockRecord;
use kvroute_common::{BlockHash, BlockHasher};
use parking_lot::Mutex;
use rmpv::Value;
use std::sync::Weak;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn dir() -> String {
    format!("{}/../tests/fixtures/vllm-kv-events/v0.33", env!("CARGO_MANIFEST_DIR"))
}

/// The three frames (topic, seq, payload) of fixture batch `n` (seq = n).
fn frames(n: usize) -> Vec<Vec<u8>> {
    ["topic", "seq", "msgpack"]
        .iter()
        .map(|e| std::fs::read(format!("{}/batch-{n}.{e}", dir())).expect("fixture"))
        .collect()
}

/// Prompt A's kvroute chain and prompt B's.
fn chains() -> (Vec<BlockHash>, Vec<BlockHash>) {
    let text = std::fs::read_to_string(format!("{}/prompts.json", dir())).expect("prompts");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let chain = |k: &str| {
        let ids: Vec<u32> = v[k].as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect();
        let mut out = Vec::new();
        BlockHasher::new(MODEL, None, 16).hash_prompt(&ids, &mut out);
        out
    };
    (chain("prompt_a_token_ids"), chain("prompt_b_token_ids"))
}

/// Applies batches to a record, as the agent's pod sink does, and counts resets.
struct RecordSink {
    rec: Arc<Mutex<BlockRecord>>,
    resets: Arc<AtomicU64>,
    alive: Weak<()>,
}

impl EventSink for RecordSink {
    fn batch(&mut self, msg: KvMessage) {
        self.rec.lock().apply(&msg.batch);
    }
    fn reset(&mut self, _reason: &str) {
        self.resets.fetch_add(1, Ordering::Relaxed);
        self.rec.lock().clear();
    }
    fn flush(&mut self) {}
    fn is_closed(&self) -> bool {
        self.alive.strong_count() == 0
    }
}

/// An engine's publisher (XPUB: a PUB that reports subscriptions) on a free port.
struct Publisher {
    socket: zmq::Socket,
    endpoint: String,
}

impl Publisher {
    fn new(ctx: &zmq::Context) -> Self {
        let socket = ctx.socket(zmq::XPUB).expect("xpub");
        socket.set_rcvtimeo(10_000).expect("rcvtimeo");
        socket.bind("tcp://127.0.0.1:*").expect("bind");
        let endpoint = socket.get_last_endpoint().expect("endpoint").expect("utf-8");
        Self { socket, endpoint }
    }

    fn publish(&self, frames: &[Vec<u8>]) {
        self.socket.send_multipart(frames, 0).expect("publish");
    }
}

/// A replay endpoint (ROUTER) that answers every request with the batches it holds from the
/// requested seq on, then the end marker (vLLM 0.33's framing). Stops when the context ends.
fn replay_server(ctx: &zmq::Context, held: Arc<Mutex<Vec<Vec<Vec<u8>>>>>) -> String {
    let router = ctx.socket(zmq::ROUTER).expect("router");
    router.set_linger(0).expect("linger");
    router.bind("tcp://127.0.0.1:*").expect("bind");
    let endpoint = router.get_last_endpoint().expect("endpoint").expect("utf-8");
    std::thread::spawn(move || {
        while let Ok(req) = router.recv_multipart(0) {
            let (Some(id), Some(from)) = (req.first(), req.get(2)) else { continue };
            let from = u64::from_be_bytes(from.as_slice().try_into().unwrap_or([0; 8]));
            let held = held.lock().clone();
            for f in held.iter().filter(|f| u64::from_be_bytes(f[1].as_slice().try_into().expect("seq")) >= from) {
                let reply = [id.clone(), Vec::new(), f[0].clone(), f[1].clone(), f[2].clone()];
                if router.send_multipart(reply, 0).is_err() {
                    return;
                }
            }
            let end = [id.clone(), Vec::new(), Vec::new(), (-1i64).to_be_bytes().to_vec(), Vec::new()];
            if router.send_multipart(end, 0).is_err() {
                return;
            }
        }
    });
    endpoint
}

struct Running {
    rec: Arc<Mutex<BlockRecord>>,
    resets: Arc<AtomicU64>,
    metrics: Arc<AgentMetrics>,
    publisher: Publisher,
    stop: Arc<AtomicBool>,
    reader: Option<std::thread::JoinHandle<()>>,
    _alive: Arc<()>,
}

impl Running {
    fn start(ctx: &zmq::Context, kv_replay: Option<String>) -> Self {
        let publisher = Publisher::new(ctx);
        let rec = Arc::new(Mutex::new(BlockRecord::new(MODEL, 16)));
        let resets = Arc::new(AtomicU64::new(0));
        let alive = Arc::new(());
        let sink = RecordSink { rec: rec.clone(), resets: resets.clone(), alive: Arc::downgrade(&alive) };
        let cfg = SubscriberConfig {
            pod: "p".into(),
            kv_events: publisher.endpoint.clone(),
            kv_replay,
            replay_timeout: Duration::from_secs(2),
        };
        let metrics = AgentMetrics::new();
        let stop = Arc::new(AtomicBool::new(false));
        let reader = spawn(ctx.clone(), vec![(cfg, sink)], Duration::from_millis(5), metrics.clone(), stop.clone())
            .expect("thread");
        publisher.socket.recv_bytes(0).expect("a subscription within 10 s");
        Self { rec, resets, metrics, publisher, stop, reader: Some(reader), _alive: alive }
    }

    /// Waits (at most 5 s) until `cond` holds on the record.
    fn wait(&self, what: &str, cond: impl Fn(&BlockRecord) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !cond(&self.rec.lock()) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn skipped(&self, reason: &str) -> u64 {
        self.metrics.kv_events_skipped.get_or_create(&pod_reason_labels("p", reason)).get()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// Fixture batch `n`'s frames with the payload cut to its first `keep` bytes.
fn cut(n: usize, keep: impl FnOnce(usize) -> usize) -> Vec<Vec<u8>> {
    let mut f = frames(n);
    let len = keep(f[2].len());
    f[2].truncate(len);
    f
}

#[test]
fn a_truncated_batch_keeps_the_record_and_the_next_batch_is_no_gap() {
    let ctx = zmq::Context::new();
    let r = Running::start(&ctx, None);
    let (a, b) = chains();
    r.publisher.publish(&frames(0));
    r.wait("batch 0", |rec| rec.contains(a[2]));
    // Batch 1 (B's own two blocks, one BlockStored) cut in the middle of its token ids: only
    // that store is lost, which under-claims; seq 1 is still received.
    r.publisher.publish(&cut(1, |len| len - 40));
    r.publisher.publish(&frames(2));
    r.wait("batch 2's removal", |rec| !rec.contains(a[2]));
    let rec = r.rec.lock();
    assert!(rec.contains(a[0]) && rec.contains(a[1]), "A's first blocks survive");
    assert!(!rec.contains(b[2]), "B's blocks were in the lost part");
    assert_eq!(rec.gpu_len(), 2);
    assert_eq!(r.resets.load(Ordering::Relaxed), 0, "no gap, no reset");
    assert_eq!(r.metrics.kv_events_malformed.get_or_create(&pod_label("p")).get(), 0);
}

#[test]
fn an_unknown_event_type_is_skipped_and_counted_and_the_batch_applies() {
    let ctx = zmq::Context::new();
    let r = Running::start(&ctx, None);
    let (a, b) = chains();
    r.publisher.publish(&frames(0));
    // Batch 1 with a newer vLLM's event in front of its BlockStored.
    let mut f = frames(1);
    let mut batch = rmpv::decode::read_value(&mut f[2].as_slice()).expect("msgpack");
    if let Value::Array(parts) = &mut batch
        && let Value::Array(events) = &mut parts[1]
    {
        let newer = Value::Map(vec![
            (Value::from("type"), Value::from("BlockPinned")),
            (Value::from("block_hashes"), Value::Array(vec![Value::from(1u64)])),
        ]);
        events.insert(0, newer);
    }
    f[2].clear();
    rmpv::encode::write_value(&mut f[2], &batch).expect("encode");
    r.publisher.publish(&f);
    r.publisher.publish(&frames(2));
    r.wait("batch 2's removal", |rec| rec.contains(a[0]) && !rec.contains(a[2]));
    let rec = r.rec.lock();
    assert!(rec.contains(b[2]) && rec.contains(b[3]), "batch 1's store was kept");
    assert_eq!(rec.gpu_len(), 4);
    assert_eq!(r.resets.load(Ordering::Relaxed), 0);
    assert_eq!(r.skipped("unknown_type"), 1);
}

#[test]
fn a_batch_that_lost_a_possible_removal_is_replayed_whole_or_else_clears_the_record() {
    let ctx = zmq::Context::new();
    let held = Arc::new(Mutex::new(Vec::new()));
    let r = Running::start(&ctx, Some(replay_server(&ctx, held.clone())));
    let (a, _) = chains();
    r.publisher.publish(&frames(0));
    r.wait("batch 0", |rec| rec.gpu_len() == 3);
    // Batch 3 (two BlockStored) as seq 1, cut inside its first event: the second one may have
    // been anything. The engine still holds seq 1 whole: that copy is applied instead.
    let mut whole = frames(3);
    whole[1] = 1u64.to_be_bytes().to_vec();
    held.lock().push(whole.clone());
    let mut damaged = whole.clone();
    let third = damaged[2].len() / 3;
    damaged[2].truncate(third);
    r.publisher.publish(&damaged);
    r.wait("seq 1's LoRA block", |rec| rec.gpu_len() == 4);
    assert_eq!(r.skipped("untrusted"), 0, "the whole copy was used");
    assert_eq!(r.metrics.kv_events_replayed.get_or_create(&pod_label("p")).get(), 1);
    // Seq 2 damaged the same way, and the engine does not hold it: the record is cleared at the
    // damage (the events after it may have removed anything), counted as a resync.
    damaged[1] = 2u64.to_be_bytes().to_vec();
    r.publisher.publish(&damaged);
    r.wait("the untrusted clear", |rec| rec.gpu_len() == 0);
    assert!(!r.rec.lock().contains(a[0]));
    assert_eq!(r.skipped("untrusted"), 1);
    assert_eq!(r.metrics.kv_resyncs.get_or_create(&pod_label("p")).get(), 1);
    assert_eq!(r.resets.load(Ordering::Relaxed), 0, "cleared in place, not by a gap");
    // Seq 3 applies normally after it.
    r.publisher.publish(
        &frames(0)
            .into_iter()
            .enumerate()
            .map(|(i, f)| if i == 1 { 3u64.to_be_bytes().to_vec() } else { f })
            .collect::<Vec<_>>(),
    );
    r.wait("seq 3", |rec| rec.gpu_len() == 3);
}
