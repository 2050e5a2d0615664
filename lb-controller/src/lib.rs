//! The cloud controller: turns Services of type LoadBalancer (target cluster) into yawol-compatible
//! `LoadBalancer` objects (control cluster), keeps their endpoints in line with the nodes, and
//! reports external IPs and events back to the Services.
//!
//! Layout: pure decisions in [`desired`] and [`endpoints`]; I/O in [`service_controller`],
//! [`backchannel`], [`leader`]; wiring in [`run`], stopping in [`stop`]. The tests run
//! the controllers against a real kube-apiserver (`kube-testenv`); the benchmark against an in-memory one.
//!
//! OpenStack side (LoadBalancer → LoadBalancerSet → LoadBalancerMachine, `lb-controller controller`): the cloud
//! behind the [`openstack::Cloud`] trait ([`openstack::sdk::SdkCloud`] on `openstack_sdk`,
//! [`openstack::fake::FakeCloud`] for unit tests); the controllers [`lb_controller`], [`lbs_controller`] and
//! [`lbm_controller`] with their shared [`finalizer`] and [`ownership`] rules; the LoadBalancer's OpenStack steps in
//! [`lb_openstack`]; the machine's in [`machine`] (with the health rules); pure builders for the VM's cloud-init
//! ([`cloudinit`]) and its Kubernetes access ([`rbac`]).

pub mod cli;
pub mod cloud;
pub mod crds;
pub mod metrics;
pub mod openstack;
pub mod process;
pub mod runtime;
