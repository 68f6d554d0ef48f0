//! The KV-event reader: ONE std thread for all of an agent's engines (the `zmq` crate is
//! blocking), a SUB socket per engine on its PUB endpoint, handing decoded batches, in seq order,
//! to each engine's [`EventSink`] on that thread, then asking the sinks to send what changed.
//!
//! Read passes (docs/decisions/0023-agent-cpu-budget.md): when idle, the thread waits in
//! `zmq::poll` for any engine's first batch.
//! Then it works in passes one coalescing window (`block_flush_ms`, docs/design.md §7) apart: sleep the
//! window, read every batch that queued up meanwhile on every socket, end the pass with
//! [`EventSink::flush`] on the engines that got batches; it goes back to `poll` after a pass that
//! found nothing. Under load that is one wake-up per window for the whole node, instead of one
//! per batch per engine thread plus a flush timer on the tokio side (8 threads × ~35 wake-ups/s
//! at ~300 batches/s), and no `poll` between passes (libzmq's poll asks every socket for its
//! state, one system call each). A batch waits at most one window. libzmq queues the
//! batches in the meantime (default high-water mark 1 000 messages per socket).
//!
//! Sequence handling (docs/design.md §7), per engine: the thread remembers the last seq it forwarded. On
//! start, and on a gap, it asks the engine's ROUTER replay endpoint (DEALER socket,
//! `["", start_seq as u64 BE]`) for the missing batches, reading replies until the end marker or
//! the replay timeout, and drops duplicates by seq. The start-up replays of all engines run at
//! once (one deadline, not one per engine). If replay cannot fill a gap, or seq goes backwards
//! (engine restart), the sink gets [`EventSink::reset`] so the pod's record is cleared and rebuilt
//! from new events (under-claim rather than over-claim). While a gap replay runs (milliseconds
//! from a live engine, at most the replay timeout from a dead one) the other engines' batches
//! wait in their sockets.
//!
//! Engine restarts whose new sequence does not visibly go back (the old engine had sent few
//! batches, or the new one sent several before the SUB reconnected, so the first seq seen looks
//! like a gap or even the next one) are caught by a ZeroMQ socket monitor per SUB: when it
//! reconnects after a disconnect, the publisher may be a new process, so the engine is reset and
//! rebuilt from its replay history (seq ≥ 0). A network blip to the same engine costs the same
//! clear-and-replay: never wrong, at worst under-claiming blocks older than the replay buffer.
//!
//! Damaged batches (docs/design.md §7; see [`super::kv_events`] for what the decoder keeps): events
//! of unknown types and unreadable stores are skipped and counted
//! (`kvroute_agent_kv_events_skipped_total{reason}`), the rest of the batch applies. A batch that
//! lost events which may have removed blocks ([`KvEvent::Untrusted`]) is first asked for again
//! from the replay endpoint (the engine may hold it whole); only when that fails does the record
//! clear at that point, counted as a resync. The seq of a damaged batch counts as received, so it
//! never turns into a gap that clears the whole record later.
//!
//! Bounds: a message over [`MAX_MESSAGE_BYTES`] makes libzmq drop the connection (which then
//! resyncs like any reconnect); a replay keeps at most [`MAX_REPLAY_BATCHES`] batches and
//! [`MAX_REPLAY_BYTES`] of payload, else it counts as failed. Warnings about damage are
//! rate-limited per engine ([`DAMAGE_WARN_EVERY`]; unknown type names: once each).
//!
//! All sockets share one ZeroMQ context (one libzmq I/O thread and one reaper for the node).
//! `connect()` returns at once even when the engine is not up; libzmq reconnects by itself
//! (0.2–0.3 s after a publisher restart). The thread exits when every sink reports itself closed
//! or `stop` is set (looked at on every pass, and every [`IDLE_WAKE_MS`] when idle).
//!
//! Engines come and go while the thread runs ([`spawn_dynamic`], docs/design.md §14): a
//! [`ReaderHandle`] queues an add or a removal and wakes the thread through an in-process PAIR
//! socket polled with the SUBs, so a change applies at once when idle and after the current pass
//! when busy. A removed engine's sockets close at once (linger 0); an engine whose sink closed
//! is dropped the same way. An added engine's history is replayed when its SUB first connects
//! (the engine is up), not when it is added: a pod whose engine is still loading its model does
//! not hold the thread for the replay timeout. The thread of [`spawn_dynamic`] runs, idle if it
//! has no engine, until `stop` or until its handle is dropped and no engine is left.

use super::kv_events::{KvEvent, KvMessage, ReplayFrame, decode_message, decode_replay};
use crate::telemetry::{AgentMetrics, pod_label, pod_reason_labels};
use prometheus_client::metrics::counter::Counter;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Receives what the reader thread decodes for one engine, in seq order, on the reader thread
/// (so implementations must not block for long: no socket is read meanwhile).
pub trait EventSink: Send + 'static {
    /// A batch, in seq order (duplicates already dropped).
    fn batch(&mut self, msg: KvMessage);
    /// Events were lost beyond replay or the engine restarted: clear the pod's record.
    fn reset(&mut self, reason: &str);
    /// End of a read pass that handed this sink batches or a reset: send what they changed.
    fn flush(&mut self);
    /// True when nobody consumes the events any more: the thread exits once every sink is.
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

/// Errors that stop the reader thread.
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

/// Starts the reader thread for `engines` (each: where to read, where its batches go), reading
/// in passes at most one `window` apart (see the module docs).
pub fn spawn<S: EventSink>(
    ctx: zmq::Context,
    engines: Vec<(SubscriberConfig, S)>,
    window: Duration,
    metrics: Arc<AgentMetrics>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    start_thread(ctx, engines, None, window, metrics, stop)
}

/// Starts the reader thread with no engine; engines are added and removed through the returned
/// [`ReaderHandle`] (see the module docs).
///
/// # Errors
/// The wake-up sockets could not be set up, or the thread could not start.
pub fn spawn_dynamic<S: EventSink>(
    ctx: zmq::Context,
    window: Duration,
    metrics: Arc<AgentMetrics>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<(std::thread::JoinHandle<()>, ReaderHandle<S>)> {
    let io = |e: zmq::Error| std::io::Error::other(format!("kv-event reader wake-up socket: {e}"));
    let endpoint = format!("inproc://kv-reader-wake-{}", MONITOR_IDS.fetch_add(1, Ordering::Relaxed));
    // Bound before the handle's side connects (inproc needs the bind first on older libzmq).
    let wake_rx = ctx.socket(zmq::PAIR).map_err(io)?;
    wake_rx.set_linger(0).map_err(io)?;
    wake_rx.bind(&endpoint).map_err(io)?;
    let wake_tx = ctx.socket(zmq::PAIR).map_err(io)?;
    wake_tx.set_linger(0).map_err(io)?;
    wake_tx.set_sndhwm(1).map_err(io)?;
    wake_tx.connect(&endpoint).map_err(io)?;
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = start_thread(ctx, Vec::new(), Some(Control { rx, wake: wake_rx }), window, metrics, stop)?;
    Ok((thread, ReaderHandle { tx, wake: parking_lot::Mutex::new(wake_tx) }))
}

fn start_thread<S: EventSink>(
    ctx: zmq::Context,
    engines: Vec<(SubscriberConfig, S)>,
    control: Option<Control<S>>,
    window: Duration,
    metrics: Arc<AgentMetrics>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("kv-events".into()).spawn(move || {
        let mut reader = Reader {
            ctx,
            engines: Vec::with_capacity(engines.len()),
            window,
            parts: Vec::new(),
            control,
            awaiting_connect: Vec::new(),
            metrics,
        };
        for (cfg, sink) in engines {
            match Engine::open(&reader.ctx, cfg, sink, &reader.metrics) {
                Ok(e) => reader.engines.push(e),
                Err(e) => tracing::error!(error = %e, "KV-event subscriber not started"),
            }
        }
        if let Err(e) = reader.run(&stop) {
            tracing::error!(error = %e, "KV-event reader stopped");
        }
    })
}

/// A change to a running reader's engines.
enum Change<S> {
    Add(SubscriberConfig, S),
    Remove(String),
}

/// The reader's side of [`ReaderHandle`].
struct Control<S> {
    rx: std::sync::mpsc::Receiver<Change<S>>,
    /// Readable when the handle queued changes.
    wake: zmq::Socket,
}

/// Adds and removes engines of a reader thread started by [`spawn_dynamic`]. Dropping it lets
/// the thread end once its last engine is gone.
pub struct ReaderHandle<S> {
    tx: std::sync::mpsc::Sender<Change<S>>,
    /// The PAIR whose message wakes the thread's poll (held only to send, never across awaits).
    wake: parking_lot::Mutex<zmq::Socket>,
}

impl<S: EventSink> ReaderHandle<S> {
    /// Subscribes to a new engine (`cfg.pod` names it; an engine of that name is replaced).
    /// Returns false when the thread is gone.
    pub fn add(&self, cfg: SubscriberConfig, sink: S) -> bool {
        self.send(Change::Add(cfg, sink))
    }

    /// Unsubscribes from the engine `pod` (its sockets close). Returns false when the thread is
    /// gone.
    pub fn remove(&self, pod: &str) -> bool {
        self.send(Change::Remove(pod.to_string()))
    }

    fn send(&self, change: Change<S>) -> bool {
        if self.tx.send(change).is_err() {
            return false;
        }
        // One pending wake-up is enough (high-water mark 1): EAGAIN means one is queued already.
        let _ = self.wake.lock().send(&b""[..], zmq::DONTWAIT);
        true
    }
}

fn zerr<'a>(what: &'static str, endpoint: &'a str) -> impl FnOnce(zmq::Error) -> SubscriberError + 'a {
    move |source| SubscriberError::Zmq { what, endpoint: endpoint.to_string(), source }
}

/// How long the thread waits in `poll` before it looks at `stop` again (ms): the only wake-up of
/// an idle node, so it is long (an idle node should cost next to nothing; at 100 ms per engine,
/// 8 engines would wake 80 times a second doing nothing); a batch or a monitor event wakes it at
/// once.
const IDLE_WAKE_MS: i64 = 500;

/// Most batches read from one engine in one pass, so an engine that publishes faster than the
/// thread decodes cannot starve the others (the rest wait for the next pass).
const MAX_BATCHES_PER_PASS: usize = 4096;

/// Largest KV-event message accepted (bytes; libzmq's `ZMQ_MAXMSGSIZE`). A vLLM batch covers one
/// engine step, at most `max_num_batched_tokens` new tokens at about 5 bytes each plus 9 per
/// block hash: 16 MiB is over 3 M tokens in one step.
pub const MAX_MESSAGE_BYTES: i64 = 16 << 20;

/// Most batches one replay keeps (vLLM buffers 10 000 steps by default).
pub const MAX_REPLAY_BATCHES: usize = 20_000;

/// Most payload bytes one replay keeps.
pub const MAX_REPLAY_BYTES: usize = 256 << 20;

/// Shortest time between two warnings about damaged batches from one engine (the counters
/// count every one).
pub const DAMAGE_WARN_EVERY: Duration = Duration::from_secs(10);

/// Unknown event type names remembered per engine, each warned about once.
const WARNED_TYPES: usize = 16;

/// One engine's sockets, sink and sequence state.
struct Engine<S> {
    cfg: SubscriberConfig,
    sink: S,
    sub: zmq::Socket,
    monitor: zmq::Socket,
    link: LinkState,
    st: SeqState,
    /// Got batches or a reset in this pass: flush at its end.
    dirty: bool,
    // Hot-path counters resolved once (a family lookup hashes the labels under a lock).
    received: Counter,
    malformed: Counter,
    replayed: Counter,
    resyncs: Counter,
    skipped_unknown: Counter,
    skipped_unreadable: Counter,
    skipped_untrusted: Counter,
    /// Unknown event types already warned about.
    warned_types: Vec<String>,
    /// Last warning about a damaged batch.
    last_damage_warn: Option<Instant>,
}

impl<S: EventSink> Engine<S> {
    fn open(
        ctx: &zmq::Context,
        cfg: SubscriberConfig,
        sink: S,
        metrics: &AgentMetrics,
    ) -> Result<Self, SubscriberError> {
        let monitor_endpoint = format!("inproc://kv-sub-monitor-{}", MONITOR_IDS.fetch_add(1, Ordering::Relaxed));
        let monitor_endpoint = monitor_endpoint.as_str();
        let ep = cfg.kv_events.as_str();
        let sub = ctx.socket(zmq::SUB).map_err(zerr("socket", ep))?;
        sub.set_subscribe(b"").map_err(zerr("subscribe", ep))?;
        sub.set_linger(0).map_err(zerr("linger", ep))?;
        sub.set_maxmsgsize(MAX_MESSAGE_BYTES).map_err(zerr("maxmsgsize", ep))?;
        // Monitor before connect, so the first CONNECTED is seen too.
        let events = zmq::SocketEvent::CONNECTED.to_raw() | zmq::SocketEvent::DISCONNECTED.to_raw();
        sub.monitor(monitor_endpoint, i32::from(events)).map_err(zerr("monitor", ep))?;
        let monitor = ctx.socket(zmq::PAIR).map_err(zerr("socket", monitor_endpoint))?;
        monitor.set_linger(0).map_err(zerr("linger", monitor_endpoint))?;
        monitor.connect(monitor_endpoint).map_err(zerr("connect", monitor_endpoint))?;
        sub.connect(ep).map_err(zerr("connect", ep))?;
        let labels = pod_label(&cfg.pod);
        // One statement each: a family's read guard lives to the end of its statement, and a
        // second get_or_create on the same family in that statement would wait for it for ever.
        let skipped = |reason| metrics.kv_events_skipped.get_or_create(&pod_reason_labels(&cfg.pod, reason)).clone();
        let skipped_unknown = skipped("unknown_type");
        let skipped_unreadable = skipped("unreadable");
        let skipped_untrusted = skipped("untrusted");
        Ok(Self {
            received: metrics.kv_events_received.get_or_create(&labels).clone(),
            malformed: metrics.kv_events_malformed.get_or_create(&labels).clone(),
            replayed: metrics.kv_events_replayed.get_or_create(&labels).clone(),
            resyncs: metrics.kv_resyncs.get_or_create(&labels).clone(),
            skipped_unknown,
            skipped_unreadable,
            skipped_untrusted,
            warned_types: Vec::new(),
            last_damage_warn: None,
            cfg,
            sink,
            sub,
            monitor,
            link: LinkState::default(),
            st: SeqState { last: None, dup_upto: None },
            dirty: false,
        })
    }

    /// Hands `m` to the sink unless it is a duplicate.
    fn forward(&mut self, m: KvMessage) {
        if self.st.last.is_some_and(|l| m.seq <= l) {
            return;
        }
        self.st.last = Some(m.seq);
        self.dirty = true;
        self.note_damage(&m);
        self.sink.batch(m);
    }

    /// Counts and logs what the decoder skipped or lost in `m` (the batch itself still goes to
    /// the sink: its record clears at each [`KvEvent::Untrusted`]).
    fn note_damage(&mut self, m: &KvMessage) {
        let d = &m.batch.damage;
        let untrusted: Vec<&str> = m
            .batch
            .events
            .iter()
            .filter_map(|e| match e {
                KvEvent::Untrusted(why) => Some(why.as_str()),
                _ => None,
            })
            .collect();
        if d.is_none() && untrusted.is_empty() {
            return;
        }
        let pod = self.cfg.pod.as_str();
        self.skipped_unknown.inc_by(u64::from(d.unknown_events));
        self.skipped_unreadable.inc_by(u64::from(d.skipped_events));
        self.skipped_untrusted.inc_by(untrusted.len() as u64);
        self.resyncs.inc_by(untrusted.len() as u64);
        for name in &d.unknown_types {
            if self.warned_types.len() < WARNED_TYPES && !self.warned_types.contains(name) {
                self.warned_types.push(name.clone());
                tracing::warn!(pod, seq = m.seq, event_type = %name, "KV events of an unknown type skipped (newer vLLM?)");
            }
        }
        if d.skipped_events == 0 && untrusted.is_empty() {
            return;
        }
        let now = Instant::now();
        if self.last_damage_warn.is_some_and(|t| now.duration_since(t) < DAMAGE_WARN_EVERY) {
            tracing::debug!(pod, seq = m.seq, skipped = d.skipped_events, untrusted = ?untrusted, "damaged KV-event batch");
            return;
        }
        self.last_damage_warn = Some(now);
        if let Some(why) = untrusted.first() {
            tracing::warn!(pod, seq = m.seq, reason = %why, "KV events lost that may have removed blocks: clearing the pod's record (rebuilt from new events)");
        }
        if let Some(why) = &d.first_skip_reason {
            tracing::warn!(pod, seq = m.seq, skipped = d.skipped_events, reason = %why, "unreadable KV events skipped (their blocks are not claimed)");
        }
    }

    fn reset(&mut self, reason: &str) {
        self.resyncs.inc();
        self.sink.reset(reason);
        self.st.last = None;
        self.dirty = true;
    }

    /// Forwards a whole replay history (seq ≥ 0) and marks it, so the live copies of those
    /// batches are dropped as duplicates rather than taken for a restart.
    fn forward_history(&mut self, history: Vec<KvMessage>) {
        for m in history {
            self.replayed.inc();
            self.forward(m);
        }
        self.st.dup_upto = self.st.last;
    }

    /// One live message: decode, drop duplicates, detect restarts and gaps (replaying these),
    /// forward.
    fn handle(&mut self, ctx: &zmq::Context, frames: &[zmq::Message]) {
        let msg = match decode_message(frames) {
            Ok(m) => m,
            Err(e) => {
                self.malformed.inc();
                tracing::warn!(pod = %self.cfg.pod, error = %e, "malformed KV-event message skipped");
                return;
            }
        };
        self.received.inc();
        // Live batches that a replay already delivered are duplicates, not an engine restart.
        if let Some(upto) = self.st.dup_upto {
            if msg.seq <= upto {
                return;
            }
            self.st.dup_upto = None;
        }
        match self.st.last {
            Some(last) if msg.seq <= last => {
                tracing::warn!(pod = %self.cfg.pod, last, seq = msg.seq, "KV-event seq went back: engine restart, clearing");
                self.reset("seq went back");
            }
            Some(last) if msg.seq > last + 1 => {
                let from = last + 1;
                let got = replay(ctx, &[(&self.cfg, from)]).pop().flatten().unwrap_or_default();
                let filled: Vec<KvMessage> = got.into_iter().filter(|m| m.seq >= from && m.seq < msg.seq).collect();
                let contiguous = filled.iter().enumerate().all(|(i, m)| m.seq == from + i as u64)
                    && filled.len() as u64 == msg.seq - from;
                if contiguous {
                    tracing::info!(pod = %self.cfg.pod, from, to = msg.seq - 1, "KV-event gap filled by replay");
                    for m in filled {
                        self.replayed.inc();
                        self.forward(m);
                    }
                } else {
                    tracing::warn!(pod = %self.cfg.pod, from, to = msg.seq - 1, "KV-event gap not replayable, clearing");
                    self.reset("gap beyond replay");
                }
            }
            _ => {}
        }
        let msg = if msg.batch.untrusted() { self.whole_copy(ctx, msg) } else { msg };
        self.forward(msg);
    }

    /// A batch that lost events: the replay endpoint's copy of it when that one is whole, else
    /// the batch as it is.
    fn whole_copy(&mut self, ctx: &zmq::Context, msg: KvMessage) -> KvMessage {
        if self.cfg.kv_replay.is_none() {
            return msg;
        }
        let got = replay(ctx, &[(&self.cfg, msg.seq)]).pop().flatten().unwrap_or_default();
        match got.into_iter().find(|m| m.seq == msg.seq && !m.batch.untrusted()) {
            Some(whole) => {
                tracing::info!(pod = %self.cfg.pod, seq = msg.seq, "damaged KV-event batch replaced by its replayed copy");
                self.replayed.inc();
                whole
            }
            None => msg,
        }
    }
}

/// The reader thread's state.
struct Reader<S> {
    ctx: zmq::Context,
    engines: Vec<Engine<S>>,
    window: Duration,
    /// Frames of the current message, reused: no allocation or copy per frame on our side.
    parts: Vec<zmq::Message>,
    /// Changes from a [`ReaderHandle`], while it lives.
    control: Option<Control<S>>,
    /// Engines added while running whose SUB has not connected yet: their history is replayed
    /// when it does.
    awaiting_connect: Vec<String>,
    metrics: Arc<AgentMetrics>,
}

impl<S: EventSink> Reader<S> {
    fn run(&mut self, stop: &AtomicBool) -> Result<(), SubscriberError> {
        // History the engines still buffer (we may have started after them), all at once.
        let all: Vec<usize> = (0..self.engines.len()).collect();
        self.replay_histories(&all);
        self.flush();
        loop {
            self.apply_changes();
            if stop.load(Ordering::Relaxed) || (self.control.is_none() && self.engines.is_empty()) {
                return Ok(());
            }
            // Idle: wait for any engine's first batch (or a change).
            let ready = {
                let mut items: Vec<zmq::PollItem<'_>> =
                    self.engines.iter().map(|e| e.sub.as_poll_item(zmq::POLLIN)).collect();
                if let Some(c) = &self.control {
                    items.push(c.wake.as_poll_item(zmq::POLLIN));
                }
                let n = match zmq::poll(&mut items, IDLE_WAKE_MS) {
                    Ok(n) => n,
                    Err(zmq::Error::ETERM) => return Ok(()),
                    Err(zmq::Error::EINTR) => continue,
                    Err(e) => return Err(zerr("poll", "kv-event sockets")(e)),
                };
                let woken = self.control.is_some() && items.last().is_some_and(zmq::PollItem::is_readable);
                if woken { n - 1 } else { n }
            };
            self.drain_wake();
            if ready == 0 {
                // Reconnects without traffic (an engine restarted and is silent) still resync.
                self.check_links(&(0..self.engines.len()).collect::<Vec<_>>());
                self.flush();
                continue;
            }
            // Busy: one pass per window (a batch waits at most one window) for as long as
            // passes find batches; no poll in between, so no per-socket readiness checks.
            loop {
                std::thread::sleep(self.window);
                let Some(read) = self.pass()? else { return Ok(()) };
                self.flush();
                self.drain_wake();
                self.apply_changes();
                if read == 0 || stop.load(Ordering::Relaxed) || self.engines.is_empty() {
                    break;
                }
            }
        }
    }

    /// Empties the wake-up socket (its messages carry nothing; the changes are in the channel).
    fn drain_wake(&mut self) {
        if let Some(c) = &self.control {
            while c.wake.recv_bytes(zmq::DONTWAIT).is_ok() {}
        }
    }

    /// Applies queued changes and drops engines whose sink closed; forgets the handle once it is
    /// gone.
    fn apply_changes(&mut self) {
        let mut gone = false;
        let mut changes = Vec::new();
        if let Some(c) = &self.control {
            loop {
                match c.rx.try_recv() {
                    Ok(change) => changes.push(change),
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        gone = true;
                        break;
                    }
                }
            }
        }
        if gone {
            self.control = None;
        }
        for change in changes {
            match change {
                Change::Add(cfg, sink) => {
                    let pod = cfg.pod.clone();
                    self.drop_engine(&pod);
                    match Engine::open(&self.ctx, cfg, sink, &self.metrics) {
                        Ok(e) => {
                            tracing::info!(pod = %pod, endpoint = %e.cfg.kv_events, "KV-event subscription added");
                            self.engines.push(e);
                            self.awaiting_connect.push(pod);
                        }
                        Err(e) => tracing::error!(pod = %pod, error = %e, "KV-event subscriber not started"),
                    }
                }
                Change::Remove(pod) => {
                    if self.drop_engine(&pod) {
                        tracing::info!(pod = %pod, "KV-event subscription closed");
                    }
                }
            }
        }
        let before = self.engines.len();
        self.engines.retain(|e| !e.sink.is_closed());
        if self.engines.len() != before {
            let open: Vec<&str> = self.engines.iter().map(|e| e.cfg.pod.as_str()).collect();
            self.awaiting_connect.retain(|p| open.contains(&p.as_str()));
        }
    }

    /// Closes the engine `pod`'s sockets; whether it was there.
    fn drop_engine(&mut self, pod: &str) -> bool {
        self.awaiting_connect.retain(|p| p != pod);
        let before = self.engines.len();
        self.engines.retain(|e| e.cfg.pod != pod);
        self.engines.len() != before
    }

    /// Reads the monitors of the engines at `which`; resets and replays those that reconnected,
    /// replays those added while running that connected for the first time.
    fn check_links(&mut self, which: &[usize]) {
        let reconnected: Vec<usize> = which
            .iter()
            .copied()
            .filter(|&i| self.engines.get_mut(i).is_some_and(|e| e.link.poll(&e.monitor)))
            .collect();
        let first: Vec<usize> = which
            .iter()
            .copied()
            .filter(|&i| {
                self.engines.get(i).is_some_and(|e| e.link.connected && self.awaiting_connect.contains(&e.cfg.pod))
            })
            .collect();
        if !first.is_empty() {
            for &i in &first {
                if let Some(e) = self.engines.get(i) {
                    let pod = e.cfg.pod.clone();
                    self.awaiting_connect.retain(|p| *p != pod);
                }
            }
            self.replay_histories(&first);
        }
        for &i in &reconnected {
            if let Some(e) = self.engines.get_mut(i) {
                tracing::warn!(pod = %e.cfg.pod, "KV-event publisher reconnected (engine may have restarted): clearing, replaying");
                e.reset("publisher reconnected");
            }
        }
        self.replay_histories(&reconnected);
    }

    /// Reads every engine's queued batches; the number read, `None` when the context was
    /// terminated. An engine's monitor is read before its first batch of the pass, so a
    /// reconnect (possibly a new engine process) is handled before that engine's new batches.
    fn pass(&mut self) -> Result<Option<usize>, SubscriberError> {
        let mut read = 0;
        for i in 0..self.engines.len() {
            for n in 0..MAX_BATCHES_PER_PASS {
                let Some(e) = self.engines.get_mut(i) else { break };
                let got = match recv_parts(&e.sub, &mut self.parts) {
                    Ok(got) => got,
                    Err(zmq::Error::EAGAIN) => break,
                    Err(zmq::Error::ETERM) => return Ok(None),
                    Err(err) => return Err(zerr("recv", &e.cfg.kv_events)(err)),
                };
                if n == 0 {
                    self.check_links(&[i]);
                }
                let (Some(e), Some(frames)) = (self.engines.get_mut(i), self.parts.get(..got)) else { break };
                e.handle(&self.ctx, frames);
                read += 1;
            }
        }
        Ok(Some(read))
    }

    /// Replays the whole buffered history of the engines at `which` (indices), concurrently.
    fn replay_histories(&mut self, which: &[usize]) {
        let with_replay: Vec<usize> =
            which.iter().copied().filter(|&i| self.engines.get(i).is_some_and(|e| e.cfg.kv_replay.is_some())).collect();
        if with_replay.is_empty() {
            return;
        }
        let requests: Vec<(&SubscriberConfig, u64)> =
            with_replay.iter().filter_map(|&i| self.engines.get(i)).map(|e| (&e.cfg, 0)).collect();
        let histories = replay(&self.ctx, &requests);
        for (i, history) in with_replay.into_iter().zip(histories) {
            if let Some(e) = self.engines.get_mut(i) {
                e.forward_history(history.unwrap_or_default());
            }
        }
    }

    /// Ends a pass: every engine that got batches or a reset sends its changes.
    fn flush(&mut self) {
        for e in &mut self.engines {
            if std::mem::take(&mut e.dirty) {
                e.sink.flush();
            }
        }
    }
}

/// Receives one queued multipart message into `parts` (grown as needed, messages reused) without
/// waiting; returns its frame count, or `EAGAIN` when nothing is queued. The frames of a
/// multipart message arrive together, so only the first can be missing.
fn recv_parts(sock: &zmq::Socket, parts: &mut Vec<zmq::Message>) -> Result<usize, zmq::Error> {
    let mut n = 0;
    loop {
        if parts.len() == n {
            parts.push(zmq::Message::new());
        }
        let Some(part) = parts.get_mut(n) else { return Ok(n) };
        sock.recv(part, zmq::DONTWAIT)?;
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

/// Connection history of a SUB socket, from its monitor events.
#[derive(Default)]
struct LinkState {
    disconnected: bool,
    /// Connected at least once.
    connected: bool,
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
            if id == zmq::SocketEvent::CONNECTED.to_raw() {
                self.connected = true;
            }
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

/// One replay request in flight.
struct Pending<'a> {
    cfg: &'a SubscriberConfig,
    /// `None`: no replay endpoint, or the request failed.
    dealer: Option<zmq::Socket>,
    deadline: Instant,
    out: Vec<KvMessage>,
    /// Payload bytes in `out`.
    bytes: usize,
    done: bool,
}

/// Asks each engine's replay endpoint for every buffered batch with seq ≥ its `from`, all
/// requests at once, each bounded by its engine's `replay_timeout`. Per request, in order:
/// `None` when there is no replay endpoint or it did not answer in time; replies in seq order.
fn replay(ctx: &zmq::Context, requests: &[(&SubscriberConfig, u64)]) -> Vec<Option<Vec<KvMessage>>> {
    let start = Instant::now();
    let mut pending: Vec<Pending<'_>> = requests
        .iter()
        .map(|&(cfg, from)| {
            let dealer = cfg.kv_replay.as_deref().and_then(|endpoint| {
                let open = || -> Result<zmq::Socket, zmq::Error> {
                    let dealer = ctx.socket(zmq::DEALER)?;
                    dealer.set_linger(0)?;
                    dealer.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
                    dealer.connect(endpoint)?;
                    dealer.send_multipart([&b""[..], &from.to_be_bytes()[..]], 0)?;
                    Ok(dealer)
                };
                open().map_err(|e| tracing::warn!(pod = %cfg.pod, endpoint, error = %e, "replay failed")).ok()
            });
            Pending { cfg, dealer, deadline: start + cfg.replay_timeout, out: Vec::new(), bytes: 0, done: false }
        })
        .collect();
    loop {
        let now = Instant::now();
        let waiting: Vec<usize> = (0..pending.len())
            .filter(|&i| pending[i].dealer.is_some() && !pending[i].done && now < pending[i].deadline)
            .collect();
        let Some(next_deadline) = waiting.iter().map(|&i| pending[i].deadline).min() else { break };
        let timeout_ms = next_deadline.saturating_duration_since(now).as_millis().clamp(1, 60_000) as i64;
        let readable: Vec<usize> = {
            let mut items: Vec<zmq::PollItem<'_>> = waiting
                .iter()
                .filter_map(|&i| pending[i].dealer.as_ref().map(|d| d.as_poll_item(zmq::POLLIN)))
                .collect();
            if let Err(e) = zmq::poll(&mut items, timeout_ms) {
                tracing::warn!(error = %e, "replay poll failed");
                break;
            }
            waiting.iter().zip(&items).filter(|(_, item)| item.is_readable()).map(|(&i, _)| i).collect()
        };
        for i in readable {
            let p = &mut pending[i];
            while let Some(dealer) = &p.dealer {
                let frames = match dealer.recv_multipart(zmq::DONTWAIT) {
                    Ok(f) => f,
                    Err(zmq::Error::EAGAIN) => break,
                    Err(e) => {
                        tracing::warn!(pod = %p.cfg.pod, error = %e, "replay failed");
                        p.dealer = None;
                        break;
                    }
                };
                p.bytes += frames.iter().map(Vec::len).sum::<usize>();
                if p.out.len() >= MAX_REPLAY_BATCHES || p.bytes > MAX_REPLAY_BYTES {
                    tracing::warn!(pod = %p.cfg.pod, batches = p.out.len(), bytes = p.bytes, "replay larger than its bounds: abandoned");
                    p.dealer = None;
                    p.out = Vec::new();
                    break;
                }
                match decode_replay(&frames) {
                    Ok(ReplayFrame::End) => {
                        p.done = true;
                        break;
                    }
                    Ok(ReplayFrame::Batch(m)) => p.out.push(m),
                    Err(e) => tracing::warn!(pod = %p.cfg.pod, error = %e, "malformed replay reply skipped"),
                }
            }
        }
    }
    pending
        .into_iter()
        .map(|p| {
            if p.done {
                Some(p.out)
            } else {
                if p.dealer.is_some() {
                    tracing::warn!(pod = %p.cfg.pod, endpoint = p.cfg.kv_replay.as_deref().unwrap_or(""), "replay timed out");
                }
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
