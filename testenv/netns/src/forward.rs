//! A TCP forwarder from inside a namespace to an address of the caller's namespace: how a process in the
//! topology (the agent in Kubernetes mode) reaches a server on the test machine's loopback (the test API
//! server), as a load-balancer VM reaches its control cluster over the network.
//!
//! The listening socket is created by a thread that entered the namespace (a socket keeps the namespace it was
//! created in); the accepting and copying threads stay in the caller's, so their connections go to its loopback.
//! Bytes are copied as they arrive (no buffering, no Nagle), so the forwarder adds microseconds, not a delay a
//! watch event would notice.

use crate::{Host, Topology};
use anyhow::{Context, Result};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// A running forwarder; dropping it closes the listener and every forwarded connection.
pub struct Forward {
    listener: Arc<TcpListener>,
    stop: Arc<AtomicBool>,
    /// Both ends of every forwarded connection, to cut them on drop.
    conns: Arc<Mutex<Vec<TcpStream>>>,
    accept: Option<JoinHandle<()>>,
}

impl Forward {
    /// Listens on `listen` in `host`'s namespace and forwards each connection to `target` in the caller's.
    pub fn start(
        topo: &Topology,
        host: Host,
        listen: SocketAddr,
        target: SocketAddr,
    ) -> Result<Self> {
        let listener = topo
            .run_in(host, move || TcpListener::bind(listen))?
            .with_context(|| format!("binding {listen} in {host}'s namespace"))?;
        let listener = Arc::new(listener);
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let accept = {
            let (listener, stop, conns) = (listener.clone(), stop.clone(), conns.clone());
            std::thread::Builder::new()
                .name(format!("forward-{listen}"))
                .spawn(move || {
                    for inside in listener.incoming() {
                        if stop.load(Ordering::SeqCst) {
                            return;
                        }
                        let Ok(inside) = inside else {
                            // Out of descriptors or the like: try again, without spinning.
                            std::thread::sleep(std::time::Duration::from_millis(10));
                            continue;
                        };
                        // A refused connect closes the inside end: the client sees the server gone and retries.
                        let Ok(outside) = TcpStream::connect(target) else {
                            continue;
                        };
                        let _ = forward_pair(inside, outside, &conns);
                    }
                })?
        };
        Ok(Forward {
            listener,
            stop,
            conns,
            accept: Some(accept),
        })
    }
}

/// Copies both ways between `a` and `b` on two threads; each direction's end is passed on as a half-close.
fn forward_pair(a: TcpStream, b: TcpStream, conns: &Mutex<Vec<TcpStream>>) -> Result<()> {
    a.set_nodelay(true)?;
    b.set_nodelay(true)?;
    {
        let mut c = conns.lock().unwrap();
        c.push(a.try_clone()?);
        c.push(b.try_clone()?);
    }
    for (mut from, mut to) in [(a.try_clone()?, b.try_clone()?), (b, a)] {
        std::thread::Builder::new()
            .name("forward-copy".into())
            .spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                loop {
                    match from.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = to.shutdown(Shutdown::Write);
            })?;
    }
    Ok(())
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // shutdown(2) on a listening socket makes a blocked accept return: the accept thread sees `stop`.
        // SAFETY: a plain syscall on a socket this struct keeps open.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}
