//! What every controller here is made of, on top of kube-runtime: how it watches ([`watches`]), stops ([`stop`]),
//! retries ([`retry`]), holds its objects ([`finalizer`]), finds their children ([`ownership`]) and reports
//! ([`events`]).

pub mod events;
pub mod finalizer;
pub mod ownership;
pub mod retry;
pub mod stop;
pub mod watches;
