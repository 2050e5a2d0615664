#!/bin/sh
# The data plane's scaling sweep on a machine with no compiler or package manager (root, kernel with BTF).
#
#   benches/sweep.sh pack [DIR]   on the build machine, from the repository root: builds the benchmark and its
#                                 eBPF object and puts them, with this script, into DIR (default target/sweep);
#                                 copy DIR to the other machine.
#   ./sweep.sh run [ARGS]         there, in DIR: `bench-dataplane --sweep` (1, 2, 4, … threads up to the CPUs
#                                 present; ARGS are passed on, e.g. --runs 5 --sweeps 4: on a virtual machine one
#                                 sweep is not enough, see scaling.rs) with the machine's description; prints the
#                                 table and leaves results/ (JSON, uname, CPU list) beside the script.
#   ./bench-dataplane --combine A.json B.json …   the medians of sweeps run separately, as one table.
#
# The sweep needs no `ip`, `ethtool` or network namespace: BPF_PROG_TEST_RUN only, no map pinned.
set -eu

case "${1:-}" in
pack)
    [ -f benches/sweep.sh ] || { echo "sweep.sh pack: run it from the repository root" >&2; exit 1; }
    out="${2:-target/sweep}"
    cargo xtask build-ebpf
    cargo build --release -p lb-benches --bin bench-dataplane
    mkdir -p "$out"
    cp target/release/bench-dataplane target/bpf/lb-bench.o "$out/"
    cp "$0" "$out/sweep.sh"
    echo "packed into $out: $(ls "$out" | tr '\n' ' ')"
    ;;
run)
    shift
    cd "$(dirname "$0")"
    [ "$(id -u)" = 0 ] || { echo "sweep.sh run: needs root (BPF_PROG_TEST_RUN)" >&2; exit 1; }
    mkdir -p results
    { uname -a; nproc; grep -m1 'model name' /proc/cpuinfo || true; } > results/machine.txt
    LB_BENCH_OUT="$PWD/results" ./bench-dataplane --object ./lb-bench.o --sweep "$@" | tee results/sweep.txt
    ;;
*)
    sed -n '2,13p' "$0" >&2
    exit 2
    ;;
esac
