//! The controllers of the load balancer: the cloud-controller side turns Services of type LoadBalancer (target
//! cluster) into yawol-compatible `LoadBalancer` objects (control cluster) and reports their state back; the OpenStack
//! side turns each LoadBalancer into OpenStack resources, LoadBalancerSets and LoadBalancerMachines with their VMs.
//!
//! Rooms, by who does what:
//!
//! - [`cloud`] (`lb-controller run`, yawol-cloud-controller's role): [`cloud::loadbalancer_spec`] (Service + nodes +
//!   defaults → the LoadBalancer's spec, pure), [`cloud::endpoints`] (which nodes, pure), [`cloud::service`] (the
//!   Service controller), [`cloud::backchannel`] (external IP and events back to the Service), [`cloud::run`]
//!   (caches, triggers, loops).
//! - [`openstack`] (`lb-controller controller`, yawol-controller's role): the [`openstack::Cloud`] trait with its
//!   implementations ([`openstack::sdk`] on `openstack_sdk`, `openstack::fake` for tests only, behind the
//!   `fake-openstack` feature), credentials
//!   ([`openstack::config`]) and which session serves a LoadBalancer ([`openstack::clouds`]); one folder per
//!   controller, each `mod.rs` reading `reconcile → apply | cleanup` with its steps beside it:
//!   - [`openstack::loadbalancer`]: the LoadBalancer's cloud resources ([`openstack::loadbalancer::resources`]:
//!     security group, floating IP, VIP port, server group), its sets ([`openstack::loadbalancer::sets`]), HA
//!     settings ([`openstack::loadbalancer::ha`]) and metrics;
//!   - [`openstack::set`]: a set's machines ([`openstack::set::plan`]) by the health rules
//!     ([`openstack::set::health`]), and its metrics;
//!   - [`openstack::machine`]: a machine's VM port and server ([`openstack::machine::resources`]), its cloud-init
//!     ([`openstack::machine::cloudinit`]), its agent's Kubernetes access ([`openstack::machine::rbac`]), its
//!     decisions ([`openstack::machine::plan`]) and metrics;
//!
//!   and [`openstack::run`], the three started together.
//! - [`runtime`]: what every controller uses on top of kube-runtime (watches, change filters, finalizer, retry,
//!   ownership, events, the API server's refusals, bad input reported once, stop).
//! - [`process`]: the process around either side (`/metrics` and probes, the leader Lease, [`process::supervise`]);
//!   [`cli`] the flags and environment, [`metrics`] the Prometheus registry (each controller's own series in its
//!   folder's `metrics.rs`), [`crds`] the CRD manifests.
//!
//! Each controller's settings and shared state are `Config` and `Context` in its module (`cloud::service::Config`,
//! `openstack::set::Context`, …).
//!
//! An OpenStack call is made in a `resources.rs` (through [`openstack::Cloud`]); a CR field is written by the
//! controller of the folder named after its object (a Service's in [`cloud`]); a controller's rules are in its
//! folder's pure files (`loadbalancer_spec.rs`, `endpoints.rs`, `sets.rs`, `ha.rs`, `plan.rs`, `health.rs`). The tests
//! run the controllers against a real kube-apiserver (`kube-testenv`); the benchmark against an in-memory one.

pub mod cli;
pub mod cloud;
pub mod crds;
pub mod metrics;
pub mod openstack;
pub mod process;
pub mod runtime;
