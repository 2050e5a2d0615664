//! The rare things an operator wants in the agent's log with their details, sent through aya-log (the agent
//! forwards them to its own log with target `lb_ebpf`): a backend's SNAT ports exhausted, a flow the tables
//! could not store, a Maglev table that points nowhere, the SYN guard dropping, a frame the parser refused.
//!
//! Counters stay the record of how often; a line here says which service, backend or source. Each function is
//! called only on the branch that counts its event — never for a forwarded packet — and writes at most one line
//! per kind per CPU per second ([`due`]): a flood of dropped SYNs or malformed frames costs each packet one
//! per-CPU array read and a compare with the time the packet path already has, not a record. Writing a line is a
//! BPF function of its own (`inline(never)`), so the log code stays out of the packet paths.

use aya_ebpf::{helpers::bpf_ktime_get_coarse_ns, macros::map, maps::PerCpuArray};
use aya_log_ebpf::warn;

/// Kinds, each rate-limited on its own.
const SNAT_EXHAUSTED: u32 = 0;
const FLOW_INSERT: u32 = 1;
const BAD_BACKEND: u32 = 2;
const SYN_GUARD: u32 = 3;
const MALFORMED: u32 = 4;
const KINDS: u32 = 5;

/// At most one line per kind per CPU in this time.
const INTERVAL_NS: u64 = 1_000_000_000;

/// When this CPU last wrote a line of each kind (ns, `bpf_ktime_get_coarse_ns`; never pinned: a restarted agent
/// may log again at once).
#[map]
static KLOG_LAST: PerCpuArray<u64> = PerCpuArray::with_max_entries(KINDS, 0);

/// Whether a line of `kind` may be written at `now` (the packet path's coarse clock, ns) on this CPU, and if so
/// records that it is. The caller's clock, not one read here: a clock read per dropped SYN of a flood cost
/// 30–100 ns (bench dataplane, `tcp_syn_guard_drop_full`).
#[inline(always)]
fn due(kind: u32, now: u64) -> bool {
    let Some(last) = KLOG_LAST.get_ptr_mut(kind) else {
        return false;
    };
    // SAFETY: this CPU's slot; nothing else runs on this CPU meanwhile.
    unsafe {
        if *last != 0 && now.wrapping_sub(*last) < INTERVAL_NS {
            return false;
        }
        *last = now;
    }
    true
}

/// No free SNAT port towards a backend (addresses and ports in network order, as in the packet).
#[inline(always)]
pub fn snat_exhausted(svc_id: u32, node: u32, node_port: u16, snat: u32, now: u64) {
    if due(SNAT_EXHAUSTED, now) {
        write_snat_exhausted(svc_id, node, node_port, snat);
    }
}

#[inline(never)]
fn write_snat_exhausted(svc_id: u32, node: u32, node_port: u16, snat: u32) {
    warn!(
        &(),
        "service {}: no free SNAT port from {:i} towards backend {:i}:{}; new connections to it are dropped \
         (drop_snat_exhausted)",
        svc_id,
        u32::from_be(snat),
        u32::from_be(node),
        u16::from_be(node_port)
    );
}

/// A new flow's entries could not be written to the connection table (`FLOWS_V4`).
#[inline(always)]
pub fn flow_insert_failed(svc_id: u32, now: u64) {
    if due(FLOW_INSERT, now) {
        write_flow_insert_failed(svc_id);
    }
}

#[inline(never)]
fn write_flow_insert_failed(svc_id: u32) {
    warn!(
        &(),
        "service {}: the connection table refused a new flow's entries; the packet is dropped \
         (drop_flow_insert)",
        svc_id
    );
}

/// The service's Maglev slot or the backend it names is empty: the agent's tables are inconsistent.
#[inline(always)]
pub fn bad_backend(svc_id: u32, slot: u32) {
    // A new flow's path without a clock of its own yet; a broken table is rare, the clock read is fine here.
    if due(BAD_BACKEND, unsafe { bpf_ktime_get_coarse_ns() }) {
        write_bad_backend(svc_id, slot);
    }
}

#[inline(never)]
fn write_bad_backend(svc_id: u32, slot: u32) {
    warn!(
        &(),
        "service {}: Maglev slot {} names no backend; the packet is dropped (drop_bad_backend)",
        svc_id,
        slot
    );
}

/// A SYN from an untrusted source dropped over the new-handshake rate (address in network order).
#[inline(always)]
pub fn syn_guard_dropping(svc_id: u32, src: u32, now: u64) {
    if due(SYN_GUARD, now) {
        write_syn_guard_dropping(svc_id, src);
    }
}

#[inline(never)]
fn write_syn_guard_dropping(svc_id: u32, src: u32) {
    warn!(
        &(),
        "service {}: SYN guard dropping SYNs over the new-handshake rate on this CPU from sources that never \
         completed a handshake (one of them: {:i}) (drop_syn_rate)",
        svc_id,
        u32::from_be(src)
    );
}

/// Why the parser refused a frame.
#[derive(Clone, Copy)]
#[repr(u8)]
pub enum Malformed {
    /// Shorter than an Ethernet header.
    Ethernet,
    /// The IPv4 header is cut short.
    Ipv4Header,
    /// Version not 4, or IHL < 5.
    Ipv4Version,
    /// Total length below the header length or beyond the frame.
    Ipv4Length,
    /// The TCP header is cut short, or its data offset is out of bounds.
    Tcp,
    /// The UDP header is cut short or beyond the IPv4 total length.
    Udp,
    /// The ICMP header is cut short.
    Icmp,
}

/// A frame dropped as malformed (before the packet path reads its clock).
#[inline(always)]
pub fn malformed(why: Malformed, len: u32) {
    if due(MALFORMED, unsafe { bpf_ktime_get_coarse_ns() }) {
        write_malformed(why, len);
    }
}

#[inline(never)]
fn write_malformed(why: Malformed, len: u32) {
    let what = match why {
        Malformed::Ethernet => "shorter than an Ethernet header",
        Malformed::Ipv4Header => "IPv4 header cut short",
        Malformed::Ipv4Version => "IPv4 version or header length invalid",
        Malformed::Ipv4Length => "IPv4 total length out of bounds",
        Malformed::Tcp => "TCP header cut short or data offset out of bounds",
        Malformed::Udp => "UDP header cut short or beyond the IPv4 length",
        Malformed::Icmp => "ICMP header cut short",
    };
    warn!(
        &(),
        "dropped a malformed frame of {} bytes: {} (drop_malformed)", len, what
    );
}
