//! The load-balancer agent: loads the XDP data plane and programs it (see README "Architecture").
pub mod arena;
pub mod maglev;
pub mod dataplane;
pub mod model;
pub mod programmer;
