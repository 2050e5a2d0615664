//! A 60 s outage of the control cluster's API server under the whole OpenStack-side cascade against the real
//! OpenStack of `cargo xtask openstack up` (`cascade::Cascade`: the controllers as the binary starts them,
//! under `deploy/openstack-controller.yaml`'s RBAC with a real token; the agents played with their VMs' kubeconfig,
//! trying to report through the outage). A LoadBalancer with two ready machines loses nothing: Nova creates and
//! deletes no server during the outage nor after it, no machine is marked, deleted or replaced, the controllers keep
//! running; the agents report again with their own tokens once the server is back, and a scale-up written after the
//! outage reaches Nova. The API server refuses the controllers and agents nothing (no 401 or 403), except while it
//! starts again: they reach it as soon as it listens, and it answers 403 until its authorizer's and admission's caches
//! have synced (seen: an agent's status patch in that second); those are printed and tolerated, the clients retry
//! them. That window ends when `restart_apiserver` returns, which is when a ServiceAccount's requests are served (not
//! when `/readyz` says ok: a 403 after that failed this test); any refusal after it fails the test.
//!
//! The fake-cloud twin of this test (`openstack_controllers_api_outage.rs`, with the controllers' call counters of
//! the in-memory cloud) runs in the unit stage; this one proves the same against the real cloud and with the
//! credentials of a real deployment. Its own API server (`KubeEnv::start`): it is stopped.
//!
//! `#[ignore]`d like the other real-OpenStack tests: the `openstack` stage of `cargo xtask test` runs it with
//! `--ignored --test-threads=1`. By hand: `cargo xtask openstack up && cargo test --workspace --exclude lb-testbed
//! --test openstack_cascade_api_outage -- --ignored --nocapture` (prints timings).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{ensure, Context, Result};
use kube_testenv::KubeEnv;
use lb_api::constants::conditions;
use lb_controller::metrics::Metrics;
use lb_controller::openstack::clouds::SecretClouds;
use lb_test_support::cascade::{
    self, connect, finish, lb_json, ready, servers_named, wait_for, Cascade, CascadeConfig,
    CALL_TIMEOUT, STEP,
};
use openstack_testenv::{LeakCheck, TestEnv};
use serde_json::json;

const OUTAGE: Duration = Duration::from_secs(60);

/// The controllers' Nova server calls of `operation` (`create`, `delete`) so far, from their `yawol_openstack`
/// counter.
fn nova_server_calls(c: &Cascade, operation: &str) -> u64 {
    let wanted = [
        r#"api="nova""#,
        r#"object="server""#,
        &format!(r#"operation="{operation}""#),
    ];
    c.metrics
        .encode()
        .lines()
        .filter(|l| l.starts_with("yawol_openstack{") && wanted.iter().all(|w| l.contains(w)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// The ids of Nova's servers named `prefix…`, sorted.
async fn nova_ids(
    env: &TestEnv,
    direct: &openstack_sdk::AsyncOpenStack,
    prefix: &str,
) -> Result<Vec<String>> {
    let mut ids: Vec<String> = servers_named(env, direct, prefix)
        .await?
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    ids.sort();
    Ok(ids)
}

/// Names of the live machines of `lb`, sorted.
fn live_machines(c: &Cascade, lb: &str) -> Vec<String> {
    c.machines_of(lb)
        .iter()
        .filter(|m| m["metadata"]["deletionTimestamp"].is_null())
        .map(cascade::name_of)
        .collect()
}

/// Whether every live machine of `lb` has a heartbeat written after `since`.
fn heartbeats_since(c: &Cascade, lb: &str, since: jiff::Timestamp) -> bool {
    let machines: Vec<_> = c
        .machines_of(lb)
        .into_iter()
        .filter(|m| m["metadata"]["deletionTimestamp"].is_null())
        .collect();
    !machines.is_empty()
        && machines.iter().all(|m| {
            m["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|cond| cond["type"] == conditions::DATAPLANE_READY)
                .filter_map(|cond| cond["lastHeartbeatTime"].as_str()?.parse().ok())
                .any(|t: jiff::Timestamp| t > since)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the OpenStack test environment (cargo xtask openstack up); run by the openstack stage"]
async fn a_minute_without_the_api_server_changes_nothing_in_openstack() -> Result<()> {
    const LB: &str = "csc-outage";
    let env = TestEnv::load()?;
    let cloud = connect(&env, &[]).await?;
    let direct = env.connect().await?;
    LeakCheck::new(&env)
        .assert_clean(&direct)
        .await
        .context("before the test")?;
    let kube = KubeEnv::start().await?;
    let metrics = Arc::new(Metrics::new());
    let calls = metrics.openstack_calls.clone();
    let c = Cascade::start(
        &kube,
        &env,
        metrics,
        CascadeConfig::default(),
        move |client| SecretClouds::new(client, CALL_TIMEOUT, calls),
    )
    .await?;
    let prefix = format!("{LB}-");
    let scenario = async {
        c.create_lb(lb_json(&env, &c.ns, LB, 2, json!({}))).await?;
        let (_, active) = ready(&c, LB, 1, 2).await?;
        // Settled: the set has what it wants and Nova agrees.
        let mut servers: Vec<String> = active.iter().map(|(_, s)| s.clone()).collect();
        servers.sort();
        wait_for("Nova lists the two servers", STEP, || async {
            Ok(nova_ids(&env, &direct, &prefix).await? == servers)
        })
        .await?;
        let machines = live_machines(&c, LB);
        let (created, deleted) = (
            nova_server_calls(&c, "create"),
            nova_server_calls(&c, "delete"),
        );

        // The outage; Nova is looked at every 5 s throughout.
        let stopped_at = SystemTime::now();
        kube.stop_apiserver();
        let t0 = Instant::now();
        while t0.elapsed() < OUTAGE {
            let now = nova_ids(&env, &direct, &prefix).await?;
            ensure!(
                now == servers,
                "Nova's servers changed {:.0}s into the outage: {now:?}, before {servers:?}",
                t0.elapsed().as_secs_f64()
            );
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        let back = jiff::Timestamp::now();
        kube.restart_apiserver().await?;
        let t_back = Instant::now();
        // The restarted API server serves requests before it is ready, and until its caches have synced it refuses
        // them: those are the only refusals tolerated (the clients retry them like any error). `restart_apiserver`
        // returned once a ServiceAccount is served; everything refused later counts.
        let starting = c.refusals.take_between(stopped_at, SystemTime::now());
        for r in &starting {
            eprintln!("refused while the API server started (tolerated): {r}");
        }

        // The agents report again with their own tokens, and the test's watch has relisted.
        c.wait("fresh heartbeats after the outage", STEP, |c| {
            heartbeats_since(c, LB, back)
        })
        .await?;
        let t_heartbeats = t_back.elapsed();

        // Working again: a scale-up reaches Nova.
        c.patch_lb(LB, json!({"spec": {"replicas": 3}})).await?;
        let (_, active3) = ready(&c, LB, 1, 3).await?;
        let t_scaled = t_back.elapsed();
        eprintln!(
            "timing: heartbeats {:.1}s and the scale-up's third server ACTIVE and ready {:.1}s after the restart",
            t_heartbeats.as_secs_f64(),
            t_scaled.as_secs_f64()
        );
        let now = nova_ids(&env, &direct, &prefix).await?;
        ensure!(
            now.len() == 3 && servers.iter().all(|s| now.contains(s)),
            "the two servers stay, one is added: {now:?}, before {servers:?}"
        );
        ensure!(
            active3.iter().all(|(_, s)| now.contains(s)),
            "the machines' servers are Nova's: {active3:?} vs {now:?}"
        );
        ensure!(
            (
                nova_server_calls(&c, "create"),
                nova_server_calls(&c, "delete")
            ) == (created + 1, deleted),
            "Nova server calls: one create (the scale-up), no delete"
        );
        let after = live_machines(&c, LB);
        ensure!(
            machines.iter().all(|m| after.contains(m)) && after.len() == 3,
            "the machines stay, one is added: {after:?}, before {machines:?}"
        );
        let marked: Vec<_> = ["MachineMarkedForDeletion", "MachineDeleted"]
            .iter()
            .flat_map(|reason| c.events_of("LoadBalancerSet", reason))
            .collect();
        ensure!(
            marked.is_empty()
                && !c
                    .metrics
                    .encode()
                    .contains("lb_cloud_controller_machine_deletions_total{"),
            "no machine marked or deleted: {marked:?}"
        );
        ensure!(
            c.controllers_running()
                && !c
                    .health
                    .failed
                    .load(std::sync::atomic::Ordering::SeqCst),
            "the controllers keep running"
        );

        let t_delete = c.delete_lb(LB, STEP).await?;
        eprintln!("timing: deletion {:.2}s", t_delete.as_secs_f64());
        anyhow::Ok(())
    }
    .await;
    let cleanup = c.stop().await;
    finish(&env, &cloud, &direct, scenario, cleanup).await
}
