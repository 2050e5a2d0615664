//! The flow filter (see `lb_common::flow_filter`): which TCP keys `FLOWS_V4` may hold, so that a new connection
//! skips the lookups in the large table that would only miss — its own key, and the reverse key of each SNAT port
//! it tries.

use lb_common::{
    flow_filter::{slot, GENERATION_INDEX, WORDS},
    FlowAddr, FlowKey,
};

use crate::maps::FLOW_FILTER;

/// Whether `FLOWS_V4` may hold `key` (a TCP key). `false` is certain; `true` means "look it up".
#[inline(always)]
pub fn may_hold<A: FlowAddr>(key: &FlowKey<A>) -> bool {
    let Some(&generation) = FLOW_FILTER.get(GENERATION_INDEX) else {
        return true;
    };
    let (word, bit) = slot(key);
    match FLOW_FILTER.get((generation as u32 & 1) * WORDS + word) {
        Some(w) => w & bit != 0,
        None => true,
    }
}

/// Marks `key`, just written into `FLOWS_V4`, in both generations (atomically: other CPUs and the agent's
/// rebuild write the same words).
#[inline(always)]
pub fn mark<A: FlowAddr>(key: &FlowKey<A>) {
    let (word, bit) = slot(key);
    for generation in 0..2 {
        if let Some(p) = FLOW_FILTER.get_ptr_mut(generation * WORDS + word) {
            // SAFETY: an element of an array map, 8-byte aligned, valid for the program's run.
            unsafe { atomic_or(p, bit) };
        }
    }
}

/// `*p |= v` as one atomic instruction (BPF_ATOMIC | BPF_OR). The BPF target has no `AtomicU64::fetch_or` in
/// `core` (it is not among its RMW atomics), but LLVM lowers the intrinsic to the instruction the kernel has had
/// since 5.12.
#[cfg(target_arch = "bpf")]
#[inline(always)]
unsafe fn atomic_or(p: *mut u64, v: u64) {
    core::intrinsics::atomic_or::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(p, v);
}

/// Host builds (unit tests of the pure parts) use the ordinary atomic.
#[cfg(not(target_arch = "bpf"))]
#[inline(always)]
unsafe fn atomic_or(p: *mut u64, v: u64) {
    core::sync::atomic::AtomicU64::from_ptr(p).fetch_or(v, core::sync::atomic::Ordering::Relaxed);
}
