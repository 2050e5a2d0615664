//! The agent's config file and the LoadBalancer-to-config path: any YAML is parsed without panicking, and a
//! parsed one is validated without panicking; a refusal names a field.
#![no_main]

use lb_agent::source::config::{desired, LocalConfig};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // As the agent reads its file (an unknown key at any depth is refused).
    let Ok(cfg) = LocalConfig::parse(text) else {
        return;
    };
    if let Err(e) = desired(
        &cfg.named_vips(),
        &cfg.named_snat(),
        &cfg.ports,
        &cfg.endpoints,
        &cfg.options,
        cfg.health_check.clone(),
        true,
    ) {
        let msg = format!("{e:#}");
        assert!(
            msg.contains('.') || msg.contains(':'),
            "a refusal names the field: {msg}"
        );
    }
});
