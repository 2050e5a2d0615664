//! The new-handshake rate guard: a SYN flood from spoofed sources must not cost what a real connection costs.
//!
//! Each CPU may open one handshake per `Config::syn_interval_ns` on average, with `syn_burst_ns` of burst
//! (a GCRA: the token bucket written as one per-CPU timestamp, no division on the path). Over that rate, a SYN
//! gets in only when its source completed a handshake here before (`TRUSTED_SOURCES`, filled when a handshake
//! completes): a spoofed source never sees the backend's SYN-ACK, so it never gets in, while the clients that
//! were already talking to the load balancer keep connecting during a flood. The others' SYNs are dropped
//! before the flow-table lookups, the handshake-table insert, the SNAT search and the backend's SYN-ACK.

use lb_common::{stat, Config, FlowAddr};

use crate::maps::{count, SYN_GUARD, TRUSTED_SOURCES};

/// This CPU's guard state (theoretical arrival time of the next handshake), when the guard is on.
#[inline(always)]
fn state(cfg: &Config) -> Option<&'static mut u64> {
    if cfg.syn_interval_ns == 0 {
        return None;
    }
    // SAFETY: this CPU's slot; nothing else runs on this CPU while this program does.
    SYN_GUARD.get_ptr_mut(0).map(|p| unsafe { &mut *p })
}

/// Whether this CPU is over its rate at `now` (the guard is on and its budget is used up). Takes nothing from
/// the budget (see [`take`]).
#[inline(always)]
pub fn over_rate(cfg: &Config, now: u64) -> bool {
    match state(cfg) {
        Some(tat) => tat.saturating_sub(now) > cfg.syn_burst_ns as u64,
        None => false,
    }
}

/// Whether `src` (network order) completed a handshake here (counted: such a SYN gets in over the rate).
#[inline(always)]
pub fn trusted<A: FlowAddr>(src: A) -> bool {
    let known = TRUSTED_SOURCES.get_ptr(src.to_addr()).is_some();
    if known {
        count(stat::SYN_TRUSTED);
    }
    known
}

/// A handshake was opened at `now`: one interval of this CPU's budget is used (trusted sources over the rate
/// use none, so they cannot push the budget further away).
#[inline(always)]
pub fn take(cfg: &Config, now: u64) {
    let Some(tat) = state(cfg) else {
        return;
    };
    let at = if *tat > now { *tat } else { now };
    if at - now <= cfg.syn_burst_ns as u64 {
        *tat = at + cfg.syn_interval_ns as u64;
    }
}

/// Remembers `src` (network order) as a source that completed a handshake (only while the guard is on:
/// without it nobody reads the list).
#[inline(always)]
pub fn trust<A: FlowAddr>(cfg: &Config, src: A) {
    if cfg.syn_interval_ns == 0 {
        return;
    }
    let addr = src.to_addr();
    // A lookup first: returning clients (the common case) cost no insert, which would recycle an LRU node.
    if TRUSTED_SOURCES.get_ptr(addr).is_none() {
        let _ = TRUSTED_SOURCES.insert(addr, 1u8, 0);
    }
}
