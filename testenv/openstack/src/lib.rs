//! Test support for the OpenStack test environment that `cargo xtask openstack up` runs on 127.0.0.1.
//!
//! - [`TestEnv`] finds the environment (`$LB_OPENSTACK_DIR`, default `target/openstack`) from the files `up` wrote
//!   and connects to it with `openstack_sdk`, failing loudly when it is not up.
//! - [`FaultProxy`] sits in front of one API and injects 5xx, 409, 413/quota errors, delays or dropped connections.
//! - [`LeakCheck`] lists what is left in the test project after a test.
//!
//! The integration tests of this crate (`tests/`) are `#[ignore]`d so that a plain `cargo test --workspace` needs no
//! OpenStack; the `openstack` stage of `cargo xtask test` brings the environment up and runs them with `--ignored`.

#![warn(missing_docs)]

mod env;
mod fault;
mod leak;

pub use env::{EnvInfo, TestEnv, DIR_ENV};
pub use fault::{Fault, FaultProxy, Rule, Seen};
pub use leak::{LeakCheck, Resource};

/// The HTTP status of an `openstack_sdk` API error, when the cloud answered one.
pub fn api_status<E>(err: &openstack_sdk::api::ApiError<E>) -> Option<u16>
where
    E: std::error::Error + Send + Sync + 'static,
{
    use openstack_sdk::api::ApiError;
    match err {
        ApiError::OpenStack { status, .. }
        | ApiError::OpenStackService { status, .. }
        | ApiError::OpenStackUnrecognized { status, .. } => Some(status.as_u16()),
        _ => None,
    }
}
