//! The rare things an operator wants in the agent's log with their details: a backend's SNAT ports exhausted, a
//! flow the table refused, a Maglev slot naming no backend, the SYN guard dropping, a frame the parser refused.
//! Each becomes a small fixed record ([`KernelEvent`]) on `KLOG_EVENTS`, which the agent turns into a log line.
//!
//! Counters stay the record of how often; a line says which service, backend or source. Each kind's function is
//! called only on the branch that counts its event — never for a forwarded packet — and writes at most one record
//! per kind per CPU per second: a flood of dropped SYNs or malformed frames costs each packet a call, a per-CPU
//! array read and a compare with the time the packet path already has.
//!
//! Why not aya-log: its record writer is costly to verify (the formatting of each `warn!` walks bounded loops over
//! every literal and argument). Five of them added 195k verified instructions to each fast program (365k → 561k)
//! and pushed the traced programs of `lbctl trace` past the verifier's limit of a million; a fixed record costs
//! the verifier little, and the text is written in the agent.

use aya_ebpf::{helpers::bpf_ktime_get_coarse_ns, macros::map, maps::PerCpuArray, maps::RingBuf};
use lb_common::{klog::*, Addr, FlowAddr, KernelEvent};

/// At most one record per kind per CPU in this time.
const INTERVAL_NS: u64 = 1_000_000_000;

/// The records, read by the agent (never pinned: each agent reads the programs it loaded).
#[map]
static KLOG_EVENTS: RingBuf = RingBuf::with_byte_size(1 << 16, 0);

/// When this CPU last wrote a record of each kind (ns, `bpf_ktime_get_coarse_ns`).
#[map]
static KLOG_LAST: PerCpuArray<u64> = PerCpuArray::with_max_entries(KINDS, 0);

/// Records event `kind` unless this CPU recorded one of that kind less than a second before `now` (the packet
/// path's coarse clock, ns; 0 = read it here). Inlined into each kind's function below, which is a BPF function
/// of its own (`inline(never)`): one call frame under the packet path's. A global function one level further down
/// made the call chain too deep for the image's kernel 6.1 ("combined stack size of 4 calls is 544"), and the
/// per-call verification of a record write is small.
#[inline(always)]
fn event(kind_why: u32, svc_id: u32, value: u32, port_be: u32, addr: Option<(u8, Addr)>, now: u64) {
    let kind = kind_why & 0xff;
    let Some(last) = KLOG_LAST.get_ptr_mut(kind) else {
        return;
    };
    let now = if now == 0 {
        unsafe { bpf_ktime_get_coarse_ns() }
    } else {
        now
    };
    // SAFETY: this CPU's slot; nothing else runs on this CPU meanwhile.
    unsafe {
        if *last != 0 && now.wrapping_sub(*last) < INTERVAL_NS {
            return;
        }
        *last = now;
    }
    let Some(mut e) = KLOG_EVENTS.reserve::<KernelEvent>(0) else {
        return;
    };
    // Field by field into the record: a record built by value is a 48-byte temporary on the BPF stack, under the
    // IPv6 programs' deepest frames. Volatile stores, and the family with the padding after it as one word: LLVM
    // merges adjacent zero stores (a record without an address) into a call of `memset`, a BPF function of its own
    // under this one (the kernel counts 32 bytes of stack for any frame).
    let r = e.as_mut_ptr();
    let (family, words) = match addr {
        // The 16 bytes as words, for either family.
        Some((family, a)) => (family, a.v6_raw()),
        None => (0, [0; 4]),
    };
    // SAFETY: an exclusively owned ring-buffer record of this type; `addr` is 4-aligned, as is `family`, which
    // the 3 bytes of padding follow.
    unsafe {
        (&raw mut (*r).kind).write_volatile(kind as u8);
        (&raw mut (*r).why).write_volatile((kind_why >> 8) as u8);
        (&raw mut (*r).port_be).write_volatile(port_be as u16);
        (&raw mut (*r).svc_id).write_volatile(svc_id);
        (&raw mut (*r).value).write_volatile(value);
        (&raw mut (*r).family as *mut u32).write_volatile(u32::from_ne_bytes([family, 0, 0, 0]));
        let w = &raw mut (*r).addr as *mut u32;
        for (i, x) in words.into_iter().enumerate() {
            w.add(i).write_volatile(x);
        }
    }
    e.submit(0);
}

/// No free SNAT port towards a backend (address and port in network order, as in the packet).
#[inline(never)]
pub fn snat_exhausted<A: FlowAddr>(svc_id: u32, node: A, node_port_be: u16, now: u64) {
    event(
        KIND_SNAT_EXHAUSTED as u32,
        svc_id,
        0,
        node_port_be as u32,
        Some((A::FAMILY, node.to_addr())),
        now,
    );
}

/// A new flow's entries could not be written to the connection table (`FLOWS_V4`).
#[inline(never)]
pub fn flow_insert_failed(svc_id: u32, now: u64) {
    event(KIND_FLOW_INSERT as u32, svc_id, 0, 0, None, now);
}

/// The service's Maglev slot or the backend it names is empty: the agent's tables are inconsistent.
#[inline(never)]
pub fn bad_backend(svc_id: u32, slot: u32) {
    event(KIND_BAD_BACKEND as u32, svc_id, slot, 0, None, 0);
}

/// A SYN from an untrusted source dropped over the new-handshake rate (address in network order).
#[inline(never)]
pub fn syn_guard_dropping<A: FlowAddr>(svc_id: u32, src: A, now: u64) {
    event(
        KIND_SYN_GUARD as u32,
        svc_id,
        0,
        0,
        Some((A::FAMILY, src.to_addr())),
        now,
    );
}

/// A frame dropped as malformed (`why`: `MALFORMED_*`), before the packet path reads its clock.
#[inline(never)]
pub fn malformed(why: u8, len: usize) {
    event(
        KIND_MALFORMED as u32 | (why as u32) << 8,
        0,
        len as u32,
        0,
        None,
        0,
    );
}
