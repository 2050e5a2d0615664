//! TCP and UDP echo servers that identify themselves.
//!
//! TCP: on accept the server sends `<id>\n`, then echoes every byte until the client's EOF, then closes.
//! UDP: each datagram is answered with `<id>\n` followed by the datagram's bytes.
//! The id tells the client which backend the load balancer picked. Nothing is logged per connection: under
//! load, logging would cost more than the echo.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};
use tokio::task::JoinSet;

/// What to serve.
#[derive(Debug, Clone)]
pub struct EchoConfig {
    /// Identity sent in every greeting/reply (e.g. `backend-1`); must not contain `\n`.
    pub id: String,
    /// TCP listen addresses.
    pub tcp: Vec<SocketAddr>,
    /// UDP listen addresses.
    pub udp: Vec<SocketAddr>,
}

/// Bound echo sockets; serve with [`EchoServer::serve`]. Dropping the future returned by `serve` (or aborting
/// its task) closes the listeners and every open connection, like killing a backend process.
pub struct EchoServer {
    id: Arc<[u8]>,
    tcp: Vec<TcpListener>,
    udp: Vec<Arc<UdpSocket>>,
}

/// Listen backlog: bursts of thousands of connects must not overflow the accept queue.
const BACKLOG: u32 = 4096;
/// Per-connection buffer. Small on purpose: 10k held-open connections cost 40 MiB, not 160.
const TCP_BUF: usize = 4096;
/// Tasks per UDP socket, so one slow send does not stall the socket.
const UDP_TASKS: usize = 2;

impl EchoServer {
    /// Binds every socket; fails naming the address that could not be bound.
    pub async fn bind(cfg: &EchoConfig) -> Result<Self> {
        anyhow::ensure!(!cfg.id.contains('\n'), "echo id must not contain a newline");
        anyhow::ensure!(
            !cfg.tcp.is_empty() || !cfg.udp.is_empty(),
            "nothing to serve: give --tcp and/or --udp"
        );
        let mut tcp = Vec::new();
        for addr in &cfg.tcp {
            let sock = if addr.is_ipv4() {
                TcpSocket::new_v4()
            } else {
                TcpSocket::new_v6()
            }?;
            sock.set_reuseaddr(true)?;
            sock.bind(*addr)
                .with_context(|| format!("cannot bind TCP {addr}"))?;
            tcp.push(
                sock.listen(BACKLOG)
                    .with_context(|| format!("cannot listen on TCP {addr}"))?,
            );
        }
        let mut udp = Vec::new();
        for addr in &cfg.udp {
            let sock = UdpSocket::bind(addr)
                .await
                .with_context(|| format!("cannot bind UDP {addr}"))?;
            udp.push(Arc::new(sock));
        }
        let mut id = cfg.id.as_bytes().to_vec();
        id.push(b'\n');
        Ok(Self {
            id: id.into(),
            tcp,
            udp,
        })
    }

    /// Bound TCP addresses (with the actual port when 0 was requested).
    pub fn tcp_addrs(&self) -> Vec<SocketAddr> {
        self.tcp
            .iter()
            .filter_map(|l| l.local_addr().ok())
            .collect()
    }

    /// Bound UDP addresses.
    pub fn udp_addrs(&self) -> Vec<SocketAddr> {
        self.udp
            .iter()
            .filter_map(|s| s.local_addr().ok())
            .collect()
    }

    /// Serves forever (until dropped).
    pub async fn serve(self) -> Result<()> {
        let mut tasks = JoinSet::new();
        for listener in self.tcp {
            tasks.spawn(accept_loop(listener, self.id.clone()));
        }
        for sock in self.udp {
            for _ in 0..UDP_TASKS {
                tasks.spawn(udp_loop(sock.clone(), self.id.clone()));
            }
        }
        while let Some(res) = tasks.join_next().await {
            res.context("echo task failed")?;
        }
        Ok(())
    }
}

async fn accept_loop(listener: TcpListener, id: Arc<[u8]>) {
    // Connections live in this JoinSet so that stopping the server (dropping this future) closes them all.
    let mut conns = JoinSet::new();
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                conns.spawn(echo_tcp(stream, id.clone()));
            }
            // EMFILE/ENFILE/ECONNABORTED: back off briefly instead of spinning; the server must stay up.
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
        // Reap finished connections so the set does not grow without bound.
        while conns.try_join_next().is_some() {}
    }
}

async fn echo_tcp(mut stream: TcpStream, id: Arc<[u8]>) {
    let _ = stream.set_nodelay(true);
    if stream.write_all(&id).await.is_err() {
        return;
    }
    let mut buf = vec![0u8; TCP_BUF];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => {
                if stream.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
            Err(_) => return,
        }
    }
    let _ = stream.shutdown().await;
}

async fn udp_loop(sock: Arc<UdpSocket>, id: Arc<[u8]>) {
    // The reply is built in place: id prefix once, datagram received right behind it.
    let mut buf = vec![0u8; id.len() + 65536];
    buf[..id.len()].copy_from_slice(&id);
    loop {
        match sock.recv_from(&mut buf[id.len()..]).await {
            Ok((n, peer)) => {
                // A reply that does not fit (payload near 64 KiB) is dropped; the client reports a timeout.
                let _ = sock.send_to(&buf[..id.len() + n], peer).await;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
}
