//! [`Column`]: one value per pod of the pod table, in fixed-size chunks shared between
//! publications, so a publication that changes a few pods' statuses copies only their chunks
//! (docs/design.md §4 "Decision speed").
//!
//! Why chunks: a decision reads every candidate's entry. A column rebuilt whole at each
//! publication is written by the pool's writer thread and so lies cold in the deciding core's
//! caches: at 1,000 pods that is over a thousand cache lines fetched from another core, every
//! time any pod reports. Shared chunks stay warm; only a changed pod's chunk, and the short list
//! of chunk pointers, are new.

use std::ops::Index;
use std::sync::Arc;

/// Pods per chunk: 16 [`PodHot`](super::PodHot)s fill 18 cache lines, small enough that copying
/// one for a changed pod is cheap, large enough that the list of chunks (63 pointers for 1,000
/// pods) stays within a few cache lines.
pub(crate) const CHUNK: usize = 16;

/// A chunk's values, aligned so the `Arc`'s reference counts, which every publication that
/// shares the chunk updates, sit on a cache line of their own: reading a value never touches
/// that line (only dropping the last table that holds the chunk does).
#[derive(Debug, Clone)]
#[repr(C, align(64))]
struct Chunk<T>([T; CHUNK]);

/// An immutable sequence of `len` values, `CHUNK` to a shared chunk. Cloning copies the chunk
/// pointers, not the values; [`Column::set`] copies the one chunk it changes unless this column
/// alone holds it.
#[derive(Debug)]
pub(crate) struct Column<T> {
    chunks: Vec<Arc<Chunk<T>>>,
    len: usize,
}

impl<T> Default for Column<T> {
    fn default() -> Self {
        Column { chunks: Vec::new(), len: 0 }
    }
}

impl<T> Clone for Column<T> {
    fn clone(&self) -> Self {
        Column { chunks: self.chunks.clone(), len: self.len }
    }
}

impl<T> Column<T> {
    /// The values in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flat_map(|c| c.0.iter()).take(self.len)
    }
}

impl<T: Clone> Column<T> {
    /// Replaces value `i`. Panics if `i >= len` (as a slice's index would).
    pub(crate) fn set(&mut self, i: usize, value: T) {
        assert!(i < self.len, "column index {i} out of range for length {}", self.len);
        Arc::make_mut(&mut self.chunks[i / CHUNK]).0[i % CHUNK] = value;
    }
}

impl<T: Clone> FromIterator<T> for Column<T> {
    /// The last chunk is padded with copies of the last value, never read (a padding copy of
    /// an `Arc` keeps that value alive until the column is next built whole).
    fn from_iter<I: IntoIterator<Item = T>>(values: I) -> Self {
        let mut chunks = Vec::new();
        let mut len = 0;
        let mut values = values.into_iter();
        while let Some(first) = values.next() {
            let mut part: Vec<T> = Vec::with_capacity(CHUNK);
            part.push(first);
            part.extend(values.by_ref().take(CHUNK - 1));
            len += part.len();
            while part.len() < CHUNK {
                let pad = part[part.len() - 1].clone();
                part.push(pad);
            }
            if let Ok(full) = <[T; CHUNK]>::try_from(part) {
                chunks.push(Arc::new(Chunk(full)));
            }
        }
        Column { chunks, len }
    }
}

impl<T> Index<usize> for Column<T> {
    type Output = T;

    /// Value `i`. Panics if `i >= len`.
    #[inline]
    fn index(&self, i: usize) -> &T {
        assert!(i < self.len, "column index {i} out of range for length {}", self.len);
        &self.chunks[i / CHUNK].0[i % CHUNK]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A column reads as the values it was built from, at every length around chunk edges, and
    /// a `set` changes its own copy only: a clone taken before keeps the old value and shares
    /// every other chunk.
    #[test]
    fn a_column_reads_as_its_values_and_set_copies_one_chunk() {
        for n in [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5] {
            let mut col: Column<u64> = (0..n as u64).collect();
            assert_eq!(col.len, n);
            assert_eq!(col.iter().copied().collect::<Vec<_>>(), (0..n as u64).collect::<Vec<_>>());
            for i in 0..n {
                assert_eq!(col[i], i as u64);
            }
            if n == 0 {
                continue;
            }
            let before = col.clone();
            let i = n - 1;
            col.set(i, 1000);
            assert_eq!((col[i], before[i]), (1000, i as u64), "n = {n}");
            let shared = col.chunks.iter().zip(&before.chunks).filter(|(a, b)| Arc::ptr_eq(a, b)).count();
            assert_eq!(shared, col.chunks.len() - 1, "n = {n}: only the changed chunk is copied");
            // Held by this column alone now: a second change to the same chunk copies nothing.
            let copied = Arc::as_ptr(&col.chunks[i / CHUNK]);
            col.set(i, 1001);
            assert_eq!(Arc::as_ptr(&col.chunks[i / CHUNK]), copied);
            assert_eq!(col.iter().count(), n);
        }
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn reading_past_the_end_panics_inside_the_padding_too() {
        let col: Column<u64> = (0..3).collect();
        let _ = col[3];
    }
}
