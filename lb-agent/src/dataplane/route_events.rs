//! The kernel's route changes, as they happen: a routing daemon (BIRD, FRR) installing or withdrawing a route to a
//! backend moves its next hop, and the agent re-resolves next hops on the next second's tick instead of waiting
//! for the periodic refresh (`--neighbor-interval`).
//!
//! An rtnetlink socket subscribed to the IPv4 and IPv6 route groups. The messages are not parsed — any change
//! means "resolve again", and the resolution itself asks the kernel (`neighbor::resolve`) — so a few lines of
//! `libc` do what a netlink crate would, without one more dependency.

use anyhow::{anyhow, Context, Result};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use tokio::io::{unix::AsyncFd, Interest};

/// A subscription to the current network namespace's route changes.
pub struct RouteEvents {
    fd: AsyncFd<OwnedFd>,
}

impl RouteEvents {
    /// Subscribes (in the calling thread's network namespace).
    pub fn open() -> Result<Self> {
        // SAFETY: plain syscalls on a socket this function owns; the address is a zeroed, filled sockaddr_nl.
        let fd = unsafe {
            let fd = libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            );
            if fd < 0 {
                return Err(io::Error::last_os_error()).context("opening an rtnetlink socket");
            }
            let fd = OwnedFd::from_raw_fd(fd);
            let mut sa: libc::sockaddr_nl = std::mem::zeroed();
            sa.nl_family = libc::AF_NETLINK as u16;
            sa.nl_groups = (libc::RTMGRP_IPV4_ROUTE | libc::RTMGRP_IPV6_ROUTE) as u32;
            if libc::bind(
                fd.as_raw_fd(),
                (&sa as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            ) < 0
            {
                return Err(io::Error::last_os_error())
                    .context("subscribing to the kernel's route changes");
            }
            fd
        };
        // SAFETY: `fd` is an open socket the AsyncFd owns from here on, and the same fd for its whole life.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(|e| anyhow!("registering the rtnetlink socket with the runtime: {e}"))?;
        Ok(RouteEvents { fd })
    }

    /// Waits until routes changed; every message queued by then is consumed (one burst of a routing daemon's
    /// updates is one change).
    pub async fn changed(&self) -> Result<()> {
        let mut buf = [0u8; 16384];
        loop {
            let mut guard = self.fd.readable().await?;
            let mut got = false;
            loop {
                // SAFETY: `buf` is writable for its length.
                let n = unsafe {
                    libc::recv(
                        self.fd.get_ref().as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                    )
                };
                if n > 0 {
                    got = true;
                    continue;
                }
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EAGAIN) => {
                        guard.clear_ready();
                        break;
                    }
                    // The socket's buffer overran: messages were lost, so something changed.
                    Some(libc::ENOBUFS) => got = true,
                    Some(libc::EINTR) => {}
                    _ => return Err(e).context("reading route changes"),
                }
            }
            if got {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A route added in a fresh network namespace is seen (needs root; `unshare` of a thread's namespace).
    #[tokio::test(flavor = "current_thread")]
    async fn a_route_added_is_seen() {
        if unsafe { libc::geteuid() } != 0 {
            panic!("needs root (network namespaces)");
        }
        // SAFETY: this test's thread moves into a new network namespace; the runtime is current-thread, so the
        // socket and the commands below run in it.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
        let events = RouteEvents::open().unwrap();
        let ip = |args: &[&str]| {
            let ok = std::process::Command::new("ip")
                .args(args)
                .status()
                .unwrap()
                .success();
            assert!(ok, "ip {args:?}");
        };
        ip(&["link", "set", "lo", "up"]);
        ip(&["route", "add", "192.0.2.0/24", "dev", "lo"]);
        tokio::time::timeout(Duration::from_secs(5), events.changed())
            .await
            .expect("a route change within 5 s")
            .unwrap();
    }
}
