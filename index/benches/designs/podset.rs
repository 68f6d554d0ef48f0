//! [`PodSet`]: the set of pods holding one block, kept sorted.
//!
//! Up to [`INLINE_PODS`] pods live inline (no allocation: a block is usually on 1–3 pods); more
//! spill to a heap vector. 16 bytes either way, so a map entry (hash + set) is 24 bytes.

use kvroute_index::PodIdx;

/// Pods stored inline before the set spills to the heap.
pub const INLINE_PODS: usize = 7;

/// A sorted, duplicate-free set of [`PodIdx`].
// The box keeps the enum at 16 bytes (a `Vec` is 24): the map entry stays 24 bytes.
#[allow(clippy::box_collection)]
#[derive(Clone, Debug)]
pub enum PodSet {
    /// `len` pods in `pods[..len]`, sorted ascending.
    Inline { len: u8, pods: [PodIdx; INLINE_PODS] },
    /// More than [`INLINE_PODS`] pods, sorted ascending.
    Heap(Box<Vec<PodIdx>>),
}

impl Default for PodSet {
    fn default() -> Self {
        PodSet::Inline { len: 0, pods: [PodIdx(0); INLINE_PODS] }
    }
}

impl PodSet {
    /// The pods, sorted ascending.
    #[inline]
    pub fn as_slice(&self) -> &[PodIdx] {
        match self {
            PodSet::Inline { len, pods } => &pods[..usize::from(*len)],
            PodSet::Heap(v) => v.as_slice(),
        }
    }

    /// Number of pods in the set.
    #[inline]
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// True when no pod holds the block (such entries are removed from the map).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Inserts `pod`; returns false when it was already present.
    pub fn insert(&mut self, pod: PodIdx) -> bool {
        let pos = match self.as_slice().binary_search(&pod) {
            Ok(_) => return false,
            Err(pos) => pos,
        };
        match self {
            PodSet::Inline { len, pods } => {
                let n = usize::from(*len);
                if n < INLINE_PODS {
                    pods.copy_within(pos..n, pos + 1);
                    pods[pos] = pod;
                    *len += 1;
                } else {
                    let mut v = Vec::with_capacity(INLINE_PODS * 2);
                    v.extend_from_slice(&pods[..n]);
                    v.insert(pos, pod);
                    *self = PodSet::Heap(Box::new(v));
                }
            }
            PodSet::Heap(v) => v.insert(pos, pod),
        }
        true
    }

    /// Removes `pod`; returns false when it was absent.
    pub fn remove(&mut self, pod: PodIdx) -> bool {
        let Ok(pos) = self.as_slice().binary_search(&pod) else {
            return false;
        };
        match self {
            PodSet::Inline { len, pods } => {
                let n = usize::from(*len);
                pods.copy_within(pos + 1..n, pos);
                *len -= 1;
            }
            PodSet::Heap(v) => {
                v.remove(pos);
                if v.len() <= INLINE_PODS {
                    let mut pods = [PodIdx(0); INLINE_PODS];
                    pods[..v.len()].copy_from_slice(v);
                    // `v.len() <= INLINE_PODS` (7), so the cast cannot truncate.
                    *self = PodSet::Inline { len: v.len() as u8, pods };
                }
            }
        }
        true
    }
}
