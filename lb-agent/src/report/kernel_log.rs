//! The data plane's rare events in the agent's log: the records lb-ebpf's `klog` writes to `KLOG_EVENTS` (a
//! backend's SNAT ports exhausted, a flow the table refused, a Maglev slot naming no backend, the SYN guard
//! dropping, a malformed frame and why), each written as a warning with target `lb_ebpf`. The kernel side
//! rate-limits them (one per kind per CPU per second), so this task wakes rarely.

use anyhow::{anyhow, Context, Result};
use aya::maps::{MapData, RingBuf};
use lb_common::{klog::*, KernelEvent, FAMILY_V6};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::dataplane::{programmer::addr_to_ip, Dataplane};

/// The programs' event ring of the loaded object (taken out of it: one reader).
pub fn ring(dp: &mut Dataplane) -> Result<RingBuf<MapData>> {
    let map = dp
        .ebpf_mut()?
        .take_map("KLOG_EVENTS")
        .ok_or_else(|| anyhow!("KLOG_EVENTS missing from the data-plane object"))?;
    RingBuf::try_from(map).context("KLOG_EVENTS is not a ring buffer")
}

/// The records waiting in `ring`.
pub fn drain(ring: &mut RingBuf<MapData>) -> Vec<KernelEvent> {
    let mut out = Vec::new();
    while let Some(item) = ring.next() {
        if item.len() >= std::mem::size_of::<KernelEvent>() {
            // SAFETY: the programs write whole `KernelEvent`s; read_unaligned copes with any alignment.
            out.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) });
        }
    }
    out
}

/// The log line of an event, ending with the counter that counts its kind.
pub fn describe(e: &KernelEvent) -> String {
    let addr = addr_to_ip(&e.addr, e.family != FAMILY_V6);
    // An IPv6 address with its port in brackets, as `SocketAddr` writes it.
    let backend = std::net::SocketAddr::new(addr, u16::from_be(e.port_be));
    let svc = e.svc_id;
    match e.kind {
        KIND_SNAT_EXHAUSTED => format!(
            "service {svc}: no free SNAT port towards backend {backend}; new connections to it are dropped \
             (drop_snat_exhausted)"
        ),
        KIND_FLOW_INSERT => format!(
            "service {svc}: the connection table refused a new flow's entries; the packet was dropped \
             (drop_flow_insert)"
        ),
        KIND_BAD_BACKEND => format!(
            "service {svc}: Maglev slot {} names no backend of its family; the packet was dropped (drop_bad_backend)",
            e.value
        ),
        KIND_SYN_GUARD => format!(
            "service {svc}: the SYN guard is dropping SYNs over the new-handshake rate from sources that never \
             completed a handshake, {addr} among them (drop_syn_rate)"
        ),
        KIND_MALFORMED => {
            let why = match e.why {
                MALFORMED_ETHERNET => "shorter than an Ethernet header",
                MALFORMED_IPV4_HEADER => "IPv4 header cut short",
                MALFORMED_IPV4_VERSION => "IPv4 version or header length invalid",
                MALFORMED_IPV4_LENGTH => "IPv4 total length out of bounds",
                MALFORMED_TCP => "TCP header cut short or data offset out of bounds",
                MALFORMED_UDP => "UDP header cut short or beyond the IP packet",
                MALFORMED_ICMP => "ICMP header cut short",
                MALFORMED_IPV6_HEADER => "IPv6 header cut short or version not 6",
                MALFORMED_IPV6_LENGTH => "IPv6 payload length beyond the frame",
                MALFORMED_IPV6_EXT => "IPv6 extension header cut short",
                MALFORMED_ICMPV6 => "ICMPv6 header cut short",
                _ => "unknown reason",
            };
            format!(
                "dropped a malformed frame of {} bytes: {why} (drop_malformed)",
                e.value
            )
        }
        kind => format!("data-plane event of unknown kind {kind}: {e:?}"),
    }
}

/// Starts writing the loaded programs' events to the log, on a task detached from the caller: it ends with the
/// runtime.
pub fn spawn(dp: &mut Dataplane) -> Result<()> {
    let ring = ring(dp)?;
    // SAFETY: the RingBuf owns the map's fd and keeps it open, unreplaced, while the AsyncFd holds it.
    let mut ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
        .context("polling the data plane's event ring")?;
    tokio::spawn(async move {
        loop {
            let mut ready = match ring.readable_mut().await {
                Ok(ready) => ready,
                Err(e) => {
                    tracing::warn!(
                        "the data plane's event ring failed, its events are no longer logged: {e}"
                    );
                    return;
                }
            };
            for e in drain(ready.get_inner_mut()) {
                tracing::warn!(target: "lb_ebpf", "{}", describe(&e));
            }
            ready.clear_ready();
        }
    });
    Ok(())
}
