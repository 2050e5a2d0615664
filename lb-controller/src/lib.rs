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

pub mod backchannel;
pub mod cli;
pub mod cloudinit;
pub mod crds;
pub mod desired;
pub mod endpoints;
pub mod events;
pub mod finalizer;
pub mod http;
pub mod lb_controller;
pub mod lb_openstack;
pub mod lbm_controller;
pub mod lbm_metrics;
pub mod lbs_controller;
pub mod leader;
pub mod machine;
pub mod metrics;
pub mod openstack;
pub mod ownership;
pub mod rbac;
pub mod retry;
pub mod run;
pub mod service_controller;
pub mod stop;
pub mod watches;
