//! yawol's `cloudprovider.conf` (user-supplied text in the LoadBalancer's credentials Secret): any text is
//! parsed without panicking; a refusal says which file and what; an accepted one has the fields the
//! OpenStack client needs and becomes its configuration.
#![no_main]

use lb_controller::openstack::config::CloudProviderConf;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match CloudProviderConf::parse(&text) {
        Err(e) => {
            let msg = format!("{e:#}");
            assert!(msg.starts_with("cloudprovider.conf"), "{msg}");
        }
        Ok(conf) => {
            assert!(
                !conf.auth_url.is_empty() && !conf.username.is_empty() && !conf.password.is_empty()
            );
            assert!(conf.project_id.is_some() || conf.project_name.is_some());
            let override_id = data.first().filter(|b| **b % 2 == 1).map(|_| "override");
            conf.to_cloud_config(override_id)
                .expect("an accepted cloudprovider.conf makes a client configuration");
        }
    }
});
