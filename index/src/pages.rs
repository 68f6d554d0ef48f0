//! [`Table`]: a fixed-length, zero-initialised heap array for the index's large flat tables (the
//! slot table of every copy, [`crate::flat`]), placed so the kernel can back it with 2 MiB pages.
//!
//! Why (docs/decisions/0003-index-huge-page-tables.md): the writer's steady work is random stores
//! into two or three 16 MiB slot tables, one per copy; with 4 KiB pages those span more pages
//! than the TLB holds, so most stores also miss the TLB. With 2 MiB pages for the whole process
//! (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`) the writer does 10.5–10.8 M events per CPU-second
//! against 9.2–9.5. This type gives huge pages to the index's tables only.
//!
//! How: on Linux a table of at least [`HUGE_PAGE`] bytes is its own anonymous mapping, rounded
//! up to and aligned on [`HUGE_PAGE`], advised `madvise(MADV_HUGEPAGE)` before its first write:
//! transparent huge pages then fault in as 2 MiB pages where the system allows them
//! (`transparent_hugepage/enabled` set to `madvise` or `always`). The advice is a hint: when it
//! fails, or huge pages are off or unavailable, the table is on 4 KiB pages, contents and
//! behaviour unchanged. The mapping's pages arrive zeroed from the kernel, so a new table is not
//! written twice (through the global allocator an over-aligned zeroed allocation is written by
//! the kernel and again by `memset`, and glibc maps and unmaps one per table: a fifth of a bulk
//! load then goes to clearing pages). When the mapping fails, and for smaller tables and on
//! other systems, it is an ordinary zeroed allocation from the global allocator.
//!
//! Accounting: mappings bypass the global allocator, so a counting allocator does not see them;
//! [`mapped_bytes`] is their process-wide total (live bytes, rounded up to [`HUGE_PAGE`]), which
//! `tests/alloc.rs` and `bench/peers` add to the allocator's figures.
//!
//! The length is fixed at construction (a table grows by allocating a bigger one); the element
//! type is `Copy`, so it has no destructor and a drop only frees the memory.

// The crate's `unsafe` (Cargo.toml): allocation, mapping, the slice views and the advice; the
// only other is `flat::Slot`'s `Zeroed` marker.
#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Size (and alignment) of a huge page on x86-64 and, with 4 KiB base pages, on aarch64 Linux.
pub const HUGE_PAGE: usize = 2 << 20;

/// Live bytes in [`Table`] mappings, process-wide.
static MAPPED: AtomicUsize = AtomicUsize::new(0);

/// Bytes the process's [`Table`]s hold in their own mappings (outside the global allocator),
/// rounded up to [`HUGE_PAGE`] each: add it to a counting allocator's figures.
pub fn mapped_bytes() -> usize {
    MAPPED.load(Ordering::Relaxed)
}

/// Element types of a [`Table`]: all-zero bytes are a valid value.
///
/// # Safety
/// Implement only for types for which the all-zero bit pattern is a valid, initialised value
/// (integers and structs of them, no references, no `NonZero`, no enums without a zero variant).
pub unsafe trait Zeroed: Copy {}

// `Slot`'s implementation is beside its definition (`flat.rs`), where its fields are.
// SAFETY: zero is a valid `u64`.
unsafe impl Zeroed for u64 {}

/// Where a table's memory came from, which decides how it is freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// Nothing allocated (no bytes): `ptr` is dangling.
    None,
    /// The global allocator, with [`Table::layout`]'s layout.
    Heap,
    /// Its own anonymous mapping of this many bytes.
    Mapped(usize),
}

/// A heap array of `len` `T`s that derefs to `[T]`, zeroed when made; see the module docs.
/// `Clone` copies the contents into a new table placed the same way.
pub struct Table<T: Zeroed> {
    /// Start of the memory (dangling, well aligned, when nothing is allocated).
    ptr: NonNull<T>,
    len: usize,
    origin: Origin,
    /// Owns `T`s (for the auto traits' and drop check's sake, as `Box<[T]>` does).
    _owns: PhantomData<T>,
}

// SAFETY: a `Table<T>` owns its elements exclusively, as `Box<[T]>` does: sending it sends the
// `T`s, so it is `Send` when `T` is.
unsafe impl<T: Zeroed + Send> Send for Table<T> {}
// SAFETY: `&Table<T>` gives only `&[T]` (mutation needs `&mut`), so sharing it shares `&T`s:
// `Sync` when `T` is.
unsafe impl<T: Zeroed + Sync> Sync for Table<T> {}

impl<T: Zeroed> Table<T> {
    /// A table of `len` all-zero `T`s.
    ///
    /// # Panics
    /// When `len` `T`s exceed `isize::MAX` bytes (as `vec!` does); aborts through
    /// [`alloc::handle_alloc_error`] when the allocator fails.
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        if layout.size() == 0 {
            return Table { ptr: NonNull::dangling(), len, origin: Origin::None, _owns: PhantomData };
        }
        if layout.size() >= HUGE_PAGE
            && layout.align() <= HUGE_PAGE
            && let Some((ptr, mapped)) = map(layout.size())
        {
            MAPPED.fetch_add(mapped, Ordering::Relaxed);
            return Table { ptr: ptr.cast(), len, origin: Origin::Mapped(mapped), _owns: PhantomData };
        }
        // SAFETY: the layout's size is non-zero (checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else { alloc::handle_alloc_error(layout) };
        Table { ptr, len, origin: Origin::Heap, _owns: PhantomData }
    }

    /// The layout of `len` `T`s.
    fn layout(len: usize) -> Layout {
        match Layout::array::<T>(len) {
            Ok(layout) => layout,
            Err(_) => panic!("a table of {len} elements of {} bytes overflows isize", size_of::<T>()),
        }
    }

    /// Bytes of the table's elements (`len × size_of::<T>()`); its own mapping, if it has one,
    /// is this rounded up to [`HUGE_PAGE`] (the same for the slot tables, powers of two).
    pub fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// Whether the table is its own huge-page-aligned, advised mapping.
    #[cfg(test)]
    fn is_mapped(&self) -> bool {
        matches!(self.origin, Origin::Mapped(_))
    }
}

/// A fresh anonymous mapping of `size` bytes rounded up to [`HUGE_PAGE`], [`HUGE_PAGE`]-aligned,
/// advised `MADV_HUGEPAGE` (failure of the advice is ignored), and its length; `None` when the
/// kernel refuses it.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn map(size: usize) -> Option<(NonNull<u8>, usize)> {
    let len = size.checked_next_multiple_of(HUGE_PAGE)?;
    // Room to slide the start to a huge-page boundary.
    let reserve = len.checked_add(HUGE_PAGE)?;
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing: it aliases no
    // memory this process uses, and its result is checked before use.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let head = (base as usize).next_multiple_of(HUGE_PAGE) - base as usize;
    let start = base.cast::<u8>().wrapping_add(head);
    let tail = reserve - head - len;
    if head > 0 {
        // SAFETY: `base..base + head` is the start of the mapping just made, page aligned (the
        // kernel's and HUGE_PAGE's boundaries are both multiples of the page size); nothing
        // refers to it. A failed unmap only leaves it reserved.
        unsafe { libc::munmap(base, head) };
    }
    if tail > 0 {
        // SAFETY: `start + len..base + reserve` is the end of the same mapping, page aligned
        // (`start` and `len` are multiples of HUGE_PAGE); nothing refers to it.
        unsafe { libc::munmap(start.wrapping_add(len).cast(), tail) };
    }
    // SAFETY: `start..start + len` lies in the mapping just made; MADV_HUGEPAGE changes only
    // which page size backs it, not its contents or validity. Failure is harmless.
    unsafe { libc::madvise(start.cast(), len, libc::MADV_HUGEPAGE) };
    Some((NonNull::new(start)?, len))
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn map(_size: usize) -> Option<(NonNull<u8>, usize)> {
    None
}

impl<T: Zeroed> Drop for Table<T> {
    fn drop(&mut self) {
        match self.origin {
            Origin::None => {}
            Origin::Heap => {
                // SAFETY: `ptr` came from the global allocator with this same layout (a
                // function of `len`, which never changes) and is freed only here; `T: Copy` has
                // no destructor to run first.
                unsafe { alloc::dealloc(self.ptr.as_ptr().cast(), Self::layout(self.len)) };
            }
            Origin::Mapped(len) => {
                unmap(self.ptr.cast(), len);
                MAPPED.fetch_sub(len, Ordering::Relaxed);
            }
        }
    }
}

/// Unmaps what [`map`] returned.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn unmap(p: NonNull<u8>, len: usize) {
    // SAFETY: `p..p + len` is a mapping `map` made for one table, unmapped only here, when that
    // table (the only owner of references into it) is dropped.
    unsafe { libc::munmap(p.as_ptr().cast(), len) };
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn unmap(_p: NonNull<u8>, _len: usize) {}

impl<T: Zeroed> Deref for Table<T> {
    type Target = [T];

    #[inline(always)]
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` is valid for reads of `len` initialised `T`s (zeroed at construction,
        // a valid `T` by `Zeroed`) and aligned (the mapping is page aligned, the heap layout
        // has `T`'s alignment; dangling but aligned when there are no bytes); the borrow of
        // `self` keeps it alive and unaliased by any `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroed> DerefMut for Table<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference to the elements.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroed> Clone for Table<T> {
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(self.len);
        copy.copy_from_slice(self);
        copy
    }
}

impl<T: Zeroed> Default for Table<T> {
    fn default() -> Self {
        Self::zeroed(0)
    }
}

impl<T: Zeroed + fmt::Debug> fmt::Debug for Table<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: Zeroed + PartialEq> PartialEq for Table<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Zeroed + Eq> Eq for Table<T> {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat::Slot;

    const HUGE: bool = cfg!(any(target_os = "linux", target_os = "android"));
    const S: Slot = Slot { key: 7, set: 8, run: 9 };

    #[test]
    fn small_tables_are_zeroed_heap_allocations() {
        for len in [0, 1, 3, 1000] {
            let mut t = Table::<Slot>::zeroed(len);
            assert_eq!(t.len(), len);
            assert!(t.iter().all(|s| *s == Slot::default()));
            assert_eq!(t.as_ptr() as usize % align_of::<Slot>(), 0);
            assert!(!t.is_mapped());
            assert_eq!(t.bytes(), len * 16);
            if let Some(last) = t.last_mut() {
                *last = S;
                assert_eq!(t[len - 1], S);
            }
        }
    }

    #[test]
    fn large_tables_are_huge_page_aligned_mappings_and_zeroed() {
        // Exactly one huge page, and more than one with a partial last page.
        for len in [HUGE_PAGE / 16, HUGE_PAGE / 16 * 3 + 5] {
            let before = mapped_bytes();
            let mut t = Table::<Slot>::zeroed(len);
            assert_eq!(t.len(), len);
            assert!(t.iter().all(|s| *s == Slot::default()), "zeroed");
            if HUGE {
                assert!(t.is_mapped());
                assert_eq!(t.as_ptr() as usize % HUGE_PAGE, 0, "huge-page aligned");
                // Other tests may map tables meanwhile: at least this one's rounded length.
                assert!(mapped_bytes() >= before + t.bytes().next_multiple_of(HUGE_PAGE));
            }
            assert_eq!(t.bytes(), len * 16);
            t[len - 1] = S;
            t[0].set = 3;
            assert_eq!((t[len - 1], t[0].set, t[1].set), (S, 3, 0));
        }
    }

    #[test]
    fn clones_are_equal_independent_and_placed_alike() {
        for len in [0, 5, HUGE_PAGE / 16 + 1] {
            let mut a = Table::<Slot>::zeroed(len);
            for s in a.iter_mut() {
                *s = S;
            }
            if let Some(last) = a.last_mut() {
                last.run = 42;
            }
            let mut b = a.clone();
            assert_eq!(a, b);
            assert_eq!(a.is_mapped(), b.is_mapped());
            if b.is_mapped() {
                assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0, "a clone is placed alike");
            }
            if let Some(first) = b.first_mut() {
                first.key = 1;
                assert_ne!(a, b, "a clone has its own memory");
                assert_eq!(a[0], S);
            }
            drop(a);
            // The clone outlives its source.
            assert!(b.iter().skip(1).take(len.saturating_sub(2)).all(|s| *s == S));
        }
    }

    /// Mapped bytes go back down when a mapped table is dropped (this test's own tables: the
    /// counter is process-wide, so it checks its own difference while holding many).
    #[test]
    fn dropping_a_mapped_table_unmaps_it() {
        let tables: Vec<Table<u64>> = (0..8).map(|_| Table::zeroed(HUGE_PAGE / 8)).collect();
        let held = mapped_bytes();
        drop(tables);
        if HUGE {
            assert!(held >= 8 * HUGE_PAGE);
            // Others may have mapped at most a few tables meanwhile; ours (16 MiB) are gone.
            assert!(mapped_bytes() < held, "{} mapped after dropping 16 MiB of {held}", mapped_bytes());
        }
    }

    #[test]
    fn default_is_empty_and_equal_to_an_empty_table() {
        let t = Table::<Slot>::default();
        assert!(t.is_empty() && !t.is_mapped());
        assert_eq!(t, Table::zeroed(0));
        assert_eq!(format!("{:?}", Table::<u64>::zeroed(2)), "[0, 0]");
    }
}
