//! Streaming msgpack → event decoding with `rmp-serde`: each field is read straight into its
//! final form (token ids into one `Vec<u32>` sized from the array header, hashes into
//! `Vec<EngineBlockHash>`), with no intermediate value tree: building and dropping an `rmpv` tree
//! of every token id is a large share of the agent's CPU under load. Token ids and hashes, the
//! bulk of a batch, have their own element visitors, because going through the general
//! [`Scalar`] per element is slower than the tree (figures in
//! docs/decisions/0023-agent-cpu-budget.md).
//!
//! The visitors are lenient: a value of the wrong type is consumed and recorded as a shape
//! problem ([`Lenient`]) rather than failing the deserializer, so that (a) a field is only an
//! error when the event kind actually needs it, exactly as when fields were looked up in a tree,
//! and (b) every error the deserializer itself returns is a msgpack error (bad marker, truncated
//! data), which keeps [`KvEventError::Msgpack`] and [`KvEventError::Shape`] apart.
//!
//! Map keys may come in any order (the `"type"` of an event map is not assumed first): map
//! events collect every known field, then the kind decides which are required.
//!
//! Results go into a [`Gathered`] that the visitors write through (serde seeds), not through
//! serde's return values: when the payload breaks off, the deserializer's error unwinds every
//! visitor, and the events read whole before the break are still there to keep.

use super::{
    BlockExtra, BlockStored, Damage, KvEvent, KvEventBatch, KvEventError, MAX_DEPTH, MAX_LOGGED_NAME, MAX_MEDIUM_BYTES,
    MAX_NAME_BYTES, MAX_UNKNOWN_NAMES, Medium,
};
use kvroute_common::{EngineBlockHash, ExtraKey};
use serde::de::{self, Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::borrow::Cow;
use std::fmt;

/// A field's value, or what was wrong with its shape.
type Lenient<T> = Result<T, String>;

/// Decodes a msgpack `KVEventBatch` payload (see the parent module for the accepted shapes).
pub(super) fn decode_batch(payload: &[u8]) -> Result<KvEventBatch, KvEventError> {
    let mut de = rmp_serde::Deserializer::from_read_ref(payload);
    de.set_max_depth(MAX_DEPTH);
    let mut g = Gathered::default();
    let read = BatchSeed(&mut g).deserialize(&mut de);
    g.finish(read.err().map(|e| e.to_string()))
}

/// A msgpack value that is not needed whole: scalars kept (strings and bytes borrowed from the
/// payload), arrays and maps skipped.
#[derive(Debug)]
enum Scalar<'de> {
    Nil,
    Bool(bool),
    /// Any non-negative integer.
    U64(u64),
    /// A negative integer.
    I64(i64),
    F64(f64),
    Str(Cow<'de, str>),
    Bin(Cow<'de, [u8]>),
    /// An array or map (consumed, not kept).
    Compound,
}

impl fmt::Display for Scalar<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Nil => f.write_str("nil"),
            Scalar::Bool(b) => write!(f, "{b}"),
            Scalar::U64(u) => write!(f, "{u}"),
            Scalar::I64(i) => write!(f, "{i}"),
            Scalar::F64(x) => write!(f, "{x}"),
            Scalar::Str(s) => write!(f, "{s:?}"),
            Scalar::Bin(b) => write!(f, "{} bytes", b.len()),
            Scalar::Compound => f.write_str("an array or map"),
        }
    }
}

impl<'de> Scalar<'de> {
    fn as_str(&self) -> Option<&str> {
        match self {
            Scalar::Str(s) => Some(s),
            _ => None,
        }
    }

    fn as_u64(&self) -> Option<u64> {
        match self {
            Scalar::U64(u) => Some(*u),
            _ => None,
        }
    }

    fn as_i64(&self) -> Option<i64> {
        match self {
            Scalar::U64(u) => i64::try_from(*u).ok(),
            Scalar::I64(i) => Some(*i),
            _ => None,
        }
    }

    fn as_f64(&self) -> Option<f64> {
        match self {
            Scalar::U64(u) => Some(*u as f64),
            Scalar::I64(i) => Some(*i as f64),
            Scalar::F64(x) => Some(*x),
            _ => None,
        }
    }

    /// An engine block hash: an integer (negative = two's complement), or bytes read as the
    /// big-endian u64 of their last 8 (zero-padded on the left).
    fn hash(&self) -> Lenient<EngineBlockHash> {
        match self {
            Scalar::U64(u) => Ok(EngineBlockHash(*u)),
            Scalar::I64(i) => Ok(EngineBlockHash(*i as u64)),
            Scalar::Bin(b) if !b.is_empty() => {
                let tail = &b[b.len().saturating_sub(8)..];
                let mut buf = [0u8; 8];
                buf[8 - tail.len()..].copy_from_slice(tail);
                Ok(EngineBlockHash(u64::from_be_bytes(buf)))
            }
            other => Err(format!("block hash is neither integer nor bytes: {other}")),
        }
    }

    fn medium(&self) -> Lenient<Medium> {
        match self {
            Scalar::Nil => Ok(Medium::Gpu),
            Scalar::Str(s) => Ok(match &**s {
                m if m.eq_ignore_ascii_case("gpu") => Medium::Gpu,
                m if m.eq_ignore_ascii_case("cpu") => Medium::Cpu,
                m => Medium::Other(m.to_string()),
            }),
            other => Err(format!("medium is not a string: {other}")),
        }
    }
}

/// The scalar visits every lenient visitor shares: anything that is not the container it wants
/// becomes a [`Scalar`], handed to `$conv` with the visitor (`|visitor, scalar| value`).
macro_rules! scalar_visits {
    ($conv:expr) => {
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
            Ok(($conv)(self, Scalar::Bool(v)))
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(($conv)(self, int_scalar(v)))
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(($conv)(self, Scalar::U64(v)))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Ok(($conv)(self, Scalar::F64(v)))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(($conv)(self, Scalar::Str(Cow::Owned(v.to_string()))))
        }
        fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(($conv)(self, Scalar::Str(Cow::Borrowed(v))))
        }
        fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
            Ok(($conv)(self, Scalar::Bin(Cow::Owned(v.to_vec()))))
        }
        fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Self::Value, E> {
            Ok(($conv)(self, Scalar::Bin(Cow::Borrowed(v))))
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(($conv)(self, Scalar::Nil))
        }
        fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            IgnoredAny::deserialize(d)?;
            Ok(($conv)(self, Scalar::Compound))
        }
    };
}

/// Skips a map's remaining entries.
fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Skips a sequence's remaining elements.
fn skip_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any msgpack value")
    }

    scalar_visits!(|_, s| s);

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        skip_seq(seq)?;
        Ok(Scalar::Compound)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        skip_map(map)?;
        Ok(Scalar::Compound)
    }
}

/// A signed integer as a [`Scalar`]: non-negative ones are `U64`, so each value has one form.
fn int_scalar(v: i64) -> Scalar<'static> {
    u64::try_from(v).map_or(Scalar::I64(v), Scalar::U64)
}

impl<'de> Deserialize<'de> for Scalar<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

/// `block_hashes`: every hash, or the first problem.
struct Hashes(Lenient<Vec<EngineBlockHash>>);

/// One block hash, read without building a [`Scalar`] (hashes are the second bulk of a batch).
struct HashItem(Lenient<EngineBlockHash>);

struct HashItemVisitor;

impl<'de> Visitor<'de> for HashItemVisitor {
    type Value = HashItem;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a block hash")
    }

    scalar_visits!(|_, s: Scalar<'_>| HashItem(s.hash()));

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<HashItem, A::Error> {
        skip_seq(seq)?;
        Ok(HashItem(Scalar::Compound.hash()))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<HashItem, A::Error> {
        skip_map(map)?;
        Ok(HashItem(Scalar::Compound.hash()))
    }
}

impl<'de> Deserialize<'de> for HashItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(HashItemVisitor)
    }
}

struct HashesVisitor;

impl<'de> Visitor<'de> for HashesVisitor {
    type Value = Hashes;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("block hashes")
    }

    scalar_visits!(|_, _| Hashes(Err("block_hashes is not an array".to_string())));

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        skip_map(map)?;
        Ok(Hashes(Err("block_hashes is not an array".to_string())))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        let mut bad = None;
        while let Some(HashItem(h)) = seq.next_element()? {
            match h {
                Ok(h) => out.push(h),
                Err(e) => bad = bad.or(Some(e)),
            }
        }
        Ok(Hashes(bad.map_or(Ok(out), Err)))
    }
}

impl<'de> Deserialize<'de> for Hashes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(HashesVisitor)
    }
}

/// `token_ids`, read straight into `u32`s (the bulk of a batch: one element visitor per id).
struct Tokens(Lenient<Vec<u32>>);

/// One token id: `None` when it is not an integer that fits a u32.
struct TokenId(Option<u32>);

struct TokenIdVisitor;

impl<'de> Visitor<'de> for TokenIdVisitor {
    type Value = TokenId;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token id")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<TokenId, E> {
        Ok(TokenId(u32::try_from(v).ok()))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<TokenId, E> {
        Ok(TokenId(u32::try_from(v).ok()))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<TokenId, E> {
        Ok(TokenId(None))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<TokenId, E> {
        Ok(TokenId(None))
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<TokenId, E> {
        Ok(TokenId(None))
    }

    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<TokenId, E> {
        Ok(TokenId(None))
    }

    fn visit_unit<E: de::Error>(self) -> Result<TokenId, E> {
        Ok(TokenId(None))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<TokenId, D::Error> {
        IgnoredAny::deserialize(d)?;
        Ok(TokenId(None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<TokenId, A::Error> {
        skip_seq(seq)?;
        Ok(TokenId(None))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<TokenId, A::Error> {
        skip_map(map)?;
        Ok(TokenId(None))
    }
}

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TokenIdVisitor)
    }
}

struct TokensVisitor;

impl<'de> Visitor<'de> for TokensVisitor {
    type Value = Tokens;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("token ids")
    }

    scalar_visits!(|_, _| Tokens(Err("BlockStored without token_ids".to_string())));

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        skip_map(map)?;
        Ok(Tokens(Err("BlockStored without token_ids".to_string())))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
        let mut ok = true;
        while let Some(TokenId(t)) = seq.next_element()? {
            match t {
                Some(t) => out.push(t),
                None => ok = false,
            }
        }
        Ok(Tokens(if ok { Ok(out) } else { Err("token_ids holds a non-u32".to_string()) }))
    }
}

impl<'de> Deserialize<'de> for Tokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TokensVisitor)
    }
}

/// One key of a block's `extra_keys` list: a string (LoRA name or cache salt), a multimodal
/// item `[identifier, offset]`, or anything else (uninterpretable).
#[derive(Debug)]
enum ExtraElem<'de> {
    Str(Cow<'de, str>),
    Item(Cow<'de, str>, i64),
    Other,
}

struct ExtraElemVisitor;

impl<'de> Visitor<'de> for ExtraElemVisitor {
    type Value = ExtraElem<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an extra key")
    }

    scalar_visits!(|_, s: Scalar<'de>| match s {
        Scalar::Str(s) => ExtraElem::Str(s),
        _ => ExtraElem::Other,
    });

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        skip_map(map)?;
        Ok(ExtraElem::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let id = seq.next_element::<Scalar<'de>>()?;
        let offset = seq.next_element::<Scalar<'de>>()?;
        let mut more = false;
        while seq.next_element::<IgnoredAny>()?.is_some() {
            more = true;
        }
        Ok(match (id, offset.as_ref().and_then(Scalar::as_i64)) {
            (Some(Scalar::Str(id)), Some(off)) if !more => ExtraElem::Item(id, off),
            _ => ExtraElem::Other,
        })
    }
}

impl<'de> Deserialize<'de> for ExtraElem<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ExtraElemVisitor)
    }
}

/// One entry of `extra_keys` (per block): nil, a list of keys, or a single value.
#[derive(Debug)]
enum ExtraEntry<'de> {
    Keys(Vec<ExtraElem<'de>>),
    One(Scalar<'de>),
}

impl ExtraEntry<'_> {
    /// The block's keys besides its LoRA name `lora` (vLLM lists the LoRA name first).
    fn extra(&self, lora: Option<&str>) -> BlockExtra {
        let keys: &[ExtraElem<'_>] = match self {
            ExtraEntry::One(Scalar::Nil) => return BlockExtra::Plain,
            ExtraEntry::One(Scalar::Str(s)) if Some(&**s) == lora => return BlockExtra::Plain,
            ExtraEntry::One(Scalar::Str(s)) => return BlockExtra::Keys(vec![ExtraKey::Str(s.to_string())]),
            ExtraEntry::One(_) => return BlockExtra::Opaque,
            ExtraEntry::Keys(keys) => keys,
        };
        let rest = match (keys.first(), lora) {
            (Some(ExtraElem::Str(first)), Some(l)) if first == l => &keys[1..],
            _ => keys,
        };
        if rest.is_empty() {
            return BlockExtra::Plain;
        }
        let mut out = Vec::with_capacity(rest.len());
        for k in rest {
            out.push(match k {
                ExtraElem::Str(s) => ExtraKey::Str(s.to_string()),
                ExtraElem::Item(id, off) => ExtraKey::Item(id.to_string(), *off),
                ExtraElem::Other => return BlockExtra::Opaque,
            });
        }
        BlockExtra::Keys(out)
    }
}

struct ExtraEntryVisitor;

impl<'de> Visitor<'de> for ExtraEntryVisitor {
    type Value = ExtraEntry<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an extra_keys entry")
    }

    scalar_visits!(|_, s| ExtraEntry::One(s));

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        skip_map(map)?;
        Ok(ExtraEntry::One(Scalar::Compound))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut keys = Vec::new();
        while let Some(k) = seq.next_element::<ExtraElem<'de>>()? {
            keys.push(k);
        }
        Ok(ExtraEntry::Keys(keys))
    }
}

impl<'de> Deserialize<'de> for ExtraEntry<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ExtraEntryVisitor)
    }
}

/// `extra_keys`: one entry per block, or any other value.
#[derive(Debug)]
enum ExtraKeys<'de> {
    List(Vec<ExtraEntry<'de>>),
    One(Scalar<'de>),
}

impl ExtraKeys<'_> {
    /// Each block's keys besides the LoRA name. When the list length does not match the block
    /// count, no entry can be placed: plain blocks stay plain only if every entry is plain, else
    /// every block is opaque.
    fn per_block(v: Option<&Self>, blocks: usize, lora: Option<&str>) -> Vec<BlockExtra> {
        match v {
            Some(ExtraKeys::List(entries)) if entries.len() == blocks => {
                entries.iter().map(|e| e.extra(lora)).collect()
            }
            Some(ExtraKeys::List(entries)) => {
                let plain = entries.iter().all(|e| e.extra(lora) == BlockExtra::Plain);
                vec![if plain { BlockExtra::Plain } else { BlockExtra::Opaque }; blocks]
            }
            None | Some(ExtraKeys::One(Scalar::Nil)) => vec![BlockExtra::Plain; blocks],
            Some(ExtraKeys::One(_)) => vec![BlockExtra::Opaque; blocks],
        }
    }
}

struct ExtraKeysVisitor;

impl<'de> Visitor<'de> for ExtraKeysVisitor {
    type Value = ExtraKeys<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("extra_keys")
    }

    scalar_visits!(|_, s| ExtraKeys::One(s));

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        skip_map(map)?;
        Ok(ExtraKeys::One(Scalar::Compound))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut entries = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(e) = seq.next_element::<ExtraEntry<'de>>()? {
            entries.push(e);
        }
        Ok(ExtraKeys::List(entries))
    }
}

impl<'de> Deserialize<'de> for ExtraKeys<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ExtraKeysVisitor)
    }
}

/// Field names of a BlockStored in positional order (after the type name).
const STORED_FIELDS: [&str; 8] =
    ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys"];
const REMOVED_FIELDS: [&str; 2] = ["block_hashes", "medium"];

/// An event's kind, once its type name is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl Kind {
    fn of(name: &str) -> Kind {
        match name {
            "BlockStored" => Kind::Stored,
            "BlockRemoved" => Kind::Removed,
            "AllBlocksCleared" => Kind::Cleared,
            _ => Kind::Unknown,
        }
    }
}

/// What became of one event read whole.
enum Outcome {
    /// Decoded.
    Event(KvEvent),
    /// Of an unknown type (its name): skipped.
    Unknown(String),
    /// Unreadable, and losing it only under-claims: skipped (why).
    Skip(String),
    /// Unreadable, and it may have removed blocks: the record is cleared here (why).
    Untrusted(String),
}

/// Every field an event may carry, as read (absent = `None`).
#[derive(Default)]
struct EventFields<'de> {
    block_hashes: Option<Hashes>,
    parent: Option<Scalar<'de>>,
    token_ids: Option<Tokens>,
    block_size: Option<Scalar<'de>>,
    lora_id: Option<Scalar<'de>>,
    medium: Option<Scalar<'de>>,
    lora_name: Option<Scalar<'de>>,
    extra_keys: Option<ExtraKeys<'de>>,
}

impl<'de> EventFields<'de> {
    /// Reads field `name` from `next` (a map value or the next array element); unknown names
    /// are skipped. `Ok(false)` when `next` had nothing left.
    fn read<E>(&mut self, name: &str, next: impl FieldSource<'de, Error = E>) -> Result<bool, E> {
        fn put<T>(slot: &mut Option<T>, v: Option<T>) -> bool {
            let some = v.is_some();
            if some {
                *slot = v;
            }
            some
        }
        Ok(match name {
            "block_hashes" => put(&mut self.block_hashes, next.next()?),
            "parent_block_hash" => put(&mut self.parent, next.next()?),
            "token_ids" => put(&mut self.token_ids, next.next()?),
            "block_size" => put(&mut self.block_size, next.next()?),
            "lora_id" => put(&mut self.lora_id, next.next()?),
            "medium" => put(&mut self.medium, next.next()?),
            "lora_name" => put(&mut self.lora_name, next.next()?),
            "extra_keys" => put(&mut self.extra_keys, next.next()?),
            _ => next.next::<IgnoredAny>()?.is_some(),
        })
    }

    /// The event of type `name` (kind `kind`) these fields make, or what to do without it.
    fn into_outcome(self, kind: Kind, name: &str) -> Outcome {
        match kind {
            Kind::Stored => self.stored().map_or_else(Outcome::Skip, |s| Outcome::Event(KvEvent::Stored(s))),
            Kind::Removed => self.removed().map_or_else(Outcome::Untrusted, Outcome::Event),
            Kind::Cleared => Outcome::Event(KvEvent::AllCleared),
            Kind::Unknown => Outcome::Unknown(name.chars().take(MAX_LOGGED_NAME).collect()),
        }
    }

    fn stored(self) -> Lenient<BlockStored> {
        let block_hashes = hashes(self.block_hashes)?;
        let parent = match self.parent {
            None | Some(Scalar::Nil) => None,
            Some(h) => Some(h.hash()?),
        };
        let token_ids = match self.token_ids {
            Some(Tokens(t)) => t?,
            None => return Err("BlockStored without token_ids".into()),
        };
        let block_size = match self.block_size.as_ref().and_then(Scalar::as_u64).and_then(|b| u32::try_from(b).ok()) {
            Some(b) if b > 0 => b,
            _ => return Err("BlockStored without a positive block_size".into()),
        };
        let lora_name = match self.lora_name {
            Some(Scalar::Str(s)) if s.len() > MAX_NAME_BYTES => {
                return Err(format!("lora_name of {} bytes (limit {MAX_NAME_BYTES})", s.len()));
            }
            Some(Scalar::Str(s)) => Some(s.into_owned()),
            _ => None,
        };
        let extra_keys = ExtraKeys::per_block(self.extra_keys.as_ref(), block_hashes.len(), lora_name.as_deref());
        Ok(BlockStored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            lora_id: self.lora_id.as_ref().and_then(Scalar::as_i64),
            medium: medium(self.medium)?,
            lora_name,
            extra_keys,
        })
    }

    fn removed(self) -> Lenient<KvEvent> {
        let block_hashes = hashes(self.block_hashes).map_err(|e| format!("BlockRemoved: {e}"))?;
        let medium = medium(self.medium).map_err(|e| format!("BlockRemoved: {e}"))?;
        Ok(KvEvent::Removed { block_hashes, medium })
    }
}

fn hashes(h: Option<Hashes>) -> Lenient<Vec<EngineBlockHash>> {
    match h {
        Some(Hashes(h)) => h,
        None => Err("block_hashes is not an array".into()),
    }
}

fn medium(m: Option<Scalar<'_>>) -> Lenient<Medium> {
    match m {
        Some(Scalar::Str(s)) if s.len() > MAX_MEDIUM_BYTES => {
            Err(format!("medium name of {} bytes (limit {MAX_MEDIUM_BYTES})", s.len()))
        }
        Some(m) => m.medium(),
        None => Ok(Medium::Gpu),
    }
}

/// Where [`EventFields::read`] takes a field's value from: the next array element, or the
/// value of the map entry whose key was just read.
trait FieldSource<'de> {
    type Error;
    fn next<T: Deserialize<'de>>(self) -> Result<Option<T>, Self::Error>;
}

struct FromSeq<'a, A>(&'a mut A);

impl<'de, A: SeqAccess<'de>> FieldSource<'de> for FromSeq<'_, A> {
    type Error = A::Error;
    fn next<T: Deserialize<'de>>(self) -> Result<Option<T>, A::Error> {
        self.0.next_element()
    }
}

struct FromMap<'a, A>(&'a mut A);

impl<'de, A: MapAccess<'de>> FieldSource<'de> for FromMap<'_, A> {
    type Error = A::Error;
    fn next<T: Deserialize<'de>>(self) -> Result<Option<T>, A::Error> {
        self.0.next_value().map(Some)
    }
}

/// What the visitors have read so far; see the module docs for why it lives outside serde's
/// return values.
#[derive(Default)]
struct Gathered {
    ts: Option<f64>,
    dp_rank: Option<i64>,
    /// The events array's header was read.
    events_started: bool,
    /// Its last element was read.
    events_done: bool,
    /// Its declared length.
    declared: usize,
    /// Events read whole, whatever became of them.
    read: usize,
    /// Kind of the event being read, once its type name was read.
    current: Option<Kind>,
    /// Why the batch has no usable events array (a shape problem, not a msgpack one).
    shape: Option<String>,
    events: Vec<KvEvent>,
    damage: Damage,
}

impl Gathered {
    fn take(&mut self, outcome: Outcome) {
        self.read += 1;
        self.current = None;
        match outcome {
            Outcome::Event(e) => self.events.push(e),
            Outcome::Unknown(name) => {
                self.damage.unknown_events += 1;
                if self.damage.unknown_types.len() < MAX_UNKNOWN_NAMES && !self.damage.unknown_types.contains(&name) {
                    self.damage.unknown_types.push(name);
                }
            }
            Outcome::Skip(why) => {
                self.damage.skipped_events += 1;
                self.damage.first_skip_reason.get_or_insert(why);
            }
            Outcome::Untrusted(why) => self.events.push(KvEvent::Untrusted(why)),
        }
    }

    /// The batch, given the deserializer's error if it stopped early (see the module docs of
    /// the parent for what is kept).
    fn finish(mut self, error: Option<String>) -> Result<KvEventBatch, KvEventError> {
        if let Some(why) = self.shape {
            return Err(KvEventError::Shape(why));
        }
        if !self.events_started {
            return Err(match error {
                Some(e) => KvEventError::Msgpack(e),
                None => KvEventError::Shape("batch has no events array".into()),
            });
        }
        if let Some(e) = error
            && !self.events_done
        {
            self.damage.truncated = true;
            // Lost: the event being read and every one after it. Only the rest of one final
            // BlockStored can be lost without risk.
            let after = self.declared.saturating_sub(self.read + 1);
            if !(self.current == Some(Kind::Stored) && after == 0) {
                let of = self.declared;
                self.events
                    .push(KvEvent::Untrusted(format!("payload broke off after {} of {of} events ({e})", self.read)));
            }
        }
        Ok(KvEventBatch { ts: self.ts.unwrap_or(0.0), events: self.events, dp_rank: self.dp_rank, damage: self.damage })
    }
}

/// Reads one event into a [`Gathered`].
struct EventSeed<'a>(&'a mut Gathered);

impl<'de> DeserializeSeed<'de> for EventSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EventSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a KV event (map or array)")
    }

    scalar_visits!(|v: Self, s: Scalar<'_>| v.0.take(Outcome::Skip(format!("event is neither map nor array: {s}"))));

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut kind: Option<Scalar<'de>> = None;
        let mut fields = EventFields::default();
        while let Some(key) = map.next_key::<Scalar<'de>>()? {
            match key.as_str() {
                Some("type") => {
                    let k: Scalar<'de> = map.next_value()?;
                    self.0.current = k.as_str().map(Kind::of);
                    kind = Some(k);
                }
                Some(name) => {
                    fields.read(name, FromMap(&mut map))?;
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let outcome = match kind.as_ref().and_then(Scalar::as_str) {
            Some(name) => fields.into_outcome(Kind::of(name), name),
            None => Outcome::Skip("event map without a string \"type\"".into()),
        };
        self.0.take(outcome);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let kind: Option<Scalar<'de>> = seq.next_element()?;
        let Some(name) = kind.as_ref().and_then(Scalar::as_str) else {
            skip_seq(seq)?;
            self.0.take(Outcome::Skip("event array without a type name first".into()));
            return Ok(());
        };
        let k = Kind::of(name);
        self.0.current = Some(k);
        let names: &[&str] = match k {
            Kind::Stored => &STORED_FIELDS,
            Kind::Removed => &REMOVED_FIELDS,
            Kind::Cleared | Kind::Unknown => &[],
        };
        let mut fields = EventFields::default();
        for name in names {
            if !fields.read(name, FromSeq(&mut seq))? {
                break;
            }
        }
        skip_seq(seq)?;
        self.0.take(fields.into_outcome(k, name));
        Ok(())
    }
}

/// Reads the events array into a [`Gathered`], event by event.
struct EventsSeed<'a>(&'a mut Gathered);

impl<'de> DeserializeSeed<'de> for EventsSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EventsSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an events array")
    }

    scalar_visits!(|v: Self, _| v.0.shape = Some("batch has no events array".into()));

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        skip_map(map)?;
        self.0.shape = Some("batch has no events array".into());
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let g = self.0;
        g.events_started = true;
        g.declared = seq.size_hint().unwrap_or(0);
        g.events.reserve(g.declared.min(1 << 12));
        while seq.next_element_seed(EventSeed(&mut *g))?.is_some() {}
        g.events_done = true;
        Ok(())
    }
}

/// Reads a whole batch into a [`Gathered`].
struct BatchSeed<'a>(&'a mut Gathered);

impl<'de> DeserializeSeed<'de> for BatchSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for BatchSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a KVEventBatch (array or map)")
    }

    scalar_visits!(|v: Self, s: Scalar<'_>| v.0.shape = Some(format!("batch is neither array nor map: {s}")));

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let g = self.0;
        let Some(ts) = seq.next_element::<Scalar<'de>>()? else { return Ok(()) };
        g.ts = ts.as_f64();
        if seq.next_element_seed(EventsSeed(&mut *g))?.is_none() {
            return Ok(());
        }
        g.dp_rank = seq.next_element::<Scalar<'de>>()?.as_ref().and_then(Scalar::as_i64);
        skip_seq(seq)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let g = self.0;
        while let Some(key) = map.next_key::<Scalar<'de>>()? {
            match key.as_str() {
                Some("ts") => g.ts = map.next_value::<Scalar<'de>>()?.as_f64(),
                Some("events") => map.next_value_seed(EventsSeed(&mut *g))?,
                Some("data_parallel_rank") => g.dp_rank = map.next_value::<Scalar<'de>>()?.as_i64(),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}
