//! What every controller here is made of, on top of kube-runtime: how it watches ([`watches`]) and which changes
//! wake it ([`changes`]), how it stops ([`stop`]) and retries ([`retry`]), holds its objects ([`finalizer`]), finds
//! their children ([`ownership`]), reads the API server's refusals ([`api_errors`]), and reports ([`events`], bad input
//! once: [`reported`]).

pub mod api_errors;
pub mod changes;
pub mod events;
pub mod finalizer;
pub mod ownership;
pub mod reported;
pub mod retry;
pub mod stop;
pub mod watches;
