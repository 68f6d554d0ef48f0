//! KV events in vLLM 0.33's wire format: a ZeroMQ PUB socket and a ROUTER replay socket.
//!
//! Wire format (vLLM `ZmqEventPublisher`, see `tests/fixtures/vllm-kv-events/`): every message is
//! three frames `[topic, seq as u64 big-endian, msgpack KVEventBatch]`, where the batch is the
//! array `[ts (f64 unix seconds), [event maps tagged by "type"], data_parallel_rank]`. Replay: a
//! client sends `[empty, start_seq u64 BE]` to the ROUTER; the reply is one `[empty, topic, seq,
//! payload]` per buffered batch with seq >= start, then `[empty, empty, i64 -1 BE, empty]`.
//!
//! Concurrency: `zmq` sockets are neither `Sync` nor async, so each socket lives on its own std
//! thread. The engine sends [`KvEvent`]s through an unbounded std channel (the publisher is far
//! faster than the emulated engine); the PUB thread gathers events arriving within
//! [`BATCH_WINDOW`] into one batch, numbers it (seq starts at 0, +1 per batch, also for batches
//! dropped by fault injection), records it in the replay ring and sends it. The ROUTER thread reads
//! the ring under a short `parking_lot` lock. Both threads poll a shutdown flag every 100 ms.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use rmpv::Value;

use crate::cache::ExtraKey;
use crate::faults::FaultState;

/// How long the publisher waits for more events before sending a batch.
pub const BATCH_WINDOW: Duration = Duration::from_millis(2);
const POLL: Duration = Duration::from_millis(100);

/// Errors of the KV-event sockets.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvEventsError {
    /// A ZeroMQ call failed (bind, option, send).
    #[error("zeromq {what} on {endpoint}: {source}")]
    Zmq {
        /// The operation that failed.
        what: &'static str,
        /// The endpoint concerned.
        endpoint: String,
        /// The libzmq error.
        source: zmq::Error,
    },
    /// Encoding a batch to msgpack failed.
    #[error("msgpack encoding of a KV-event batch: {0}")]
    Encode(#[from] rmpv::encode::Error),
    /// A socket thread ended before reporting its bound endpoint.
    #[error("the {0} socket thread ended before binding")]
    ThreadGone(&'static str),
}

/// One engine cache event, as vLLM's `vllm.distributed.kv_events` defines it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks newly cached, forming one chain segment.
    BlockStored {
        /// Engine hashes of the blocks, in chain order.
        block_hashes: Vec<u64>,
        /// Engine hash of the block before the first one; `None` at the start of a prompt.
        parent_block_hash: Option<u64>,
        /// The blocks' tokens concatenated (`block_hashes.len() * block_size` ids).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// LoRA adapter id and name, if the blocks belong to an adapter.
        lora: Option<(u32, String)>,
        /// Per block (same length as `block_hashes`), the extra keys folded into its hash: LoRA
        /// name, multimodal `(identifier, offset)` pairs, `cache_salt`. Sent as vLLM's
        /// `extra_keys` (a list with one tuple or nil per block) when any block has some.
        extra_keys: Vec<Option<Vec<ExtraKey>>>,
    },
    /// Blocks evicted from the GPU cache.
    BlockRemoved {
        /// Engine hashes of the evicted blocks.
        block_hashes: Vec<u64>,
    },
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}

impl KvEvent {
    /// The event as vLLM's msgspec encodes it: a map tagged by `"type"`, fields in declaration
    /// order, fields at their default (`extra_keys: None`) omitted. A block's extra keys are a
    /// tuple (msgpack array): the LoRA name and the salt as strings, a multimodal item as the
    /// pair `[identifier, offset]`.
    pub fn to_msgpack_value(&self) -> Value {
        let kv = |k: &str, v: Value| (Value::from(k), v);
        match self {
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, lora, extra_keys } => {
                let mut fields = vec![
                    kv("type", Value::from("BlockStored")),
                    kv("block_hashes", Value::Array(block_hashes.iter().map(|h| Value::from(*h)).collect())),
                    kv("parent_block_hash", parent_block_hash.map_or(Value::Nil, Value::from)),
                    kv("token_ids", Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect())),
                    kv("block_size", Value::from(*block_size)),
                    kv("lora_id", lora.as_ref().map_or(Value::Nil, |(id, _)| Value::from(*id))),
                    kv("medium", Value::from("GPU")),
                    kv("lora_name", lora.as_ref().map_or(Value::Nil, |(_, name)| Value::from(name.as_str()))),
                ];
                if extra_keys.iter().any(Option::is_some) {
                    let per_block = extra_keys
                        .iter()
                        .map(|keys| keys.as_ref().map_or(Value::Nil, |keys| extra_keys_value(keys)))
                        .collect();
                    fields.push(kv("extra_keys", Value::Array(per_block)));
                }
                Value::Map(fields)
            }
            KvEvent::BlockRemoved { block_hashes } => Value::Map(vec![
                kv("type", Value::from("BlockRemoved")),
                kv("block_hashes", Value::Array(block_hashes.iter().map(|h| Value::from(*h)).collect())),
                kv("medium", Value::from("GPU")),
            ]),
            KvEvent::AllBlocksCleared => Value::Map(vec![kv("type", Value::from("AllBlocksCleared"))]),
        }
    }
}

/// One block's extra keys as vLLM's msgspec writes the tuple.
fn extra_keys_value(keys: &[ExtraKey]) -> Value {
    Value::Array(
        keys.iter()
            .map(|k| match k {
                ExtraKey::Lora(name) => Value::from(name.as_str()),
                ExtraKey::Salt(salt) => Value::from(salt.as_str()),
                ExtraKey::Mm { identifier, offset } => {
                    Value::Array(vec![Value::from(identifier.as_str()), Value::from(*offset)])
                }
            })
            .collect(),
    )
}

/// Encodes a `KVEventBatch` `[ts, events, data_parallel_rank = 0]` to msgpack bytes.
///
/// Byte-compatible with vLLM: msgspec writes a `BlockStored` map header as map16 (`0xde`) whatever
/// its field count (the struct has more than 15 possible fields), other events as fixmaps.
pub fn encode_batch(ts_unix_s: f64, events: &[KvEvent]) -> Result<Vec<u8>, KvEventsError> {
    let mut out = Vec::with_capacity(256);
    out.push(0x93);
    rmpv::encode::write_value(&mut out, &Value::F64(ts_unix_s))?;
    write_array_len(&mut out, events.len());
    for event in events {
        match (event, event.to_msgpack_value()) {
            (KvEvent::BlockStored { .. }, Value::Map(fields)) => {
                out.push(0xde);
                out.extend_from_slice(&(fields.len() as u16).to_be_bytes());
                for (key, value) in &fields {
                    rmpv::encode::write_value(&mut out, key)?;
                    rmpv::encode::write_value(&mut out, value)?;
                }
            }
            (_, value) => rmpv::encode::write_value(&mut out, &value)?,
        }
    }
    rmpv::encode::write_value(&mut out, &Value::from(0))?;
    Ok(out)
}

fn write_array_len(out: &mut Vec<u8>, len: usize) {
    if len < 16 {
        out.push(0x90 | len as u8);
    } else if let Ok(len) = u16::try_from(len) {
        out.push(0xdc);
        out.extend_from_slice(&len.to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
}

/// Where the publisher binds and what it sends.
#[derive(Debug, Clone)]
pub struct KvEventsConfig {
    /// PUB endpoint, e.g. `tcp://127.0.0.1:5557` (`:*` for a free port).
    pub events_endpoint: String,
    /// ROUTER replay endpoint.
    pub replay_endpoint: String,
    /// Topic frame of every message.
    pub topic: String,
    /// Batches kept for replay.
    pub replay_buffer: usize,
}

/// A batch kept for replay: its sequence number and msgpack payload.
type Buffered = (u64, Arc<Vec<u8>>);

/// Handle on the running publisher: the event sender and the endpoints actually bound.
#[derive(Debug)]
pub struct KvEventPublisher {
    sender: mpsc::Sender<KvEvent>,
    /// The PUB endpoint as bound (ports resolved).
    pub events_endpoint: String,
    /// The ROUTER endpoint as bound (ports resolved).
    pub replay_endpoint: String,
    shutdown: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

/// Cheap cloneable sender of engine events to the publisher.
#[derive(Debug, Clone)]
pub struct KvEventSink(mpsc::Sender<KvEvent>);

impl KvEventSink {
    /// Queues events for the next batch; silently ignored once the publisher has stopped.
    pub fn send(&self, events: impl IntoIterator<Item = KvEvent>) {
        for event in events {
            if self.0.send(event).is_err() {
                tracing::debug!("KV-event publisher stopped; event dropped");
                return;
            }
        }
    }
}

impl KvEventPublisher {
    /// Binds both sockets (on their own threads) and returns once both are bound.
    pub fn start(config: KvEventsConfig, faults: Arc<FaultState>) -> Result<Self, KvEventsError> {
        let ctx = zmq::Context::new();
        let shutdown = Arc::new(AtomicBool::new(false));
        let ring: Arc<Mutex<VecDeque<Buffered>>> = Arc::new(Mutex::new(VecDeque::new()));
        let (sender, receiver) = mpsc::channel();

        let (pub_thread, events_endpoint) = {
            let (config, ring, shutdown) = (config.clone(), ring.clone(), shutdown.clone());
            spawn_bound(&ctx, "kv-pub", zmq::PUB, config.events_endpoint.clone(), move |socket| {
                publish_loop(&socket, &receiver, &config, &ring, &faults, &shutdown)
            })?
        };
        let (router_thread, replay_endpoint) = {
            let (config, ring, stop) = (config.clone(), ring.clone(), shutdown.clone());
            match spawn_bound(&ctx, "kv-replay", zmq::ROUTER, config.replay_endpoint.clone(), move |socket| {
                replay_loop(&socket, &config, &ring, &stop)
            }) {
                Ok(bound) => bound,
                Err(e) => {
                    shutdown.store(true, Ordering::SeqCst);
                    return Err(e);
                }
            }
        };
        tracing::info!(%events_endpoint, %replay_endpoint, topic = %config.topic, "KV-event sockets bound");
        Ok(Self { sender, events_endpoint, replay_endpoint, shutdown, threads: vec![pub_thread, router_thread] })
    }

    /// A sender for the engine.
    pub fn sink(&self) -> KvEventSink {
        KvEventSink(self.sender.clone())
    }

    /// Stops both threads and waits for them (up to one poll period each).
    pub fn shutdown(mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl Drop for KvEventPublisher {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
    }
}

/// Binds a socket on its own thread (zmq sockets are not `Sync`), then runs `serve` there.
/// Returns once the socket is bound, with the thread and the bound endpoint.
fn spawn_bound(
    ctx: &zmq::Context,
    name: &'static str,
    kind: zmq::SocketType,
    endpoint: String,
    serve: impl FnOnce(zmq::Socket) + Send + 'static,
) -> Result<(std::thread::JoinHandle<()>, String), KvEventsError> {
    let ctx = ctx.clone();
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let thread = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || match bind(&ctx, kind, &endpoint) {
            Ok((socket, bound)) => {
                let _ = ready_tx.send(Ok(bound));
                serve(socket);
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        })
        .map_err(|_| KvEventsError::ThreadGone(name))?;
    let bound = ready_rx.recv().map_err(|_| KvEventsError::ThreadGone(name))??;
    Ok((thread, bound))
}

fn bind(ctx: &zmq::Context, kind: zmq::SocketType, endpoint: &str) -> Result<(zmq::Socket, String), KvEventsError> {
    let err = |what| move |source| KvEventsError::Zmq { what, endpoint: endpoint.to_string(), source };
    let socket = ctx.socket(kind).map_err(err("socket"))?;
    socket.set_linger(0).map_err(err("set_linger"))?;
    socket.set_rcvtimeo(POLL.as_millis() as i32).map_err(err("set_rcvtimeo"))?;
    socket.set_sndhwm(100_000).map_err(err("set_sndhwm"))?;
    socket.bind(endpoint).map_err(err("bind"))?;
    let bound = match socket.get_last_endpoint() {
        Ok(Ok(bound)) => bound,
        _ => endpoint.to_string(),
    };
    Ok((socket, bound))
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

fn publish_loop(
    socket: &zmq::Socket,
    receiver: &mpsc::Receiver<KvEvent>,
    config: &KvEventsConfig,
    ring: &Mutex<VecDeque<Buffered>>,
    faults: &FaultState,
    shutdown: &AtomicBool,
) {
    let mut next_seq: u64 = 0;
    while !shutdown.load(Ordering::SeqCst) {
        let first = match receiver.recv_timeout(POLL) {
            Ok(event) => event,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let mut events = vec![first];
        let deadline = Instant::now() + BATCH_WINDOW;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match receiver.recv_timeout(left) {
                Ok(event) => events.push(event),
                Err(_) => break,
            }
        }
        let payload = match encode_batch(unix_now(), &events) {
            Ok(payload) => Arc::new(payload),
            Err(e) => {
                tracing::error!(error = %e, "dropping an unencodable KV-event batch");
                continue;
            }
        };
        let seq = next_seq;
        next_seq += 1;
        {
            let mut ring = ring.lock();
            if ring.len() >= config.replay_buffer {
                ring.pop_front();
            }
            ring.push_back((seq, payload.clone()));
        }
        if faults.take_kv_drop() {
            tracing::info!(seq, events = events.len(), "fault injection: KV-event batch not sent");
            continue;
        }
        let frames: [&[u8]; 3] = [config.topic.as_bytes(), &seq.to_be_bytes(), payload.as_slice()];
        if let Err(e) = socket.send_multipart(frames, 0) {
            tracing::warn!(seq, error = %e, "KV-event batch send failed");
        }
    }
}

fn replay_loop(socket: &zmq::Socket, config: &KvEventsConfig, ring: &Mutex<VecDeque<Buffered>>, shutdown: &AtomicBool) {
    while !shutdown.load(Ordering::SeqCst) {
        let frames = match socket.recv_multipart(0) {
            Ok(frames) => frames,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "replay receive failed");
                continue;
            }
        };
        let start = match frames.as_slice() {
            [_, empty, start] if empty.is_empty() => match <[u8; 8]>::try_from(start.as_slice()) {
                Ok(bytes) => u64::from_be_bytes(bytes),
                Err(_) => {
                    tracing::warn!(len = start.len(), "replay request with a start seq that is not 8 bytes; ignored");
                    continue;
                }
            },
            _ => {
                tracing::warn!(frames = frames.len(), "malformed replay request (want [identity, \"\", seq]); ignored");
                continue;
            }
        };
        let identity = &frames[0];
        let batches: Vec<Buffered> = ring.lock().iter().filter(|(seq, _)| *seq >= start).cloned().collect();
        tracing::info!(start, batches = batches.len(), "serving KV-event replay");
        for (seq, payload) in &batches {
            let reply: [&[u8]; 5] = [identity, b"", config.topic.as_bytes(), &seq.to_be_bytes(), payload.as_slice()];
            if let Err(e) = socket.send_multipart(reply, 0) {
                tracing::warn!(seq, error = %e, "replay send failed");
            }
        }
        let end: [&[u8]; 5] = [identity, b"", b"", &(-1i64).to_be_bytes(), b""];
        if let Err(e) = socket.send_multipart(end, 0) {
            tracing::warn!(error = %e, "replay end-marker send failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        let path = format!("{}/../fixtures/vllm-kv-events/v0.33/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn decode(bytes: &[u8]) -> Value {
        rmpv::decode::read_value(&mut &bytes[..]).unwrap()
    }

    fn field<'a>(map: &'a Value, key: &str) -> &'a Value {
        map.as_map().unwrap().iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v).unwrap()
    }

    fn ts_of(batch: &Value) -> f64 {
        batch.as_array().unwrap()[0].as_f64().unwrap()
    }

    /// Re-encodes the fixture's events from their decoded fields and expects vLLM's exact bytes.
    #[test]
    fn encoding_is_byte_identical_to_vllm_fixtures() {
        for n in [0, 1, 2, 4] {
            let bytes = fixture(&format!("batch-{n}.msgpack"));
            let batch = decode(&bytes);
            let events: Vec<KvEvent> = batch.as_array().unwrap()[1]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| match field(e, "type").as_str().unwrap() {
                    "BlockStored" => KvEvent::BlockStored {
                        block_hashes: field(e, "block_hashes")
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|h| h.as_u64().unwrap())
                            .collect(),
                        parent_block_hash: field(e, "parent_block_hash").as_u64(),
                        token_ids: field(e, "token_ids")
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|t| t.as_u64().unwrap() as u32)
                            .collect(),
                        block_size: field(e, "block_size").as_u64().unwrap() as u32,
                        lora: None,
                        extra_keys: Vec::new(),
                    },
                    "BlockRemoved" => KvEvent::BlockRemoved {
                        block_hashes: field(e, "block_hashes")
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|h| h.as_u64().unwrap())
                            .collect(),
                    },
                    "AllBlocksCleared" => KvEvent::AllBlocksCleared,
                    other => panic!("unexpected event type {other}"),
                })
                .collect();
            let ours = encode_batch(ts_of(&batch), &events).unwrap();
            assert_eq!(ours, bytes, "batch {n} differs from vLLM's encoding");
        }
    }

    /// Batch 3 mixes a LoRA block and a CPU block; our LoRA BlockStored must match the first.
    #[test]
    fn lora_block_stored_matches_vllm_structure() {
        let batch = decode(&fixture("batch-3.msgpack"));
        let theirs = batch.as_array().unwrap()[1].as_array().unwrap()[0].clone();
        let ours = KvEvent::BlockStored {
            block_hashes: vec![field(&theirs, "block_hashes").as_array().unwrap()[0].as_u64().unwrap()],
            parent_block_hash: None,
            token_ids: (1000..1016).collect(),
            block_size: 16,
            lora: Some((1, "sql-lora".into())),
            extra_keys: vec![Some(vec![ExtraKey::Lora("sql-lora".into())])],
        }
        .to_msgpack_value();
        assert_eq!(ours, theirs);
    }
}
