//! The baselines design C was chosen against (`docs/index.md`), kept with the benchmark and out
//! of the library: they implement the library's public [`Backend`] and [`BlockPods`] traits, so
//! they run under the same [`kvroute_index::Writer`], walk and differential tests as the index in
//! use (`tests/difftest.rs` includes this module too).
//!
//! - [`sharded`] (design A): 64 copy-on-write hashbrown shards (`Arc::make_mut`);
//! - [`double`] (design B): two copies of one hashbrown map, left-right style, kept in step by
//!   replaying an op log;
//! - [`pooled_hb`] (design C-hb): the pool of up to three copies over B's hashbrown map, kept in
//!   step by the op log (the library's pool copies dirty slots instead;
//!   docs/decisions/0002-index-snapshot-design.md).

#![allow(dead_code)]

pub mod double;
pub mod podset;
pub mod pooled_hb;
pub mod sharded;

use kvroute_index::{MixBuild, PodIdx};

pub use double::{DoubleBackend, DoubleSnapshot};
pub use podset::PodSet;
pub use pooled_hb::PooledHashbrown;
pub use sharded::ShardedBackend;

/// Block hash → pods holding it. The baseline designs are built from these maps.
pub type BlockMap = hashbrown::HashMap<u64, PodSet, MixBuild>;

/// Adds `pod` to `block`'s set; returns (the block is new, the pair is new).
#[inline]
pub fn map_link(map: &mut BlockMap, pod: PodIdx, block: u64) -> (bool, bool) {
    let set = map.entry(block).or_default();
    let new_node = set.is_empty();
    (new_node, set.insert(pod))
}

/// Removes `pod` from `block`'s set; returns (the pair was present, the block is now gone).
#[inline]
pub fn map_unlink(map: &mut BlockMap, pod: PodIdx, block: u64) -> (bool, bool) {
    let Some(set) = map.get_mut(&block) else {
        return (false, false);
    };
    let removed = set.remove(pod);
    if set.is_empty() {
        map.remove(&block);
        return (removed, true);
    }
    (removed, false)
}

/// One primitive change to a block map, logged so another copy can replay it (designs B, C-hb).
#[derive(Clone, Copy, Debug)]
pub enum LogOp {
    Link(PodIdx, u64),
    Unlink(PodIdx, u64),
}

/// Applies `ops` in order to `map` (bringing a copy that lacks them up to date).
pub fn replay(map: &mut BlockMap, ops: &[LogOp]) {
    for op in ops {
        match *op {
            LogOp::Link(p, h) => {
                let _ = map_link(map, p, h);
            }
            LogOp::Unlink(p, h) => {
                let _ = map_unlink(map, p, h);
            }
        }
    }
}

/// Op-log capacity kept between batches (16 bytes per op).
pub const LOG_KEEP_OPS: usize = 1 << 16;
/// Bytes per map slot: 8-byte key + 16-byte `PodSet` + 1 control byte.
pub const SLOT_BYTES: u64 = 25;
