//! Decoder for vLLM's KV-cache events as they arrive over ZeroMQ (docs/design.md §7, `tests/fixtures/README.md`).
//!
//! A PUB message is three frames: topic (UTF-8, may be empty), sequence number (u64 big-endian),
//! and a msgpack `KVEventBatch`. The batch is an array `[ts, events, data_parallel_rank]` (a map
//! with those keys is accepted too). Each event is either a map tagged by `"type"` (vLLM ≥ 0.33,
//! default-valued fields omitted) or a positional array whose first element is the type name
//! (older releases). Unknown fields and trailing elements are ignored; absent optional fields take
//! their defaults (absent `medium` = GPU).
//!
//! Events are judged one by one, so that one unreadable event neither rejects its whole batch nor
//! turns into a gap that clears the pod's whole record (docs/decisions/0024-bounded-outside-input.md).
//! Keep what can be kept, clear only what cannot be trusted (docs/design.md §7, under-claim):
//! - an event of a type this decoder does not know (a newer vLLM) is skipped and counted
//!   ([`Damage::unknown_events`]);
//! - a `BlockStored` whose fields cannot be read, or an event without a type, is skipped and
//!   counted ([`Damage::skipped_events`]): losing a store only under-claims;
//! - a `BlockRemoved` whose hashes or medium cannot be read becomes [`KvEvent::Untrusted`] in its
//!   place: blocks it named may be gone, so the record is cleared there;
//! - a payload that breaks off (truncated, or unreadable msgpack) inside its events array keeps
//!   the events read whole before the break. What was lost is untrusted (an
//!   [`KvEvent::Untrusted`] at the break) unless it can only have been the rest of one final
//!   `BlockStored` (its type already read, and the array header says no event follows);
//! - a payload with no readable events array at all is a [`KvEventError`].
//!
//! Bounds: nesting depth at most [`MAX_DEPTH`]; a `lora_name` over [`MAX_NAME_BYTES`] or a medium
//! name over [`MAX_MEDIUM_BYTES`] makes its event unreadable (as above). Every other size is
//! bounded by the payload, whose size the ZeroMQ socket bounds.
//!
//! Block hashes: vLLM sends unsigned integers (the low 64 bits of a SHA-256). A negative integer is
//! taken as its two's-complement u64; a byte string (some configurations send raw digests) is read
//! as the big-endian u64 of its LAST 8 bytes (zero-padded on the left when shorter). The hash is
//! opaque either way: it is only ever a key for the agent's engine→kvroute map.
//!
//! Replay replies (ROUTER→DEALER) come in two framings: 0.33 `["", topic, seq, payload]`, ending
//! with `["", "", i64 -1, ""]`; older `["", seq, payload]`, ending with `["", i64 -1, ""]`.
//!
//! Payloads are decoded in one pass with `rmp-serde` straight into the event types (see
//! [`wire`]): no intermediate value tree, strings and byte hashes borrowed from the frame.
//!
//! Pure functions, no shared state. Every malformed input is a [`KvEventError`], never a panic.

use kvroute_common::EngineBlockHash;

mod wire;

/// Errors while decoding KV-event frames.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum KvEventError {
    /// Wrong number of ZeroMQ frames for the message kind.
    #[error("expected {expected} frames, got {got}")]
    Frames {
        /// Accepted frame counts, in words.
        expected: &'static str,
        /// Frame count received.
        got: usize,
    },
    /// The sequence frame is not 8 bytes.
    #[error("sequence frame has {0} bytes, expected 8")]
    Seq(usize),
    /// The payload is not valid msgpack.
    #[error("payload is not msgpack: {0}")]
    Msgpack(String),
    /// The msgpack does not have the shape of a KVEventBatch or event.
    #[error("bad event batch: {0}")]
    Shape(String),
}

/// Storage tier of a block (vLLM's `medium`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Medium {
    /// GPU memory: the only tier that counts as cached for routing.
    Gpu,
    /// CPU offload tier.
    Cpu,
    /// Any other tier (disk, remote…), by name.
    Other(String),
}

/// A stored run of blocks (vLLM `BlockStored`).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// Engine hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<EngineBlockHash>,
    /// Engine hash of the block before `block_hashes[0]`; `None` = chain start.
    pub parent: Option<EngineBlockHash>,
    /// Token ids of all the stored blocks (block_size × block count).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// vLLM's LoRA id, if any.
    pub lora_id: Option<i64>,
    /// Storage tier.
    pub medium: Medium,
    /// LoRA adapter name, if any: part of the kvroute hash root.
    pub lora_name: Option<String>,
    /// Per block, its `extra_keys` besides the LoRA name (docs/design.md §2): cache salt and
    /// multimodal items are folded into the kvroute hash; keys the agent cannot read make the
    /// block (and the rest of its run) unplaceable.
    pub extra_keys: Vec<BlockExtra>,
}

/// A block's extra keys as the agent reads them (docs/design.md §2).
#[derive(Debug, Clone, PartialEq)]
pub enum BlockExtra {
    /// Nothing besides the LoRA name: the block hashes from its tokens alone.
    Plain,
    /// Keys folded into the kvroute hash after the tokens: the cache salt (a string), multimodal
    /// items `(identifier, offset)`, in vLLM's order.
    Keys(Vec<kvroute_common::ExtraKey>),
    /// Keys of a shape the agent cannot interpret: the block is skipped and counted.
    Opaque,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks were stored.
    Stored(BlockStored),
    /// Blocks were evicted from `medium`.
    Removed {
        /// Engine hashes of the removed blocks.
        block_hashes: Vec<EngineBlockHash>,
        /// Storage tier they left.
        medium: Medium,
    },
    /// The engine dropped its whole prefix cache.
    AllCleared,
    /// Not sent by the engine: here the decoder lost events that may have removed blocks (an
    /// unreadable `BlockRemoved`, a payload cut short), so the record is not to be trusted past
    /// this point: it is cleared here (under-claim). The text says why.
    Untrusted(String),
}

/// What the decoder skipped or could not read in one batch; all zero for an intact batch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Damage {
    /// Events of a type this decoder does not know (a newer vLLM), skipped.
    pub unknown_events: u32,
    /// The first few of their type names (at most [`MAX_UNKNOWN_NAMES`], each cut to
    /// [`MAX_LOGGED_NAME`] characters), for the log.
    pub unknown_types: Vec<String>,
    /// Events skipped because they could not be read and their loss only under-claims
    /// (a `BlockStored` with unreadable fields, an event without a type).
    pub skipped_events: u32,
    /// Why the first skipped event was skipped.
    pub first_skip_reason: Option<String>,
    /// The payload broke off before the end of its events array.
    pub truncated: bool,
}

impl Damage {
    /// True when nothing was skipped or lost.
    pub fn is_none(&self) -> bool {
        *self == Damage::default()
    }
}

/// Most unknown type names kept per batch in [`Damage::unknown_types`].
pub const MAX_UNKNOWN_NAMES: usize = 4;
/// Longest unknown type name kept (characters).
pub const MAX_LOGGED_NAME: usize = 64;
/// Deepest msgpack nesting read (vLLM's batches nest 5 deep: batch, events, event, extra_keys,
/// entry); deeper input fails as unreadable msgpack instead of growing the stack.
pub const MAX_DEPTH: usize = 32;
/// Longest `lora_name` accepted (bytes).
pub const MAX_NAME_BYTES: usize = 1024;
/// Longest medium name accepted (bytes).
pub const MAX_MEDIUM_BYTES: usize = 64;

/// A decoded `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Engine wall-clock timestamp, seconds since the Unix epoch.
    pub ts: f64,
    /// Events in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank, if sent.
    pub dp_rank: Option<i64>,
    /// What was skipped or lost while decoding.
    pub damage: Damage,
}

impl KvEventBatch {
    /// True when the batch holds a [`KvEvent::Untrusted`]: events were lost that may have
    /// removed blocks.
    pub fn untrusted(&self) -> bool {
        self.events.iter().any(|e| matches!(e, KvEvent::Untrusted(_)))
    }
}

/// A decoded PUB message or replayed batch.
#[derive(Debug, Clone, PartialEq)]
pub struct KvMessage {
    /// ZeroMQ topic (llm-d: `kv@<pod-ip>@<model>`; vLLM default empty).
    pub topic: String,
    /// Publisher's sequence number.
    pub seq: u64,
    /// The batch.
    pub batch: KvEventBatch,
}

/// One reply frame-set from the replay endpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayFrame {
    /// A buffered batch.
    Batch(KvMessage),
    /// End of the replay (seq −1).
    End,
}

fn parse_seq(frame: &[u8]) -> Result<i64, KvEventError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| KvEventError::Seq(frame.len()))?;
    Ok(i64::from_be_bytes(bytes))
}

fn seq_u64(frame: &[u8]) -> Result<u64, KvEventError> {
    parse_seq(frame).map(|s| s as u64)
}

/// Decodes one SUB message: `[topic, seq, payload]` (or `[seq, payload]` without a topic frame).
/// Frames are anything that derefs to bytes (`Vec<u8>`, `zmq::Message`).
pub fn decode_message<F: std::ops::Deref<Target = [u8]>>(frames: &[F]) -> Result<KvMessage, KvEventError> {
    let (topic, seq, payload): (&[u8], &[u8], &[u8]) = match frames {
        [topic, seq, payload] => (topic, seq, payload),
        [seq, payload] => (&[][..], seq, payload),
        _ => return Err(KvEventError::Frames { expected: "2 or 3", got: frames.len() }),
    };
    Ok(KvMessage {
        topic: String::from_utf8_lossy(topic).into_owned(),
        seq: seq_u64(seq)?,
        batch: decode_batch(payload)?,
    })
}

/// Decodes one replay reply, in either framing (see the module docs).
pub fn decode_replay(frames: &[Vec<u8>]) -> Result<ReplayFrame, KvEventError> {
    let (topic, seq, payload) = match frames {
        [empty, topic, seq, payload] if empty.is_empty() => (topic.as_slice(), seq, payload),
        [empty, seq, payload] if empty.is_empty() => (&[][..], seq, payload),
        _ => return Err(KvEventError::Frames { expected: "3 or 4 starting with an empty frame", got: frames.len() }),
    };
    let seq = parse_seq(seq)?;
    if seq == -1 {
        return Ok(ReplayFrame::End);
    }
    Ok(ReplayFrame::Batch(KvMessage {
        topic: String::from_utf8_lossy(topic).into_owned(),
        seq: seq as u64,
        batch: decode_batch(payload)?,
    }))
}

/// Decodes a msgpack `KVEventBatch` payload. Damage inside the events array is reported in the
/// batch (see the module docs); an error only when no events array could be read at all.
pub fn decode_batch(payload: &[u8]) -> Result<KvEventBatch, KvEventError> {
    wire::decode_batch(payload)
}

#[cfg(test)]
mod tests;
