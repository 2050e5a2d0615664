//! Connection-state sync between the replicas of one load balancer.
//!
//! VRRP moves the VIP between 2-3 replicas; the new master must translate existing flows exactly as the old
//! one did, so every replica pushes its connection-tracking changes ([`FlowRecord`]s) to the others.
//!
//! - Each node listens on [`SyncOptions::listen`] and connects to every peer; a connection carries the
//!   connecting node's own records one way (A→B carries A's changes to B) and acknowledgements and
//!   heartbeats back. So every pair of nodes has two connections, one per direction of records.
//! - Handshake: mutual HMAC-SHA256 challenge-response over random nonces with the pre-shared key; then
//!   each frame carries a sequence number and an HMAC under a per-direction session key derived from the key
//!   and both nonces, so frames cannot be forged, replayed, reordered or reflected. Any failure closes the
//!   connection and is counted. Frames are authenticated, not encrypted. Wire format: [`wire`].
//! - On every (re)connect the sender subscribes a bounded queue, then takes a full dump of its store, sends
//!   it, a DumpDone marker, then live records from the queue. A change published while the dump is taken is
//!   sent twice at worst, never lost — so stores must apply records idempotently. If the queue overflows the
//!   connection is dropped and re-established at once, with a new dump.
//! - The receiver applies records in order, acknowledges them (the sender measures the apply lag from that)
//!   and counts the outcomes.
//!
//! Records carry ages rather than timestamps (the replicas' monotonic clocks differ); the sender adds the
//! time a record waited in its queue.

mod memory;
mod peer;
mod queue;
pub mod wire;

pub use memory::MemoryFlowStore;

use super::lock;
use anyhow::{bail, Context, Result};
use lb_common::{FlowEventV4, FlowEventV6};
use queue::PeerQueue;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

/// A connection-tracking change of either address family, as the data plane publishes it (`FLOW_EVENTS`,
/// `FLOW_EVENTS_V6`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncEvent {
    /// An IPv4 connection's change.
    V4(FlowEventV4),
    /// An IPv6 connection's change.
    V6(FlowEventV6),
}

impl Default for SyncEvent {
    fn default() -> Self {
        SyncEvent::V4(FlowEventV4::default())
    }
}

impl From<FlowEventV4> for SyncEvent {
    fn from(e: FlowEventV4) -> Self {
        SyncEvent::V4(e)
    }
}

impl From<FlowEventV6> for SyncEvent {
    fn from(e: FlowEventV6) -> Self {
        SyncEvent::V6(e)
    }
}

impl SyncEvent {
    /// `FLOW_EV_*`.
    pub fn kind(&self) -> u8 {
        match self {
            SyncEvent::V4(e) => e.kind,
            SyncEvent::V6(e) => e.kind,
        }
    }
}

/// One replicated change: the event plus how long ago the entry was last used (ages, not timestamps: the
/// replicas' monotonic clocks differ). The entries' `last_seen_ns` are not sent and arrive as 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowRecord {
    /// The change (`FLOW_EV_NEW`, `FLOW_EV_CLOSE` or `FLOW_EV_REFRESH`).
    pub event: SyncEvent,
    /// Milliseconds since a packet last used the flow, when the record was made.
    pub age_ms: u32,
}

/// What [`FlowStore::apply`] did with a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// The table changed.
    Applied,
    /// The table already had it (records repeat around a resync).
    Unchanged,
    /// A local entry translates the same tuple differently; the local one was kept.
    Conflict,
    /// The record's service id is not configured here (yet).
    UnknownService,
    /// The store failed (map error).
    Error,
}

/// The local connection-tracking table (the real one wraps the pinned BPF maps; it decides conflicts).
///
/// Calls come from a blocking thread ([`tokio::task::spawn_blocking`]), one at a time (the store sits behind
/// a mutex), so they may make syscalls.
pub trait FlowStore: Send + 'static {
    /// Every live flow as records (`FLOW_EV_NEW` with both entries), for a full resync to a peer.
    fn dump(&mut self) -> anyhow::Result<Vec<FlowRecord>>;
    /// Applies records received from a peer (a frame's worth), in order; one outcome per record. Must be
    /// idempotent and must not move a flow's last use backwards: records published while a dump is taken arrive
    /// twice, and a late refresh may carry an older age than the dump did.
    fn apply(&mut self, recs: &[FlowRecord]) -> Vec<ApplyOutcome>;
}

/// Settings of [`start`]. [`SyncOptions::new`] fills in the defaults.
#[derive(Clone)]
pub struct SyncOptions {
    /// Where to listen for peers (port 0: any free port, see [`SyncHandle::local_addr`]).
    pub listen: SocketAddr,
    /// The replicas' sync addresses. This node's own address may be in it and is ignored (also when it
    /// is only discovered by connecting to itself). May change at runtime.
    pub peers: watch::Receiver<Vec<SocketAddr>>,
    /// Pre-shared key, at least 16 bytes.
    pub secret: Vec<u8>,
    /// Records queued per peer before that peer is forced into a full resync. Default 65536.
    pub queue_capacity: usize,
    /// Heartbeat interval; a peer silent for three intervals is dead. Default 1 s.
    pub heartbeat: Duration,
    /// How long [`SyncHandle::synced`] waits for peers that do not answer. Default 10 s.
    pub sync_grace: Duration,
    /// Longest wait between connection attempts to an unreachable peer (doubling from 100 ms). Default 5 s.
    pub reconnect_max: Duration,
}

impl SyncOptions {
    /// Options with the defaults.
    pub fn new(
        listen: SocketAddr,
        peers: watch::Receiver<Vec<SocketAddr>>,
        secret: Vec<u8>,
    ) -> Self {
        SyncOptions {
            listen,
            peers,
            secret,
            queue_capacity: 65536,
            heartbeat: Duration::from_secs(1),
            sync_grace: Duration::from_secs(10),
            reconnect_max: Duration::from_secs(5),
        }
    }
}

impl fmt::Debug for SyncOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncOptions")
            .field("listen", &self.listen)
            .field("peers", &*self.peers.borrow())
            .field("secret", &format_args!("<{} bytes>", self.secret.len()))
            .field("queue_capacity", &self.queue_capacity)
            .field("heartbeat", &self.heartbeat)
            .field("sync_grace", &self.sync_grace)
            .field("reconnect_max", &self.reconnect_max)
            .finish()
    }
}

/// Records and frames dropped, by reason.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncDrops {
    /// Handshakes that failed authentication (the other side has another secret, or no secret).
    pub auth: u64,
    /// Messages that did not decode: unknown protocol version, bad magic, unknown kind, bad lengths.
    pub decode: u64,
    /// Received records that conflicted with a local entry (the local one was kept).
    pub conflict: u64,
    /// Received records of a service not configured here.
    pub unknown_service: u64,
    /// Records not queued for a peer because its queue was full (that peer is resynced instead).
    pub queue_full: u64,
    /// Received records the store failed to apply, and failed dumps.
    pub store_error: u64,
}

/// A snapshot of the sync counters (totals since [`start`], except the gauges noted).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncCounters {
    /// Records sent to peers (dumps included).
    pub records_sent: u64,
    /// Records received from peers.
    pub records_received: u64,
    /// Received records that changed the local table.
    pub records_applied: u64,
    /// Received records the local table already had.
    pub records_unchanged: u64,
    /// Drops by reason.
    pub dropped: SyncDrops,
    /// Full dumps sent completely.
    pub full_resyncs_sent: u64,
    /// Full dumps received completely.
    pub full_resyncs_received: u64,
    /// Gauge: peers this node is connected to (and pushes its records to).
    pub peers_connected: u64,
    /// Gauge: peers connected to this node (pushing their records here).
    pub peers_inbound: u64,
    /// Frames after the handshake that failed their HMAC or sequence check (forged, tampered with,
    /// replayed, reordered); each closed its connection.
    pub frames_rejected: u64,
    /// Gauge: time from publishing a record to the peer's acknowledgement that it applied it, for the latest
    /// acknowledged batch, in ms (0 until measured).
    pub last_apply_lag_ms: u64,
}

#[derive(Default)]
struct Counters {
    records_sent: AtomicU64,
    records_received: AtomicU64,
    records_applied: AtomicU64,
    records_unchanged: AtomicU64,
    auth: AtomicU64,
    decode: AtomicU64,
    conflict: AtomicU64,
    unknown_service: AtomicU64,
    queue_full: AtomicU64,
    store_error: AtomicU64,
    full_resyncs_sent: AtomicU64,
    full_resyncs_received: AtomicU64,
    peers_connected: AtomicU64,
    peers_inbound: AtomicU64,
    frames_rejected: AtomicU64,
    last_apply_lag_ms: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> SyncCounters {
        let g = |c: &AtomicU64| c.load(Relaxed);
        SyncCounters {
            records_sent: g(&self.records_sent),
            records_received: g(&self.records_received),
            records_applied: g(&self.records_applied),
            records_unchanged: g(&self.records_unchanged),
            dropped: SyncDrops {
                auth: g(&self.auth),
                decode: g(&self.decode),
                conflict: g(&self.conflict),
                unknown_service: g(&self.unknown_service),
                queue_full: g(&self.queue_full),
                store_error: g(&self.store_error),
            },
            full_resyncs_sent: g(&self.full_resyncs_sent),
            full_resyncs_received: g(&self.full_resyncs_received),
            peers_connected: g(&self.peers_connected),
            peers_inbound: g(&self.peers_inbound),
            frames_rejected: g(&self.frames_rejected),
            last_apply_lag_ms: g(&self.last_apply_lag_ms),
        }
    }
}

/// A configured peer address.
struct PeerInfo {
    /// The node id learnt in the last successful handshake (a restarted peer draws a new one).
    node_id: Option<u64>,
    /// The address turned out to be this node.
    is_self: bool,
    /// Whether our connection to it is up.
    connected: bool,
    /// Cuts the reconnect backoff short.
    kick: Arc<Notify>,
}

/// An authenticated connection from a peer.
struct Inbound {
    node_id: u64,
    dump_done: bool,
}

#[derive(Default)]
struct State {
    peers: HashMap<SocketAddr, PeerInfo>,
    inbound: HashMap<u64, Inbound>,
    /// Node ids that delivered a complete dump since start.
    dumps_from: HashSet<u64>,
    next_session: u64,
}

struct Shared {
    node_id: u64,
    local_addr: SocketAddr,
    secret: Vec<u8>,
    heartbeat: Duration,
    /// Three heartbeats: silence this long ends a connection; also bounds connects and handshakes.
    dead_after: Duration,
    queue_capacity: usize,
    reconnect_max: Duration,
    grace: Duration,
    started: Instant,
    peers: watch::Receiver<Vec<SocketAddr>>,
    counters: Counters,
    state: Mutex<State>,
    subscribers: Mutex<Vec<Arc<PeerQueue>>>,
    synced: AtomicBool,
}

impl Shared {
    /// Statically known to be this node (other spellings of its address are found by connecting to them:
    /// [`wire::WireError::SelfConnection`]).
    fn is_own_addr(&self, a: &SocketAddr) -> bool {
        *a == self.local_addr
            || (self.local_addr.ip().is_unspecified()
                && a.port() == self.local_addr.port()
                && a.ip().is_loopback())
    }
}

type SharedStore = Arc<Mutex<dyn FlowStore>>;

/// The agent's side of a running sync: publish changes, read state and counters. Cheap to clone.
#[derive(Clone)]
pub struct SyncHandle {
    shared: Arc<Shared>,
}

impl SyncHandle {
    /// Queues records for every connected peer; never blocks. A peer whose queue is full is resynced
    /// (counted as `queue_full`); unconnected peers get a full dump when they connect, so nothing is lost.
    pub fn publish(&self, records: &[FlowRecord]) {
        if records.is_empty() {
            return;
        }
        let now = Instant::now();
        let subs = lock(&self.shared.subscribers);
        for q in subs.iter() {
            let refused = q.push(records, now);
            if refused > 0 {
                self.shared
                    .counters
                    .queue_full
                    .fetch_add(refused as u64, Relaxed);
            }
        }
    }

    /// True once this node has the flows of its peers: a full dump was received from every peer connected
    /// to it, and either from every configured peer or the grace period ([`SyncOptions::sync_grace`]) has
    /// passed. Stays true afterwards: later resyncs only repair a replica that already has the flows, and the
    /// agent must not refuse the VIP because the old master just died mid-resync.
    pub fn synced(&self) -> bool {
        let sh = &self.shared;
        if sh.synced.load(Relaxed) {
            return true;
        }
        let peers = sh.peers.borrow().clone();
        let st = lock(&sh.state);
        if !st.inbound.values().all(|s| s.dump_done) {
            return false;
        }
        let all = peers
            .iter()
            .filter(|p| !sh.is_own_addr(p))
            .all(|p| match st.peers.get(p) {
                Some(PeerInfo { is_self: true, .. }) => true,
                Some(PeerInfo {
                    node_id: Some(id), ..
                }) => st.dumps_from.contains(id),
                _ => false,
            });
        let graced = sh.started.elapsed() >= sh.grace;
        if all || graced {
            if !sh.synced.swap(true, Relaxed) {
                if all {
                    tracing::info!("sync: received the flows of every peer");
                } else {
                    tracing::info!(
                        grace = ?sh.grace,
                        "sync: not every peer answered within the grace period; synced with those that did"
                    );
                }
            }
            return true;
        }
        false
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> SyncCounters {
        self.shared.counters.snapshot()
    }

    /// The address the sync listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }
}

/// Binds the listener and starts syncing `store` with the peers. Returns the handle and the task that runs
/// everything (listener, one connection task per peer and per inbound connection); it runs until aborted,
/// and aborting it closes every connection. Fails on a secret shorter than 16 bytes, a zero queue capacity
/// or heartbeat, or a listen address that cannot be bound.
pub async fn start<S: FlowStore>(
    opts: SyncOptions,
    store: S,
) -> Result<(SyncHandle, JoinHandle<()>)> {
    if opts.secret.len() < 16 {
        bail!(
            "sync secret must be at least 16 bytes, got {}",
            opts.secret.len()
        );
    }
    if opts.queue_capacity == 0 || opts.heartbeat.is_zero() {
        bail!("sync queue capacity and heartbeat must be positive");
    }
    let listener = TcpListener::bind(opts.listen)
        .await
        .with_context(|| format!("binding the sync listener on {}", opts.listen))?;
    let local_addr = listener.local_addr()?;
    let node_id = getrandom::u64().context("drawing a node id")?;
    let shared = Arc::new(Shared {
        node_id,
        local_addr,
        secret: opts.secret,
        heartbeat: opts.heartbeat,
        dead_after: opts.heartbeat * 3,
        queue_capacity: opts.queue_capacity,
        reconnect_max: opts.reconnect_max.max(peer::RECONNECT_MIN),
        grace: opts.sync_grace,
        started: Instant::now(),
        peers: opts.peers.clone(),
        counters: Counters::default(),
        state: Mutex::new(State::default()),
        subscribers: Mutex::new(Vec::new()),
        synced: AtomicBool::new(false),
    });
    let store: SharedStore = Arc::new(Mutex::new(store));
    tracing::info!(
        listen = %local_addr, node_id = format_args!("{node_id:016x}"),
        "sync: listening for peers"
    );
    let task = tokio::spawn(peer::run(shared.clone(), store, listener, opts.peers));
    Ok((SyncHandle { shared }, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn short_secrets_are_refused() {
        let (_tx, rx) = watch::channel(vec![]);
        let opts = SyncOptions::new("127.0.0.1:0".parse().unwrap(), rx, b"too short".to_vec());
        let e = start(opts, MemoryFlowStore::new()).await.err().unwrap();
        assert!(e.to_string().contains("at least 16 bytes"), "{e}");
    }

    #[tokio::test]
    async fn a_lone_node_is_synced_and_hides_its_secret() {
        let (_tx, rx) = watch::channel(vec![]);
        let opts = SyncOptions::new(
            "127.0.0.1:0".parse().unwrap(),
            rx,
            b"0123456789abcdef-secret".to_vec(),
        );
        assert!(
            !format!("{opts:?}").contains("secret\": [") && !format!("{opts:?}").contains("0123")
        );
        let (h, task) = start(opts, MemoryFlowStore::new()).await.unwrap();
        assert!(h.synced());
        h.publish(&[FlowRecord::default()]); // nobody subscribed: nothing to count
        assert_eq!(h.counters(), SyncCounters::default());
        task.abort();
    }
}
