//! Time and count bounds of the picker's listeners (every outside input is bounded in size,
//! count and time: docs/decisions/0024-bounded-outside-input.md). The `limits:` section of the
//! picker's config file:
//!
//! ```yaml
//! limits:
//!   body_timeout_ms: 30000          # ext_proc: request headers → end of body, else 408
//!   keepalive_ms: 10000             # ext_proc + ingest: HTTP/2 PING interval
//!   keepalive_timeout_ms: 20000     # ... and the wait for its answer before closing
//!   ext_proc_max_streams: 4096      # ext_proc: concurrent streams per connection
//!   ext_proc_max_connections: 4096  # ext_proc: open connections (past it: closed at accept)
//!   ext_proc_first_stream_ms: 10000 # ext_proc: accept → first stream (TLS, preface, HEADERS)
//!   ext_proc_idle_ms: 300000        # ext_proc: a connection with no open stream this long closes
//!   admin_header_timeout_ms: 10000  # admin HTTP: request head / idle keep-alive
//!   admin_max_connections: 256      # admin HTTP: open connections
//!   max_report_age_ms: 10000        # agent stats older than this count as unknown
//!   unreachable_probe_ms: 200       # probe period of endpoints Envoy could not connect to
//!   frozen_engine_ms: 5000          # a busy engine silent this long is frozen: its requests 503
//!   max_messages: 16384             # chat / responses: messages (413 past it)
//!   max_content_parts: 65536        # ... content parts over all messages
//!   max_tools: 1024                 # ... tools
//!   max_rendered_prompt_bytes: 33554432  # ... chat template output, checked before tokenizing
//!   max_tokenize_ms: 10000          # one large body's decision (413 past it)
//!   max_concurrent_tokenizations: 0 # large bodies decided at once (0: half the cores, at least 1)
//! ```
//!
//! - A stream that sends request headers and then no body, or part of a body and stalls, holds
//!   memory (up to `body_limit_bytes`) and a stream: after `body_timeout_ms` it gets a 408
//!   immediate response and ends.
//! - HTTP/2 keepalive finds a peer that vanished without closing (a SIGSTOPped or partitioned
//!   agent or Envoy) within `keepalive_ms + keepalive_timeout_ms`: the connection closes, its
//!   streams end (an agent's pods enter the grace period, an Envoy stream releases its slot).
//! - The admin listener closes a connection whose request head does not arrive in
//!   `admin_header_timeout_ms` and keeps at most `admin_max_connections` open (the oldest slow
//!   one is closed first), so half-sent requests cannot starve `/healthz`.
//! - The ext_proc listener keeps at most `ext_proc_max_connections` open, and fewer when the
//!   process's file-descriptor limit would not leave [`fd_reserve`] descriptors for the other
//!   listeners, the watchers and the tokenizers ([`Limits::ext_proc_connection_cap`]); a connection
//!   past the cap is closed at accept. A connection that opens no stream within
//!   `ext_proc_first_stream_ms` (a half-open socket, a partial HTTP/2 preface, a stalled TLS
//!   handshake) is closed, and so is one with no open stream for `ext_proc_idle_ms`
//!   ([`crate::ext_proc::conn`]). [`raise_nofile_limit`] raises the soft descriptor limit to the
//!   hard one at start.
//! - A request body is refused with 413 before it is rendered or tokenized when it holds more
//!   messages, content parts or tools than `max_messages`, `max_content_parts`, `max_tools`, and
//!   before tokenizing when its rendered chat prompt is over `max_rendered_prompt_bytes`. Bodies of
//!   [`CANCELLABLE_BODY_BYTES`](crate::ext_proc::CANCELLABLE_BODY_BYTES) or more are decided at
//!   most `max_concurrent_tokenizations` at a time, off the async workers (a request waits for its
//!   turn at most `max_tokenize_ms`, then 503), and each decision is stopped after
//!   `max_tokenize_ms` (413), so huge bodies cannot starve the other requests' decisions.
//! - A pod whose agent sent no stats for `max_report_age_ms` (a SIGSTOPped or wedged agent whose
//!   TCP connection still stands) has its figures counted as unknown: health at most 0.5
//!   ("agent report stale") and every in-flight request in its queue depth.
//! - A pod Envoy could not connect to (its local 503 "upstream connect error", seen in the
//!   response phase of the request the picker routed there) leaves the candidates at once and
//!   returns when it answers HTTP again (`GET /health`, any status), tried every
//!   `unreachable_probe_ms`.
//! - A pod with requests in flight whose engine has answered no `GET /health` for
//!   `frozen_engine_ms` (SIGSTOPped, wedged) is frozen: marked unreachable, and its requests end
//!   with a 503 at once instead of waiting for Envoy's route timeout ([`crate::frozen`]).

use serde::Deserialize;
use std::time::Duration;

/// Default [`Limits::body_timeout_ms`].
pub const DEFAULT_BODY_TIMEOUT_MS: u64 = 30_000;
/// Default [`Limits::keepalive_ms`].
pub const DEFAULT_KEEPALIVE_MS: u64 = 10_000;
/// Default [`Limits::keepalive_timeout_ms`].
pub const DEFAULT_KEEPALIVE_TIMEOUT_MS: u64 = 20_000;
/// Default [`Limits::ext_proc_max_streams`].
pub const DEFAULT_EXT_PROC_MAX_STREAMS: u32 = 4096;

/// Default [`Limits::ext_proc_max_connections`].
pub const DEFAULT_EXT_PROC_MAX_CONNECTIONS: usize = 4096;
/// Default [`Limits::ext_proc_first_stream_ms`].
pub const DEFAULT_EXT_PROC_FIRST_STREAM_MS: u64 = 10_000;
/// Default [`Limits::ext_proc_idle_ms`].
pub const DEFAULT_EXT_PROC_IDLE_MS: u64 = 300_000;

/// The `limits:` section (see the module doc). Every field is optional.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Longest time, in ms, from an ext_proc stream's request headers to the end of its request
    /// body; past it the request gets a 408 and the stream ends. Default
    /// [`DEFAULT_BODY_TIMEOUT_MS`] (30 000).
    pub body_timeout_ms: u64,
    /// HTTP/2 keepalive PING interval, ms, on the ext_proc and ingest listeners. Default
    /// [`DEFAULT_KEEPALIVE_MS`] (10 000).
    pub keepalive_ms: u64,
    /// How long, in ms, a keepalive PING may go unanswered before the connection is closed.
    /// Default [`DEFAULT_KEEPALIVE_TIMEOUT_MS`] (20 000).
    pub keepalive_timeout_ms: u64,
    /// Most concurrent ext_proc streams (requests) on one connection from Envoy. Default
    /// [`DEFAULT_EXT_PROC_MAX_STREAMS`] (4096).
    pub ext_proc_max_streams: u32,
    /// Most open ext_proc connections (Envoy opens a few per worker thread); a connection past it
    /// is closed at accept. Lowered at start to leave [`fd_reserve`] descriptors free. Default
    /// [`DEFAULT_EXT_PROC_MAX_CONNECTIONS`] (4096).
    pub ext_proc_max_connections: usize,
    /// Longest time, in ms, from an ext_proc connection's accept to its first stream's headers
    /// (TLS handshake and HTTP/2 preface included); past it the connection is closed. Default
    /// [`DEFAULT_EXT_PROC_FIRST_STREAM_MS`] (10 000).
    pub ext_proc_first_stream_ms: u64,
    /// Longest time, in ms, an ext_proc connection may stay with no open stream; past it the
    /// connection is closed (Envoy opens a new one when it needs it). Default
    /// [`DEFAULT_EXT_PROC_IDLE_MS`] (300 000).
    pub ext_proc_idle_ms: u64,
    /// Admin listener: longest wait, ms, for a request head (also the idle timeout between
    /// kept-alive requests). Default 10 000.
    pub admin_header_timeout_ms: u64,
    /// Admin listener: most open connections (past it the oldest one that sent no request head
    /// is closed). Default 256.
    pub admin_max_connections: usize,
    /// Age, in ms, past which a pod's last stats report counts as unknown (health at most 0.5,
    /// every in-flight request queued). Default 10 000
    /// ([`DEFAULT_MAX_REPORT_AGE_MS`](crate::pool::DEFAULT_MAX_REPORT_AGE_MS)).
    pub max_report_age_ms: u64,
    /// Period, in ms, of the TCP connect probe to endpoints Envoy could not connect to (each
    /// probe bounded by the same time). Default [`DEFAULT_UNREACHABLE_PROBE_MS`] (200).
    pub unreachable_probe_ms: u64,
    /// How long, in ms, a pod with requests in flight may leave `GET /health` unanswered before
    /// it counts as frozen (its requests get a 503, it leaves the candidates). Default
    /// [`DEFAULT_FROZEN_ENGINE_MS`] (5 000).
    pub frozen_engine_ms: u64,
    /// Most chat `messages` in one request (413 past it, before rendering). Default 16 384.
    pub max_messages: usize,
    /// Most content parts over all messages of one request (413). Default 65 536.
    pub max_content_parts: usize,
    /// Most `tools` in one request (413). Default 1 024.
    pub max_tools: usize,
    /// Longest chat-template output, bytes, tokenized (413 past it, before tokenizing). Default
    /// 32 MiB.
    pub max_rendered_prompt_bytes: usize,
    /// Longest decision of one large body, ms (413 past it); also the longest wait for a
    /// tokenization slot (503 past it). Default 10 000.
    pub max_tokenize_ms: u64,
    /// Most large bodies decided at once; 0 means half the cores, at least 1. Default 0.
    pub max_concurrent_tokenizations: usize,
}

/// Default [`Limits::frozen_engine_ms`].
pub const DEFAULT_FROZEN_ENGINE_MS: u64 = 5_000;

/// Default [`Limits::unreachable_probe_ms`].
pub const DEFAULT_UNREACHABLE_PROBE_MS: u64 = 200;

impl Default for Limits {
    fn default() -> Self {
        Self {
            body_timeout_ms: DEFAULT_BODY_TIMEOUT_MS,
            keepalive_ms: DEFAULT_KEEPALIVE_MS,
            keepalive_timeout_ms: DEFAULT_KEEPALIVE_TIMEOUT_MS,
            ext_proc_max_streams: DEFAULT_EXT_PROC_MAX_STREAMS,
            ext_proc_max_connections: DEFAULT_EXT_PROC_MAX_CONNECTIONS,
            ext_proc_first_stream_ms: DEFAULT_EXT_PROC_FIRST_STREAM_MS,
            ext_proc_idle_ms: DEFAULT_EXT_PROC_IDLE_MS,
            admin_header_timeout_ms: kvroute_common::listener::DEFAULT_HEADER_READ_TIMEOUT.as_millis() as u64,
            admin_max_connections: kvroute_common::listener::DEFAULT_MAX_CONNECTIONS,
            max_report_age_ms: crate::pool::DEFAULT_MAX_REPORT_AGE_MS,
            unreachable_probe_ms: DEFAULT_UNREACHABLE_PROBE_MS,
            frozen_engine_ms: DEFAULT_FROZEN_ENGINE_MS,
            max_messages: 16_384,
            max_content_parts: 65_536,
            max_tools: 1_024,
            max_rendered_prompt_bytes: 32 * 1024 * 1024,
            max_tokenize_ms: 10_000,
            max_concurrent_tokenizations: 0,
        }
    }
}

impl Limits {
    /// The first field that is zero (every limit must be positive), if any.
    pub fn zero_field(&self) -> Option<&'static str> {
        [
            ("limits.body_timeout_ms", self.body_timeout_ms == 0),
            ("limits.keepalive_ms", self.keepalive_ms == 0),
            ("limits.keepalive_timeout_ms", self.keepalive_timeout_ms == 0),
            ("limits.ext_proc_max_streams", self.ext_proc_max_streams == 0),
            ("limits.ext_proc_max_connections", self.ext_proc_max_connections == 0),
            ("limits.ext_proc_first_stream_ms", self.ext_proc_first_stream_ms == 0),
            ("limits.ext_proc_idle_ms", self.ext_proc_idle_ms == 0),
            ("limits.admin_header_timeout_ms", self.admin_header_timeout_ms == 0),
            ("limits.admin_max_connections", self.admin_max_connections == 0),
            ("limits.max_report_age_ms", self.max_report_age_ms == 0),
            ("limits.unreachable_probe_ms", self.unreachable_probe_ms == 0),
            ("limits.frozen_engine_ms", self.frozen_engine_ms == 0),
            ("limits.max_messages", self.max_messages == 0),
            ("limits.max_content_parts", self.max_content_parts == 0),
            ("limits.max_tools", self.max_tools == 0),
            ("limits.max_rendered_prompt_bytes", self.max_rendered_prompt_bytes == 0),
            ("limits.max_tokenize_ms", self.max_tokenize_ms == 0),
        ]
        .into_iter()
        .find_map(|(name, zero)| zero.then_some(name))
    }

    /// [`Limits::body_timeout_ms`] as a duration.
    pub fn body_timeout(&self) -> Duration {
        Duration::from_millis(self.body_timeout_ms)
    }

    /// A gRPC server builder with the HTTP/2 keepalive of these limits (ext_proc and ingest; the
    /// caller adds its own services, TLS and stream bounds).
    pub fn grpc_server(&self) -> tonic::transport::Server {
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_millis(self.keepalive_ms)))
            .http2_keepalive_timeout(Some(Duration::from_millis(self.keepalive_timeout_ms)))
            .tcp_keepalive(Some(Duration::from_millis(self.keepalive_ms)))
    }

    /// The ext_proc listener's connection bounds under a soft descriptor limit of `nofile`:
    /// `ext_proc_max_connections`, lowered to `nofile - fd_reserve(nofile)` (at least 1).
    pub fn ext_proc_connection_cap(&self, nofile: u64) -> ConnBounds {
        let room = nofile.saturating_sub(fd_reserve(nofile)).max(1);
        ConnBounds {
            max_connections: self.ext_proc_max_connections.min(usize::try_from(room).unwrap_or(usize::MAX)),
            first_stream: Duration::from_millis(self.ext_proc_first_stream_ms),
            idle: Duration::from_millis(self.ext_proc_idle_ms),
        }
    }

    /// The request-size bounds of the decision path.
    pub fn request_bounds(&self) -> RequestBounds {
        let slots = match self.max_concurrent_tokenizations {
            0 => std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
            n => n,
        };
        RequestBounds {
            chat: crate::request::ChatBounds {
                max_messages: self.max_messages,
                max_content_parts: self.max_content_parts,
                max_tools: self.max_tools,
            },
            max_rendered_prompt_bytes: self.max_rendered_prompt_bytes,
            tokenize_timeout: Duration::from_millis(self.max_tokenize_ms),
            tokenize_slots: slots,
            tokenize_permits: std::sync::Arc::new(tokio::sync::Semaphore::new(slots)),
        }
    }

    /// The admin listener's bounds.
    pub fn admin_listener(&self) -> kvroute_common::listener::ListenerLimits {
        kvroute_common::listener::ListenerLimits {
            header_read_timeout: Duration::from_millis(self.admin_header_timeout_ms),
            max_connections: self.admin_max_connections,
            ..Default::default()
        }
    }
}

/// The ext_proc listener's connection bounds ([`Limits::ext_proc_connection_cap`];
/// enforced by [`crate::ext_proc::conn`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnBounds {
    /// Most open connections; past it a new connection is closed at once.
    pub max_connections: usize,
    /// Longest time from accept to the first stream's headers (TLS handshake and HTTP/2 preface
    /// included).
    pub first_stream: Duration,
    /// Longest time a connection may stay with no open stream after its first.
    pub idle: Duration,
}

/// The decision path's request bounds ([`Limits::request_bounds`]).
#[derive(Debug)]
pub struct RequestBounds {
    /// Counts checked before rendering.
    pub chat: crate::request::ChatBounds,
    /// Longest rendered chat prompt tokenized, bytes.
    pub max_rendered_prompt_bytes: usize,
    /// Longest decision of one large body, and longest wait for a slot.
    pub tokenize_timeout: Duration,
    /// How many large bodies are decided at once.
    pub tokenize_slots: usize,
    /// One permit per large body being decided.
    pub tokenize_permits: std::sync::Arc<tokio::sync::Semaphore>,
}

/// Descriptors kept out of the ext_proc connection cap under a soft limit of `nofile`: half of
/// them, at most 1024 (the admin and ingest listeners' connections, the pool watcher, the replica
/// streams, tokenizer files, the runtime's own).
pub fn fd_reserve(nofile: u64) -> u64 {
    (nofile / 2).min(1024)
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit and returns the soft limit now in force
/// (`u64::MAX` for unlimited; the old soft limit when raising fails, with a warning).
pub fn raise_nofile_limit() -> u64 {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let lim = getrlimit(Resource::Nofile);
    if lim.current.is_some_and(|cur| lim.maximum.is_none_or(|max| cur < max)) {
        let raised = rustix::process::Rlimit { current: lim.maximum, maximum: lim.maximum };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            tracing::warn!(error = %e, soft = ?lim.current, "cannot raise RLIMIT_NOFILE to the hard limit");
        }
    }
    nofile_limit()
}

/// The soft `RLIMIT_NOFILE` now in force (`u64::MAX` when unlimited).
pub fn nofile_limit() -> u64 {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_zero_fields() {
        let l: Limits = serde_norway::from_str("{}").unwrap();
        assert_eq!(l, Limits::default());
        assert_eq!(l.zero_field(), None);
        let l: Limits = serde_norway::from_str("{body_timeout_ms: 0}").unwrap();
        assert_eq!(l.zero_field(), Some("limits.body_timeout_ms"));
        assert!(serde_norway::from_str::<Limits>("{body_timeout: 1}").is_err(), "unknown keys are refused");
    }

    #[test]
    fn connection_cap_leaves_descriptors_free() {
        let l = Limits { ext_proc_max_connections: 500, ..Limits::default() };
        assert_eq!(l.ext_proc_connection_cap(1_048_576).max_connections, 500, "room to spare: the configured cap");
        assert_eq!(l.ext_proc_connection_cap(20_000).max_connections, 500);
        // 800 descriptors: 400 reserved, 400 for ext_proc.
        assert_eq!(l.ext_proc_connection_cap(800).max_connections, 400);
        assert_eq!(l.ext_proc_connection_cap(1).max_connections, 1, "never zero");
        let big = Limits::default().ext_proc_connection_cap(20_000);
        assert_eq!(big.max_connections, DEFAULT_EXT_PROC_MAX_CONNECTIONS);
        assert_eq!(Limits::default().ext_proc_connection_cap(4096).max_connections, 4096 - 1024);
        assert_eq!(fd_reserve(u64::MAX), 1024);
    }
}
