//! Backends that take PROXY protocol v2: real HAProxy (`accept-proxy`) on a backend's TCP NodePort, in front of the
//! testbed's echo server on the backend's loopback (it speaks first: a server-first protocol through PROXY).
//! HAProxy parses each connection's header and logs the addresses it carried, one line per connection, which
//! [`ProxyBackend::logged`] reads back.

use crate::rig::{spawn_echo_on, TCP_NODE_PORT, UDP_NODE_PORT};
use crate::{ChildGuard, Host, Topology};
use anyhow::{bail, Context, Result};
use std::net::{IpAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

/// Where the echo server listens behind HAProxy, on the backend's loopback.
pub const ECHO_PORT: u16 = 31999;

/// One backend's HAProxy and echo server (stopped when dropped).
pub struct ProxyBackend {
    _echo: ChildGuard,
    haproxy: ChildGuard,
}

/// The addresses one connection's PROXY header carried, as HAProxy logged them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proxied {
    pub client: IpAddr,
    pub client_port: u16,
    pub dst: IpAddr,
    pub dst_port: u16,
}

impl ProxyBackend {
    /// Starts the echo server (TCP on loopback, UDP on the NodePort as usual) and HAProxy on backend `host`'s TCP
    /// NodePort, both families, its configuration in `dir`; waits until HAProxy listens. The backend's own echo
    /// server must be stopped first (it holds the NodePorts).
    pub fn start(topo: &Topology, host: Host, dir: &Path) -> Result<Self> {
        let echo = spawn_echo_on(
            topo,
            host,
            &format!("127.0.0.1:{ECHO_PORT}"),
            &format!("[::]:{UDP_NODE_PORT}"),
        )?;
        let conf = format!(
            "global\n  log stdout format raw local0\n  maxconn 4096\n\
             defaults\n  mode tcp\n  log global\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n\
             frontend f\n  bind :::{TCP_NODE_PORT} v4v6 accept-proxy\n\
               log-format \"PROXIED %ci %cp %fi %fp\"\n  default_backend b\n\
             backend b\n  server echo 127.0.0.1:{ECHO_PORT}\n"
        );
        let path = dir.join(format!("haproxy-{}.cfg", host.name()));
        std::fs::write(&path, conf)?;
        let mut haproxy = topo
            .spawn(
                host,
                [
                    "/usr/sbin/haproxy",
                    "-db",
                    "-f",
                    &path.display().to_string(),
                ],
            )
            .context("starting haproxy")?;
        let ip = IpAddr::from(topo.ip(host));
        let deadline = Instant::now() + Duration::from_secs(10);
        let listening = || {
            topo.run_in(host, move || {
                TcpStream::connect_timeout(&(ip, TCP_NODE_PORT).into(), Duration::from_millis(200))
                    .is_ok()
            })
        };
        while !listening()? {
            if haproxy.try_wait()?.is_some() {
                bail!("haproxy on {host:?} exited: {}", haproxy.stderr());
            }
            if Instant::now() > deadline {
                bail!("haproxy on {host:?} did not listen: {}", haproxy.stderr());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(ProxyBackend {
            _echo: echo,
            haproxy,
        })
    }

    /// The connections HAProxy logged so far (a line is written when its connection ends).
    pub fn logged(&self) -> Vec<Proxied> {
        self.haproxy
            .stdout()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                match f.as_slice() {
                    ["PROXIED", ci, cp, fi, fp] => Some(Proxied {
                        client: ci.parse().ok()?,
                        client_port: cp.parse().ok()?,
                        dst: fi.parse().ok()?,
                        dst_port: fp.parse().ok()?,
                    }),
                    _ => None,
                }
            })
            .collect()
    }
}
