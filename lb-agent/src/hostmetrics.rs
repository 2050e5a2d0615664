//! The VM's own health numbers that yawol reports per machine: load averages, CPUs, memory, steal time.

use std::collections::BTreeMap;

/// A snapshot, keyed by yawol's metric names.
pub fn read() -> BTreeMap<&'static str, f64> {
    let mut m = BTreeMap::new();
    if let Ok(s) = std::fs::read_to_string("/proc/loadavg") {
        let mut it = s
            .split_whitespace()
            .map(|x| x.parse::<f64>().unwrap_or(0.0));
        m.insert("load1", it.next().unwrap_or(0.0));
        m.insert("load5", it.next().unwrap_or(0.0));
        m.insert("load15", it.next().unwrap_or(0.0));
    }
    m.insert(
        "numCPU",
        std::thread::available_parallelism().map_or(1, |n| n.get()) as f64,
    );
    if let Ok(s) = std::fs::read_to_string("/proc/meminfo") {
        for (key, name) in [
            ("MemTotal:", "memTotal"),
            ("MemFree:", "memFree"),
            ("MemAvailable:", "memAvailable"),
        ] {
            if let Some(v) = meminfo_kib(&s, key) {
                m.insert(name, v as f64);
            }
        }
    }
    if let Ok(s) = std::fs::read_to_string("/proc/stat") {
        if let Some(steal) = steal_ticks(&s) {
            m.insert("stealTime", steal as f64);
        }
    }
    m
}

fn meminfo_kib(s: &str, key: &str) -> Option<u64> {
    s.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// Steal time in clock ticks from the aggregate `cpu` line (8th value).
fn steal_ticks(s: &str) -> Option<u64> {
    let line = s.lines().find(|l| l.starts_with("cpu "))?;
    line.split_whitespace().nth(8)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_formats() {
        assert_eq!(
            meminfo_kib("MemTotal:       24000000 kB\nMemFree: 1 kB\n", "MemFree:"),
            Some(1)
        );
        assert_eq!(
            steal_ticks("cpu  10 0 20 30 40 0 5 77 0 0\ncpu0 1 2 3\n"),
            Some(77)
        );
        let m = read();
        for k in [
            "load1",
            "load5",
            "load15",
            "numCPU",
            "memTotal",
            "memAvailable",
            "stealTime",
        ] {
            assert!(m.contains_key(k), "{k} missing");
        }
    }
}
