//! The hasher of the block record's maps: foldhash (through hashbrown's `DefaultHashBuilder`),
//! randomly seeded per process. Keys are already uniformly distributed 64-bit block hashes, so
//! SipHash's per-byte work buys nothing and costs a visible share of the agent's CPU under load
//! (docs/decisions/0023-agent-cpu-budget.md); the random seed keeps prompts crafted to collide
//! under a known bucket function from being prepared in advance.

/// Builds the maps' hashers (foldhash, random per-process seed).
pub type FoldState = hashbrown::DefaultHashBuilder;
/// A `HashMap` with [`FoldState`].
pub type FoldMap<K, V> = std::collections::HashMap<K, V, FoldState>;
/// A `HashSet` with [`FoldState`].
pub type FoldSet<K> = std::collections::HashSet<K, FoldState>;
