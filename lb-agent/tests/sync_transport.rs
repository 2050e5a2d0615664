//! The connection-state sync transport between replicas, over real TCP on 127.0.0.1 with in-memory stores
//! (`MemoryFlowStore`; the BPF-map store is tested in network namespaces).
//!
//! No timed assertions: every test waits for a condition with a generous timeout.

use lb_agent::ha::sync::{
    self, wire, ApplyOutcome, FlowRecord, FlowStore, MemoryFlowStore, SyncHandle, SyncOptions,
};
use lb_common::{
    FlowEventV4, FlowKeyV4, FlowV4, FLOW_EV_NEW, FLOW_F_FORWARD, FLOW_F_REVERSE, PROTO_TCP,
};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const SECRET: &[u8] = b"sync-test-secret-0123456789";
const VIP: [u8; 4] = [10, 200, 0, 100];

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "lb_agent=info".into()),
        )
        .try_init();
}

/// Flow `i` created on node `node`: unique client tuple and SNAT port per (node, i).
fn flow(node: u8, i: u32) -> FlowRecord {
    assert!(i < 10_000);
    let vip = u32::from_ne_bytes(VIP);
    let client = u32::from_ne_bytes([10, node, (i >> 8) as u8, i as u8]);
    let cport = (20_000 + i as u16).to_be();
    let backend = u32::from_ne_bytes([10, 0, 1, 11 + (i % 3) as u8]);
    let snat_port = (1024 + node as u32 * 10_000 + i) as u16;
    let key = FlowKeyV4 {
        src: client,
        dst: vip,
        sport: cport,
        dport: 80u16.to_be(),
        proto: PROTO_TCP,
        _pad: [0; 3],
    };
    let common = FlowV4 {
        svc_id: 1,
        backend_id: i % 3,
        timeout_s: 3600,
        mac: [2, 0, 0, 0, 0, node],
        ..Default::default()
    };
    FlowRecord {
        event: FlowEventV4 {
            kind: FLOW_EV_NEW,
            _pad: [0; 7],
            key,
            fwd: FlowV4 {
                new_src: vip,
                new_dst: backend,
                new_sport: snat_port.to_be(),
                new_dport: 30080u16.to_be(),
                flags: FLOW_F_FORWARD,
                ..common
            },
            rev: FlowV4 {
                new_src: vip,
                new_dst: client,
                new_sport: 80u16.to_be(),
                new_dport: cport,
                flags: FLOW_F_REVERSE,
                ..common
            },
        }
        .into(),
        age_ms: i,
    }
}

/// The IPv4 event of a record made by [`flow`].
fn v4(r: &FlowRecord) -> &FlowEventV4 {
    match &r.event {
        sync::SyncEvent::V4(e) => e,
        sync::SyncEvent::V6(_) => panic!("an IPv4 record"),
    }
}

fn flows(node: u8, range: std::ops::Range<u32>) -> Vec<FlowRecord> {
    range.map(|i| flow(node, i)).collect()
}

fn sorted(store: &MemoryFlowStore) -> Vec<(FlowKeyV4, FlowV4)> {
    let mut e = store.entries();
    e.sort_by_key(|(k, _)| (k.src, k.dst, k.sport, k.dport, k.proto));
    e
}

fn has_all(store: &MemoryFlowStore, recs: &[FlowRecord]) -> bool {
    recs.iter().all(|r| {
        let e = v4(r);
        store.get(&e.key).is_some() && store.get(&e.fwd.partner_key(e.key.proto)).is_some()
    })
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

struct Node {
    sync: SyncHandle,
    task: JoinHandle<()>,
    store: MemoryFlowStore,
    peers: watch::Sender<Vec<SocketAddr>>,
}

impl Node {
    fn addr(&self) -> SocketAddr {
        self.sync.local_addr()
    }

    /// Flows created by this node's data plane: into its own table, then published.
    fn create(&self, recs: &[FlowRecord]) {
        for r in recs {
            assert_eq!(self.store.apply_record(r), ApplyOutcome::Applied);
        }
        self.sync.publish(recs);
    }

    fn set_peers(&self, peers: &[&Node]) {
        self.peers
            .send_replace(peers.iter().map(|n| n.addr()).collect());
    }

    async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

fn options(listen: SocketAddr, peers: watch::Receiver<Vec<SocketAddr>>) -> SyncOptions {
    let mut o = SyncOptions::new(listen, peers, SECRET.to_vec());
    o.heartbeat = Duration::from_millis(200);
    // Long enough never to be what makes a test pass, except where the grace period is the subject.
    o.sync_grace = Duration::from_secs(60);
    o.reconnect_max = Duration::from_millis(500);
    o
}

async fn node_with<S: FlowStore>(
    store: MemoryFlowStore,
    backend: S,
    listen: SocketAddr,
    peers: Vec<SocketAddr>,
    tune: impl FnOnce(&mut SyncOptions),
) -> Node {
    init_logs();
    let (tx, rx) = watch::channel(peers);
    let mut o = options(listen, rx);
    tune(&mut o);
    let (sync, task) = sync::start(o, backend).await.expect("start sync");
    Node {
        sync,
        task,
        store,
        peers: tx,
    }
}

async fn node(peers: Vec<SocketAddr>, tune: impl FnOnce(&mut SyncOptions)) -> Node {
    let store = MemoryFlowStore::new();
    node_with(
        store.clone(),
        store,
        "127.0.0.1:0".parse().unwrap(),
        peers,
        tune,
    )
    .await
}

/// Every node lists every node, itself included (as the agent's configuration will).
fn mesh(nodes: &[&Node]) {
    for n in nodes {
        n.set_peers(nodes);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_published_on_one_node_reach_every_peer() {
    let (a, b, c) = (
        node(vec![], |_| {}).await,
        node(vec![], |_| {}).await,
        node(vec![], |_| {}).await,
    );
    assert!(
        a.sync.synced(),
        "a node without peers has nothing to wait for"
    );
    mesh(&[&a, &b, &c]);
    wait_for("a full mesh", || {
        [&a, &b, &c].iter().all(|n| {
            let k = n.sync.counters();
            k.peers_connected == 2 && k.peers_inbound == 2
        })
    })
    .await;
    wait_for("every node synced", || {
        [&a, &b, &c].iter().all(|n| n.sync.synced())
    })
    .await;

    let from_a = flows(1, 0..1500); // more than one frame's worth
    let from_b = flows(2, 0..30);
    a.create(&from_a[..700]);
    a.create(&from_a[700..]);
    b.create(&from_b);
    for n in [&a, &b, &c] {
        wait_for("all flows everywhere", || {
            has_all(&n.store, &from_a) && has_all(&n.store, &from_b)
        })
        .await;
        assert_eq!(n.store.len(), 2 * (from_a.len() + from_b.len()));
    }
    assert_eq!(sorted(&a.store), sorted(&b.store));
    assert_eq!(sorted(&a.store), sorted(&c.store));
    // Ages survive the trip (plus the time spent on the way, never less).
    let k = v4(&from_a[1234]).key;
    assert!(c.store.age(&k).unwrap() >= Duration::from_millis(1234));

    let (ka, kb, kc) = (a.sync.counters(), b.sync.counters(), c.sync.counters());
    assert!(ka.records_sent >= 2 * from_a.len() as u64, "{ka:?}");
    assert!(
        kc.records_applied >= (from_a.len() + from_b.len()) as u64,
        "{kc:?}"
    );
    assert_eq!(kb.records_applied, from_a.len() as u64, "{kb:?}");
    for k in [&ka, &kb, &kc] {
        assert_eq!(k.dropped, Default::default(), "{k:?}");
        assert_eq!(k.frames_rejected, 0);
        assert!(
            k.full_resyncs_received >= 2 && k.full_resyncs_sent >= 2,
            "{k:?}"
        );
    }
    for n in [a, b, c] {
        n.stop().await;
    }
}

/// A store whose dumps wait for the test, to observe a replica before its resync completed.
struct GatedStore {
    inner: MemoryFlowStore,
    gate: Arc<Gate>,
}

#[derive(Default)]
struct Gate {
    closed: Mutex<bool>,
    cv: Condvar,
    dumps_waiting: AtomicUsize,
}

impl Gate {
    fn set(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.cv.notify_all();
    }
}

/// Opens the gate however the test ends: a blocked dump would keep the runtime from shutting down.
struct OpenOnDrop(Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

impl FlowStore for GatedStore {
    fn dump(&mut self) -> anyhow::Result<Vec<FlowRecord>> {
        let mut closed = self.gate.closed.lock().unwrap();
        if *closed {
            self.gate.dumps_waiting.fetch_add(1, Ordering::SeqCst);
            while *closed {
                closed = self.gate.cv.wait(closed).unwrap();
            }
            self.gate.dumps_waiting.fetch_sub(1, Ordering::SeqCst);
        }
        drop(closed);
        self.inner.dump()
    }

    fn apply(&mut self, recs: &[FlowRecord]) -> Vec<ApplyOutcome> {
        self.inner.apply(recs)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_gets_a_full_resync_before_it_is_synced() {
    let gate = Arc::new(Gate::default());
    let _open = OpenOnDrop(gate.clone());
    let a_store = MemoryFlowStore::new();
    let a = node_with(
        a_store.clone(),
        GatedStore {
            inner: a_store,
            gate: gate.clone(),
        },
        "127.0.0.1:0".parse().unwrap(),
        vec![],
        |_| {},
    )
    .await;
    let b = node(vec![], |_| {}).await;
    let b_addr = b.addr();
    let early = flows(1, 0..200);
    a.create(&early);
    mesh(&[&a, &b]);
    wait_for("b synced with a's flows", || {
        b.sync.synced() && has_all(&b.store, &early)
    })
    .await;
    let sent_before = a.sync.counters().full_resyncs_sent;

    // B restarts (same address, empty table) while A's next dump is held back.
    b.stop().await;
    gate.set(true);
    let late = flows(1, 200..300);
    a.create(&late); // while B is down: only a dump can bring these
    let b2_store = MemoryFlowStore::new();
    let b2 = node_with(
        b2_store.clone(),
        b2_store,
        b_addr,
        vec![a.addr(), b_addr],
        |_| {},
    )
    .await;
    wait_for("a dumping for the restarted b", || {
        gate.dumps_waiting.load(Ordering::SeqCst) > 0
    })
    .await;
    assert!(!b2.sync.synced(), "synced before a's dump arrived");
    assert!(b2.store.is_empty());

    gate.set(false);
    wait_for("b synced again", || b2.sync.synced()).await;
    assert!(has_all(&b2.store, &early) && has_all(&b2.store, &late));
    assert_eq!(sorted(&a.store), sorted(&b2.store));
    assert!(a.sync.counters().full_resyncs_sent > sent_before);
    assert!(b2.sync.counters().full_resyncs_received >= 1);
    // And live records flow again.
    let live = flows(1, 300..310);
    a.create(&live);
    wait_for("live records after the restart", || {
        has_all(&b2.store, &live)
    })
    .await;
    a.stop().await;
    b2.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_is_rejected_and_counted() {
    let a = node(vec![], |_| {}).await;
    let b = node(vec![], |o| o.secret = b"another-secret-0123456789".to_vec()).await;
    a.create(&flows(1, 0..20));
    b.create(&flows(2, 0..20));
    mesh(&[&a, &b]);
    wait_for("authentication failures on both sides", || {
        // Each node's own attempt fails (bad proof) and so does the peer's attempt towards it.
        a.sync.counters().dropped.auth >= 2 && b.sync.counters().dropped.auth >= 2
    })
    .await;
    a.create(&flows(1, 20..30));
    for (n, own) in [(&a, 30), (&b, 20)] {
        let k = n.sync.counters();
        assert_eq!(n.store.len(), 2 * own, "only its own flows");
        assert_eq!(
            (k.records_received, k.records_applied, k.records_sent),
            (0, 0, 0),
            "{k:?}"
        );
        assert_eq!((k.peers_connected, k.peers_inbound), (0, 0), "{k:?}");
        assert!(
            !n.sync.synced(),
            "a node must not count a peer it cannot authenticate"
        );
    }
    a.stop().await;
    b.stop().await;
}

/// Relays TCP connections to `target`; on the first connection only, flips one byte of the client → target
/// stream at `offset`.
async fn tampering_relay(target: SocketAddr, offset: usize) -> (SocketAddr, JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut first = true;
        loop {
            let Ok((client, _)) = l.accept().await else {
                return;
            };
            let Ok(server) = TcpStream::connect(target).await else {
                continue;
            };
            let flip = first.then_some(offset);
            first = false;
            tokio::spawn(async move {
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = async move {
                    let mut buf = vec![0u8; 16384];
                    let mut seen = 0usize;
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if let Some(at) = flip {
                            if (seen..seen + n).contains(&at) {
                                buf[at - seen] ^= 0x40;
                            }
                        }
                        seen += n;
                        if sw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                };
                let down = async move {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                };
                // Either side closing ends both.
                tokio::select! { _ = up => {}, _ = down => {} }
            });
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_frame_drops_the_connection_and_a_resync_recovers() {
    let b = node(vec![], |_| {}).await;
    // Inside the payload of the first frame after the handshake (the first batch of the dump).
    let offset = wire::HELLO_LEN + wire::AUTH_LEN + wire::FRAME_HEADER_LEN + 1;
    let (relay, relay_task) = tampering_relay(b.addr(), offset).await;
    let a = node(vec![], |_| {}).await;
    let before = flows(1, 0..50);
    a.create(&before);
    a.peers.send_replace(vec![relay]);
    wait_for("the tampered frame rejected", || {
        b.sync.counters().frames_rejected >= 1
    })
    .await;
    wait_for("recovery through a resync", || has_all(&b.store, &before)).await;
    let after = flows(1, 50..60);
    a.create(&after);
    wait_for("live records after recovery", || has_all(&b.store, &after)).await;
    assert_eq!(sorted(&a.store), sorted(&b.store));
    let k = b.sync.counters();
    assert_eq!(k.frames_rejected, 1, "{k:?}");
    // The tampered connection's dump never completed; a later one did.
    assert!(k.full_resyncs_received >= 1, "{k:?}");
    assert_eq!((k.dropped.auth, k.dropped.decode), (0, 0), "{k:?}");
    assert!(a.sync.counters().full_resyncs_sent >= 1);
    relay_task.abort();
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_overflow_forces_a_resync_and_loses_nothing() {
    let b = node(vec![], |_| {}).await;
    let a = node(vec![b.addr()], |o| o.queue_capacity = 16).await;
    wait_for("a connected and its first dump sent", || {
        a.sync.counters().full_resyncs_sent >= 1
    })
    .await;
    let burst = flows(1, 0..500);
    a.create(&burst[..10]); // fits
    a.create(&burst[10..200]); // does not: A drops the connection and resyncs B
    for chunk in burst[200..].chunks(5) {
        a.create(chunk); // some of these land in the new connection's queue, some in its dump
    }
    wait_for("every record at b", || has_all(&b.store, &burst)).await;
    assert_eq!(sorted(&a.store), sorted(&b.store));
    let k = a.sync.counters();
    assert!(k.dropped.queue_full >= 190, "{k:?}");
    assert!(k.full_resyncs_sent >= 2, "{k:?}");
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_list_can_change_at_runtime() {
    let (a, b, c) = (
        node(vec![], |_| {}).await,
        node(vec![], |_| {}).await,
        node(vec![], |_| {}).await,
    );
    let first = flows(1, 0..10);
    a.create(&first);
    a.set_peers(&[&a, &b]);
    wait_for("b has a's flows", || has_all(&b.store, &first)).await;
    assert!(c.store.is_empty(), "c is not a peer of a yet");

    a.set_peers(&[&a, &c]);
    wait_for("a switched from b to c", || {
        let k = a.sync.counters();
        k.peers_connected == 1 && b.sync.counters().peers_inbound == 0 && has_all(&c.store, &first)
    })
    .await;
    let second = flows(1, 10..20);
    a.create(&second);
    wait_for("c has the new flows", || has_all(&c.store, &second)).await;
    assert!(
        !has_all(&b.store, &second[..1]),
        "b was removed from a's peers"
    );
    assert_eq!(b.store.len(), 2 * first.len());

    a.set_peers(&[]);
    wait_for("a without peers", || {
        a.sync.counters().peers_connected == 0 && c.sync.counters().peers_inbound == 0
    })
    .await;
    for n in [a, b, c] {
        n.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synced_after_the_grace_period_when_no_peer_answers() {
    // A port nobody listens on.
    let dead = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let a = node(vec![dead], |o| o.sync_grace = Duration::from_millis(300)).await;
    wait_for("synced by the grace period", || a.sync.synced()).await;
    assert_eq!(a.sync.counters().peers_connected, 0);
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_protocol_versions_are_rejected_and_counted() {
    let a = node(vec![], |_| {}).await;
    let mut s = TcpStream::connect(a.addr()).await.unwrap();
    let mut hello = [0u8; wire::HELLO_LEN];
    hello[..4].copy_from_slice(&wire::MAGIC);
    hello[4] = wire::VERSION + 1;
    hello[5] = 1; // Hello
    s.write_all(&hello).await.unwrap();
    // The node answers with the version it speaks, then closes.
    let mut reply = [0u8; wire::PREFIX_LEN];
    s.read_exact(&mut reply).await.unwrap();
    assert_eq!(&reply[..4], &wire::MAGIC);
    assert_eq!(reply[4], wire::VERSION);
    assert_eq!(s.read(&mut reply).await.unwrap(), 0);
    wait_for("the rejection counted", || {
        a.sync.counters().dropped.decode == 1
    })
    .await;
    // Not a sync peer at all.
    let mut s = TcpStream::connect(a.addr()).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let _ = s.read(&mut reply).await;
    wait_for("garbage counted", || a.sync.counters().dropped.decode == 2).await;
    assert_eq!(a.sync.counters().dropped.auth, 0);
    a.stop().await;
}
