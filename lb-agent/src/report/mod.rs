//! What the agent tells: Prometheus metrics ([`metrics`]), the host's own figures ([`hostmetrics`]), and
//! the views and traces `lbctl` shows ([`inspect`]), and the agent's own state ([`AgentStatus`]) that a source
//! turns into a status.

pub mod hostmetrics;
pub mod inspect;
pub mod kernel_log;
pub mod metrics;
mod status;

pub use status::{AgentStatus, BgpStatus, SessionState};
