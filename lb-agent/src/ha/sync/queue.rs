//! The bounded queue between [`super::SyncHandle::publish`] and one peer's connection.

use super::{lock, FlowRecord};
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;
use tokio::sync::Notify;

/// Records waiting for one connected peer, each with the time it was published (to age it for the time it
/// waited, and to measure the lag). Once it overflows it stays overflowed: the connection is dropped and
/// the peer gets a full dump instead, which covers everything refused here.
pub(super) struct PeerQueue {
    inner: Mutex<Inner>,
    /// Woken on every push (and on overflow).
    pub notify: Notify,
    cap: usize,
}

struct Inner {
    items: VecDeque<(FlowRecord, Instant)>,
    overflowed: bool,
}

/// The queue overflowed; the peer needs a full resync.
#[derive(Debug)]
pub(super) struct Overflowed;

impl PeerQueue {
    pub fn new(cap: usize) -> Self {
        PeerQueue {
            inner: Mutex::new(Inner {
                items: VecDeque::new(),
                overflowed: false,
            }),
            notify: Notify::new(),
            cap,
        }
    }

    /// Queues `recs` whole, or none of them; returns how many were refused.
    pub fn push(&self, recs: &[FlowRecord], at: Instant) -> usize {
        let mut q = lock(&self.inner);
        if q.overflowed {
            return recs.len();
        }
        if q.items.len() + recs.len() > self.cap {
            q.overflowed = true;
            // Nothing queued will be sent any more: the resync replaces it.
            q.items = VecDeque::new();
            drop(q);
            self.notify.notify_one();
            return recs.len();
        }
        q.items.extend(recs.iter().map(|r| (*r, at)));
        drop(q);
        self.notify.notify_one();
        0
    }

    /// Moves up to `max` records to `out`.
    pub fn take(&self, max: usize, out: &mut Vec<(FlowRecord, Instant)>) -> Result<(), Overflowed> {
        let mut q = lock(&self.inner);
        if q.overflowed {
            return Err(Overflowed);
        }
        let n = max.min(q.items.len());
        out.extend(q.items.drain(..n));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_refuses_the_batch_and_sticks() {
        let q = PeerQueue::new(3);
        let r = FlowRecord::default();
        let now = Instant::now();
        assert_eq!(q.push(&[r, r], now), 0);
        let mut out = Vec::new();
        q.take(1, &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(q.push(&[r, r], now), 0);
        assert_eq!(q.push(&[r], now), 1);
        assert_eq!(q.push(&[r], now), 1);
        assert!(q.take(10, &mut out).is_err());
    }
}
