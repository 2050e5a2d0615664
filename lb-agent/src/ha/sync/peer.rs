//! The connections: the listener and peer-list task, one connector per peer (pushes our records), one
//! task per accepted connection (applies the peer's records).

use super::queue::{Overflowed, PeerQueue};
use super::wire::{self, FrameKind, Opener, Sealer, WireError, RECORDS_PER_FRAME};
use super::{lock, ApplyOutcome, FlowRecord, Inbound, PeerInfo, Shared, SharedStore};
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::{interval_at, sleep, timeout, Interval, MissedTickBehavior};
use tracing::{debug, error, info, warn};

/// First reconnect delay after a failure.
pub(super) const RECONNECT_MIN: Duration = Duration::from_millis(100);
/// Unacknowledged batches remembered for the lag measurement (a peer that never acks cannot grow it).
const MAX_PENDING_ACKS: usize = 4096;

/// Why a connection ended.
#[derive(Debug)]
enum End {
    Wire(WireError),
    Store(String),
    Overflow,
}

impl From<WireError> for End {
    fn from(e: WireError) -> Self {
        End::Wire(e)
    }
}

impl std::fmt::Display for End {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            End::Wire(e) => e.fmt(f),
            End::Store(e) => write!(f, "flow store: {e}"),
            End::Overflow => f.write_str("send queue overflowed"),
        }
    }
}

/// Counts a connection-ending protocol error; returns whether it was one (worth a warning).
fn count(shared: &Shared, e: &End) -> bool {
    let c = &shared.counters;
    let counter = match e {
        End::Wire(WireError::Auth(_)) => &c.auth,
        End::Wire(WireError::Rejected(_)) => &c.frames_rejected,
        End::Wire(WireError::Version(_) | WireError::Decode(_)) => &c.decode,
        _ => return false,
    };
    counter.fetch_add(1, Relaxed);
    true
}

/// Increments a gauge for as long as it lives (so aborted tasks decrement too).
struct Gauge<'a>(&'a AtomicU64);

impl<'a> Gauge<'a> {
    fn up(c: &'a AtomicU64) -> Self {
        c.fetch_add(1, Relaxed);
        Gauge(c)
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// Accepts connections and follows the peer list. Every task it starts lives in its `JoinSet`, so
/// aborting this task ends them all.
pub(super) async fn run(
    shared: Arc<Shared>,
    store: SharedStore,
    listener: TcpListener,
    mut peers: watch::Receiver<Vec<SocketAddr>>,
) {
    let mut tasks = JoinSet::new();
    let mut connectors: HashMap<SocketAddr, AbortHandle> = HashMap::new();
    let mut peers_open = true;
    let list = peers.borrow_and_update().clone();
    reconcile(&shared, &store, &mut tasks, &mut connectors, list);
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, remote)) => {
                    tasks.spawn(inbound(shared.clone(), store.clone(), stream, remote));
                }
                Err(e) => {
                    // Typically out of file descriptors: wait instead of spinning.
                    warn!(error = %e, "sync: accept failed");
                    sleep(Duration::from_millis(100)).await;
                }
            },
            r = peers.changed(), if peers_open => match r {
                Ok(()) => {
                    let list = peers.borrow_and_update().clone();
                    reconcile(&shared, &store, &mut tasks, &mut connectors, list);
                }
                // The list's owner is gone: keep the last list.
                Err(_) => peers_open = false,
            },
            Some(r) = tasks.join_next() => {
                if let Err(e) = r {
                    if e.is_panic() {
                        error!(error = %e, "sync: connection task panicked");
                    }
                }
            }
        }
    }
}

fn reconcile(
    shared: &Arc<Shared>,
    store: &SharedStore,
    tasks: &mut JoinSet<()>,
    connectors: &mut HashMap<SocketAddr, AbortHandle>,
    list: Vec<SocketAddr>,
) {
    let wanted: HashSet<SocketAddr> = list
        .into_iter()
        .filter(|a| !shared.is_own_addr(a))
        .collect();
    let mut st = lock(&shared.state);
    connectors.retain(|addr, task| {
        if wanted.contains(addr) {
            return true;
        }
        task.abort();
        st.peers.remove(addr);
        info!(peer = %addr, "sync: peer removed");
        false
    });
    for addr in wanted {
        if connectors.contains_key(&addr) {
            continue;
        }
        let kick = Arc::new(Notify::new());
        st.peers.insert(
            addr,
            PeerInfo {
                node_id: None,
                is_self: false,
                connected: false,
                kick: kick.clone(),
            },
        );
        info!(peer = %addr, "sync: peer added");
        let task = tasks.spawn(connector(shared.clone(), store.clone(), addr, kick));
        connectors.insert(addr, task);
    }
}

/// Keeps a connection to `addr` up and pushes our records over it.
async fn connector(shared: Arc<Shared>, store: SharedStore, addr: SocketAddr, kick: Arc<Notify>) {
    let mut backoff = Duration::ZERO;
    // Log an unreachable peer once, not at every retry.
    let mut reported = false;
    loop {
        if !backoff.is_zero() {
            tokio::select! {
                _ = sleep(backoff) => {}
                _ = kick.notified() => debug!(peer = %addr, "sync: peer came back, reconnecting now"),
            }
        }
        let (authenticated, end) = outbound(&shared, &store, addr).await;
        if let Some(p) = lock(&shared.state).peers.get_mut(&addr) {
            p.connected = false;
        }
        match end {
            End::Wire(WireError::SelfConnection) => {
                if let Some(p) = lock(&shared.state).peers.get_mut(&addr) {
                    p.is_self = true;
                }
                info!(peer = %addr, "sync: this address is this node; ignoring it");
                return;
            }
            End::Overflow => {
                warn!(peer = %addr, "sync: send queue overflowed; reconnecting for a full resync");
                backoff = Duration::ZERO;
                continue;
            }
            _ => {}
        }
        if count(&shared, &end) {
            warn!(peer = %addr, reason = %end, "sync: connection to peer failed");
        } else if authenticated || !reported {
            info!(peer = %addr, reason = %end, "sync: connection to peer lost; retrying");
        } else {
            debug!(peer = %addr, reason = %end, "sync: peer still unreachable");
        }
        reported = !authenticated;
        backoff = if authenticated {
            RECONNECT_MIN
        } else {
            (backoff * 2).clamp(RECONNECT_MIN, shared.reconnect_max)
        };
    }
}

/// Removes a queue from the publishers' list when the connection ends, however it ends.
struct Subscription<'a> {
    shared: &'a Shared,
    queue: Arc<PeerQueue>,
}

impl<'a> Subscription<'a> {
    fn new(shared: &'a Shared) -> Self {
        let queue = Arc::new(PeerQueue::new(shared.queue_capacity));
        lock(&shared.subscribers).push(queue.clone());
        Subscription { shared, queue }
    }
}

impl Drop for Subscription<'_> {
    fn drop(&mut self) {
        lock(&self.shared.subscribers).retain(|q| !Arc::ptr_eq(q, &self.queue));
    }
}

/// One outgoing connection: connect, authenticate, dump, then live records. Returns whether the handshake
/// succeeded, and why it ended.
async fn outbound(shared: &Arc<Shared>, store: &SharedStore, addr: SocketAddr) -> (bool, End) {
    let dead = shared.dead_after;
    let mut stream = match timeout(dead, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return (false, WireError::from(e).into()),
        Err(_) => return (false, WireError::Timeout.into()),
    };
    let _ = stream.set_nodelay(true);
    let est = match timeout(
        dead,
        wire::initiate(&mut stream, &shared.secret, shared.node_id),
    )
    .await
    {
        Ok(Ok(est)) => est,
        Ok(Err(e)) => return (false, e.into()),
        Err(_) => return (false, WireError::Timeout.into()),
    };
    if let Some(p) = lock(&shared.state).peers.get_mut(&addr) {
        p.node_id = Some(est.peer_node);
        p.connected = true;
    }
    let _gauge = Gauge::up(&shared.counters.peers_connected);
    // Subscribe before dumping: a change made while the dump is taken is then queued (at worst also in the
    // dump), never lost.
    let sub = Subscription::new(shared);
    info!(peer = %addr, "sync: connected to peer; sending a full dump");
    let (rd, wr) = stream.into_split();
    let pending = Mutex::new(VecDeque::new());
    let end = tokio::select! {
        r = push_records(shared, store, addr, FrameWriter::new(wr, est.sealer), &sub.queue, &pending) => r,
        r = read_acks(shared, FrameReader::new(rd, est.opener, shared.dead_after), &pending) => r,
    };
    (true, ended(end))
}

/// What a connection half returns: it only ends by failing.
type Never = std::convert::Infallible;

fn ended(r: Result<Never, End>) -> End {
    match r {
        Err(e) => e,
        Ok(never) => match never {},
    }
}

/// A heartbeat ticker whose first tick is one interval away.
fn ticker(every: Duration) -> Interval {
    let mut t = interval_at(tokio::time::Instant::now() + every, every);
    t.set_missed_tick_behavior(MissedTickBehavior::Delay);
    t
}

/// The writing half of a connection.
struct FrameWriter {
    wr: OwnedWriteHalf,
    sealer: Sealer,
    buf: Vec<u8>,
}

impl FrameWriter {
    fn new(wr: OwnedWriteHalf, sealer: Sealer) -> Self {
        FrameWriter {
            wr,
            sealer,
            buf: Vec::new(),
        }
    }

    /// Seals one frame and writes it. Not bounded in time on purpose: a receiver may stop reading for a
    /// while (its store is busy) yet be alive; the reading half ends the connection when the peer goes
    /// silent for three heartbeats, which also cancels a write stuck here.
    async fn send(&mut self, kind: FrameKind, payload: &[u8]) -> Result<(), End> {
        self.buf.clear();
        self.sealer.seal(kind, payload, &mut self.buf);
        self.wr
            .write_all(&self.buf)
            .await
            .map_err(|e| WireError::from(e).into())
    }
}

/// The reading half of a connection.
struct FrameReader {
    rd: OwnedReadHalf,
    opener: Opener,
    buf: Vec<u8>,
    dead: Duration,
}

impl FrameReader {
    fn new(rd: OwnedReadHalf, opener: Opener, dead: Duration) -> Self {
        FrameReader {
            rd,
            opener,
            buf: Vec::new(),
            dead,
        }
    }

    /// The next verified frame (kind, sequence number, payload). Both sides send at least a heartbeat per
    /// interval, so silence for three of them means the peer is gone.
    async fn next(&mut self) -> Result<(FrameKind, u64, &[u8]), End> {
        let read = wire::read_frame(&mut self.rd, &mut self.opener, &mut self.buf);
        match timeout(self.dead, read).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(WireError::Timeout.into()),
        }
    }
}

fn age(rec: &FlowRecord, since: Instant) -> FlowRecord {
    let waited = since.elapsed().as_millis().min(u32::MAX as u128) as u32;
    FlowRecord {
        age_ms: rec.age_ms.saturating_add(waited),
        ..*rec
    }
}

/// The sending half of an outgoing connection: the dump, DumpDone, then the queue; heartbeats when idle.
async fn push_records(
    shared: &Shared,
    store: &SharedStore,
    addr: SocketAddr,
    mut w: FrameWriter,
    queue: &PeerQueue,
    pending: &Mutex<VecDeque<(u64, Instant)>>,
) -> Result<Never, End> {
    let c = &shared.counters;
    let mut tick = ticker(shared.heartbeat);

    // The dump walks the whole table (syscalls on the real store): off the async workers, with heartbeats
    // going out meanwhile so the peer does not give up on a large table.
    let dump = {
        let store = store.clone();
        tokio::task::spawn_blocking(move || lock(&store).dump())
    };
    tokio::pin!(dump);
    let dumped = loop {
        tokio::select! {
            r = &mut dump => break r,
            _ = tick.tick() => w.send(FrameKind::Heartbeat, &[]).await?,
        }
    };
    let records = match dumped {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            c.store_error.fetch_add(1, Relaxed);
            return Err(End::Store(format!("dump failed: {e:#}")));
        }
        Err(e) => {
            c.store_error.fetch_add(1, Relaxed);
            return Err(End::Store(format!("dump failed: {e}")));
        }
    };
    let taken = Instant::now();
    let mut payload = Vec::new();
    for chunk in records.chunks(RECORDS_PER_FRAME) {
        payload.clear();
        wire::encode_records(chunk.iter().map(|r| age(r, taken)), &mut payload);
        w.send(FrameKind::Records, &payload).await?;
        c.records_sent.fetch_add(chunk.len() as u64, Relaxed);
    }
    let n = records.len() as u64;
    drop(records);
    w.send(FrameKind::DumpDone, &n.to_le_bytes()).await?;
    c.full_resyncs_sent.fetch_add(1, Relaxed);
    info!(peer = %addr, records = n, "sync: full dump sent");

    // Live records: drain the queue completely, frame by frame, then wait. Each frame goes out at once
    // (TCP_NODELAY), so a record waits at most for the frames queued before it.
    let mut batch = Vec::with_capacity(RECORDS_PER_FRAME);
    let mut busy = false;
    loop {
        loop {
            batch.clear();
            queue
                .take(RECORDS_PER_FRAME, &mut batch)
                .map_err(|Overflowed| End::Overflow)?;
            if batch.is_empty() {
                break;
            }
            payload.clear();
            wire::encode_records(batch.iter().map(|(r, at)| age(r, *at)), &mut payload);
            {
                let mut p = lock(pending);
                if p.len() == MAX_PENDING_ACKS {
                    p.pop_front();
                }
                p.push_back((w.sealer.next_seq(), batch[0].1));
            }
            w.send(FrameKind::Records, &payload).await?;
            c.records_sent.fetch_add(batch.len() as u64, Relaxed);
            busy = true;
        }
        tokio::select! {
            _ = queue.notify.notified() => {}
            _ = tick.tick() => {
                if !busy {
                    w.send(FrameKind::Heartbeat, &[]).await?;
                }
                busy = false;
            }
        }
    }
}

/// The receiving half of an outgoing connection: acknowledgements (apply lag) and heartbeats.
async fn read_acks(
    shared: &Shared,
    mut r: FrameReader,
    pending: &Mutex<VecDeque<(u64, Instant)>>,
) -> Result<Never, End> {
    loop {
        match r.next().await? {
            (FrameKind::Heartbeat, _, _) => {}
            (FrameKind::Ack, _, payload) => {
                let acked = wire::decode_u64(payload)?;
                let mut p = lock(pending);
                let mut oldest = None;
                while p.front().is_some_and(|(s, _)| *s <= acked) {
                    oldest = p.pop_front().map(|(_, at)| at);
                }
                if let Some(at) = oldest {
                    let ms = at.elapsed().as_millis().min(u64::MAX as u128) as u64;
                    shared.counters.last_apply_lag_ms.store(ms, Relaxed);
                }
            }
            (k, _, _) => {
                let e = format!("unexpected {k:?} frame from the receiving side");
                return Err(WireError::Decode(e).into());
            }
        }
    }
}

/// Unregisters an inbound connection however it ends.
struct InboundSession<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for InboundSession<'_> {
    fn drop(&mut self) {
        lock(&self.shared.state).inbound.remove(&self.id);
    }
}

/// One accepted connection: authenticate, then apply the peer's records.
async fn inbound(
    shared: Arc<Shared>,
    store: SharedStore,
    mut stream: TcpStream,
    remote: SocketAddr,
) {
    let _ = stream.set_nodelay(true);
    let est = match timeout(
        shared.dead_after,
        wire::respond(&mut stream, &shared.secret, shared.node_id),
    )
    .await
    {
        Ok(Ok(est)) => est,
        Ok(Err(WireError::SelfConnection)) => return,
        Ok(Err(e)) => {
            let e = End::Wire(e);
            if count(&shared, &e) {
                warn!(peer = %remote, reason = %e, "sync: rejected a connection");
            } else {
                debug!(peer = %remote, reason = %e, "sync: connection closed during the handshake");
            }
            return;
        }
        Err(_) => {
            debug!(peer = %remote, "sync: handshake timed out");
            return;
        }
    };
    let session = {
        let mut st = lock(&shared.state);
        let id = st.next_session;
        st.next_session += 1;
        st.inbound.insert(
            id,
            Inbound {
                node_id: est.peer_node,
                dump_done: false,
            },
        );
        // A peer that reaches us is up (perhaps just restarted): stop waiting out our backoff towards it,
        // so it gets our flows now rather than after up to `reconnect_max`.
        for p in st.peers.values().filter(|p| !p.connected) {
            p.kick.notify_one();
        }
        InboundSession {
            shared: &shared,
            id,
        }
    };
    let _gauge = Gauge::up(&shared.counters.peers_inbound);
    info!(peer = %remote, "sync: peer connected; receiving its full dump");
    let (rd, wr) = stream.into_split();
    let (ack_tx, ack_rx) = watch::channel(0u64);
    let reader = FrameReader::new(rd, est.opener, shared.dead_after);
    let end = ended(tokio::select! {
        r = apply_records(&shared, &store, remote, &session, reader, ack_tx) => r,
        r = send_acks(&shared, FrameWriter::new(wr, est.sealer), ack_rx) => r,
    });
    if count(&shared, &end) {
        warn!(peer = %remote, reason = %end, "sync: dropped a connection from peer");
    } else {
        info!(peer = %remote, reason = %end, "sync: peer disconnected");
    }
}

/// Per-dump outcome tallies, for the log line at DumpDone.
#[derive(Default, Clone, Copy)]
struct Tally {
    applied: u64,
    unchanged: u64,
    conflict: u64,
    unknown_service: u64,
    error: u64,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.applied += o.applied;
        self.unchanged += o.unchanged;
        self.conflict += o.conflict;
        self.unknown_service += o.unknown_service;
        self.error += o.error;
    }
}

/// Applies a batch in a blocking thread. `apply` makes syscalls on the real store, some hundred records per
/// frame: too long for an async worker, and the store mutex may be held by a dump for a
/// second or more. One hop per frame keeps the overhead small and, awaited before the next frame is read,
/// keeps the records in order.
fn apply_batch(
    store: &SharedStore,
    recs: Vec<FlowRecord>,
) -> impl Future<Output = Result<Tally, tokio::task::JoinError>> {
    let store = store.clone();
    tokio::task::spawn_blocking(move || {
        let outcomes = lock(&store).apply(&recs);
        let mut t = Tally::default();
        for o in outcomes {
            match o {
                ApplyOutcome::Applied => t.applied += 1,
                ApplyOutcome::Unchanged => t.unchanged += 1,
                ApplyOutcome::Conflict => t.conflict += 1,
                ApplyOutcome::UnknownService => t.unknown_service += 1,
                ApplyOutcome::Error => t.error += 1,
            }
        }
        t
    })
}

/// The receiving half of an accepted connection: verify, decode, apply in order, acknowledge.
async fn apply_records(
    shared: &Shared,
    store: &SharedStore,
    remote: SocketAddr,
    session: &InboundSession<'_>,
    mut r: FrameReader,
    ack_tx: watch::Sender<u64>,
) -> Result<Never, End> {
    let c = &shared.counters;
    let mut dump = Tally::default();
    let mut in_dump = true;
    loop {
        match r.next().await? {
            (FrameKind::Records, seq, payload) => {
                let recs = wire::decode_records(payload)?;
                let n = recs.len() as u64;
                c.records_received.fetch_add(n, Relaxed);
                let t = apply_batch(store, recs).await.map_err(|e| {
                    c.store_error.fetch_add(n, Relaxed);
                    End::Store(format!("apply failed: {e}"))
                })?;
                c.records_applied.fetch_add(t.applied, Relaxed);
                c.records_unchanged.fetch_add(t.unchanged, Relaxed);
                c.conflict.fetch_add(t.conflict, Relaxed);
                c.unknown_service.fetch_add(t.unknown_service, Relaxed);
                c.store_error.fetch_add(t.error, Relaxed);
                if in_dump {
                    dump.add(&t);
                }
                ack_tx.send_replace(seq);
            }
            (FrameKind::DumpDone, _, payload) => {
                if !in_dump {
                    return Err(
                        WireError::Decode("a second DumpDone on one connection".into()).into(),
                    );
                }
                let n = wire::decode_u64(payload)?;
                in_dump = false;
                {
                    let mut st = lock(&shared.state);
                    if let Some(s) = st.inbound.get_mut(&session.id) {
                        s.dump_done = true;
                        let id = s.node_id;
                        st.dumps_from.insert(id);
                    }
                }
                c.full_resyncs_received.fetch_add(1, Relaxed);
                info!(
                    peer = %remote, records = n, applied = dump.applied, unchanged = dump.unchanged,
                    conflicts = dump.conflict, unknown_service = dump.unknown_service, errors = dump.error,
                    "sync: full dump received"
                );
            }
            (FrameKind::Heartbeat, _, _) => {}
            (FrameKind::Ack, _, _) => {
                return Err(WireError::Decode("Ack frame from the sending side".into()).into());
            }
        }
    }
}

/// The sending half of an accepted connection: acknowledgements as batches are applied (coalesced), and
/// heartbeats when idle.
async fn send_acks(
    shared: &Shared,
    mut w: FrameWriter,
    mut acks: watch::Receiver<u64>,
) -> Result<Never, End> {
    let mut tick = ticker(shared.heartbeat);
    let mut busy = false;
    loop {
        tokio::select! {
            // Cannot fail while the reading half (which owns the sender) runs, and it runs as long as we do.
            Ok(()) = acks.changed() => {
                let seq = *acks.borrow_and_update();
                w.send(FrameKind::Ack, &seq.to_le_bytes()).await?;
                busy = true;
            }
            _ = tick.tick() => {
                if !busy {
                    w.send(FrameKind::Heartbeat, &[]).await?;
                }
                busy = false;
            }
        }
    }
}
