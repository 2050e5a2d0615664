//! What an interface's NIC gives the data plane: its queues, and whether native XDP's transmits (`XDP_TX`,
//! `XDP_REDIRECT`) got queues of their own.
//!
//! virtio-net, the NIC of an OpenStack VM, gives native XDP one transmit queue per possible CPU on top of the queue
//! pairs the network stack uses — when the device has that many (Nova's `hw_vif_multiqueue_enabled` image
//! property gives a VM one pair per vCPU). Otherwise it attaches anyway and shares the stack's transmit queues
//! under a lock ("XDP_TX and XDP_REDIRECT will operate in a slower locked tx mode", once in the kernel log): every
//! forwarded frame takes a spinlock the CPUs contend for. The agent says so in its log and metrics instead of
//! leaving it to the kernel log.

use super::AttachMode;
use std::path::Path;

/// An interface's queues as the kernel reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Nic {
    /// The driver's name (`virtio_net`, `veth`, …), when the interface has a device.
    pub driver: Option<String>,
    /// Receive and transmit queues the network stack uses.
    pub rx_queues: u32,
    pub tx_queues: u32,
    /// Combined channels (queue pairs) the device offers at most (`ethtool -l`'s "Pre-set maximums"), when the
    /// driver reports channels.
    pub max_combined: Option<u32>,
}

impl Nic {
    /// Reads `iface`'s driver (sysfs), queue counts (sysfs) and channel maximum (the ethtool ioctl: the image
    /// has no `ethtool`).
    pub fn read(iface: &str) -> Nic {
        let dir = Path::new("/sys/class/net").join(iface);
        let driver = std::fs::read_link(dir.join("device/driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
        let count = |prefix: &str| {
            std::fs::read_dir(dir.join("queues")).map_or(0, |d| {
                d.filter_map(|e| e.ok())
                    .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
                    .count() as u32
            })
        };
        Nic {
            driver,
            rx_queues: count("rx-"),
            tx_queues: count("tx-"),
            max_combined: max_combined(iface),
        }
    }

    /// Native XDP on this NIC transmits through the stack's queues under a lock: virtio-net with fewer queue
    /// pairs than the stack's plus one per possible CPU. (Other drivers: not known here, `false`.)
    pub fn xdp_tx_locked(&self, mode: AttachMode, possible_cpus: u32) -> bool {
        let native = matches!(mode, AttachMode::Xdp | AttachMode::XdpNative);
        native
            && self.driver.as_deref() == Some("virtio_net")
            && self
                .max_combined
                .is_some_and(|max| max < self.tx_queues + possible_cpus)
    }
}

/// The CPUs the kernel may ever bring up (`nr_cpu_ids`: what virtio-net sizes XDP's queues by), from
/// `/sys/devices/system/cpu/possible` ("0-15", "0,2-3").
pub fn possible_cpus() -> u32 {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| parse_cpu_list(s.trim()))
        .unwrap_or(1)
}

/// The highest CPU of a kernel CPU list plus one.
fn parse_cpu_list(s: &str) -> Option<u32> {
    s.split(',')
        .map(|part| part.rsplit('-').next()?.parse::<u32>().ok())
        .try_fold(0, |max, last| Some(max.max(last? + 1)))
}

/// `ETHTOOL_GCHANNELS`' `max_combined`, or `None` when the driver reports no channels.
fn max_combined(iface: &str) -> Option<u32> {
    /// `struct ethtool_channels`.
    #[repr(C)]
    #[derive(Default)]
    struct Channels {
        cmd: u32,
        max_rx: u32,
        max_tx: u32,
        max_other: u32,
        max_combined: u32,
        rx_count: u32,
        tx_count: u32,
        other_count: u32,
        combined_count: u32,
    }
    const ETHTOOL_GCHANNELS: u32 = 0x3c;
    let name = iface.as_bytes();
    if name.len() >= libc::IFNAMSIZ {
        return None;
    }
    let mut ch = Channels {
        cmd: ETHTOOL_GCHANNELS,
        ..Default::default()
    };
    // SAFETY: a zeroed ifreq is valid; the name fits with its NUL; the ioctl writes into `ch`, which outlives it;
    // the socket is closed before returning.
    unsafe {
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (d, s) in ifr.ifr_name.iter_mut().zip(name) {
            *d = *s as libc::c_char;
        }
        ifr.ifr_ifru.ifru_data = (&mut ch as *mut Channels).cast();
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
        if fd < 0 {
            return None;
        }
        let r = libc::ioctl(fd, libc::SIOCETHTOOL, &mut ifr);
        libc::close(fd);
        (r == 0).then_some(ch.max_combined)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn virtio(tx: u32, max: u32) -> Nic {
        Nic {
            driver: Some("virtio_net".into()),
            rx_queues: tx,
            tx_queues: tx,
            max_combined: Some(max),
        }
    }

    #[test]
    fn virtio_net_needs_a_queue_pair_per_possible_cpu_beyond_the_stacks() {
        // One queue pair, two vCPUs (the VM boot test's NICs; Nova without multiqueue): locked.
        assert!(virtio(1, 1).xdp_tx_locked(AttachMode::XdpNative, 2));
        // Nova's multiqueue gives a pair per vCPU, which the stack takes: still locked.
        assert!(virtio(4, 4).xdp_tx_locked(AttachMode::Xdp, 4));
        // The stack's channels lowered to half (`ethtool -L eth0 combined 2`): XDP gets its own.
        assert!(!virtio(2, 4).xdp_tx_locked(AttachMode::XdpNative, 2));
        // Only native XDP transmits through the driver.
        assert!(!virtio(1, 1).xdp_tx_locked(AttachMode::XdpGeneric, 2));
        assert!(!virtio(1, 1).xdp_tx_locked(AttachMode::Tc, 2));
        // Other drivers, or none reporting channels: not claimed.
        let veth = Nic {
            driver: None,
            ..virtio(1, 1)
        };
        assert!(!veth.xdp_tx_locked(AttachMode::XdpNative, 2));
        let no_channels = Nic {
            max_combined: None,
            ..virtio(1, 1)
        };
        assert!(!no_channels.xdp_tx_locked(AttachMode::XdpNative, 2));
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0-15"), Some(16));
        assert_eq!(parse_cpu_list("0,2-3"), Some(4));
        assert_eq!(parse_cpu_list(""), None);
        assert!(possible_cpus() >= 1);
    }

    #[test]
    fn reads_a_real_interface() {
        // `lo` has queues in sysfs and no device.
        let lo = Nic::read("lo");
        assert_eq!(lo.driver, None);
        assert!(lo.rx_queues >= 1 && lo.tx_queues >= 1, "{lo:?}");
    }
}
