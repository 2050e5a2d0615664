//! What keepalived writes (notify lines, its data dump, its stats file): parsed without panicking, whatever it
//! says.
#![no_main]

use lb_agent::ha::vrrp::parse::{parse_data_state, parse_notify_line, VrrpStats};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for line in text.lines() {
        let _ = parse_notify_line(line);
    }
    let _ = parse_data_state(&text, "lb");
    let _ = VrrpStats::parse(&text, "lb", data.first().is_some_and(|b| b % 2 == 1));
});
