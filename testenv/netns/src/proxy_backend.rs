//! Backends that take PROXY protocol v2: real HAProxy (`accept-proxy`) or real nginx (its stream module, `listen
//! … proxy_protocol`) on a backend's TCP NodePort, in front of the testbed's echo server on the backend's loopback
//! (it speaks first: a server-first protocol through PROXY). Either parses each connection's header and logs the
//! addresses it carried, one line per connection in the same shape, which [`ProxyBackend::logged`] reads back.

use crate::rig::{spawn_echo_on, TCP_NODE_PORT, UDP_NODE_PORT};
use crate::{ChildGuard, Host, Topology};
use anyhow::{bail, Context, Result};
use std::net::{IpAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

/// Where the echo server listens behind the acceptor, on the backend's loopback.
pub const ECHO_PORT: u16 = 31999;

/// The server that takes the header on a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acceptor {
    Haproxy,
    Nginx,
}

/// One backend's acceptor and echo server (stopped when dropped).
pub struct ProxyBackend {
    _echo: ChildGuard,
    acceptor: ChildGuard,
}

/// The addresses one connection's PROXY header carried, as the acceptor logged them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proxied {
    pub client: IpAddr,
    pub client_port: u16,
    pub dst: IpAddr,
    pub dst_port: u16,
}

impl ProxyBackend {
    /// Starts the echo server (TCP on loopback, UDP on the NodePort as usual) and `acceptor` on backend `host`'s
    /// TCP NodePort, both families, its configuration in `dir`; waits until it listens. The backend's own echo
    /// server must be stopped first (it holds the NodePorts).
    pub fn start(topo: &Topology, host: Host, dir: &Path, acceptor: Acceptor) -> Result<Self> {
        let echo = spawn_echo_on(
            topo,
            host,
            &format!("127.0.0.1:{ECHO_PORT}"),
            &format!("[::]:{UDP_NODE_PORT}"),
        )?;
        let name = host.name();
        let (conf, argv): (String, Vec<String>) = match acceptor {
            Acceptor::Haproxy => (
                format!(
                    "global\n  log stdout format raw local0\n  maxconn 4096\n\
                     defaults\n  mode tcp\n  log global\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n\
                     frontend f\n  bind :::{TCP_NODE_PORT} v4v6 accept-proxy\n\
                       log-format \"PROXIED %ci %cp %fi %fp\"\n  default_backend b\n\
                     backend b\n  server echo 127.0.0.1:{ECHO_PORT}\n"
                ),
                vec!["/usr/sbin/haproxy".into(), "-db".into(), "-f".into()],
            ),
            // One process (no master and workers), logging each session to stdout when it ends. Half-close passed
            // on: the loader's FIN follows its payload, and the echo must still come back.
            Acceptor::Nginx => (
                format!(
                    "daemon off;\nmaster_process off;\npid {d}/nginx-{name}.pid;\nerror_log stderr;\n\
                     load_module /usr/lib/nginx/modules/ngx_stream_module.so;\n\
                     events {{ worker_connections 4096; }}\n\
                     stream {{\n\
                       log_format proxied 'PROXIED $proxy_protocol_addr $proxy_protocol_port \
                         $proxy_protocol_server_addr $proxy_protocol_server_port';\n\
                       server {{\n    listen {TCP_NODE_PORT} proxy_protocol;\n    listen [::]:{TCP_NODE_PORT} proxy_protocol;\n\
                         access_log /dev/stdout proxied;\n    proxy_half_close on;\n    proxy_pass 127.0.0.1:{ECHO_PORT};\n  }}\n}}\n",
                    d = dir.display(),
                ),
                vec!["/usr/sbin/nginx".into(), "-e".into(), "stderr".into(), "-c".into()],
            ),
        };
        let path = dir.join(format!("{acceptor:?}-{name}.conf").to_lowercase());
        std::fs::write(&path, conf)?;
        let mut child = topo
            .spawn(
                host,
                argv.iter()
                    .map(String::as_str)
                    .chain([path.to_str().unwrap_or_default()]),
            )
            .with_context(|| format!("starting {acceptor:?}"))?;
        let ip = IpAddr::from(topo.ip(host));
        let deadline = Instant::now() + Duration::from_secs(10);
        let listening = || {
            topo.run_in(host, move || {
                TcpStream::connect_timeout(&(ip, TCP_NODE_PORT).into(), Duration::from_millis(200))
                    .is_ok()
            })
        };
        while !listening()? {
            if child.try_wait()?.is_some() {
                bail!("{acceptor:?} on {host:?} exited: {}", child.stderr());
            }
            if Instant::now() > deadline {
                bail!(
                    "{acceptor:?} on {host:?} did not listen: {}",
                    child.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(ProxyBackend {
            _echo: echo,
            acceptor: child,
        })
    }

    /// [`ProxyBackend::start`] on every backend of `topo`, with the acceptor `acceptor(backend)`.
    pub fn start_all(
        topo: &Topology,
        dir: &Path,
        acceptor: impl Fn(Host) -> Acceptor,
    ) -> Result<Vec<Self>> {
        topo.backends()
            .collect::<Vec<_>>()
            .into_iter()
            .map(|b| ProxyBackend::start(topo, b, dir, acceptor(b)))
            .collect()
    }

    /// Every connection any of `backends` logged so far.
    pub fn logged_all(backends: &[Self]) -> Vec<Proxied> {
        backends.iter().flat_map(Self::logged).collect()
    }

    /// The connections the acceptor logged so far (a line is written when its connection ends).
    pub fn logged(&self) -> Vec<Proxied> {
        self.acceptor
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
