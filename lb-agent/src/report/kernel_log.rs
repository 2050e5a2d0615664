//! The data plane's rare events in the agent's log: the lines lb-ebpf's `klog` writes through aya-log (a
//! backend's SNAT ports exhausted, a flow the tables refused, the SYN guard dropping, a malformed frame, …), read
//! from the program's log ring whenever it has data and emitted with target `lb_ebpf::klog` at level warn. The
//! kernel side rate-limits them (a line per kind per CPU per second), so this task wakes rarely.

use anyhow::{Context, Result};
use aya_log::EbpfLogger;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::dataplane::Dataplane;

/// Starts forwarding the loaded programs' log lines (aya-log → `log` → the agent's tracing subscriber, which
/// takes `log` records), on a task detached from the caller: it ends with the runtime.
pub fn spawn(dp: &mut Dataplane) -> Result<()> {
    let logger =
        EbpfLogger::init(dp.ebpf_mut()?).context("opening the data plane's log ring (AYA_LOGS)")?;
    // SAFETY: the logger owns the ring buffer's fd and keeps it open, unreplaced, while the AsyncFd holds it.
    let mut ring = unsafe { AsyncFd::register_with_interest(logger, Interest::READABLE) }
        .context("polling the data plane's log ring")?;
    tokio::spawn(async move {
        loop {
            let mut ready = match ring.readable_mut().await {
                Ok(ready) => ready,
                Err(e) => {
                    tracing::warn!(
                        "the data plane's log ring failed, its lines are no longer read: {e}"
                    );
                    return;
                }
            };
            ready.get_inner_mut().flush();
            ready.clear_ready();
        }
    });
    Ok(())
}
