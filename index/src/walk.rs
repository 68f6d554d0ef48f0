//! The prefix walk (docs/design.md §3): [`match_prefix`] calls the map's [`BlockPods::walk`],
//! which is [`walk_blocks`] unless the map knows a faster way to the same counts (the flat
//! snapshot follows runs, see `flat.rs`, and shares `narrow`/`finish` with it).
//!
//! [`walk_blocks`] walks the request's chain from block 0 and keeps the pods that held every
//! block so far (`active`, sorted). A pod leaving `active` at depth d matched d blocks. Stops at the first block
//! no remaining pod holds. No allocation once `scratch` has grown to the pod count.
//!
//! Before walking a stretch of the chain it asks the map to [`BlockPods::touch`] that stretch, so
//! a map whose slot addresses follow from the hash alone fetches their cache lines in parallel;
//! the stretch starts at [`FIRST_TOUCH`] blocks (a miss stops at block 0 and should not pay for
//! 256 loads) and doubles up to [`MAX_TOUCH`] while the walk goes on.

use kvroute_common::BlockHash;

use crate::types::{MatchScratch, PodIdx};

/// Read access to a block → pods map: what the walk needs from a snapshot.
pub trait BlockPods {
    /// Pods holding `block`, sorted ascending, empty when none.
    fn pods_of(&self, block: BlockHash) -> &[PodIdx];

    /// Starts loading whatever [`BlockPods::pods_of`] will read for `blocks`, without waiting on
    /// it (a hint: the default does nothing).
    #[inline]
    fn touch(&self, _blocks: &[BlockHash]) {}

    /// The prefix walk on this map: [`walk_blocks`] unless the map knows a faster way to the same
    /// counts (the flat snapshot follows runs of consecutive blocks).
    #[inline]
    fn walk(&self, chain: &[BlockHash], scratch: &mut MatchScratch) -> u32 {
        walk_blocks(self, chain, scratch)
    }
}

/// Blocks touched ahead before the walk's first probe.
pub const FIRST_TOUCH: usize = 8;
/// Largest stretch touched ahead at once.
pub const MAX_TOUCH: usize = 64;

/// Records in `scratch`, per pod, how many consecutive blocks of `chain` from the start it holds
/// (the numerator of docs/design.md §2's match ratio); returns the longest such run.
#[inline]
pub fn match_prefix<I: BlockPods + ?Sized>(index: &I, chain: &[BlockHash], scratch: &mut MatchScratch) -> u32 {
    index.walk(chain, scratch)
}

/// Narrows `scratch.active` to the pods also in `holders` (sorted); a pod that leaves matched
/// `depth` blocks. Returns false when no pod remains.
#[inline]
pub(crate) fn narrow(scratch: &mut MatchScratch, holders: &[PodIdx], depth: u32) -> bool {
    // Sorted-merge intersection of `active` with `holders` into `next`.
    scratch.next.clear();
    let (mut i, mut j) = (0, 0);
    while i < scratch.active.len() && j < holders.len() {
        let (a, h) = (scratch.active[i], holders[j]);
        if a == h {
            scratch.next.push(a);
            i += 1;
            j += 1;
        } else if a < h {
            // `a` stops matching here: its count is `depth`.
            scratch.set(a, depth);
            i += 1;
        } else {
            j += 1;
        }
    }
    while i < scratch.active.len() {
        let a = scratch.active[i];
        scratch.set(a, depth);
        i += 1;
    }
    std::mem::swap(&mut scratch.active, &mut scratch.next);
    !scratch.active.is_empty()
}

/// Gives every pod still in `scratch.active` the count `depth` (the walk ended with them).
pub(crate) fn finish(scratch: &mut MatchScratch, depth: u32) {
    let active = std::mem::take(&mut scratch.active);
    for &a in &active {
        scratch.set(a, depth);
    }
    scratch.active = active;
}

/// The walk one block at a time through [`BlockPods::pods_of`], touching stretches ahead.
pub fn walk_blocks<I: BlockPods + ?Sized>(index: &I, chain: &[BlockHash], scratch: &mut MatchScratch) -> u32 {
    scratch.reset();
    let Some((first, rest)) = chain.split_first() else {
        return 0;
    };
    let mut touched = chain.len().min(FIRST_TOUCH);
    index.touch(&chain[..touched]);
    scratch.active.extend_from_slice(index.pods_of(*first));
    if scratch.active.is_empty() {
        return 0;
    }
    let mut stretch = FIRST_TOUCH;
    let mut depth: u32 = 1;
    for (i, block) in rest.iter().enumerate() {
        // `i + 1` is `block`'s position in `chain`.
        if i + 1 == touched {
            stretch = (stretch * 2).min(MAX_TOUCH);
            let end = chain.len().min(touched + stretch);
            index.touch(&chain[touched..end]);
            touched = end;
        }
        let holders = index.pods_of(*block);
        // Common case on a cached prefix: the same pods hold the next block too.
        if holders == scratch.active.as_slice() {
            depth += 1;
            continue;
        }
        if !narrow(scratch, holders, depth) {
            return depth;
        }
        depth += 1;
    }
    finish(scratch, depth);
    depth
}
