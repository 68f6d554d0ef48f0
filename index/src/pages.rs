//! [`Table`]: a fixed-length heap array for the index's large flat tables (the slot table of
//! every copy, [`crate::flat`]), placed so the kernel can back it with 2 MiB pages.
//!
//! Why (docs/index.md, "Round 8"): the writer's steady work is random stores into two or three
//! 16 MiB slot tables, one per copy; with 4 KiB pages those span more pages than the TLB holds,
//! so most stores also miss the TLB. With 2 MiB pages the writer did 10.5–10.8 M events per
//! CPU-second against 9.2–9.5 (round 7, `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which gives
//! every allocation of the process huge pages). This type gives them to the index's tables only.
//!
//! How: on Linux a table of at least [`HUGE_PAGE`] bytes is allocated [`HUGE_PAGE`]-aligned
//! through the global allocator (so the process's allocator and its accounting still see it)
//! and advised `madvise(MADV_HUGEPAGE)` before its first write, which makes transparent huge
//! pages fault in as 2 MiB pages where the system allows them (`transparent_hugepage/enabled`
//! set to `madvise` or `always`). The advice is a hint: when it fails or huge pages are off or
//! unavailable, the table is on 4 KiB pages, contents and behaviour unchanged. Elsewhere (other
//! systems, smaller tables) it is an ordinary allocation with the element type's alignment.
//!
//! The length is fixed at construction (a table grows by allocating a bigger one); the element
//! type is `Copy`, so it has no destructor and a drop only frees the memory.

// The crate's only `unsafe` (Cargo.toml): allocation, the slice views and the advice.
#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::fmt;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Size (and alignment) of a huge page on x86-64 and, with 4 KiB base pages, on aarch64 Linux.
pub const HUGE_PAGE: usize = 2 << 20;

/// Whether tables of [`HUGE_PAGE`] bytes or more are huge-page aligned and advised.
const HUGE: bool = cfg!(any(target_os = "linux", target_os = "android"));

/// A heap array of `len` `T`s that derefs to `[T]`; see the module docs. `Clone` copies the
/// contents into a new allocation placed the same way; an empty table allocates nothing.
pub struct Table<T: Copy> {
    /// Start of the allocation (dangling, well aligned, when nothing is allocated).
    ptr: NonNull<T>,
    len: usize,
    /// Owns `T`s (for the auto traits' and drop check's sake, as `Box<[T]>` does).
    _owns: PhantomData<T>,
}

// SAFETY: a `Table<T>` owns its elements exclusively, as `Box<[T]>` does: sending it sends the
// `T`s, so it is `Send` when `T` is.
unsafe impl<T: Copy + Send> Send for Table<T> {}
// SAFETY: `&Table<T>` gives only `&[T]` (mutation needs `&mut`), so sharing it shares `&T`s:
// `Sync` when `T` is.
unsafe impl<T: Copy + Sync> Sync for Table<T> {}

impl<T: Copy> Table<T> {
    /// A table of `len` copies of `value`.
    ///
    /// # Panics
    /// When `len` `T`s exceed `isize::MAX` bytes (as `vec!` does); aborts through
    /// [`alloc::handle_alloc_error`] when the allocator fails.
    pub fn filled(len: usize, value: T) -> Self {
        let table = Self::uninit(len);
        // SAFETY: `uninit` allocated room for `len` `T`s at `ptr`, aligned (or `T` is
        // zero-sized and `ptr` dangling, which is valid for zero-sized accesses); viewed as
        // `MaybeUninit<T>` its contents need not be initialised yet, and `table` is not read
        // until this view ends.
        let room = unsafe { std::slice::from_raw_parts_mut(table.ptr.as_ptr().cast::<MaybeUninit<T>>(), len) };
        for slot in room {
            slot.write(value);
        }
        table
    }

    /// The allocation for `len` `T`s, advised, contents uninitialised: every caller writes all
    /// `len` elements before the table is read or returned.
    fn uninit(len: usize) -> Self {
        let layout = Self::layout(len);
        if layout.size() == 0 {
            return Table { ptr: NonNull::dangling(), len, _owns: PhantomData };
        }
        // SAFETY: the layout's size is non-zero (checked above).
        let raw = unsafe { alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else { alloc::handle_alloc_error(layout) };
        advise(raw, layout);
        Table { ptr, len, _owns: PhantomData }
    }

    /// The layout of `len` `T`s: [`HUGE_PAGE`]-aligned when at least that large (on Linux).
    /// [`Drop`] recomputes it from `len`, so allocation and deallocation always agree.
    fn layout(len: usize) -> Layout {
        let Ok(layout) = Layout::array::<T>(len) else {
            panic!("a table of {len} elements of {} bytes overflows isize", size_of::<T>());
        };
        if HUGE && layout.size() >= HUGE_PAGE {
            // Fails only when the size rounded up to HUGE_PAGE overflows isize; then the plain
            // layout (unadvised), the same every time for this `len`.
            layout.align_to(HUGE_PAGE).unwrap_or(layout)
        } else {
            layout
        }
    }

    /// Heap bytes this table holds (`len × size_of::<T>()`).
    pub fn bytes(&self) -> usize {
        Self::layout(self.len).size()
    }
}

/// Advises `MADV_HUGEPAGE` over an allocation of `layout` at `p` when it is huge-page aligned.
/// Failure is silent: the advice only changes the page size.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn advise(p: *mut u8, layout: Layout) {
    if layout.align() >= HUGE_PAGE {
        // SAFETY: `p..p + size` is one live allocation this process owns, and `p` is page
        // aligned (HUGE_PAGE-aligned); MADV_HUGEPAGE changes no contents and no mapping's
        // validity, only which page size backs it, so no Rust reference can observe it.
        let _ = unsafe { libc::madvise(p.cast(), layout.size(), libc::MADV_HUGEPAGE) };
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn advise(_p: *mut u8, _layout: Layout) {}

impl<T: Copy> Drop for Table<T> {
    fn drop(&mut self) {
        let layout = Self::layout(self.len);
        if layout.size() != 0 {
            // SAFETY: `ptr` was allocated by the global allocator with this same layout
            // (`layout` is a function of `len`, which never changes) and is freed only here;
            // `T: Copy` has no destructor to run first.
            unsafe { alloc::dealloc(self.ptr.as_ptr().cast(), layout) };
        }
    }
}

impl<T: Copy> Deref for Table<T> {
    type Target = [T];

    #[inline(always)]
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` is valid for reads of `len` initialised `T`s (every constructor writes
        // all of them) and aligned (or dangling with `len` zero-sized or zero elements); the
        // borrow of `self` keeps it alive and unaliased by any `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> DerefMut for Table<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference to the elements.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> Clone for Table<T> {
    fn clone(&self) -> Self {
        let copy = Self::uninit(self.len);
        // SAFETY: both allocations hold `len` `T`s, are distinct (`copy`'s is new), and the
        // source is initialised; after this every element of `copy` is.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), copy.ptr.as_ptr(), self.len) };
        copy
    }
}

impl<T: Copy> Default for Table<T> {
    fn default() -> Self {
        Self::uninit(0)
    }
}

impl<T: Copy + fmt::Debug> fmt::Debug for Table<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: Copy + PartialEq> PartialEq for Table<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Copy + Eq> Eq for Table<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[repr(C, align(16))]
    struct Wide {
        a: u64,
        b: u32,
        c: u32,
    }

    const W: Wide = Wide { a: 7, b: 8, c: 9 };

    #[test]
    fn small_tables_are_plain_and_filled() {
        for len in [0, 1, 3, 1000] {
            let t = Table::filled(len, W);
            assert_eq!(t.len(), len);
            assert!(t.iter().all(|w| *w == W));
            assert_eq!(t.as_ptr() as usize % align_of::<Wide>(), 0);
            assert_eq!(t.bytes(), len * 16);
        }
    }

    #[test]
    fn large_tables_are_huge_page_aligned_and_filled() {
        // Exactly one huge page, and more than one with a partial last page.
        for len in [HUGE_PAGE / 16, HUGE_PAGE / 16 * 3 + 5] {
            let mut t = Table::filled(len, Wide { a: 0, b: 0, c: 0 });
            assert_eq!(t.len(), len);
            assert!(t.iter().all(|w| w.a == 0 && w.b == 0 && w.c == 0), "zero-filled");
            if HUGE {
                assert_eq!(t.as_ptr() as usize % HUGE_PAGE, 0, "huge-page aligned");
            }
            assert_eq!(t.bytes(), len * 16);
            t[len - 1] = W;
            t[0].b = 3;
            assert_eq!((t[len - 1], t[0].b, t[1].b), (W, 3, 0));
        }
    }

    #[test]
    fn clones_are_equal_independent_and_placed_alike() {
        for len in [0, 5, HUGE_PAGE / 16 + 1] {
            let mut a = Table::filled(len, W);
            if let Some(last) = a.last_mut() {
                last.c = 42;
            }
            let mut b = a.clone();
            assert_eq!(a, b);
            if HUGE && b.bytes() >= HUGE_PAGE {
                assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0, "a clone is placed alike");
            }
            if let Some(first) = b.first_mut() {
                first.a = 1;
                assert_ne!(a, b, "a clone has its own memory");
                assert_eq!(a[0], W);
            }
            drop(a);
            // The clone outlives its source.
            assert!(b.iter().skip(1).take(len.saturating_sub(2)).all(|w| *w == W));
        }
    }

    #[test]
    fn zero_sized_elements_allocate_nothing() {
        let t = Table::filled(1000, ());
        assert_eq!((t.len(), t.bytes()), (1000, 0));
        assert_eq!(t.clone().len(), 1000);
    }

    #[test]
    fn default_is_empty_and_equal_to_an_empty_fill() {
        let t = Table::<Wide>::default();
        assert!(t.is_empty());
        assert_eq!(t, Table::filled(0, W));
        assert_eq!(format!("{:?}", Table::filled(2, 1u8)), "[1, 1]");
    }
}
