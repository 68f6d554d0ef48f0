//! Identifier newtypes. One type per hash kind: they are all `u64` underneath and must never mix.

use serde::{Deserialize, Serialize};

/// kvroute's chained block hash (docs/design.md §2): identifies a block *and* everything before it, under
/// one (model, adapter) root. Identical in agent and picker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockHash(pub u64);

/// A block hash as vLLM computes it (SHA-256-based, random per process unless PYTHONHASHSEED is
/// fixed). Opaque: only ever used as a key to find the [`BlockHash`] the agent computed for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EngineBlockHash(pub u64);

impl std::fmt::Display for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}
