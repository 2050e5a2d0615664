//! The whole OpenStack side — LoadBalancer → LoadBalancerSet → LoadBalancerMachine — started through
//! `cli::run_openstack_controllers` (the binary's path, settings from the environment) against the real OpenStack
//! of `cargo xtask openstack up` through the real `SdkCloud` (credentials from the LoadBalancer's
//! `cloudprovider.conf` Secret via `SecretClouds`, except where Neutron or Nova sits behind a fault proxy) and the
//! real API server of the test binary (kube-testenv, a namespace per test), under exactly the ServiceAccount and
//! Role of `deploy/openstack-controller.yaml` with a real token. The cluster's token controller fills each machine's
//! token Secret; the played agents report with the kubeconfig Nova holds in their server's user data, i.e. with
//! their machine's own token under the Role the machine controller wrote. Every test fails if the API server
//! refused the controllers or an agent a single request (401/403, `Cascade::stop`).
//!
//! - `cascade_lifecycle_create_update_scale_heal_delete`: a LoadBalancer with 2 replicas ends with security group,
//!   floating IP on the VIP port, server group and 2 ACTIVE servers in it, booted with our user data (token,
//!   router ID, sync secret as Nova stores them; the kubeconfig names the API server and carries the token the
//!   token controller wrote); a port change is hot (rules change, same servers); a flavor change
//!   rolls (new set, new servers with the new flavor, the old ones deleted once the new set is ready and holds the
//!   VIP); scale 2 → 3 → 2; a machine whose agent reports unhealthy is marked, deleted and replaced with a new
//!   server; deletion leaves nothing, in OpenStack nor in Kubernetes (sets, machines, token and sync Secrets, the
//!   machines' ServiceAccounts, Roles and RoleBindings).
//! - `cascade_internal_lb_and_keep_annotations`: an internal LoadBalancer (no floating IP, external IP = VIP)
//!   with `keepSecurityGroup`, and an external one with `keepFloatingIP` + `keepPort`, each with a machine; deleting
//!   them keeps exactly what the annotations say (the kept port loses the deleted group), the test removes it.
//! - `cascade_existing_and_adopted_floating_ips`: `existingFloatingIP` is used (renamed "… (user managed)" because
//!   it carried our description) and survives deletion; a floating IP with the LoadBalancer's description (left by
//!   an interrupted create or by yawol) is adopted instead of allocating another, and released with it.
//! - `cascade_neutron_5xx_during_create_is_retried_without_duplicates`: Neutron 500/503 injected by `FaultProxy`
//!   into security group, floating IP, VIP lookup and VM port creation and into the VM port's deletion: Warning
//!   events with Neutron's text, retries, and in the end exactly one of everything and nothing left.
//! - `cascade_nova_5xx_and_lost_answers_are_retried_without_duplicates`: Nova behind `FaultProxy` (found through the
//!   catalog of a Keystone proxy, see `cascade::NovaProxy`) answers 503 to a server group's creation and
//!   then 500 after creating it, 500 after booting the first machine's server, 503 to the second machine's server
//!   create and to the read of its booting server, and 503 / 500-after-deleting to server deletes: Warning events
//!   with Nova's text, retries, the group and the server that Nova made behind an error are adopted (one group, one
//!   server per machine), deletion finishes and nothing is left.
//!
//! - `cascade_dual_stack_vip_port_rules_and_addresses`: with an IPv6 subnet on the test network (made by the test),
//!   a LoadBalancer with `spec.ipFamilies [IPv4, IPv6]` gets a VIP port with an IPv4 and an IPv6 fixed IP, one
//!   floating IP (IPv4) on that port, security-group rules of both ethertypes (service port, VRRP and sync within
//!   the group, ICMP / ICMPv6), both VIPs as allowed address pairs of its machine's port, `status.portIPv6`, and the
//!   back channel would publish both addresses on the Service; deletion leaves no port, group or floating IP.
//!
//! - `cascade_active_active_routes_follow_the_eligible_machines`: a LoadBalancer with `activeActive` and 3 replicas
//!   boots its machines without VRRP, each translating to its own port address; the project's router routes the
//!   VIP's /32 to exactly the machines that report `VIPEligible=True` (one that reports False loses its next hop
//!   and gets it back), `ActiveActive` is True; scaled to 1, the condition and an event say `TooFewReplicas` and
//!   the VIP is routed to the one machine left; deleted, no route of the VIP is left.
//!
//! Every test starts and ends with the leak check over the test project (a failing check sweeps the project so the
//! next test starts clean).
//!
//! What this OpenStack cannot do, and how the tests deal with it:
//! - Nova's fake driver never boots a VM, so no agent runs: the harness plays the agents once a machine's server is
//!   ACTIVE (ready conditions, heartbeats, `KeepalivedMaster` on one machine per LoadBalancer, moving to the newest
//!   revision like the agents' revision bonus does, or `VIPEligible` on every machine booted active-active), with
//!   the credentials the VM would have. It has no data plane either: routes are checked as Neutron stores them.
//! - There is one image; the rolling update changes the flavor (a second flavor is created as admin and deleted at
//!   the end). An image change takes the same path (both are in the machine template's hash).
//! - Nova cannot sit behind the proxy through an endpoint override (openstack_sdk skips version discovery for it and
//!   sends microversion 2.0, which Nova rejects with 406), so the session authenticates through a Keystone proxy
//!   whose tokens point the catalog's compute endpoint at the Nova proxy. Nova's real quota error is covered by
//!   `tests/machines_openstack.rs`.
//! - The rollout gate is 1 s of VRRP mastership instead of 2 min (`loadbalancer::Config::rollout`); an unhealthy
//!   machine's 3-minute mark and 2-minute grace are passed by back-dating the condition times the agent and the
//!   controller wrote, not by waiting.
//!
//! `#[ignore]`d like the other real-OpenStack tests: the `openstack` stage of `cargo xtask test` runs them with
//! `--ignored --test-threads=1` (they share the project and its quota). By hand: `cargo xtask openstack up &&
//! cargo test --workspace --exclude lb-testbed --test openstack_cascade -- --ignored --test-threads=1 --nocapture`
//! (prints timings).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use kube_testenv::KubeEnv;
use lb_api::constants::{conditions, lb_annotations};
use lb_controller::metrics::Metrics;
use lb_controller::openstack::clouds::{FixedCloud, SecretClouds};
use lb_controller::openstack::{Cloud, FloatingIpFilter};
use lb_test_support::cascade::{
    self, condition, connect, connect_counted, connect_routed, delete_flavor, ensure_flavor,
    finish, lb_json, name_of, nova_group_members, nova_server, nova_servers_are, ready, revision,
    server_ids, servers_named, user_data_files, Cascade, CascadeConfig, Kind, NovaProxy,
    CALL_TIMEOUT, CONTROLLER_SERVICE_ACCOUNT, STEP,
};
use openstack_testenv::{Fault, FaultProxy, LeakCheck, Rule, TestEnv};
use serde_json::{json, Value};

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// The cascade with `SecretClouds`, as the binary runs by default.
async fn start(env: &TestEnv) -> Result<Cascade> {
    let metrics = Arc::new(Metrics::new());
    let calls = metrics.openstack_calls.clone();
    Cascade::start(
        KubeEnv::shared(),
        env,
        metrics,
        CascadeConfig::default(),
        move |client| SecretClouds::new(client, CALL_TIMEOUT, calls),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn cascade_lifecycle_create_update_scale_heal_delete() -> Result<()> {
    const LB: &str = "csc-life";
    const FLAVOR2: &str = "lbtest-cascade.rolled";
    let env = TestEnv::load()?;
    let cloud = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    let admin = env.connect_admin().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;
    let flavor2 = ensure_flavor(&admin, FLAVOR2).await?;
    let c = start(&env).await?;
    let ns = c.ns.clone();
    let prefix = format!("{LB}-");
    let os_name = format!("{ns}/{LB}");
    let scenario = async {
        // Create.
        let t0 = Instant::now();
        c.create_lb(lb_json(
            &env,
            &c.ns,
            LB,
            2,
            json!({"serverGroupPolicy": "soft-anti-affinity"}),
        ))
        .await?;
        c.wait("floating IP", STEP, |c| {
            c.status(LB)["externalIP"].is_string() && c.status(LB)["floatingID"].is_string()
        })
        .await?;
        let t_fip = t0.elapsed();
        let (set1, active1) = ready(&c, LB, 1, 2).await?;
        let t_active = t0.elapsed();
        eprintln!(
            "timing: floating IP after {:.2}s, 2 ACTIVE servers and 2/2 ready after {:.2}s",
            secs(t_fip),
            secs(t_active)
        );

        // Neutron and Nova agree with the status.
        let st = c.status(LB);
        let s = |k: &str| st[k].as_str().unwrap_or_default().to_string();
        let groups = cloud.find_security_groups(&os_name).await?;
        ensure!(
            groups.len() == 1 && groups[0].id == s("securityGroupID"),
            "one security group: {groups:?}"
        );
        let fip = cloud.get_floating_ip(&s("floatingID")).await?;
        ensure!(
            fip.address == s("externalIP") && fip.port_id.as_deref() == Some(&*s("portID")),
            "floating IP on the VIP port: {fip:?}"
        );
        let vip = cloud.get_port(&s("portID")).await?;
        ensure!(
            vip.security_groups == [s("securityGroupID")]
                && vip.primary_ip() == Some(&*s("portIP")),
            "VIP port: {vip:?}"
        );
        let sgroups = cloud.find_server_groups(&os_name).await?;
        ensure!(
            sgroups.len() == 1
                && sgroups[0].id == s("serverGroupID")
                && sgroups[0].policy == "soft-anti-affinity",
            "server group: {sgroups:?}"
        );
        let members = nova_group_members(&admin, &s("serverGroupID")).await?;
        let router_id = c.lb(LB)["metadata"]["annotations"][lb_annotations::VRRP_ROUTER_ID]
            .as_str()
            .context("router id")?
            .to_string();
        let sync = c
            .secret_data(&format!("{LB}-sync"), "secret")
            .context("sync Secret")?;
        for (m, server) in &active1 {
            let nova = nova_server(&admin, server).await?;
            ensure!(
                nova["status"] == "ACTIVE" && nova["name"] == m.as_str(),
                "server of {m}: {nova}"
            );
            ensure!(members.contains(server), "{server} not in the server group");
            let files = user_data_files(&nova)?;
            let file = |p: &str| {
                files
                    .iter()
                    .find(|(path, _)| path == p)
                    .map(|(_, c)| c.clone())
                    .unwrap_or_default()
            };
            // The token the cluster's token controller wrote for the machine's ServiceAccount; the played agent
            // of the machine has been reporting with exactly this kubeconfig.
            let kubeconfig = file(lb_controller::openstack::machine::cloudinit::KUBECONFIG_PATH);
            let token = c.secret_data(m, "token").context("token Secret")?;
            ensure!(
                kubeconfig.contains(&token) && kubeconfig.contains(&c.api_endpoint),
                "kubeconfig: {kubeconfig}"
            );
            let agent = file(lb_controller::openstack::machine::cloudinit::AGENT_ENV_PATH);
            ensure!(
                agent.contains(&format!("--vrrp-router-id={router_id}"))
                    && agent.contains(m.as_str()),
                "agent settings: {agent}"
            );
            ensure!(file("/etc/lb-agent/sync-secret") == sync, "sync secret");
            let ms = &c.machine(m)["status"];
            let port = cloud
                .get_port(ms["defaultPortID"].as_str().unwrap_or_default())
                .await?;
            ensure!(
                port.device_id == *server
                    && port.allowed_address_pairs == [s("portIP")]
                    && port.security_groups == [s("securityGroupID")],
                "VM port of {m}: {port:?}"
            );
        }
        nova_servers_are(&env, &direct, &prefix, &server_ids(&active1)).await?;

        // Hot: a new port changes the rules, not the machines.
        let hash = st["openstackReconcileHash"].clone();
        c.patch_lb(
            LB,
            json!({"spec": {"ports": [
                {"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"},
                {"name": "https", "port": 443, "nodePort": 30443, "protocol": "TCP"}
            ]}}),
        )
        .await?;
        c.wait("OpenStack step after the port change", STEP, |c| {
            c.status(LB)["openstackReconcileHash"] != hash
        })
        .await?;
        let rules = cloud.find_security_groups(&os_name).await?[0].rules.clone();
        ensure!(
            rules
                .iter()
                .any(|r| r.spec.protocol.as_deref() == Some("tcp")
                    && r.spec.port_range_min == Some(443)),
            "TCP 443 admitted: {rules:#?}"
        );
        ensure!(c.sets_of(LB).len() == 1, "hot change: no new set");
        ensure!(
            c.active_in_set(&set1) == active1,
            "hot change: same machines"
        );
        nova_servers_are(&env, &direct, &prefix, &server_ids(&active1)).await?;

        // Rolling: a new flavor is a new set; the old one goes once the new one is ready and holds the VIP.
        let t1 = Instant::now();
        c.patch_lb(
            LB,
            json!({"spec": {"infrastructure": {"flavor": {"flavorID": flavor2}}}}),
        )
        .await?;
        // Watched throughout: the old set keeps both machines until the new set has both ready.
        let mut early = None;
        c.wait("new set ready, old set deleted", STEP, |c| {
            let old = c.set(&set1);
            let new_ready = c
                .set_of_revision(LB, 2)
                .is_some_and(|s| c.set(&s)["status"]["readyReplicas"] == 2);
            let old_shrunk = old.is_null()
                || old["spec"]["replicas"] != 2
                || c.live_machines_of_set(&set1).len() < 2;
            if old_shrunk && !new_ready && early.is_none() {
                early = Some(format!("old set {old} shrank before the new one was ready"));
            }
            old.is_null() && new_ready
        })
        .await?;
        ensure!(early.is_none(), "{}", early.unwrap_or_default());
        let (set2, active2) = ready(&c, LB, 2, 2).await?;
        ensure!(set2 != set1, "a new set");
        nova_servers_are(&env, &direct, &prefix, &server_ids(&active2)).await?;
        eprintln!(
            "timing: rolling update (2 new servers, 2 old deleted) {:.2}s",
            secs(t1.elapsed())
        );
        for (_, server) in &active2 {
            let nova = nova_server(&admin, server).await?;
            ensure!(
                nova["flavor"]["original_name"] == FLAVOR2,
                "new flavor: {}",
                nova["flavor"]
            );
        }
        for reason in ["LoadBalancerSetScaledDown", "LoadBalancerSetDeleted"] {
            ensure!(
                c.lb_events(LB, reason).len() == 1,
                "{reason}: {:?}",
                c.lb_events(LB, reason)
            );
        }
        let master = c.master(LB).context("a VRRP master")?;
        ensure!(
            active2.iter().any(|(m, _)| *m == master),
            "the VIP moved to the new set"
        );

        // Scale up and down (the master stays).
        c.patch_lb(LB, json!({"spec": {"replicas": 3}})).await?;
        let (_, active3) = ready(&c, LB, 2, 3).await?;
        nova_servers_are(&env, &direct, &prefix, &server_ids(&active3)).await?;
        c.patch_lb(LB, json!({"spec": {"replicas": 2}})).await?;
        let (_, active4) = ready(&c, LB, 2, 2).await?;
        ensure!(
            active4.iter().any(|(m, _)| *m == master),
            "scale-down kept the master"
        );
        nova_servers_are(&env, &direct, &prefix, &server_ids(&active4)).await?;

        // Unhealthy: the agent of a non-master reports its data plane down (for 4 minutes already).
        let (sick, sick_server) = active4
            .iter()
            .find(|(m, _)| *m != master)
            .cloned()
            .context("a non-master")?;
        let t2 = Instant::now();
        c.set_sick(&sick, true);
        c.report(
            &sick,
            vec![
                condition(conditions::CONFIG_READY, "True", 1, 3600),
                condition(conditions::DATAPLANE_READY, "False", 1, 240),
                condition(conditions::DATAPLANE_UP_TO_DATE, "True", 1, 3600),
                condition(conditions::KEEPALIVED_MASTER, "False", 1, 3600),
            ],
        )
        .await?;
        c.wait("MarkedForDeletion", STEP, |c| {
            marked(&c.machine(&sick)).is_some()
        })
        .await?;
        // The 2-minute grace passes.
        let mut conds: Vec<Value> = c.machine(&sick)["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for cond in conds.iter_mut() {
            if cond["type"] == conditions::MARKED_FOR_DELETION {
                cond["lastTransitionTime"] = json!(cascade::ago(130));
            }
        }
        c.report(&sick, conds).await?;
        c.wait("unhealthy machine deleted", STEP, |c| {
            c.machine(&sick).is_null()
        })
        .await?;
        let (_, active5) = ready(&c, LB, 2, 2).await?;
        ensure!(
            !active5.iter().any(|(m, _)| *m == sick),
            "replaced: {active5:?}"
        );
        ensure!(!server_ids(&active5).contains(&sick_server), "a new server");
        nova_servers_are(&env, &direct, &prefix, &server_ids(&active5)).await?;
        eprintln!(
            "timing: unhealthy machine replaced by an ACTIVE one {:.2}s after its report",
            secs(t2.elapsed())
        );
        ensure!(
            c.metrics
                .encode()
                .contains(r#"lb_cloud_controller_machine_deletions_total{reason="unhealthy"} 1"#),
            "counted as an unhealthy deletion"
        );

        // Delete: everything goes, down to the RBAC objects and the sync Secret.
        let t_delete = c.delete_lb(LB, STEP).await?;
        eprintln!("timing: full deletion {:.2}s", secs(t_delete));
        ensure!(
            servers_named(&env, &direct, &prefix).await?.is_empty(),
            "servers left"
        );
        let left = LeakCheck::new(&env)
            .only_prefixed(&os_name)
            .find(&direct)
            .await?;
        ensure!(left.is_empty(), "left in OpenStack: {left:?}");
        ensure!(
            c.list_now(Kind::Machines).await?.is_empty()
                && c.list_now(Kind::Sets).await?.is_empty(),
            "sets or machines left"
        );
        ensure!(
            c.list_now(Kind::Secrets)
                .await?
                .iter()
                .all(|s| s["metadata"]["name"] == "cloud"),
            "token or sync Secrets left"
        );
        let rbac = machine_rbac_left(&c).await?;
        ensure!(rbac.is_empty(), "the machines' RBAC objects left: {rbac:?}");
        let calls = c.metrics.openstack_calls.total();
        eprintln!("OpenStack calls of the whole scenario: {calls}");
        anyhow::Ok(())
    }
    .await;
    let stopped = c.stop().await;
    let cleanup = stopped.and(delete_flavor(&admin, &flavor2).await);
    finish(&env, &cloud, &direct, scenario, cleanup).await
}

/// ServiceAccounts, Roles and RoleBindings in the cascade's namespace other than the controllers' own (and the
/// namespace's `default` ServiceAccount): what the machines' deletion left.
async fn machine_rbac_left(c: &Cascade) -> Result<Vec<String>> {
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    use kube::{Api, ResourceExt};
    let ours = |name: &str| name == CONTROLLER_SERVICE_ACCOUNT;
    let mut left = Vec::new();
    for sa in Api::<ServiceAccount>::namespaced(c.admin.clone(), &c.ns)
        .list(&Default::default())
        .await?
    {
        if !ours(&sa.name_any()) && sa.name_any() != "default" {
            left.push(format!("ServiceAccount {}", sa.name_any()));
        }
    }
    for role in Api::<Role>::namespaced(c.admin.clone(), &c.ns)
        .list(&Default::default())
        .await?
    {
        if !ours(&role.name_any()) {
            left.push(format!("Role {}", role.name_any()));
        }
    }
    for binding in Api::<RoleBinding>::namespaced(c.admin.clone(), &c.ns)
        .list(&Default::default())
        .await?
    {
        if !ours(&binding.name_any()) {
            left.push(format!("RoleBinding {}", binding.name_any()));
        }
    }
    Ok(left)
}

/// The `MarkedForDeletion` condition of a machine, if set.
fn marked(machine: &Value) -> Option<Value> {
    machine["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == conditions::MARKED_FOR_DELETION && c["status"] == "True")
        .cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn cascade_internal_lb_and_keep_annotations() -> Result<()> {
    const INTERNAL: &str = "csc-int";
    const KEEP: &str = "csc-keep";
    let env = TestEnv::load()?;
    let cloud = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;
    let c = start(&env).await?;
    let ns = c.ns.clone();
    let mut kept = (None, None, None);
    let scenario = async {
        let mut internal = lb_json(&env, &c.ns, INTERNAL, 1, json!({"internalLB": true}));
        internal["metadata"]["annotations"] = json!({lb_annotations::KEEP_SECURITY_GROUP: "true"});
        let mut keep = lb_json(&env, &c.ns, KEEP, 1, json!({}));
        keep["metadata"]["annotations"] = json!({
            lb_annotations::KEEP_FLOATING_IP: "true", lb_annotations::KEEP_PORT: "true"
        });
        c.create_lb(internal).await?;
        c.create_lb(keep).await?;
        let (_, int_active) = ready(&c, INTERNAL, 1, 1).await?;
        let (_, keep_active) = ready(&c, KEEP, 1, 1).await?;

        // Internal: no floating IP anywhere; the external IP is the VIP.
        let st = c.status(INTERNAL);
        ensure!(
            st["floatingID"].is_null()
                && st["portIP"].is_string()
                && st["externalIP"] == st["portIP"],
            "internal status: {st}"
        );
        let fips = cloud
            .find_floating_ips(&FloatingIpFilter {
                address: None,
                description: Some(format!("{ns}/{INTERNAL}")),
            })
            .await?;
        ensure!(fips.is_empty(), "floating IP for an internal LB: {fips:?}");
        let int_sg = st["securityGroupID"].as_str().context("group")?.to_string();
        let keep_st = c.status(KEEP);
        let fip_id = keep_st["floatingID"].as_str().context("fip")?.to_string();
        let port_id = keep_st["portID"].as_str().context("port")?.to_string();
        let keep_sg = keep_st["securityGroupID"]
            .as_str()
            .context("group")?
            .to_string();
        kept = (
            Some(int_sg.clone()),
            Some(fip_id.clone()),
            Some(port_id.clone()),
        );

        let (a, b) = tokio::join!(c.delete_lb(INTERNAL, STEP), c.delete_lb(KEEP, STEP));
        a?;
        b?;
        for (lb, active) in [(INTERNAL, &int_active), (KEEP, &keep_active)] {
            ensure!(
                servers_named(&env, &direct, &format!("{lb}-"))
                    .await?
                    .is_empty(),
                "servers of {lb} left"
            );
            for (m, _) in active.iter() {
                ensure!(
                    cloud.find_ports(&format!("{ns}/{m}")).await?.is_empty(),
                    "VM port of {m} left"
                );
            }
        }
        // keepSecurityGroup: only the group stays.
        let groups = cloud
            .find_security_groups(&format!("{ns}/{INTERNAL}"))
            .await?;
        ensure!(
            groups.len() == 1 && groups[0].id == int_sg,
            "kept group: {groups:?}"
        );
        ensure!(
            cloud
                .find_ports(&format!("{ns}/{INTERNAL}"))
                .await?
                .is_empty(),
            "VIP port of the internal LB deleted"
        );
        // keepFloatingIP + keepPort: both stay, still associated; the group is gone and the port no longer uses it.
        let fip = cloud.get_floating_ip(&fip_id).await?;
        ensure!(
            fip.port_id.as_deref() == Some(port_id.as_str()),
            "kept floating IP: {fip:?}"
        );
        let port = cloud.get_port(&port_id).await?;
        ensure!(port.security_groups.is_empty(), "kept port: {port:?}");
        ensure!(
            cloud
                .find_security_groups(&format!("{ns}/{KEEP}"))
                .await?
                .is_empty()
                && cloud.get_port(&port_id).await.is_ok(),
            "group of {KEEP} deleted"
        );
        ensure!(
            !cloud
                .find_security_groups(&format!("{ns}/{KEEP}"))
                .await?
                .iter()
                .any(|g| g.id == keep_sg),
            "group deleted"
        );
        anyhow::Ok(())
    }
    .await;
    let stopped = c.stop().await;
    // What the annotations kept, the test removes.
    let mut cleanup = stopped;
    if let Some(id) = &kept.1 {
        cleanup = cleanup.and(cloud.delete_floating_ip(id).await.map_err(Into::into));
    }
    if let Some(id) = &kept.2 {
        cleanup = cleanup.and(cloud.delete_port(id).await.map_err(Into::into));
    }
    if let Some(id) = &kept.0 {
        cleanup = cleanup.and(cloud.delete_security_group(id).await.map_err(Into::into));
    }
    finish(&env, &cloud, &direct, scenario, cleanup).await
}

/// The next hops of `destination` on the test project's router, sorted.
async fn next_hops(cloud: &impl Cloud, router: &str, destination: &str) -> Result<Vec<String>> {
    let mut hops: Vec<String> = cloud
        .router_routes(router)
        .await?
        .into_iter()
        .filter(|r| r.destination == destination)
        .map(|r| r.nexthop)
        .collect();
    hops.sort();
    Ok(hops)
}

/// Waits until the router routes `destination` to exactly `want` (sorted).
async fn wait_next_hops(
    cloud: &impl Cloud,
    router: &str,
    destination: &str,
    want: &[String],
) -> Result<Duration> {
    let t0 = Instant::now();
    loop {
        let hops = next_hops(cloud, router, destination).await?;
        if hops == want {
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > STEP {
            bail!("router routes {destination} via {hops:?}, not {want:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn cascade_active_active_routes_follow_the_eligible_machines() -> Result<()> {
    const LB: &str = "csc-aa";
    let env = TestEnv::load()?;
    let cloud = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    let admin = env.connect_admin().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;
    let c = start(&env).await?;
    let router = env.info.router_id.clone();
    let scenario = async {
        c.create_lb(lb_json(&env, &c.ns, LB, 3, json!({"activeActive": true})))
            .await?;
        let (_, active) = ready(&c, LB, 1, 3).await?;
        let vip = c.status(LB)["portIP"].as_str().context("VIP")?.to_string();
        let dst = format!("{vip}/32");
        let port_ip = |m: &str| {
            c.machine(m)["status"]["defaultPortIP"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        };
        // Booted active-active: no VRRP, each translating to its own port address.
        for (m, server) in &active {
            let files = user_data_files(&nova_server(&admin, server).await?)?;
            let agent = files
                .iter()
                .find(|(p, _)| p == lb_controller::openstack::machine::cloudinit::AGENT_ENV_PATH)
                .map(|(_, c)| c.clone())
                .unwrap_or_default();
            ensure!(
                agent.contains("--active-active")
                    && agent.contains(&format!("--snat-address={}", port_ip(m)))
                    && agent.contains("--sync-listen=")
                    && !agent.contains("--vrrp-router-id"),
                "agent settings of {m}: {agent}"
            );
        }

        // Every eligible machine is a next hop of the VIP.
        let mut all: Vec<String> = active.iter().map(|(m, _)| port_ip(m)).collect();
        all.sort();
        let t = wait_next_hops(&cloud, &router, &dst, &all).await?;
        eprintln!(
            "timing: 3 next hops {:.2}s after the machines were ready",
            secs(t)
        );
        c.wait("ActiveActive=True", STEP, |c| {
            c.status(LB)["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| {
                    k["type"] == conditions::ACTIVE_ACTIVE
                        && k["status"] == "True"
                        && k["reason"] == conditions::REASON_ROUTES_PROGRAMMED
                })
        })
        .await?;

        // A machine that stops being eligible loses its next hop; the others keep theirs.
        let (out, _) = &active[0];
        c.set_sick(out, true);
        let now = jiff::Timestamp::now().to_string();
        let conds = [
            conditions::CONFIG_READY,
            conditions::DATAPLANE_READY,
            conditions::DATAPLANE_UP_TO_DATE,
        ]
        .iter()
        .map(|t| {
            json!({"type": t, "status": "True", "reason": "Itest", "message": "",
                        "lastHeartbeatTime": now, "lastTransitionTime": now})
        })
        .chain([
            json!({"type": conditions::VIP_ELIGIBLE, "status": "False", "reason": "NotSynced",
                       "message": "", "lastHeartbeatTime": now, "lastTransitionTime": now}),
        ])
        .collect();
        c.report(out, conds).await?;
        let rest: Vec<String> = all
            .iter()
            .filter(|ip| **ip != port_ip(out))
            .cloned()
            .collect();
        let t = wait_next_hops(&cloud, &router, &dst, &rest).await?;
        eprintln!(
            "timing: an ineligible machine's next hop gone after {:.2}s",
            secs(t)
        );
        // Eligible again: back.
        c.set_sick(out, false);
        wait_next_hops(&cloud, &router, &dst, &all).await?;

        // Scaled to one: a condition and an event say so, and the one machine left still has the VIP.
        c.patch_lb(LB, json!({"spec": {"replicas": 1}})).await?;
        c.wait("ActiveActive=False TooFewReplicas", STEP, |c| {
            c.status(LB)["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| {
                    k["type"] == conditions::ACTIVE_ACTIVE
                        && k["status"] == "False"
                        && k["reason"] == conditions::REASON_TOO_FEW_REPLICAS
                })
                && c.machines_of(LB).len() == 1
        })
        .await?;
        let left = name_of(&c.machines_of(LB)[0]);
        wait_next_hops(&cloud, &router, &dst, &[port_ip(&left)]).await?;
        ensure!(
            !c.lb_events(LB, conditions::REASON_TOO_FEW_REPLICAS)
                .is_empty(),
            "no TooFewReplicas event"
        );

        // Deleted: no route of the VIP is left (the leak check also looks at the router's routes).
        c.delete_lb(LB, STEP).await?;
        ensure!(
            next_hops(&cloud, &router, &dst).await?.is_empty(),
            "routes of {dst} left"
        );
        anyhow::Ok(())
    }
    .await;
    let stopped = c.stop().await;
    finish(&env, &cloud, &direct, scenario, stopped).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn cascade_existing_and_adopted_floating_ips() -> Result<()> {
    const EXISTING: &str = "csc-exist";
    const ADOPT: &str = "csc-adopt";
    let env = TestEnv::load()?;
    let cloud = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;
    let c = start(&env).await?;
    let ns = c.ns.clone();
    let ext = env.info.external_network_id.clone();
    // The user's address happens to carry our description (e.g. kept from an earlier LoadBalancer of that name).
    let user = cloud
        .create_floating_ip(&ext, &format!("{ns}/{EXISTING}"))
        .await?;
    // An address allocated for ADOPT whose create never got recorded (interrupted reconcile, or yawol's).
    let orphan = cloud
        .create_floating_ip(&ext, &format!("{ns}/{ADOPT}"))
        .await?;
    let scenario = async {
        let mut existing = lb_json(&env, &c.ns, EXISTING, 0, json!({}));
        existing["spec"]["existingFloatingIP"] = json!(user.address);
        c.create_lb(existing).await?;
        c.create_lb(lb_json(&env, &c.ns, ADOPT, 0, json!({})))
            .await?;
        for lb in [EXISTING, ADOPT] {
            c.wait(&format!("{lb}: OpenStack step done"), STEP, |c| {
                c.status(lb)["lastOpenstackReconcile"].is_string()
            })
            .await?;
        }
        let st = c.status(EXISTING);
        ensure!(
            st["floatingID"] == user.id.as_str() && st["externalIP"] == user.address.as_str(),
            "existing floating IP used: {st}"
        );
        let fip = cloud.get_floating_ip(&user.id).await?;
        ensure!(
            fip.description == format!("{ns}/{EXISTING} (user managed)")
                && fip.port_id.as_deref() == st["portID"].as_str(),
            "renamed and on the VIP port: {fip:?}"
        );
        let st = c.status(ADOPT);
        ensure!(
            st["floatingID"] == orphan.id.as_str(),
            "adopted, not allocated: {st}"
        );
        let ours = cloud
            .find_floating_ips(&FloatingIpFilter {
                address: None,
                description: Some(format!("{ns}/{ADOPT}")),
            })
            .await?;
        ensure!(ours.len() == 1, "one floating IP: {ours:?}");

        let (a, b) = tokio::join!(c.delete_lb(EXISTING, STEP), c.delete_lb(ADOPT, STEP));
        a?;
        b?;
        let fip = cloud.get_floating_ip(&user.id).await?;
        ensure!(
            fip.address == user.address && fip.port_id.is_none(),
            "the user's floating IP stays: {fip:?}"
        );
        ensure!(
            cloud.get_floating_ip(&orphan.id).await.is_err(),
            "the adopted floating IP is released with the LoadBalancer"
        );
        anyhow::Ok(())
    }
    .await;
    let cleanup = c
        .stop()
        .await
        .and(cloud.delete_floating_ip(&user.id).await.map_err(Into::into));
    let orphan_gone = cloud.delete_floating_ip(&orphan.id).await;
    finish(
        &env,
        &cloud,
        &direct,
        scenario,
        cleanup.and(orphan_gone.map_err(Into::into)),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn cascade_neutron_5xx_during_create_is_retried_without_duplicates() -> Result<()> {
    const LB: &str = "csc-faults";
    let env = TestEnv::load()?;
    let neutron = FaultProxy::start("http://127.0.0.1:9696").await?;
    // Checks and cleanup go around the proxy.
    let cloud = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;
    let metrics = Arc::new(Metrics::new());
    let proxied = Arc::new(
        connect_counted(
            &env,
            &[(&neutron, "network", "v2.0")],
            metrics.openstack_calls.clone(),
        )
        .await?,
    );
    let c = Cascade::start(
        KubeEnv::shared(),
        &env,
        metrics,
        CascadeConfig::default(),
        |_| FixedCloud(proxied.clone()),
    )
    .await?;
    let ns = c.ns.clone();
    let os_name = format!("{ns}/{LB}");
    let scenario = async {
        // The LoadBalancer's steps: the group's create fails, then the floating IP's.
        neutron.inject(
            Rule::new("POST", "/security-groups").times(1),
            Fault::internal_error(),
        );
        neutron.inject(
            Rule::new("POST", "/floatingips").times(1),
            Fault::unavailable(),
        );
        let t0 = Instant::now();
        c.create_lb(lb_json(
            &env,
            &c.ns,
            LB,
            0,
            json!({"serverGroupPolicy": "soft-anti-affinity"}),
        ))
        .await?;
        c.wait("the LoadBalancer's resources", STEP, |c| {
            let st = c.status(LB);
            [
                "floatingID",
                "portID",
                "serverGroupID",
                "lastOpenstackReconcile",
            ]
            .iter()
            .all(|k| st[*k].is_string())
        })
        .await?;
        eprintln!(
            "timing: LoadBalancer ready through 2 injected faults after {:.2}s",
            secs(t0.elapsed())
        );
        let errors = c.lb_events(LB, "OpenStackError");
        for text in [
            "injected internal server error",
            "injected: service unavailable",
        ] {
            ensure!(
                errors.iter().any(|e| e.contains(text)),
                "Neutron's text {text:?} in an event: {errors:?}"
            );
        }

        // A machine: the VIP lookup and the VM port's create fail once each.
        neutron.inject(
            Rule::new("GET", "/ports/").times(1),
            Fault::internal_error(),
        );
        neutron.inject(
            Rule::new("POST", "/ports").times(1),
            Fault::internal_error(),
        );
        c.patch_lb(LB, json!({"spec": {"replicas": 1}})).await?;
        let (_, active) = ready(&c, LB, 1, 1).await?;
        ensure!(
            neutron.injected_count() == 4,
            "faults injected: {:?}",
            neutron.seen()
        );
        let machine_errors: Vec<String> = c
            .lb_events(LB, "OpenStackError")
            .into_iter()
            .filter(|e| e.starts_with("LoadBalancerMachine "))
            .collect();
        for step in ["vip port: ", "port: "] {
            ensure!(
                machine_errors
                    .iter()
                    .any(|e| e.contains(step) && e.contains("injected internal server error")),
                "the machine's {step:?} failure forwarded to the LoadBalancer: {machine_errors:?}"
            );
        }

        // No duplicates anywhere.
        ensure!(
            cloud.find_security_groups(&os_name).await?.len() == 1,
            "one security group"
        );
        let fips = cloud
            .find_floating_ips(&FloatingIpFilter {
                address: None,
                description: Some(os_name.clone()),
            })
            .await?;
        ensure!(fips.len() == 1, "one floating IP: {fips:?}");
        ensure!(cloud.find_ports(&os_name).await?.len() == 1, "one VIP port");
        ensure!(
            cloud.find_server_groups(&os_name).await?.len() == 1,
            "one server group"
        );
        let (m, server) = &active[0];
        ensure!(
            cloud.find_ports(&format!("{ns}/{m}")).await?.len() == 1,
            "one VM port"
        );
        nova_servers_are(
            &env,
            &direct,
            &format!("{LB}-"),
            std::slice::from_ref(server),
        )
        .await?;

        // Deletion through a 503 on the VM port's delete: reported on the machine, retried, nothing left.
        neutron.inject(
            Rule::new("DELETE", "/ports/").times(1),
            Fault::unavailable(),
        );
        let t_delete = c.delete_lb(LB, STEP).await?;
        eprintln!(
            "timing: deletion through an injected 503 {:.2}s",
            secs(t_delete)
        );
        ensure!(
                c.events_of("LoadBalancerMachine", "OpenStackError")
                    .iter()
                    .any(|(_, msg)| msg.starts_with("deletion:")
                        && msg.contains("service unavailable")),
                "the failed deletion step was reported"
            );
        ensure!(neutron.injected_count() == 5, "the delete fault was hit");
        anyhow::Ok(())
    }
    .await;
    neutron.clear();
    let cleanup = c.stop().await;
    finish(&env, &cloud, &direct, scenario, cleanup).await
}

/// Messages of the `OpenStackError` events about LoadBalancerMachines.
fn machine_errors(c: &Cascade) -> Vec<String> {
    c.events_of("LoadBalancerMachine", "OpenStackError")
        .into_iter()
        .map(|(_, msg)| msg)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn cascade_nova_5xx_and_lost_answers_are_retried_without_duplicates() -> Result<()> {
    const LB: &str = "csc-nova";
    // Each injected answer has its own text, so the events show which fault they report.
    const GROUP_503: &str = "injected: server group create unavailable";
    const GROUP_LOST: &str = "injected: server group created, answer lost";
    const SERVER_LOST: &str = "injected: server created, answer lost";
    const SERVER_503: &str = "injected: server create unavailable";
    const READ_503: &str = "injected: server read unavailable";
    const DELETE_503: &str = "injected: server delete unavailable";
    const DELETE_LOST: &str = "injected: server deleted, answer lost";
    let env = TestEnv::load()?;
    let proxies = NovaProxy::start(&env).await?;
    let nova = &proxies.nova;
    // Checks and cleanup go around the proxies.
    let cloud = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;
    let metrics = Arc::new(Metrics::new());
    let proxied =
        Arc::new(connect_routed(&env, &[], Some(&proxies), metrics.openstack_calls.clone()).await?);
    let c = Cascade::start(
        KubeEnv::shared(),
        &env,
        metrics,
        CascadeConfig::default(),
        |_| FixedCloud(proxied.clone()),
    )
    .await?;
    let ns = c.ns.clone();
    let os_name = format!("{ns}/{LB}");
    let prefix = format!("{LB}-");
    let scenario = async {
        // The LoadBalancer's server group: a 503 (nothing created), then a 500 after Nova created the group.
        nova.inject(
            Rule::new("POST", "/os-server-groups").times(1),
            Fault::status(503, GROUP_503),
        );
        nova.inject(
            Rule::new("POST", "/os-server-groups").times(1),
            Fault::status(500, GROUP_LOST).after_forwarding(),
        );
        let t0 = Instant::now();
        c.create_lb(lb_json(
            &env,
            &c.ns,
            LB,
            0,
            json!({"serverGroupPolicy": "soft-anti-affinity"}),
        ))
        .await?;
        c.wait("the LoadBalancer's resources", STEP, |c| {
            let st = c.status(LB);
            ["serverGroupID", "lastOpenstackReconcile"]
                .iter()
                .all(|k| st[*k].is_string())
        })
        .await?;
        eprintln!(
            "timing: LoadBalancer ready through 2 Nova faults after {:.2}s",
            secs(t0.elapsed())
        );
        let errors = c.lb_events(LB, "OpenStackError");
        for text in [GROUP_503, GROUP_LOST] {
            ensure!(
                errors.iter().any(|e| e.contains(text)),
                "Nova's text {text:?} in an event: {errors:?}"
            );
        }
        let groups = cloud.find_server_groups(&os_name).await?;
        ensure!(
            groups.len() == 1 && c.status(LB)["serverGroupID"] == groups[0].id.as_str(),
            "the group Nova created behind the 500 is adopted, not created again: {groups:?}"
        );
        // With a server-group policy no set is planned before the group exists: the first set carries it.
        let group_id = groups[0].id.clone();
        c.wait("one set, with the server group", STEP, |c| {
            let sets = c.sets_of(LB);
            sets.len() == 1
                && sets[0]["spec"]["template"]["spec"]["serverGroupID"] == group_id.as_str()
        })
        .await?;
        let rev = revision(&c.sets_of(LB)[0]);
        ensure!(
            rev == 1,
            "a set was planned before the group existed (revision {rev})"
        );

        // The first machine: Nova boots its server but the answer is a 500; the controller must adopt that server
        // (it looks for the machine's name before booting) instead of booting a second one.
        nova.inject(
            Rule::new("POST", "/servers").times(1),
            Fault::status(500, SERVER_LOST).after_forwarding(),
        );
        c.patch_lb(LB, json!({"spec": {"replicas": 1}})).await?;
        let (_, active1) = ready(&c, LB, rev, 1).await?;
        let (m1, server1) = active1[0].clone();
        ensure!(
            machine_errors(&c)
                .iter()
                .any(|e| e.starts_with("server: ") && e.contains(SERVER_LOST)),
            "the lost create reported on the machine: {:?}",
            machine_errors(&c)
        );
        ensure!(
            c.events_of("LoadBalancerMachine", "ServerCreated")
                .iter()
                .all(|(m, _)| *m != m1),
            "{m1}'s server was adopted, not booted by a second create"
        );
        nova_servers_are(&env, &direct, &prefix, std::slice::from_ref(&server1)).await?;

        // The second machine: its create fails (nothing booted), then the read of its booting server. Reads of the
        // first machine's server and server lists pass.
        nova.inject(
            Rule::new("POST", "/servers").times(1),
            Fault::status(503, SERVER_503),
        );
        nova.inject(
            Rule::new("GET", "/servers/")
                .except("/servers/detail")
                .except(&server1)
                .times(1),
            Fault::status(503, READ_503),
        );
        c.patch_lb(LB, json!({"spec": {"replicas": 2}})).await?;
        let (_, active2) = ready(&c, LB, rev, 2).await?;
        ensure!(
            nova.injected_count() == 5,
            "faults injected: {:?}",
            nova.seen()
        );
        let errors = machine_errors(&c);
        for text in [SERVER_503, READ_503] {
            ensure!(
                errors
                    .iter()
                    .any(|e| e.starts_with("server: ") && e.contains(text)),
                "Nova's text {text:?} in a machine event: {errors:?}"
            );
        }
        let forwarded = c.lb_events(LB, "OpenStackError");
        ensure!(
            forwarded
                .iter()
                .any(|e| e.starts_with("LoadBalancerMachine ") && e.contains(READ_503)),
            "the machine's failure forwarded to the LoadBalancer: {forwarded:?}"
        );

        // Exactly one server per machine, all in the one server group.
        for (m, server) in &active2 {
            let servers = cloud.find_servers(m).await?;
            ensure!(
                servers.len() == 1 && servers[0].id == *server,
                "one server for {m}: {servers:?}"
            );
        }
        nova_servers_are(&env, &direct, &prefix, &server_ids(&active2)).await?;
        ensure!(
            cloud.find_server_groups(&os_name).await?.len() == 1,
            "one server group"
        );

        // Deletion: one server delete answered 503 (not done), one answered 500 after Nova started deleting.
        nova.inject(
            Rule::new("DELETE", "/servers/").times(1),
            Fault::status(503, DELETE_503),
        );
        nova.inject(
            Rule::new("DELETE", "/servers/").times(1),
            Fault::status(500, DELETE_LOST).after_forwarding(),
        );
        let t_delete = c.delete_lb(LB, STEP).await?;
        eprintln!(
            "timing: deletion through 2 Nova faults {:.2}s",
            secs(t_delete)
        );
        ensure!(
            nova.injected_count() == 7,
            "the delete faults were hit: {:?}",
            nova.seen()
        );
        let errors = machine_errors(&c);
        for text in [DELETE_503, DELETE_LOST] {
            ensure!(
                errors
                    .iter()
                    .any(|e| e.starts_with("deletion: ") && e.contains(text)),
                "the failed deletion step {text:?} was reported: {errors:?}"
            );
        }
        ensure!(
            servers_named(&env, &direct, &prefix).await?.is_empty(),
            "servers left"
        );
        ensure!(
            cloud.find_server_groups(&os_name).await?.is_empty(),
            "server group left"
        );
        anyhow::Ok(())
    }
    .await;
    nova.clear();
    let cleanup = c.stop().await;
    finish(&env, &cloud, &direct, scenario, cleanup).await
}

/// A subnet on the test network, made by a test and removed by it (`ip_version` 6: addresses assigned statically by
/// Neutron, so ports that exist keep only their IPv4 address).
async fn create_subnet(
    direct: &openstack_sdk::AsyncOpenStack,
    network_id: &str,
    name: &str,
    cidr: &str,
) -> Result<String> {
    use openstack_sdk::api::network::v2::subnet::create;
    use openstack_sdk::api::QueryAsync;
    use std::borrow::Cow;
    let subnet = create::SubnetBuilder::default()
        .network_id(network_id)
        .ip_version(6)
        .cidr(Some(Cow::from(cidr)))
        .name(name)
        .enable_dhcp(false)
        .build()?;
    let v: Value = create::Request::builder()
        .subnet(subnet)
        .build()?
        .query_async(direct)
        .await?;
    v["id"]
        .as_str()
        .map(str::to_string)
        .context("subnet without id")
}

async fn delete_subnet(direct: &openstack_sdk::AsyncOpenStack, id: &str) -> Result<()> {
    use openstack_sdk::api::network::v2::subnet::delete;
    use openstack_sdk::api::QueryAsync;
    openstack_sdk::api::ignore(delete::Request::builder().id(id).build()?)
        .query_async(direct)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn cascade_dual_stack_vip_port_rules_and_addresses() -> Result<()> {
    use lb_controller::openstack::{Direction, EtherType};
    const LB: &str = "csc-dual";
    const V6_CIDR: &str = "2001:db8:6::/64";
    let env = TestEnv::load()?;
    let cloud = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;
    let subnet_v6 = create_subnet(&direct, &env.info.network_id, "csc-dual-v6", V6_CIDR).await?;
    let c = start(&env).await?;
    let ns = c.ns.clone();
    let os_name = format!("{ns}/{LB}");
    let scenario = async {
        let mut obj = lb_json(&env, &c.ns, LB, 1, json!({}));
        obj["spec"]["ipFamilies"] = json!(["IPv4", "IPv6"]);
        obj["spec"]["endpoints"] =
            json!([{"name": "node-1", "addresses": ["198.51.100.200", "2001:db8:6::200"]}]);
        c.create_lb(obj).await?;
        let (_, active) = ready(&c, LB, 1, 1).await?;

        // The status: the IPv4 VIP, the IPv6 VIP from the network's only IPv6 subnet, the floating IP (IPv4).
        let st = c.status(LB);
        let s = |k: &str| st[k].as_str().unwrap_or_default().to_string();
        let v4: std::net::IpAddr = s("portIP").parse().context("portIP")?;
        let v6: std::net::IpAddr = s("portIPv6").parse().context("portIPv6")?;
        ensure!(v4.is_ipv4() && v6.is_ipv6(), "status: {st}");
        ensure!(
            s("portIPv6").starts_with("2001:db8:6:"),
            "from the IPv6 subnet: {st}"
        );
        let fip = cloud.get_floating_ip(&s("floatingID")).await?;
        ensure!(
            fip.address == s("externalIP") && fip.port_id.as_deref() == Some(s("portID").as_str()),
            "one floating IP, IPv4, on the VIP port: {fip:?} / {st}"
        );
        let fips = cloud
            .find_floating_ips(&FloatingIpFilter {
                address: None,
                description: Some(os_name.clone()),
            })
            .await?;
        ensure!(fips.len() == 1, "no second floating IP: {fips:?}");

        // The VIP port carries both fixed IPs.
        let port = cloud.get_port(&s("portID")).await?;
        ensure!(
            port.ip_on_subnet(&env.info.subnet_id) == Some(s("portIP").as_str())
                && port.ip_on_subnet(&subnet_v6) == Some(s("portIPv6").as_str()),
            "VIP port: {port:?}"
        );

        // Rules of both ethertypes.
        let groups = cloud.find_security_groups(&os_name).await?;
        ensure!(groups.len() == 1, "groups: {groups:?}");
        let rules: Vec<_> = groups[0].rules.iter().map(|r| &r.spec).collect();
        for et in [EtherType::V4, EtherType::V6] {
            let has = |protocol: &str, port: Option<u16>, group: bool| {
                rules.iter().any(|r| {
                    r.direction == Direction::Ingress
                        && r.ethertype == et
                        && r.protocol.as_deref() == Some(protocol)
                        && r.port_range_min == port
                        && r.remote_group_id.is_some() == group
                })
            };
            let icmp = if et == EtherType::V4 {
                "icmp"
            } else {
                "ipv6-icmp"
            };
            ensure!(
                has("tcp", Some(80), false)
                    && has("vrrp", None, true)
                    && has("tcp", Some(lb_api::constants::sync::PORT), true)
                    && has(icmp, None, false),
                "{et:?} rules: {rules:#?}"
            );
        }

        // The machine's port may carry both VIPs (VRRP moves them).
        let (machine, _) = active.first().context("a machine")?;
        let vm_ports = cloud.find_ports(&format!("{ns}/{machine}")).await?;
        ensure!(vm_ports.len() == 1, "VM port: {vm_ports:?}");
        let pairs = &vm_ports[0].allowed_address_pairs;
        ensure!(
            pairs.contains(&s("portIP")) && pairs.contains(&s("portIPv6")),
            "allowed address pairs: {pairs:?}"
        );

        // What the back channel publishes on the Service: both addresses, in the order of spec.ipFamilies.
        let lb = c.lb_api().get(LB).await?;
        ensure!(
            lb_controller::cloud::backchannel::publishable_ips(&lb)
                == [s("externalIP"), s("portIPv6")],
            "published: {:?}",
            lb_controller::cloud::backchannel::publishable_ips(&lb)
        );

        let port_id = s("portID");
        let sg = s("securityGroupID");
        let fip_id = s("floatingID");
        c.delete_lb(LB, STEP).await?;
        ensure!(
            cloud
                .get_port(&port_id)
                .await
                .is_err_and(|e| e.is_not_found()),
            "VIP port left"
        );
        ensure!(
            cloud
                .get_floating_ip(&fip_id)
                .await
                .is_err_and(|e| e.is_not_found()),
            "floating IP left"
        );
        ensure!(
            !cloud
                .find_security_groups(&os_name)
                .await?
                .iter()
                .any(|g| g.id == sg),
            "security group left"
        );
        anyhow::Ok(())
    }
    .await;
    let stopped = c.stop().await;
    // After the ports that used it are gone (a failed scenario's leftovers are swept by `finish` first).
    let leaks = LeakCheck::new(&env).assert_clean(&direct).await;
    if leaks.is_err() {
        if let Err(e) = cascade::sweep(&env, &cloud, &direct).await {
            eprintln!("sweep failed: {e:#}");
        }
    }
    let removed = delete_subnet(&direct, &subnet_v6).await;
    finish(&env, &cloud, &direct, scenario, stopped.and(removed)).await
}
