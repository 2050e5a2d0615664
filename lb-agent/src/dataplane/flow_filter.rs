//! User space's side of the flow filter (`lb_common::flow_filter`): marking the TCP entries the agent writes into
//! `FLOWS_V4`/`FLOWS_V6` (flow sync, next-hop changes, tests) and rebuilding the filter during the GC's walk of
//! the tables, so bits of connections that left them stop costing the data plane a lookup. Both families share
//! the one bitmap (keys of different families hash apart like any two keys).

use super::mapped::MappedArray;
use anyhow::Result;
use aya::maps::MapData;
use lb_common::{
    flow_filter::{slot, ENTRIES, GENERATION_INDEX, WORDS},
    map_names as names, FlowAddr, FlowKey, FlowKeyV4, FlowKeyV6, PROTO_TCP,
};
use std::sync::atomic::{AtomicU64, Ordering};

/// The `FLOW_FILTER` map, mapped into this process.
pub struct FlowFilterMap {
    /// The map itself, kept for [`Self::reopen`].
    data: MapData,
    words: MappedArray,
    /// The inactive generation was cleared by [`Self::begin_rebuild`] and awaits [`Self::finish_rebuild`].
    rebuilding: bool,
}

impl FlowFilterMap {
    /// Maps the filter (a `BPF_F_MMAPABLE` array of [`ENTRIES`] words).
    pub fn open(data: MapData) -> Result<Self> {
        Ok(FlowFilterMap {
            words: MappedArray::map(&data, ENTRIES)?,
            data,
            rebuilding: false,
        })
    }

    /// A second mapping of the filter, for a task that writes `FLOWS_V4` through its own handle (flow sync).
    pub fn reopen(&self) -> Result<Self> {
        Self::open(super::maps::reopen(names::FLOW_FILTER, &self.data)?)
    }

    fn word(&self, i: u32) -> &AtomicU64 {
        assert!(i < ENTRIES);
        // SAFETY: `i` is within the mapping, which lives as long as self; the data plane and other handles
        // update the same words atomically too.
        unsafe { AtomicU64::from_ptr(self.words.ptr().add(i as usize)) }
    }

    fn active(&self) -> u32 {
        self.word(GENERATION_INDEX).load(Ordering::Acquire) as u32 & 1
    }

    /// Marks `key`, already written into `FLOWS_V4` or `FLOWS_V6`, in both generations (TCP keys only: see
    /// `lb_common::flow_filter`).
    pub fn mark<A: FlowAddr>(&self, key: &FlowKey<A>) {
        for generation in 0..2 {
            self.mark_in(generation, key);
        }
    }

    /// Sets the bit of `key` (if TCP) in `generation`.
    fn mark_in<A: FlowAddr>(&self, generation: u32, key: &FlowKey<A>) {
        if key.proto == PROTO_TCP {
            let (w, bit) = slot(key);
            self.word(generation * WORDS + w)
                .fetch_or(bit, Ordering::Release);
        }
    }

    /// Whether the data plane would look `key` up (tests).
    pub fn may_hold<A: FlowAddr>(&self, key: &FlowKey<A>) -> bool {
        let (w, bit) = slot(key);
        self.word(self.active() * WORDS + w).load(Ordering::Acquire) & bit != 0
    }

    /// Clears the inactive generation before a walk of the tables. From now on everything written into the table
    /// is marked there by its writer, and [`Self::finish_rebuild`] marks what the walk found.
    pub fn begin_rebuild(&mut self) {
        let inactive = 1 - self.active();
        for i in 0..WORDS {
            self.word(inactive * WORDS + i).store(0, Ordering::Relaxed);
        }
        // The clearing happens before the walk's first read of the table.
        std::sync::atomic::fence(Ordering::SeqCst);
        self.rebuilding = true;
    }

    /// Clears both generations (tests: their tables start empty).
    pub fn clear(&mut self) {
        for _ in 0..2 {
            self.begin_rebuild();
            let _ = self.finish_rebuild([]);
        }
    }

    /// Marks the keys a walk that started after [`Self::begin_rebuild`] found, then makes the rebuilt generation
    /// the active one. Without a preceding `begin_rebuild` it does nothing. Returns the bits set in the new
    /// active generation (of `2^BITS_LOG2`): the share of ports and SYNs that still cost a lookup or a try.
    pub fn finish_rebuild<'a>(
        &mut self,
        keys: impl IntoIterator<Item = &'a FlowKeyV4>,
    ) -> Option<u64> {
        self.finish_rebuild_both(keys, [])
    }

    /// [`Self::finish_rebuild`] with the keys of both families (the walk that found them covered both flow
    /// tables before both transient tables).
    pub fn finish_rebuild_both<'a, 'b>(
        &mut self,
        v4: impl IntoIterator<Item = &'a FlowKeyV4>,
        v6: impl IntoIterator<Item = &'b FlowKeyV6>,
    ) -> Option<u64> {
        if !std::mem::take(&mut self.rebuilding) {
            return None;
        }
        let inactive = 1 - self.active();
        for key in v4 {
            self.mark_in(inactive, key);
        }
        for key in v6 {
            self.mark_in(inactive, key);
        }
        self.word(GENERATION_INDEX)
            .store(inactive as u64, Ordering::Release);
        Some(
            (0..WORDS)
                .map(|i| {
                    self.word(inactive * WORDS + i)
                        .load(Ordering::Relaxed)
                        .count_ones() as u64
                })
                .sum(),
        )
    }
}
