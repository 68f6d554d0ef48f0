//! Decoder for vLLM's KV-cache events as they arrive over ZeroMQ (SPEC §7, `tests/fixtures/README.md`).
//!
//! A PUB message is three frames: topic (UTF-8, may be empty), sequence number (u64 big-endian),
//! and a msgpack `KVEventBatch`. The batch is an array `[ts, events, data_parallel_rank]` (a map
//! with those keys is accepted too). Each event is either a map tagged by `"type"` (vLLM ≥ 0.33,
//! default-valued fields omitted) or a positional array whose first element is the type name
//! (older releases). Unknown fields and trailing elements are ignored; absent optional fields take
//! their defaults (absent `medium` = GPU).
//!
//! Block hashes: vLLM sends unsigned integers (the low 64 bits of a SHA-256). A negative integer is
//! taken as its two's-complement u64; a byte string (some configurations send raw digests) is read
//! as the big-endian u64 of its LAST 8 bytes (zero-padded on the left when shorter). The hash is
//! opaque either way: it is only ever a key for the agent's engine→kvroute map.
//!
//! Replay replies (ROUTER→DEALER) come in two framings: 0.33 `["", topic, seq, payload]`, ending
//! with `["", "", i64 -1, ""]`; older `["", seq, payload]`, ending with `["", i64 -1, ""]`.
//!
//! Payloads are parsed into borrowed `rmpv::ValueRef`s (strings and byte hashes point into the
//! frame, no allocation per map key or string field).
//!
//! Pure functions, no shared state. Every malformed input is a [`KvEventError`], never a panic.

use kvroute_common::EngineBlockHash;
use rmpv::ValueRef as Value;

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

fn shape<T>(msg: impl Into<String>) -> Result<T, KvEventError> {
    Err(KvEventError::Shape(msg.into()))
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

impl Medium {
    fn parse(v: Option<&Value<'_>>) -> Result<Medium, KvEventError> {
        match v {
            None | Some(Value::Nil) => Ok(Medium::Gpu),
            Some(Value::String(s)) => Ok(match s.as_str().unwrap_or("") {
                m if m.eq_ignore_ascii_case("gpu") => Medium::Gpu,
                m if m.eq_ignore_ascii_case("cpu") => Medium::Cpu,
                m => Medium::Other(m.to_string()),
            }),
            Some(other) => shape(format!("medium is not a string: {other}")),
        }
    }
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
    /// Per block: true when its `extra_keys` carry anything other than the LoRA name
    /// (multimodal identifiers, cache salt): such blocks are not matchable by text requests.
    pub opaque_extra_keys: Vec<bool>,
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
}

/// A decoded `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Engine wall-clock timestamp, seconds since the Unix epoch.
    pub ts: f64,
    /// Events in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank, if sent.
    pub dp_rank: Option<i64>,
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

/// Decodes a msgpack `KVEventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<KvEventBatch, KvEventError> {
    let mut rd = payload;
    let value = rmpv::decode::read_value_ref(&mut rd).map_err(|e| KvEventError::Msgpack(e.to_string()))?;
    let (ts, events, rank) = match &value {
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        Value::Map(_) => (map_get(&value, "ts"), map_get(&value, "events"), map_get(&value, "data_parallel_rank")),
        other => return shape(format!("batch is neither array nor map: {other}")),
    };
    let ts = ts.and_then(as_f64).unwrap_or(0.0);
    let events = match events {
        Some(Value::Array(evs)) => evs.iter().map(decode_event).collect::<Result<Vec<_>, _>>()?,
        _ => return shape("batch has no events array"),
    };
    Ok(KvEventBatch { ts, events, dp_rank: rank.and_then(as_i64) })
}

/// The string in `v`, if it is valid UTF-8 (borrowed from the payload).
fn as_str<'p>(v: &Value<'p>) -> Option<&'p str> {
    match v {
        Value::String(s) => s.into_str(),
        _ => None,
    }
}

fn as_i64(v: &Value<'_>) -> Option<i64> {
    match v {
        Value::Integer(i) => i.as_i64(),
        _ => None,
    }
}

fn as_f64(v: &Value<'_>) -> Option<f64> {
    match v {
        Value::Integer(i) => i.as_f64(),
        Value::F32(f) => Some(f64::from(*f)),
        Value::F64(f) => Some(*f),
        _ => None,
    }
}

fn map_get<'a, 'p>(map: &'a Value<'p>, key: &str) -> Option<&'a Value<'p>> {
    match map {
        Value::Map(entries) => entries.iter().find(|(k, _)| as_str(k) == Some(key)).map(|(_, v)| v),
        _ => None,
    }
}

/// Field names of a BlockStored in positional order (after the type name).
const STORED_FIELDS: [&str; 8] =
    ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys"];
const REMOVED_FIELDS: [&str; 2] = ["block_hashes", "medium"];

fn decode_event<'a, 'p>(v: &'a Value<'p>) -> Result<KvEvent, KvEventError> {
    // Normalise both shapes to a field lookup.
    type Getter<'a, 'p> = Box<dyn Fn(&str) -> Option<&'a Value<'p>> + 'a>;
    let (kind, get): (&str, Getter<'a, 'p>) = match v {
        Value::Map(_) => {
            let Some(kind) = map_get(v, "type").and_then(as_str) else {
                return shape("event map without a string \"type\"");
            };
            (kind, Box::new(move |k: &str| map_get(v, k)))
        }
        Value::Array(a) => {
            let Some(kind) = a.first().and_then(as_str) else {
                return shape("event array without a type name first");
            };
            let fields: &[&str] = match kind {
                "BlockStored" => &STORED_FIELDS,
                "BlockRemoved" => &REMOVED_FIELDS,
                _ => &[],
            };
            (kind, Box::new(move |k: &str| fields.iter().position(|f| *f == k).and_then(|i| a.get(i + 1))))
        }
        other => return shape(format!("event is neither map nor array: {other}")),
    };
    match kind {
        "BlockStored" => {
            let block_hashes = hashes(get("block_hashes"))?;
            let parent = match get("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(h) => Some(hash(h)?),
            };
            let token_ids = match get("token_ids") {
                Some(Value::Array(t)) => t
                    .iter()
                    .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .map_or_else(|| shape("token_ids holds a non-u32"), Ok)?,
                _ => return shape("BlockStored without token_ids"),
            };
            let block_size = match get("block_size").and_then(Value::as_u64).and_then(|b| u32::try_from(b).ok()) {
                Some(b) if b > 0 => b,
                _ => return shape("BlockStored without a positive block_size"),
            };
            let lora_name = get("lora_name").and_then(as_str).map(str::to_string);
            let opaque_extra_keys = extra_keys(get("extra_keys"), block_hashes.len(), lora_name.as_deref());
            Ok(KvEvent::Stored(BlockStored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_id: get("lora_id").and_then(as_i64),
                medium: Medium::parse(get("medium"))?,
                lora_name,
                opaque_extra_keys,
            }))
        }
        "BlockRemoved" => {
            Ok(KvEvent::Removed { block_hashes: hashes(get("block_hashes"))?, medium: Medium::parse(get("medium"))? })
        }
        "AllBlocksCleared" => Ok(KvEvent::AllCleared),
        other => shape(format!("unknown event type {other:?}")),
    }
}

/// Per block: does its `extra_keys` entry hold anything besides the LoRA name? vLLM sends one
/// entry per block (nil or a list). When the list length does not match the block count, the
/// whole event is judged by any entry.
fn extra_keys(v: Option<&Value<'_>>, blocks: usize, lora: Option<&str>) -> Vec<bool> {
    fn opaque(entry: &Value<'_>, lora: Option<&str>) -> bool {
        match entry {
            Value::Nil => false,
            Value::Array(keys) => keys.iter().any(|k| !(as_str(k).is_some() && as_str(k) == lora)),
            Value::String(_) => as_str(entry) != lora,
            _ => true,
        }
    }
    match v {
        Some(Value::Array(entries)) if entries.len() == blocks => entries.iter().map(|e| opaque(e, lora)).collect(),
        Some(Value::Array(entries)) => vec![entries.iter().any(|e| opaque(e, lora)); blocks],
        None | Some(Value::Nil) => vec![false; blocks],
        Some(_) => vec![true; blocks],
    }
}

fn hashes(v: Option<&Value<'_>>) -> Result<Vec<EngineBlockHash>, KvEventError> {
    match v {
        Some(Value::Array(a)) => a.iter().map(hash).collect(),
        _ => shape("block_hashes is not an array"),
    }
}

fn hash(v: &Value<'_>) -> Result<EngineBlockHash, KvEventError> {
    match v {
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(EngineBlockHash(u)),
            (None, Some(s)) => Ok(EngineBlockHash(s as u64)),
            _ => shape("block hash integer out of range"),
        },
        Value::Binary(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            let mut buf = [0u8; 8];
            buf[8 - tail.len()..].copy_from_slice(tail);
            Ok(EngineBlockHash(u64::from_be_bytes(buf)))
        }
        other => shape(format!("block hash is neither integer nor bytes: {other}")),
    }
}

#[cfg(test)]
mod tests;
