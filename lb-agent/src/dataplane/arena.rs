//! Slot allocator for the Maglev arena.
//!
//! All services' Maglev tables live in one BPF array of `total` u32 slots; each service owns a
//! contiguous slice `[offset, offset + len)`. To switch a service to a new table atomically the
//! agent allocates a *new* slice, writes the table into it, flips the service's `(offset, size)`
//! with one map update and only then frees the old slice. Old and new slices therefore coexist
//! briefly, so replacing a table of `len` slots needs `len` free slots on top of the old one.
//!
//! This type only does the bookkeeping (no map access). Policy: **best fit**, ties broken by the
//! lowest offset. Table sizes come from a short list of primes (`crate::dataplane::maglev::PRIMES`), so
//! best fit tends to reuse a hole of exactly the right size and keeps big holes for big tables;
//! it is also deterministic, which keeps tests and debugging simple. Both lookups are
//! `O(log n)` in the number of free blocks.

use std::collections::{BTreeMap, BTreeSet};

/// Why a list of used slices (e.g. read back from pinned maps) cannot be adopted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArenaError {
    /// The slice does not fit into the arena.
    #[error("slice [{offset}, +{len}) exceeds arena of {total} slots")]
    OutOfRange {
        /// Start of the offending slice.
        offset: u32,
        /// Length of the offending slice.
        len: u32,
        /// Arena size.
        total: u32,
    },
    /// Two slices share at least one slot.
    #[error("slices [{}, +{}) and [{}, +{}) overlap", .first.0, .first.1, .second.0, .second.1)]
    Overlap {
        /// `(offset, len)` of the slice starting first.
        first: (u32, u32),
        /// `(offset, len)` of the slice starting later (or equal).
        second: (u32, u32),
    },
}

/// Allocator of contiguous slot ranges in an arena of `total` slots (see the module docs).
#[derive(Debug, Clone)]
pub struct Arena {
    total: u32,
    /// Free blocks, `offset -> len`; never adjacent (always coalesced), never empty.
    free_by_offset: BTreeMap<u32, u32>,
    /// The same free blocks as `(len, offset)`, for best-fit and largest-block queries.
    free_by_size: BTreeSet<(u32, u32)>,
    /// Handed-out slices, `offset -> len`; lets `free` reject unknown or double frees.
    used: BTreeMap<u32, u32>,
    free_slots: u32,
}

impl Arena {
    /// An empty arena of `total` slots (all free).
    pub fn new(total: u32) -> Self {
        let mut arena = Self {
            total,
            free_by_offset: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            used: BTreeMap::new(),
            free_slots: 0,
        };
        arena.insert_free(0, total);
        arena
    }

    /// Rebuilds the allocator state from the slices currently in use, e.g. the `(offset, size)`
    /// of every service found in re-adopted pinned maps after an agent restart. Everything else
    /// is free — including slices orphaned by a crash between "write new table" and "flip".
    /// Zero-length entries (services without a table) are ignored; order does not matter.
    ///
    /// # Errors
    /// If a slice lies outside the arena or two slices overlap (corrupt or foreign state).
    pub fn from_used(total: u32, used: &[(u32, u32)]) -> Result<Self, ArenaError> {
        let mut slices: Vec<(u32, u32)> = used.iter().copied().filter(|&(_, l)| l > 0).collect();
        slices.sort_unstable();

        let mut arena = Self {
            total,
            free_by_offset: BTreeMap::new(),
            free_by_size: BTreeSet::new(),
            used: BTreeMap::new(),
            free_slots: 0,
        };
        let mut cursor = 0u32; // end of the previous used slice
        let mut prev: Option<(u32, u32)> = None;
        for (offset, len) in slices {
            let end = offset
                .checked_add(len)
                .filter(|&end| end <= total)
                .ok_or(ArenaError::OutOfRange { offset, len, total })?;
            if let Some(first) = prev.filter(|_| offset < cursor) {
                return Err(ArenaError::Overlap {
                    first,
                    second: (offset, len),
                });
            }
            arena.insert_free(cursor, offset - cursor);
            arena.used.insert(offset, len);
            cursor = end;
            prev = Some((offset, len));
        }
        arena.insert_free(cursor, total - cursor);
        Ok(arena)
    }

    /// Allocates `len` contiguous slots and returns the offset of the first, or `None` if no
    /// free block is large enough (or `len == 0`). Best fit, lowest offset on ties.
    pub fn alloc(&mut self, len: u32) -> Option<u32> {
        if len == 0 {
            return None;
        }
        let &(block_len, offset) = self.free_by_size.range((len, 0)..).next()?;
        self.remove_free(offset, block_len);
        // Carve from the start of the block; the tail stays free.
        self.insert_free(offset + len, block_len - len);
        self.used.insert(offset, len);
        Some(offset)
    }

    /// Returns the slice `[offset, offset + len)` obtained from [`alloc`](Self::alloc) (or
    /// adopted by [`from_used`](Self::from_used)) and merges it with free neighbours.
    /// `len == 0` is a no-op.
    ///
    /// # Panics
    /// If `(offset, len)` is not exactly a slice currently handed out (double free, wrong length,
    /// never allocated). That is a bookkeeping bug; carrying on could hand the same slots to two
    /// services and silently corrupt live tables, so it is not tolerated.
    pub fn free(&mut self, offset: u32, len: u32) {
        if len == 0 {
            return;
        }
        match self.used.get(&offset) {
            Some(&l) if l == len => {
                self.used.remove(&offset);
            }
            found => panic!(
                "arena: free of [{offset}, +{len}) which is not an allocated slice (found {found:?})"
            ),
        }

        let (mut start, mut end) = (offset, offset + len);
        // Left neighbour ending exactly at `offset`.
        if let Some((&p_off, &p_len)) = self.free_by_offset.range(..offset).next_back() {
            if p_off + p_len == offset {
                self.remove_free(p_off, p_len);
                start = p_off;
            }
        }
        // Right neighbour starting exactly at the end.
        if let Some(&n_len) = self.free_by_offset.get(&end) {
            self.remove_free(end, n_len);
            end += n_len;
        }
        self.insert_free(start, end - start);
    }

    /// Arena size in slots.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// Number of free slots (possibly fragmented).
    pub fn free_slots(&self) -> u32 {
        self.free_slots
    }

    /// Length of the largest free block, i.e. the largest `len` for which `alloc` succeeds.
    pub fn largest_free(&self) -> u32 {
        self.free_by_size.last().map_or(0, |&(len, _)| len)
    }

    /// Slices currently handed out, as `(offset, len)` in offset order.
    pub fn used(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.used.iter().map(|(&o, &l)| (o, l))
    }

    fn insert_free(&mut self, offset: u32, len: u32) {
        if len == 0 {
            return;
        }
        self.free_by_offset.insert(offset, len);
        self.free_by_size.insert((len, offset));
        self.free_slots += len;
    }

    fn remove_free(&mut self, offset: u32, len: u32) {
        self.free_by_offset.remove(&offset);
        self.free_by_size.remove(&(len, offset));
        self.free_slots -= len;
    }

    /// Checks every internal invariant; tests call this after each operation.
    #[cfg(test)]
    fn check_invariants(&self) {
        assert_eq!(self.free_by_offset.len(), self.free_by_size.len());
        for (&o, &l) in &self.free_by_offset {
            assert!(self.free_by_size.contains(&(l, o)));
        }
        // Free and used blocks tile [0, total) exactly, and free blocks are never adjacent.
        let mut blocks: Vec<(u32, u32, bool)> = self
            .free_by_offset
            .iter()
            .map(|(&o, &l)| (o, l, true))
            .chain(self.used.iter().map(|(&o, &l)| (o, l, false)))
            .collect();
        blocks.sort_unstable();
        let mut cursor = 0;
        let mut prev_free = false;
        for (o, l, is_free) in blocks {
            assert!(l > 0, "empty block at {o}");
            assert_eq!(o, cursor, "gap or overlap at {o}");
            assert!(!(prev_free && is_free), "uncoalesced free blocks at {o}");
            cursor = o + l;
            prev_free = is_free;
        }
        assert_eq!(cursor, self.total);
        let free: u32 = self.free_by_offset.values().sum();
        assert_eq!(free, self.free_slots);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn alloc_until_full_then_free_all() {
        let mut a = Arena::new(100);
        assert_eq!(a.alloc(40), Some(0));
        assert_eq!(a.alloc(40), Some(40));
        assert_eq!(a.alloc(30), None);
        assert_eq!(a.alloc(20), Some(80));
        assert_eq!((a.free_slots(), a.largest_free()), (0, 0));
        assert_eq!(a.alloc(1), None);
        a.free(40, 40);
        a.free(0, 40);
        a.free(80, 20);
        a.check_invariants();
        assert_eq!((a.free_slots(), a.largest_free()), (100, 100));
    }

    #[test]
    fn zero_length() {
        let mut a = Arena::new(10);
        assert_eq!(a.alloc(0), None);
        a.free(3, 0);
        assert_eq!(a.free_slots(), 10);
        let empty = Arena::new(0);
        assert_eq!((empty.free_slots(), empty.largest_free()), (0, 0));
    }

    #[test]
    fn best_fit_prefers_smallest_hole() {
        let mut a = Arena::new(100);
        let x = a.alloc(30).unwrap(); // [0,30)
        let _ = a.alloc(10).unwrap(); // [30,40)
        let y = a.alloc(10).unwrap(); // [40,50)
        let _ = a.alloc(10).unwrap(); // [50,60), tail [60,100) free (40)
        a.free(x, 30);
        a.free(y, 10);
        // Holes: 30 @0, 10 @40, 40 @60. A 10-slot request takes the exact 10-slot hole.
        assert_eq!(a.alloc(10), Some(40));
        // A 35-slot request skips the 30 hole and takes the 40 one.
        assert_eq!(a.alloc(35), Some(60));
        assert_eq!(a.largest_free(), 30);
        a.check_invariants();
    }

    #[test]
    fn coalesces_both_neighbours() {
        let mut a = Arena::new(30);
        let (x, y, z) = (
            a.alloc(10).unwrap(),
            a.alloc(10).unwrap(),
            a.alloc(10).unwrap(),
        );
        a.free(x, 10);
        a.free(z, 10);
        assert_eq!(a.largest_free(), 10);
        a.free(y, 10);
        assert_eq!(a.largest_free(), 30);
        a.check_invariants();
    }

    #[test]
    fn make_before_break_replacement() {
        // Service table grows from 251 to 509 slots: new slice first, then free the old one.
        let mut a = Arena::new(1024);
        let old = a.alloc(251).unwrap();
        let new = a.alloc(509).unwrap();
        assert!(new >= old + 251 || new + 509 <= old);
        a.free(old, 251);
        assert_eq!(a.free_slots(), 1024 - 509);
        a.check_invariants();
    }

    #[test]
    #[should_panic(expected = "not an allocated slice")]
    fn double_free_panics() {
        let mut a = Arena::new(10);
        let o = a.alloc(5).unwrap();
        a.free(o, 5);
        a.free(o, 5);
    }

    #[test]
    #[should_panic(expected = "not an allocated slice")]
    fn wrong_length_free_panics() {
        let mut a = Arena::new(10);
        let o = a.alloc(5).unwrap();
        a.free(o, 4);
    }

    #[test]
    fn from_used_rebuilds_state() {
        let a = Arena::from_used(100, &[(50, 10), (0, 5), (7, 0), (90, 10)]).unwrap();
        a.check_invariants();
        assert_eq!(
            a.used().collect::<Vec<_>>(),
            vec![(0, 5), (50, 10), (90, 10)]
        );
        assert_eq!(a.free_slots(), 75);
        assert_eq!(a.largest_free(), 45); // [5, 50)
        let mut a = a;
        a.free(50, 10);
        assert_eq!(a.largest_free(), 85); // [5, 90)
        a.check_invariants();
        assert_eq!(Arena::from_used(10, &[]).unwrap().largest_free(), 10);
    }

    #[test]
    fn from_used_rejects_bad_input() {
        assert_eq!(
            Arena::from_used(100, &[(95, 10)]).unwrap_err(),
            ArenaError::OutOfRange {
                offset: 95,
                len: 10,
                total: 100
            }
        );
        assert!(matches!(
            Arena::from_used(100, &[(u32::MAX, 2)]),
            Err(ArenaError::OutOfRange { .. })
        ));
        assert_eq!(
            Arena::from_used(100, &[(10, 10), (0, 11)]).unwrap_err(),
            ArenaError::Overlap {
                first: (0, 11),
                second: (10, 10)
            }
        );
        assert!(matches!(
            Arena::from_used(100, &[(10, 5), (10, 5)]),
            Err(ArenaError::Overlap { .. })
        ));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u32),
        /// Free the live slice at `index % live.len()`.
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (1u32..200).prop_map(Op::Alloc),
            2 => any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 64,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn random_alloc_free_sequences(ops in proptest::collection::vec(op(), 1..120)) {
            const TOTAL: u32 = 2048;
            let mut a = Arena::new(TOTAL);
            let mut live: Vec<(u32, u32)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        let largest = a.largest_free();
                        match a.alloc(len) {
                            Some(off) => {
                                prop_assert!(len <= largest);
                                prop_assert!(off + len <= TOTAL);
                                for &(o, l) in &live {
                                    prop_assert!(off + len <= o || o + l <= off,
                                        "[{}, +{}) overlaps [{}, +{})", off, len, o, l);
                                }
                                live.push((off, len));
                            }
                            None => prop_assert!(len > largest),
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let (o, l) = live.swap_remove(i % live.len());
                        a.free(o, l);
                    }
                    Op::Free(_) => {}
                }
                a.check_invariants();
                // Conservation: free + handed out == total.
                let used: u32 = live.iter().map(|&(_, l)| l).sum();
                prop_assert_eq!(a.free_slots() + used, TOTAL);
                prop_assert!(a.largest_free() <= a.free_slots());
            }

            // Re-adoption sees the same state.
            let adopted = Arena::from_used(TOTAL, &live).unwrap();
            adopted.check_invariants();
            prop_assert_eq!(adopted.free_slots(), a.free_slots());
            prop_assert_eq!(adopted.largest_free(), a.largest_free());
            prop_assert_eq!(adopted.used().collect::<Vec<_>>(), a.used().collect::<Vec<_>>());

            // Freeing everything coalesces back to a single block.
            for (o, l) in live {
                a.free(o, l);
            }
            a.check_invariants();
            prop_assert_eq!(a.largest_free(), TOTAL);
            prop_assert_eq!(a.free_slots(), TOTAL);
        }
    }
}
