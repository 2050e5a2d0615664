//! `cargo xtask chart`: regenerates the plain manifests `deploy/cloud-controller.yaml` and
//! `deploy/openstack-controller.yaml` from the Helm chart `deploy/helm/xdp-lb` with the pinned helm.
//!
//! How they are rendered is written once, in `lb-controller/tests/chart.rs`, whose drift test compares them with
//! `helm template` and, with `UPDATE_MANIFESTS=1`, writes them instead; this command runs that test so.

use crate::util::run;
use anyhow::Result;

pub fn render() -> Result<()> {
    let helm = crate::prereq::helm()?;
    run(
        crate::test::workspace_cargo(&[
            "test",
            "--exclude",
            "lb-testbed",
            "--test",
            "chart",
            "--",
            "plain_manifests",
        ])
        .env("HELM_BIN", &helm)
        .env("UPDATE_MANIFESTS", "1"),
        "rendering deploy/*.yaml from the chart (lb-controller/tests/chart.rs)",
    )?;
    eprintln!(
        "deploy/cloud-controller.yaml and deploy/openstack-controller.yaml rendered with {}; \
         `export HELM_BIN={0}` to run the chart tests by hand",
        helm.display()
    );
    Ok(())
}
