//! Prints the cloud-init user data lb-controller would give a load-balancer VM, from the real
//! [`lb_controller::openstack::machine::cloudinit::user_data`]. `cargo xtask image boot-test` boots the image with it.
//!
//! `cargo run -p lb-controller --example render_user_data -- --api-server https://192.0.2.1:6443 ...`

use anyhow::Context;
use base64::Engine as _;
use clap::Parser;
use lb_api::ha::HaSettings;
use lb_controller::openstack::machine::cloudinit::{user_data, UserDataParams};
use std::path::PathBuf;

#[derive(Parser)]
struct Args {
    /// API server URL as the VM would reach it.
    #[arg(long)]
    api_server: String,
    /// PEM file of the cluster CA (base64-encoded into the kubeconfig, as the controller does); none: system roots.
    #[arg(long)]
    ca_file: Option<PathBuf>,
    /// The ServiceAccount token.
    #[arg(long, default_value = "boot-test-token")]
    token: String,
    /// Namespace of the LoadBalancer and the machine.
    #[arg(long, default_value = "yawol")]
    namespace: String,
    /// LoadBalancer name.
    #[arg(long, default_value = "default--boot-test")]
    loadbalancer: String,
    /// LoadBalancerMachine name.
    #[arg(long, default_value = "default--boot-test-abc12-x1y2z")]
    machine: String,
    /// The VIP.
    #[arg(long, default_value = "192.0.2.10")]
    vip: String,
    /// Interface carrying the VIP (the controller's default).
    #[arg(long, default_value = "eth0")]
    interface: String,
    /// NTP servers/pools (repeatable).
    #[arg(long = "ntp-server")]
    ntp_servers: Vec<String>,
    /// Start sshd (debug settings).
    #[arg(long)]
    debug_ssh: bool,
    /// VRRP router id; given, the machine gets HA settings (VRRP and state sync) like a replicated LoadBalancer.
    #[arg(long)]
    vrrp_router_id: Option<u8>,
    /// State-sync secret (with --vrrp-router-id).
    #[arg(long, default_value = "boot-test-sync-secret-0123456789abcdef")]
    sync_secret: String,
    /// Active-active (with --vrrp-router-id for the sync settings): the machine's own port address, which it
    /// translates to; no VRRP.
    #[arg(long, requires = "vrrp_router_id")]
    active_active_address: Option<String>,
    /// Revision of the machine's LoadBalancerSet.
    #[arg(long)]
    machine_revision: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let ca_data_base64 = match &a.ca_file {
        Some(path) => base64::engine::general_purpose::STANDARD
            .encode(std::fs::read(path).with_context(|| format!("reading {}", path.display()))?),
        None => String::new(),
    };
    let params = UserDataParams {
        api_server: a.api_server,
        ca_data_base64,
        token: a.token,
        namespace: a.namespace,
        loadbalancer: a.loadbalancer,
        machine: a.machine,
        vip: a.vip,
        interfaces: vec![a.interface],
        ntp_servers: a.ntp_servers,
        debug_ssh: a.debug_ssh,
        ha: a.vrrp_router_id.map(|router_id| HaSettings {
            router_id,
            base_priority: lb_api::ha::DEFAULT_BASE_PRIORITY,
            advert_interval: lb_api::ha::DEFAULT_ADVERT_INTERVAL,
            sync_port: lb_api::ha::DEFAULT_SYNC_PORT,
            sync_secret: a.sync_secret,
        }),
        active_active_address: a.active_active_address,
        machine_revision: a.machine_revision,
    };
    print!("{}", user_data(&params));
    Ok(())
}
