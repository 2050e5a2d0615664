//! The fault-injection proxy in front of the real Neutron and Nova, driven through `openstack_sdk` the way the
//! controllers will use it: injected errors reach the client with their status and body, untouched requests work,
//! Nova can sit behind a proxy found through the catalog of a Keystone proxy (version discovery intact), a create
//! answered with an error after forwarding really happened, and nothing leaks.
//!
//! Needs `cargo xtask openstack up`; ignored by a plain `cargo test`, run by the `openstack` stage of
//! `cargo xtask test`. The proxy's own behaviour is unit-tested in `src/fault.rs` without OpenStack.

use anyhow::{ensure, Context, Result};
use openstack_sdk::api::compute::v2 as nova;
use openstack_sdk::api::network::v2 as neutron;
use openstack_sdk::api::{ignore, QueryAsync};
use openstack_sdk::AsyncOpenStack;
use openstack_testenv::{api_status, Fault, FaultProxy, LeakCheck, Rule, TestEnv};
use serde_json::Value;
use std::borrow::Cow;
use std::time::{Duration, Instant};

#[tokio::test]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn injected_faults_reach_the_sdk_and_everything_else_passes() -> Result<()> {
    let env = TestEnv::load()?;
    // Straight to the API (not through the proxies) for set-up checks and clean-up.
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test: the test project must be empty")?;
    let neutron_proxy = FaultProxy::start("http://127.0.0.1:9696").await?;
    let nova_proxy = FaultProxy::start("http://127.0.0.1:8774").await?;
    let mut config = env.cloud_config(&env.info.cloud)?;
    neutron_proxy.route(&mut config, "network", "v2.0");
    nova_proxy.route(&mut config, "compute", "v2.1");
    let client = env.connect_with(&config).await?;

    let mut sg_id = None;
    let result = scenario(&env, &client, &neutron_proxy, &nova_proxy, &mut sg_id).await;
    if let Some(id) = sg_id {
        let deleted = ignore(
            neutron::security_group::delete::Request::builder()
                .id(id.as_str())
                .build()?,
        )
        .query_async(&direct)
        .await;
        if let Err(e) = deleted {
            if api_status(&e) != Some(404) {
                eprintln!("clean-up: deleting security group {id}: {e}");
            }
        }
    }
    let leaks = LeakCheck::new(&env).assert_clean(&direct).await;
    result?;
    leaks
}

async fn scenario(
    env: &TestEnv,
    client: &AsyncOpenStack,
    neutron_proxy: &FaultProxy,
    nova_proxy: &FaultProxy,
    sg_id_out: &mut Option<String>,
) -> Result<()> {
    let info = &env.info;

    // Untouched requests go through to the real API.
    let sg: Value = neutron::security_group::create::Request::builder()
        .security_group(
            neutron::security_group::create::SecurityGroupBuilder::default()
                .name("fault-proxy-sg")
                .build()?,
        )
        .build()?
        .query_async(client)
        .await
        .context("creating a security group through the proxy")?;
    let sg_id = sg["id"]
        .as_str()
        .context("security group without id")?
        .to_string();
    *sg_id_out = Some(sg_id.clone());
    ensure!(
        neutron_proxy
            .seen()
            .iter()
            .any(|s| s.method == "POST" && s.path.starts_with("/v2.0/security-groups")),
        "the request did not go through the proxy: {:?}",
        neutron_proxy.seen()
    );

    // Neutron's quota error on floating IPs, once.
    neutron_proxy.inject(
        Rule::new("POST", "/floatingips").times(1),
        Fault::neutron_over_quota("floatingip"),
    );
    let create_fip = || -> Result<neutron::floatingip::create::Request<'_>> {
        Ok(neutron::floatingip::create::Request::builder()
            .floatingip(
                neutron::floatingip::create::FloatingipBuilder::default()
                    .floating_network_id(info.external_network_id.as_str())
                    .description("fault-proxy-fip")
                    .build()?,
            )
            .build()?)
    };
    let err = create_fip()?
        .query_async(client)
        .await
        .map(|_: Value| ())
        .expect_err("quota error injected");
    ensure!(api_status(&err) == Some(409), "expected 409, got {err}");
    ensure!(
        err.to_string().contains("Quota exceeded"),
        "the OverQuota message is lost: {err}"
    );
    // The rule is used up: the next one is created for real (then deleted).
    let fip: Value = create_fip()?
        .query_async(client)
        .await
        .context("creating a floating IP after the fault")?;
    ignore(
        neutron::floatingip::delete::Request::builder()
            .id(fip["id"].as_str().unwrap_or_default())
            .build()?,
    )
    .query_async(client)
    .await?;

    // A 500 on listing ports, until cleared.
    neutron_proxy.inject(Rule::new("GET", "/ports"), Fault::internal_error());
    let list_ports = || neutron::port::list::Request::builder().build();
    for _ in 0..2 {
        let err = list_ports()?
            .query_async(client)
            .await
            .map(|_: Vec<Value>| ())
            .expect_err("500 injected");
        ensure!(api_status(&err) == Some(500), "expected 500, got {err}");
    }
    neutron_proxy.clear();
    let _: Vec<Value> = list_ports()?
        .query_async(client)
        .await
        .context("listing ports after clear()")?;

    // A slow API: the call takes the delay and still succeeds.
    neutron_proxy.inject(
        Rule::new("GET", "/security-groups/").times(1),
        Fault::Delay(Duration::from_millis(800)),
    );
    let t = Instant::now();
    let _: Value = neutron::security_group::get::Request::builder()
        .id(sg_id.as_str())
        .build()?
        .query_async(client)
        .await?;
    ensure!(
        t.elapsed() >= Duration::from_millis(800),
        "the delay was not applied"
    );

    // A dropped connection is a transport error, not an HTTP status.
    neutron_proxy.inject(Rule::new("GET", "/networks").times(1), Fault::Drop);
    let err = neutron::network::list::Request::builder()
        .build()?
        .query_async(client)
        .await
        .map(|_: Vec<Value>| ())
        .expect_err("connection dropped");
    ensure!(
        api_status(&err).is_none(),
        "a dropped connection must not look like an HTTP answer: {err}"
    );

    // Nova: 413 over limit on a server group, 503 on a server create.
    nova_proxy.inject(
        Rule::new("POST", "/os-server-groups").times(1),
        Fault::over_limit("Quota exceeded, too many server groups."),
    );
    let err = nova::server_group::create_264::Request::builder()
        .server_group(
            nova::server_group::create_264::ServerGroupBuilder::default()
                .name("fault-proxy-group")
                .policy(nova::server_group::create_264::Policy::AntiAffinity)
                .build()?,
        )
        .build()?
        .query_async(client)
        .await
        .map(|_: Value| ())
        .expect_err("413 injected");
    ensure!(api_status(&err) == Some(413), "expected 413, got {err}");

    nova_proxy.inject(Rule::new("POST", "/servers").times(1), Fault::unavailable());
    use nova::server::create_294::{NetworksBuilder, ServerBuilder, ServerNetworks};
    let err = nova::server::create_294::Request::builder()
        .server(
            ServerBuilder::default()
                .name("fault-proxy-vm")
                .flavor_ref(info.flavor_id.as_str())
                .image_ref(info.image_id.as_str())
                .networks(ServerNetworks::F1(vec![NetworksBuilder::default()
                    .uuid(Cow::from(info.network_id.as_str()))
                    .build()?]))
                .build()?,
        )
        .build()?
        .query_async(client)
        .await
        .map(|_: Value| ())
        .expect_err("503 injected");
    ensure!(api_status(&err) == Some(503), "expected 503, got {err}");
    ensure!(
        nova_proxy.injected_count() == 2,
        "nova proxy: {:?}",
        nova_proxy.seen()
    );

    ignore(
        neutron::security_group::delete::Request::builder()
            .id(sg_id.as_str())
            .build()?,
    )
    .query_async(client)
    .await
    .context("deleting the security group through the proxy")?;
    Ok(())
}

/// Nova behind a proxy the way the controllers' sessions find it: authenticated through a second proxy in front of
/// Keystone whose tokens name the Nova proxy in the catalog. The SDK discovers Nova's microversions through the
/// proxy, so a request whose minimum is 2.0 goes out as Nova's minimum 2.1 (with [`FaultProxy::route`] it would go
/// out as 2.0 and get a 406); every Nova call passes the proxy; a create answered with an injected 500 after
/// forwarding is really there.
#[tokio::test]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn nova_behind_a_keystone_proxy_keeps_version_discovery() -> Result<()> {
    const GROUP: &str = "fault-proxy-forwarded";
    let env = TestEnv::load()?;
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test: the test project must be empty")?;
    let nova_proxy = FaultProxy::start("http://127.0.0.1:8774").await?;
    let keystone = FaultProxy::start("http://127.0.0.1:5000").await?;
    keystone.rewrite_responses("http://127.0.0.1:8774", &nova_proxy.url());
    let mut config = env.cloud_config(&env.info.cloud)?;
    config
        .auth
        .as_mut()
        .context("clouds.yaml without auth")?
        .auth_url = Some(format!("{}/v3", keystone.url()));
    let client = env.connect_with(&config).await?;

    let result = async {
        ensure!(
            keystone
                .seen()
                .iter()
                .any(|s| s.method == "POST" && s.path.contains("/auth/tokens")),
            "authentication did not go through the Keystone proxy: {:?}",
            keystone.seen()
        );
        let flavors: Vec<Value> = nova::flavor::list_20::Request::builder()
            .build()?
            .query_async(&client)
            .await
            .context("listing flavors through the Nova proxy (microversion negotiated)")?;
        ensure!(
            flavors
                .iter()
                .any(|f| f["id"] == env.info.flavor_id.as_str()),
            "the environment's flavor is listed: {flavors:?}"
        );
        ensure!(
            nova_proxy
                .seen()
                .iter()
                .any(|s| s.path.contains("/flavors") && s.status == Some(200)),
            "the call did not go through the Nova proxy: {:?}",
            nova_proxy.seen()
        );

        nova_proxy.inject(
            Rule::new("POST", "/os-server-groups").times(1),
            Fault::internal_error().after_forwarding(),
        );
        let err = nova::server_group::create_264::Request::builder()
            .server_group(
                nova::server_group::create_264::ServerGroupBuilder::default()
                    .name(GROUP)
                    .policy(nova::server_group::create_264::Policy::AntiAffinity)
                    .build()?,
            )
            .build()?
            .query_async(&client)
            .await
            .map(|_: Value| ())
            .expect_err("500 injected after forwarding");
        ensure!(api_status(&err) == Some(500), "expected 500, got {err}");
        anyhow::Ok(())
    }
    .await;

    // The group the client was told had failed exists: found (and removed) around the proxies.
    let groups: Vec<Value> = nova::server_group::list_20::Request::builder()
        .build()?
        .query_async(&direct)
        .await?;
    let ours: Vec<&Value> = groups.iter().filter(|g| g["name"] == GROUP).collect();
    for g in &ours {
        ignore(
            nova::server_group::delete::Request::builder()
                .id(g["id"].as_str().unwrap_or_default())
                .build()?,
        )
        .query_async(&direct)
        .await?;
    }
    let leaks = LeakCheck::new(&env).assert_clean(&direct).await;
    result?;
    ensure!(
        ours.len() == 1,
        "the forwarded create made exactly one group: {ours:?}"
    );
    leaks
}
