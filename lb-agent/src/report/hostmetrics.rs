//! The VM's own health numbers, as yawollet writes them to `LoadBalancerMachine.status.metrics`
//! (yawol `internal/hostmetrics`, gopsutil on Linux): same names, units and text, so dashboards and the
//! controller's `loadbalancermachine{type=…}` gauge read the same numbers whichever agent runs on the VM.
//!
//! | name | unit | text | source |
//! |---|---|---|---|
//! | `load1`, `load5`, `load15` | load average | two decimals (`0.50`) | `/proc/loadavg` |
//! | `uptime` | seconds | integer | `/proc/uptime`, rounded up like sysinfo(2) |
//! | `memTotal`, `memFree`, `memAvailable` | bytes | integer | `/proc/meminfo` (kB × 1024) |
//! | `stealTime` | seconds | two decimals | `/proc/stat`, aggregate `cpu` line, ticks / `CLK_TCK` |
//! | `numCPU` | CPUs | integer | CPUs the process may run on (Go's `runtime.NumCPU`) |

use std::collections::BTreeMap;

/// How yawol writes a value: `strconv.FormatFloat(v, 'f', 2, 64)` or `strconv.FormatUint` / `Itoa`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    TwoDecimals,
    Integer,
}

/// yawol's host metrics in the order yawollet appends them (`helper.GetMetrics`), with their text format.
const YAWOL: [(&str, Format); 9] = [
    ("load1", Format::TwoDecimals),
    ("load5", Format::TwoDecimals),
    ("load15", Format::TwoDecimals),
    ("uptime", Format::Integer),
    ("memTotal", Format::Integer),
    ("memFree", Format::Integer),
    ("memAvailable", Format::Integer),
    ("stealTime", Format::TwoDecimals),
    ("numCPU", Format::Integer),
];

/// A snapshot keyed by yawol's names, in yawol's units (also served as `lb_host{name}`). A source that cannot be
/// read or parsed leaves its metrics out, as yawollet does.
pub fn read() -> BTreeMap<&'static str, f64> {
    let file = |path: &str| std::fs::read_to_string(path).ok();
    let mut m = BTreeMap::new();
    if let Some([l1, l5, l15]) = file("/proc/loadavg").as_deref().and_then(loadavg) {
        m.extend([("load1", l1), ("load5", l5), ("load15", l15)]);
    }
    if let Some(s) = file("/proc/uptime").as_deref().and_then(uptime_seconds) {
        m.insert("uptime", s as f64);
    }
    if let Some(s) = file("/proc/meminfo") {
        m.extend(memory_bytes(&s).map(|(k, v)| (k, v as f64)));
    }
    if let Some(s) = file("/proc/stat")
        .as_deref()
        .and_then(|s| steal_seconds(s, clock_ticks()))
    {
        m.insert("stealTime", s);
    }
    m.insert("numCPU", num_cpu() as f64);
    m
}

/// The `(type, value)` entries of `LoadBalancerMachine.status.metrics` for a [`read`] snapshot, in yawol's order
/// and text (`0.50`, `8589934592`); names the snapshot lacks are left out.
pub fn yawol_metrics(host: &BTreeMap<&'static str, f64>) -> Vec<(String, String)> {
    YAWOL
        .iter()
        .filter_map(|&(name, format)| {
            let v = *host.get(name)?;
            let text = match format {
                Format::TwoDecimals => format!("{v:.2}"),
                Format::Integer => format!("{v:.0}"),
            };
            Some((name.to_string(), text))
        })
        .collect()
}

/// load1, load5, load15 from `/proc/loadavg` (all or nothing, as gopsutil).
fn loadavg(s: &str) -> Option<[f64; 3]> {
    let mut it = s.split_whitespace().map(str::parse::<f64>);
    Some([it.next()?.ok()?, it.next()?.ok()?, it.next()?.ok()?])
}

/// Whole seconds since boot. gopsutil takes sysinfo(2)'s `uptime`, which the kernel rounds up from the same
/// boot-time clock `/proc/uptime` prints in hundredths; rounding that up gives the same number.
fn uptime_seconds(s: &str) -> Option<u64> {
    let secs: f64 = s.split_whitespace().next()?.parse().ok()?;
    (secs >= 0.0).then(|| secs.ceil() as u64)
}

/// memTotal, memFree, memAvailable in bytes: `/proc/meminfo` says "kB" but means KiB, and gopsutil multiplies by
/// 1024.
fn memory_bytes(s: &str) -> impl Iterator<Item = (&'static str, u64)> + '_ {
    [
        ("MemTotal:", "memTotal"),
        ("MemFree:", "memFree"),
        ("MemAvailable:", "memAvailable"),
    ]
    .into_iter()
    .filter_map(move |(key, name)| {
        let kib: u64 = s
            .lines()
            .find_map(|l| l.strip_prefix(key))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        Some((name, kib * 1024))
    })
}

/// Steal time of all CPUs in seconds: the aggregate `cpu` line's 8th value (clock ticks) divided by `ticks_per_sec`.
fn steal_seconds(s: &str, ticks_per_sec: f64) -> Option<f64> {
    let line = s.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: f64 = line.split_whitespace().nth(8)?.parse().ok()?;
    Some(ticks / ticks_per_sec)
}

/// `/proc/stat`'s tick rate (USER_HZ); 100 if sysconf does not know, as gopsutil assumes.
fn clock_ticks() -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// CPUs in this process's affinity mask, like Go's `runtime.NumCPU`. Rust's `available_parallelism` would also
/// apply cgroup CPU quotas, which yawol's number does not.
fn num_cpu() -> usize {
    match crate::cpus::allowed().len() {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Fixed /proc texts (a 2-vCPU, 8 GiB VM).
    const LOADAVG: &str = "0.50 0.05 1.00 2/187 1234\n";
    const UPTIME: &str = "350735.47 690465.95\n";
    const MEMINFO: &str = "MemTotal:        8388608 kB\nMemFree:         1048576 kB\n\
                           MemAvailable:    4194304 kB\nBuffers:           65536 kB\n";
    const STAT: &str = "cpu  4705 150 1120 16250 520 0 35 77 0 0\n\
                        cpu0 2350 75 560 8125 260 0 20 40 0 0\nintr 1 2 3\n";

    fn fixed() -> BTreeMap<&'static str, f64> {
        let mut m = BTreeMap::new();
        let [l1, l5, l15] = loadavg(LOADAVG).unwrap();
        m.extend([("load1", l1), ("load5", l5), ("load15", l15)]);
        m.insert("uptime", uptime_seconds(UPTIME).unwrap() as f64);
        m.extend(memory_bytes(MEMINFO).map(|(k, v)| (k, v as f64)));
        m.insert("stealTime", steal_seconds(STAT, 100.0).unwrap());
        m.insert("numCPU", 2.0);
        m
    }

    /// Names, order, units and text exactly as yawollet writes them for the same /proc contents.
    #[test]
    fn yawol_names_units_and_text() {
        let want: Vec<(String, String)> = [
            ("load1", "0.50"),
            ("load5", "0.05"),
            ("load15", "1.00"),
            ("uptime", "350736"),
            ("memTotal", "8589934592"),
            ("memFree", "1073741824"),
            ("memAvailable", "4294967296"),
            ("stealTime", "0.77"),
            ("numCPU", "2"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(yawol_metrics(&fixed()), want);
    }

    #[test]
    fn parses_proc_formats() {
        assert_eq!(loadavg(LOADAVG), Some([0.5, 0.05, 1.0]));
        assert_eq!(loadavg("0.10 0.20\n"), None);
        // Whole seconds, rounded up like sysinfo(2); an exact second stays.
        assert_eq!(uptime_seconds(UPTIME), Some(350736));
        assert_eq!(uptime_seconds("12.00 3.00\n"), Some(12));
        assert_eq!(uptime_seconds(""), None);
        // kB in /proc/meminfo are KiB.
        assert_eq!(
            memory_bytes("MemTotal: 1 kB\nMemFree: 2 kB\n").collect::<Vec<_>>(),
            [("memTotal", 1024), ("memFree", 2048)]
        );
        // The aggregate line, not cpu0; 12345 ticks at USER_HZ 100 are 123.45 s.
        assert_eq!(steal_seconds(STAT, 100.0), Some(0.77));
        assert_eq!(
            steal_seconds("cpu  1 2 3 4 5 6 7 12345 0 0\n", 100.0),
            Some(123.45)
        );
        assert_eq!(steal_seconds("cpu  1 2 3\n", 100.0), None);
    }

    #[test]
    fn text_matches_go_formatting() {
        let m = BTreeMap::from([
            ("load1", 0.0),
            ("load5", 12.345_678),
            ("stealTime", 123_456.7),
            ("memTotal", 1_099_511_627_776.0),
        ]);
        let got = yawol_metrics(&m);
        assert_eq!(
            got,
            [
                ("load1".to_string(), "0.00".to_string()),
                ("load5".to_string(), "12.35".to_string()),
                ("memTotal".to_string(), "1099511627776".to_string()),
                ("stealTime".to_string(), "123456.70".to_string()),
            ]
        );
    }

    /// On this machine: every metric is there and in range.
    #[test]
    fn reads_this_host() {
        let m = read();
        for (k, _) in YAWOL {
            assert!(m.contains_key(k), "{k} missing");
        }
        assert!(m["memTotal"] >= m["memAvailable"] && m["memTotal"] > 1e8);
        assert!(m["uptime"] >= 1.0);
        assert!(m["numCPU"] >= 1.0);
        assert_eq!(clock_ticks(), 100.0);
    }
}
