//! The LoadBalancer and LoadBalancerMachine OpenStack logic against the real OpenStack of
//! `cargo xtask openstack up` (not a mock): create → security group with rules, floating IP, VIP port, server group
//! and ACTIVE servers booted with our cloud-init; delete → nothing left (leak check); injected 5xx and quota errors
//! keep the floating IP and leak nothing.
//!
//! `#[ignore]`d so a plain `cargo test` needs no cloud; the `openstack` stage of `cargo xtask test` runs them with
//! `--ignored --test-threads=1`. Without the environment they fail (`TestEnv::load` names the command to run).

use anyhow::{ensure, Context, Result};
use lb_api::{LoadBalancer, LoadBalancerStatus};
use lb_controller::openstack::loadbalancer::resources::{self as lb_openstack, DiscardStatus};
use lb_controller::openstack::machine::resources::{self as machine, MachineSpec};
use lb_controller::openstack::sdk::SdkCloud;
use lb_controller::openstack::{Cloud, CloudErrorKind};
use lb_test_support::cascade::connect;
use openstack_testenv::{Fault, FaultProxy, LeakCheck, Rule, TestEnv};
use std::time::{Duration, Instant};

fn lb(env: &TestEnv, name: &str, options: &str) -> LoadBalancer {
    let info = &env.info;
    let yaml = format!(
        r#"
apiVersion: yawol.stackit.cloud/v1beta1
kind: LoadBalancer
metadata: {{name: {name}, namespace: itest, uid: u-{name}}}
spec:
  selector: {{matchLabels: {{yawol.stackit.cloud/loadbalancer: {name}}}}}
  replicas: 2
  ports:
  - {{name: http, port: 80, nodePort: 30080, protocol: TCP}}
  - {{name: dns, port: 53, nodePort: 30053, protocol: UDP}}
  infrastructure:
    defaultNetwork: {{networkID: {net}, floatingNetID: {ext}}}
    flavor: {{flavorID: {flavor}}}
    image: {{imageID: {image}}}
    authSecretRef: {{name: cloud, namespace: itest}}
  options: {{{options}}}
"#,
        net = info.network_id,
        ext = info.external_network_id,
        flavor = info.flavor_id,
        image = info.image_id,
    );
    serde_yaml::from_str(&yaml).expect("fixture parses")
}

async fn reconcile(cloud: &SdkCloud, lb: &mut LoadBalancer) -> Result<(), lb_openstack::StepError> {
    let mut status = lb.status.clone().unwrap_or_default();
    let mut warnings = Vec::new();
    let r =
        lb_openstack::reconcile(cloud, lb, &mut status, &mut DiscardStatus, &mut warnings).await;
    lb.status = Some(status);
    r
}

fn machine_spec(env: &TestEnv, lb: &LoadBalancer, name: &str) -> MachineSpec {
    let st: LoadBalancerStatus = lb.status.clone().unwrap_or_default();
    let params = lb_controller::openstack::machine::cloudinit::UserDataParams {
        api_server: "https://203.0.113.1:6443".into(),
        ca_data_base64: "Q0E=".into(),
        token: "token".into(),
        namespace: "itest".into(),
        loadbalancer: lb.metadata.name.clone().unwrap(),
        machine: name.into(),
        vip: st.port_ip.clone().unwrap_or_default(),
        interfaces: vec!["eth0".into()],
        ntp_servers: vec!["pool.ntp.org".into()],
        debug_ssh: false,
        ..Default::default()
    };
    MachineSpec {
        name: name.into(),
        network_id: env.info.network_id.clone(),
        subnet_id: None,
        security_group_id: st.security_group_id.unwrap_or_default(),
        vip_addresses: st.port_ip.into_iter().collect(),
        flavor_id: env.info.flavor_id.clone(),
        image_id: env.info.image_id.clone(),
        availability_zone: None,
        additional_networks: vec![],
        user_data: lb_controller::openstack::machine::cloudinit::user_data(&params),
        key_name: None,
        server_group_id: st.server_group_id,
        ..Default::default()
    }
}

/// Deletes machines then the load balancer, whatever state they are in.
async fn teardown(cloud: &SdkCloud, lb: &LoadBalancer, machines: &[String]) -> Result<()> {
    for m in machines {
        machine::delete_machine(cloud, m, None, Duration::from_secs(90)).await?;
    }
    lb_openstack::delete(cloud, lb).await?;
    Ok(())
}

#[tokio::test]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn openstack_lb_create_with_machines_then_delete_leaves_nothing() -> Result<()> {
    let env = TestEnv::load()?;
    let cloud = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;

    let mut l = lb(
        &env,
        "itest-create",
        "serverGroupPolicy: anti-affinity, loadBalancerSourceRanges: [10.0.0.0/8]",
    );
    let machines = vec!["itest-create-m1".to_string(), "itest-create-m2".to_string()];
    let scenario = async {
        let t0 = Instant::now();
        reconcile(&cloud, &mut l).await?;
        let st = l.status.clone().unwrap();
        let t_fip = t0.elapsed();
        ensure!(st.external_ip.is_some() && st.floating_id.is_some(), "no floating IP: {st:?}");
        ensure!(st.port_ip.is_some() && st.server_group_id.is_some(), "no port/server group: {st:?}");
        let sg = cloud.find_security_groups("itest/itest-create").await?;
        ensure!(sg.len() == 1, "one security group: {sg:?}");
        // 2 egress + 2 VRRP + 2 flow sync + 2 ICMP + 2 ports × 1 source range.
        ensure!(sg[0].rules.len() == 10, "rules: {:#?}", sg[0].rules);
        let fip = cloud.get_floating_ip(st.floating_id.as_deref().unwrap()).await?;
        ensure!(fip.port_id == st.port_id, "floating IP on the VIP port: {fip:?}");

        // Steady state: a second reconcile only reads.
        let before = cloud.calls().total();
        reconcile(&cloud, &mut l).await?;
        let steady = cloud.calls().total() - before;
        ensure!(l.status.as_ref().unwrap().floating_id == st.floating_id, "same floating IP");

        // Machines one at a time (Nova's late anti-affinity check fails simultaneous boots on one host).
        for m in &machines {
            let spec = machine_spec(&env, &l, m);
            let port = machine::ensure_vm_port(&cloud, &spec).await?;
            ensure!(port.allowed_address_pairs == spec.vip_addresses, "VIP as allowed address pair: {port:?}");
            let server = machine::ensure_server(&cloud, &spec, &port.id).await?;
            machine::wait_active(&cloud, &server.id, Duration::from_secs(90)).await?;
            // Nova took the config drive (the user data's way in without OpenStack DMI).
            let server = cloud.get_server(&server.id).await?;
            ensure!(server.config_drive, "no config drive: {server:?}");
        }
        let t_active = t0.elapsed();
        eprintln!(
            "timing: floating IP after {:.2}s, 2 ACTIVE servers after {:.2}s; steady-state reconcile: {steady} calls",
            t_fip.as_secs_f64(),
            t_active.as_secs_f64()
        );
        let t1 = Instant::now();
        teardown(&cloud, &l, &machines).await?;
        eprintln!("timing: full deletion {:.2}s", t1.elapsed().as_secs_f64());
        anyhow::Ok(())
    }
    .await;
    let cleanup = teardown(&cloud, &l, &machines).await;
    let leaks = LeakCheck::new(&env).assert_clean(&direct).await;
    scenario?;
    cleanup?;
    leaks
}

#[tokio::test]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn openstack_lb_5xx_and_quota_keep_the_floating_ip_and_leak_nothing() -> Result<()> {
    let env = TestEnv::load()?;
    let proxy = FaultProxy::start("http://127.0.0.1:9696").await?;
    let cloud = connect(&env, &[(&proxy, "network", "v2.0")]).await?;
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;

    let mut a = lb(&env, "itest-faults-a", "");
    let mut b = lb(&env, "itest-faults-b", "");
    let scenario = async {
        reconcile(&cloud, &mut a).await?;
        let first = a.status.clone().unwrap();

        // Neutron answers 500 to reading floating IPs: an error with Neutron's text, the status keeps the IP.
        proxy.inject(Rule::new("GET", "/floatingips"), Fault::internal_error());
        let err = reconcile(&cloud, &mut a)
            .await
            .expect_err("5xx must fail the step");
        ensure!(
            err.step == "floating IP" && err.error.kind == CloudErrorKind::Unavailable,
            "{err}"
        );
        ensure!(
            a.status.as_ref().unwrap().floating_id == first.floating_id,
            "floating IP forgotten"
        );
        proxy.clear();
        reconcile(&cloud, &mut a).await?;
        ensure!(
            a.status.as_ref().unwrap().floating_id == first.floating_id,
            "floating IP replaced"
        );
        ensure!(
            a.status.as_ref().unwrap().external_ip == first.external_ip,
            "address changed"
        );

        // Quota exhausted for floating IPs: a Quota error, no floating IP, and a retry after it works.
        proxy.inject(
            Rule::new("POST", "/floatingips").times(1),
            Fault::neutron_over_quota("floatingip"),
        );
        let err = reconcile(&cloud, &mut b)
            .await
            .expect_err("quota must fail the step");
        ensure!(err.error.kind == CloudErrorKind::Quota, "{err}");
        ensure!(
            err.to_string().to_lowercase().contains("quota"),
            "event text: {err}"
        );
        ensure!(
            b.status.as_ref().unwrap().floating_id.is_none(),
            "no floating IP recorded"
        );
        reconcile(&cloud, &mut b).await?;
        ensure!(
            b.status.as_ref().unwrap().floating_id.is_some(),
            "retry allocates"
        );

        // A 503 in the middle of deletion: the next attempt finishes it.
        proxy.inject(
            Rule::new("DELETE", "/ports/").times(1),
            Fault::unavailable(),
        );
        ensure!(
            lb_openstack::delete(&cloud, &a).await.is_err(),
            "injected 503 on delete"
        );
        anyhow::Ok(())
    }
    .await;
    proxy.clear();
    let c1 = teardown(&cloud, &a, &[]).await;
    let c2 = teardown(&cloud, &b, &[]).await;
    let leaks = LeakCheck::new(&env).assert_clean(&direct).await;
    scenario?;
    c1?;
    c2?;
    leaks
}

#[tokio::test]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn openstack_internal_lb_existing_fip_and_keep_annotations() -> Result<()> {
    let env = TestEnv::load()?;
    let cloud = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;

    let mut internal = lb(&env, "itest-internal", "internalLB: true");
    let user_fip = cloud
        .create_floating_ip(&env.info.external_network_id, "itest user fip")
        .await?;
    let mut existing = lb(&env, "itest-existing", "");
    existing.spec.existing_floating_ip = Some(user_fip.address.clone());
    let scenario = async {
        reconcile(&cloud, &mut internal).await?;
        let st = internal.status.clone().unwrap();
        ensure!(
            st.floating_id.is_none() && st.external_ip == st.port_ip,
            "internal: {st:?}"
        );

        reconcile(&cloud, &mut existing).await?;
        let st = existing.status.clone().unwrap();
        ensure!(
            st.floating_id.as_deref() == Some(user_fip.id.as_str()),
            "existing FIP used: {st:?}"
        );
        // Deleting the LB never releases a user's floating IP.
        lb_openstack::delete(&cloud, &existing).await?;
        let still = cloud.get_floating_ip(&user_fip.id).await?;
        ensure!(still.address == user_fip.address, "user FIP kept");

        // keepSecurityGroup: the group survives the deletion; a second delete without it removes it.
        internal
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(
                "yawol.stackit.cloud/keepSecurityGroup".into(),
                "true".into(),
            );
        lb_openstack::delete(&cloud, &internal).await?;
        ensure!(
            cloud
                .find_security_groups("itest/itest-internal")
                .await?
                .len()
                == 1,
            "kept"
        );
        ensure!(
            cloud.find_ports("itest/itest-internal").await?.is_empty(),
            "port deleted"
        );
        internal.metadata.annotations = None;
        anyhow::Ok(())
    }
    .await;
    let c1 = teardown(&cloud, &internal, &[]).await;
    let c2 = teardown(&cloud, &existing, &[]).await;
    let c3 = cloud.delete_floating_ip(&user_fip.id).await;
    let leaks = LeakCheck::new(&env).assert_clean(&direct).await;
    scenario?;
    c1?;
    c2?;
    c3?;
    leaks
}
