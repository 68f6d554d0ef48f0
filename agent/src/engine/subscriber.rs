//! The KV-event subscriber: one std thread per engine (the `zmq` crate is blocking) with a SUB
//! socket on the engine's PUB endpoint, handing decoded batches, in seq order, to an
//! [`EventSink`] on that same thread.
//!
//! Why on this thread (issue 5): handing every batch to a tokio task cost a thread wake-up and
//! context switch per batch (~20 % of the agent's CPU at ~177 batches/s). The agent's sink applies
//! the batch to the pod's record right here, under the pod's mutex, and wakes the tokio side at
//! most once per flush window to send the coalesced changes.
//!
//! Sequence handling (SPEC §7): the thread remembers the last seq it forwarded. On start, and on
//! a gap, it asks the engine's ROUTER replay endpoint (DEALER socket, `["", start_seq as u64 BE]`)
//! for the missing batches, reading replies until the end marker or a 1 s timeout, and drops
//! duplicates by seq. If replay cannot fill a gap, or seq goes backwards (engine restart), it
//! sends [`SubscriberEvent::Reset`] so the pod's record is cleared and rebuilt from new events
//! (under-claim rather than over-claim).
//!
//! Engine restarts whose new sequence does not visibly go back (the old engine had sent few
//! batches, or the new one sent several before the SUB reconnected, so the first seq seen looks
//! like a gap or even the next one) are caught by a ZeroMQ socket monitor: when the SUB
//! reconnects after a disconnect, the publisher may be a new process, so the thread sends
//! [`SubscriberEvent::Reset`] and rebuilds from the engine's replay history (seq ≥ 0). A network
//! blip to the same engine costs the same clear-and-replay: never wrong, at worst under-claiming
//! blocks older than the replay buffer.
//!
//! All subscribers of an agent share one ZeroMQ context (one libzmq I/O thread and one reaper
//! for every engine, instead of two threads per engine); each has its own monitor endpoint.
//!
//! `connect()` returns at once even when the engine is not up; libzmq reconnects by itself
//! (0.2–0.3 s after a publisher restart). The thread exits when the sink reports itself closed or
//! `stop` is set (looked at on every message, and every [`IDLE_WAKE_MS`] when idle).

use super::kv_events::{KvMessage, ReplayFrame, decode_message, decode_replay};
use crate::telemetry::{AgentMetrics, pod_label};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Receives what the subscriber thread decodes, in seq order, on the subscriber's own thread
/// (so implementations must not block for long: the SUB socket is not read meanwhile).
pub trait EventSink: Send + 'static {
    /// A batch, in seq order (duplicates already dropped).
    fn batch(&mut self, msg: KvMessage);
    /// Events were lost beyond replay or the engine restarted: clear the pod's record.
    fn reset(&mut self, reason: &str);
    /// True when nobody consumes the events any more: the thread then exits.
    fn is_closed(&self) -> bool;
}

/// Subscriber settings for one engine.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// Pod name (logs, metrics).
    pub pod: String,
    /// Engine PUB endpoint.
    pub kv_events: String,
    /// Engine ROUTER replay endpoint, if any.
    pub kv_replay: Option<String>,
    /// How long to wait for replay replies.
    pub replay_timeout: Duration,
}

/// Errors that stop a subscriber thread.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubscriberError {
    /// A ZeroMQ call failed.
    #[error("zmq {what} on {endpoint}: {source}")]
    Zmq {
        /// Which call.
        what: &'static str,
        /// Endpoint concerned.
        endpoint: String,
        /// libzmq error.
        source: zmq::Error,
    },
}

/// Starts the subscriber thread.
pub fn spawn<S: EventSink>(
    ctx: zmq::Context,
    cfg: SubscriberConfig,
    mut sink: S,
    metrics: Arc<AgentMetrics>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name(format!("kv-sub-{}", cfg.pod)).spawn(move || {
        if let Err(e) = run(&ctx, &cfg, &mut sink, &metrics, &stop) {
            tracing::error!(pod = %cfg.pod, error = %e, "KV-event subscriber stopped");
        }
    })
}

fn zerr<'a>(what: &'static str, endpoint: &'a str) -> impl FnOnce(zmq::Error) -> SubscriberError + 'a {
    move |source| SubscriberError::Zmq { what, endpoint: endpoint.to_string(), source }
}

fn run(
    ctx: &zmq::Context,
    cfg: &SubscriberConfig,
    tx: &mut dyn EventSink,
    metrics: &AgentMetrics,
    stop: &AtomicBool,
) -> Result<(), SubscriberError> {
    let monitor_endpoint = format!("inproc://kv-sub-monitor-{}", MONITOR_IDS.fetch_add(1, Ordering::Relaxed));
    let monitor_endpoint = monitor_endpoint.as_str();
    let sub = ctx.socket(zmq::SUB).map_err(zerr("socket", &cfg.kv_events))?;
    sub.set_subscribe(b"").map_err(zerr("subscribe", &cfg.kv_events))?;
    sub.set_rcvtimeo(IDLE_WAKE_MS).map_err(zerr("rcvtimeo", &cfg.kv_events))?;
    sub.set_linger(0).map_err(zerr("linger", &cfg.kv_events))?;
    // Monitor before connect, so the first CONNECTED is seen too.
    let events = zmq::SocketEvent::CONNECTED.to_raw() | zmq::SocketEvent::DISCONNECTED.to_raw();
    sub.monitor(monitor_endpoint, i32::from(events)).map_err(zerr("monitor", &cfg.kv_events))?;
    let monitor = ctx.socket(zmq::PAIR).map_err(zerr("socket", monitor_endpoint))?;
    monitor.set_linger(0).map_err(zerr("linger", monitor_endpoint))?;
    monitor.connect(monitor_endpoint).map_err(zerr("connect", monitor_endpoint))?;
    sub.connect(&cfg.kv_events).map_err(zerr("connect", &cfg.kv_events))?;
    let labels = pod_label(&cfg.pod);
    // Hot-path counters resolved once (a family lookup hashes the labels under a lock).
    let received_ctr = metrics.kv_events_received.get_or_create(&labels).clone();
    let malformed_ctr = metrics.kv_events_malformed.get_or_create(&labels).clone();
    let mut st = SeqState { last: None, dup_upto: None };
    let mut link = LinkState::default();
    // History the engine still buffers (we may have started after it).
    if !replay_all(ctx, cfg, tx, metrics, &mut st) {
        return Ok(());
    }
    // Frames of the current message, reused: no allocation or copy per frame on our side.
    let mut parts: Vec<zmq::Message> = Vec::new();
    while !stop.load(Ordering::Relaxed) && !tx.is_closed() {
        let received = recv_parts(&sub, &mut parts);
        if link.poll(&monitor) {
            tracing::warn!(pod = %cfg.pod, "KV-event publisher reconnected (engine may have restarted): clearing, replaying");
            metrics.kv_resyncs.get_or_create(&labels).inc();
            tx.reset("publisher reconnected");
            st.last = None;
            if !replay_all(ctx, cfg, tx, metrics, &mut st) {
                return Ok(());
            }
        }
        let frames = match received {
            Ok(n) => parts.get(..n).unwrap_or_default(),
            Err(zmq::Error::EAGAIN) => continue,
            Err(zmq::Error::ETERM) => return Ok(()),
            Err(e) => return Err(zerr("recv", &cfg.kv_events)(e)),
        };
        let msg = match decode_message(frames) {
            Ok(m) => m,
            Err(e) => {
                malformed_ctr.inc();
                tracing::warn!(pod = %cfg.pod, error = %e, "malformed KV-event message skipped");
                continue;
            }
        };
        received_ctr.inc();
        // Live batches that a replay already delivered are duplicates, not an engine restart.
        if let Some(upto) = st.dup_upto {
            if msg.seq <= upto {
                continue;
            }
            st.dup_upto = None;
        }
        match st.last {
            Some(last) if msg.seq <= last => {
                tracing::warn!(pod = %cfg.pod, last, seq = msg.seq, "KV-event seq went back: engine restart, clearing");
                metrics.kv_resyncs.get_or_create(&labels).inc();
                tx.reset("seq went back");
                st.last = None;
            }
            Some(last) if msg.seq > last + 1 => {
                let from = last + 1;
                let got = replay(ctx, cfg, from).unwrap_or_default();
                let filled: Vec<KvMessage> = got.into_iter().filter(|m| m.seq >= from && m.seq < msg.seq).collect();
                let contiguous = filled.iter().enumerate().all(|(i, m)| m.seq == from + i as u64)
                    && filled.len() as u64 == msg.seq - from;
                if contiguous {
                    tracing::info!(pod = %cfg.pod, from, to = msg.seq - 1, "KV-event gap filled by replay");
                    for m in filled {
                        metrics.kv_events_replayed.get_or_create(&labels).inc();
                        forward(tx, &mut st, m);
                    }
                } else {
                    tracing::warn!(pod = %cfg.pod, from, to = msg.seq - 1, "KV-event gap not replayable, clearing");
                    metrics.kv_resyncs.get_or_create(&labels).inc();
                    tx.reset("gap beyond replay");
                }
            }
            _ => {}
        }
        forward(tx, &mut st, msg);
    }
    Ok(())
}

/// How long a SUB read waits for a message before the thread looks at `stop` and the monitor
/// again (ms). Every engine's thread wakes this often when its engine is idle (issue 5: at
/// 100 ms, 8 engines cost 80 wake-ups/s doing nothing); a batch that arrives wakes it at once,
/// and a reconnect is noticed at the next batch or wake.
const IDLE_WAKE_MS: i32 = 500;

/// Receives one multipart message into `parts` (grown as needed, messages reused); returns
/// its frame count.
fn recv_parts(sock: &zmq::Socket, parts: &mut Vec<zmq::Message>) -> Result<usize, zmq::Error> {
    let mut n = 0;
    loop {
        if parts.len() == n {
            parts.push(zmq::Message::new());
        }
        let Some(part) = parts.get_mut(n) else { return Ok(n) };
        sock.recv(part, 0)?;
        n += 1;
        if !part.get_more() {
            return Ok(n);
        }
    }
}

struct SeqState {
    /// Last seq forwarded.
    last: Option<u64>,
    /// Highest seq a replay delivered, until a live batch goes past it.
    dup_upto: Option<u64>,
}

/// Numbers the in-process monitor endpoints (`inproc://kv-sub-monitor-<n>`), unique within the
/// shared context.
static MONITOR_IDS: AtomicU64 = AtomicU64::new(0);

/// Connection history of the SUB socket, from its monitor events.
#[derive(Default)]
struct LinkState {
    disconnected: bool,
}

impl LinkState {
    /// Reads pending monitor events; true when the SUB connected again after a disconnect.
    fn poll(&mut self, monitor: &zmq::Socket) -> bool {
        let mut reconnected = false;
        while let Ok(frames) = monitor.recv_multipart(zmq::DONTWAIT) {
            // Frame 0: event id (u16, native endian) and value (u32); frame 1: the endpoint.
            let Some(id) = frames.first().and_then(|f| f.get(..2)).map(|b| u16::from_ne_bytes([b[0], b[1]])) else {
                continue;
            };
            if id == zmq::SocketEvent::DISCONNECTED.to_raw() {
                self.disconnected = true;
            } else if id == zmq::SocketEvent::CONNECTED.to_raw() && self.disconnected {
                self.disconnected = false;
                reconnected = true;
            }
        }
        reconnected
    }
}

/// Forwards the engine's whole replay history (seq ≥ 0); false when the sink is closed.
fn replay_all(
    ctx: &zmq::Context,
    cfg: &SubscriberConfig,
    tx: &mut dyn EventSink,
    metrics: &AgentMetrics,
    st: &mut SeqState,
) -> bool {
    if cfg.kv_replay.is_none() {
        return true;
    }
    let labels = pod_label(&cfg.pod);
    for m in replay(ctx, cfg, 0).into_iter().flatten() {
        metrics.kv_events_replayed.get_or_create(&labels).inc();
        forward(tx, st, m);
    }
    st.dup_upto = st.last;
    !tx.is_closed()
}

/// Hands `m` to the sink unless it is a duplicate.
fn forward(tx: &mut dyn EventSink, st: &mut SeqState, m: KvMessage) {
    if st.last.is_some_and(|l| m.seq <= l) {
        return;
    }
    st.last = Some(m.seq);
    tx.batch(m);
}

/// Asks the replay endpoint for every buffered batch with seq ≥ `from`. `None` when there is no
/// replay endpoint or it did not answer in time; replies are in seq order.
fn replay(ctx: &zmq::Context, cfg: &SubscriberConfig, from: u64) -> Option<Vec<KvMessage>> {
    let endpoint = cfg.kv_replay.as_deref()?;
    let result = (|| -> Result<Option<Vec<KvMessage>>, zmq::Error> {
        let dealer = ctx.socket(zmq::DEALER)?;
        dealer.set_linger(0)?;
        dealer.set_rcvtimeo(100)?;
        dealer.connect(endpoint)?;
        dealer.send_multipart([&b""[..], &from.to_be_bytes()[..]], 0)?;
        let deadline = Instant::now() + cfg.replay_timeout;
        let mut out = Vec::new();
        while Instant::now() < deadline {
            let frames = match dealer.recv_multipart(0) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => continue,
                Err(e) => return Err(e),
            };
            match decode_replay(&frames) {
                Ok(ReplayFrame::End) => return Ok(Some(out)),
                Ok(ReplayFrame::Batch(m)) => out.push(m),
                Err(e) => tracing::warn!(pod = %cfg.pod, error = %e, "malformed replay reply skipped"),
            }
        }
        tracing::warn!(pod = %cfg.pod, endpoint, "replay timed out");
        Ok(None)
    })();
    result.unwrap_or_else(|e| {
        tracing::warn!(pod = %cfg.pod, endpoint, error = %e, "replay failed");
        None
    })
}
