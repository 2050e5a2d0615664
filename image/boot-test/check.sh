#!/bin/sh
# In-VM half of `cargo xtask image boot-test` (never part of the image: the test's vendor-data, or its part of
# the user data from the metadata service, installs it under /run and starts it once cloud-init is done). Prints
# `LB-IMAGE-CHECK key=value` lines on the serial console; the xtask judges them. Then powers the VM off.
#
# Environment (set by the xtask): USER_DATA — whose user data the VM booted with: `lb-controller` (then
# FILE_VIP, FILE_SNAT, ECHO_PORT: the file-mode data-plane check, clients on eth1, the backend behind eth2;
# CHECK_PROGRAMS=1: `lb-agent --check-programs`) or
# `yawol` (then VIP: the LoadBalancer's VIP on eth0, REQUEUE: yawollet's requeue time); TRAFFIC_FLOWS —
# connections the xtask opens on `traffic=go`.
set -u
out() { printf 'LB-IMAGE-CHECK %s=%s\n' "$1" "$2" >/dev/ttyS0; }
info() { printf 'LB-IMAGE-INFO %s\n' "$*" >/dev/ttyS0; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }
# GET http://127.0.0.1:PORT/PATH: "<status> <first line of the body>", "0 <error>" when nothing answers.
http_get() {
    python3 - "$1" "$2" <<'EOF'
import sys, urllib.request, urllib.error
try:
    r = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}{sys.argv[2]}", timeout=3)
    print(r.status, r.read().decode(errors="replace"))
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode(errors="replace"))
except Exception as e:
    print(0, e)
EOF
}
# A unit's log this boot, without the colours of the agent's text log format.
log_of() { journalctl -b -u "$1" --no-pager 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g'; }
# The sum over NIC's queues of a virtio-net counter (`ethtool -S`, which the image lacks, through the ioctl):
# DIR rx or tx, NAME e.g. xdp_redirects — rx_queue_0_xdp_redirects on 6.1, rx0_xdp_redirects on newer kernels.
nic_stat() {
    python3 - "$1" "$2" "$3" <<'EOF'
import array, fcntl, re, socket, struct, sys
ifname, direction, name = sys.argv[1:4]
def ethtool(buf):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fcntl.ioctl(s.fileno(), 0x8946, struct.pack("16sP", ifname.encode(), buf.buffer_info()[0]) + bytes(16))
try:
    info = array.array("B", struct.pack("I", 0x03) + bytes(192))  # ETHTOOL_GDRVINFO: n_stats at 180
    ethtool(info)
    n = struct.unpack_from("I", info, 180)[0]
    names = array.array("B", struct.pack("III", 0x1B, 1, n) + bytes(32 * n))  # ETHTOOL_GSTRINGS, ETH_SS_STATS
    ethtool(names)
    values = array.array("B", struct.pack("II", 0x1D, n) + bytes(8 * n))  # ETHTOOL_GSTATS
    ethtool(values)
    want = re.compile(rf"{direction}(_queue_)?[0-9]+_{name}")
    print(sum(struct.unpack_from("Q", values, 8 + 8 * i)[0] for i in range(n)
              if want.fullmatch(names[12 + 32 * i:44 + 32 * i].tobytes().split(b"\0")[0].decode())))
except OSError as e:
    print(f"error: {e}")
EOF
}
# Seconds since boot of the first journal line of UNIT matching PATTERN (empty if none).
journal_mono() {
    journalctl -b -u "$1" -o short-monotonic --no-pager 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | grep -m1 -- "$2" |
        sed -n 's/^\[ *\([0-9.]*\)\].*/\1/p'
}

out stage start
out uptime_at_start "$(uptime_s)"
cloud-init status --wait >/dev/null 2>&1
out kernel "$(uname -r)"

# cloud-init: finished, no errors, from the expected datasource (the NoCloud seed, or Ec2 when the xtask serves a
# metadata service instead), and which datasources ds-identify left for it to try.
out cloud_init_status "$(cloud-init status 2>/dev/null | sed -n 's/^status: //p')"
python3 - >/dev/ttyS0 <<'EOF'
import json
r = json.load(open("/run/cloud-init/result.json"))["v1"]
print(f"LB-IMAGE-CHECK cloud_init_errors={len(r.get('errors', []))}")
print(f"LB-IMAGE-CHECK cloud_init_datasource={(r.get('datasource') or 'none').split()[0]}")
for e in r.get("errors", [])[:10]:
    print(f"LB-IMAGE-INFO cloud-init error: {e}")
EOF
out ds_identify "$(sed -n 's/^datasource_list: *\[\(.*\)\]/\1/p' /run/cloud-init/cloud.cfg 2>/dev/null | tr -d ' ')"
# Two warnings are known and harmless, both of the Ec2 datasource on Nova (counted apart; the xtask wants none with
# the NoCloud seed): Nova's EC2 metadata has no 'network' key, so cloud-init keeps its fallback configuration
# (DHCP on eth0, as in the local stage), and as a network-stage datasource it applies that again and ifup says
# eth0 is up already.
known1="Metadata 'network' key not valid: None"
known2='ifup: interface eth0 already configured'
out cloud_init_warnings "$(grep 'WARNING' /var/log/cloud-init.log | grep -c -v -F -e "$known1" -e "$known2")"
out cloud_init_known_warnings "$(grep 'WARNING' /var/log/cloud-init.log | grep -c -F -e "$known1" -e "$known2")"
grep 'WARNING' /var/log/cloud-init.log | head -5 | while IFS= read -r l; do info "cloud-init: $l"; done

# Image properties.
out nic_eth0 "$(test -e /sys/class/net/eth0 && echo 1 || echo 0)"
out btf "$(test -s /sys/kernel/btf/vmlinux && echo 1 || echo 0)"
out bpffs "$(findmnt -n -t bpf -o TARGET /sys/fs/bpf >/dev/null && echo 1 || echo 0)"
out keepalived "$(command -v keepalived >/dev/null && keepalived --version 2>&1 | sed -n '1s/^Keepalived v\{0,1\}\([^ ]*\).*/\1/p' || echo missing)"
out keepalived_unit "$(systemctl is-enabled keepalived.service 2>/dev/null)"
out keepalived_unit_active "$(systemctl is-active keepalived.service 2>/dev/null)"
out bird "$(command -v bird >/dev/null && bird --version 2>&1 | sed -n '1s/^BIRD version \([^ ]*\).*/\1/p' || echo missing)"
out bird_unit "$(systemctl is-enabled bird.service 2>/dev/null)"
out bird_unit_active "$(systemctl is-active bird.service 2>/dev/null)"
out sshd_active "$(systemctl is-active ssh.service 2>/dev/null)"
out sshd_enabled "$(systemctl is-enabled ssh.service 2>/dev/null)"
out sshd_processes "$(pgrep -c -x sshd)"
out ssh_host_keys "$(ls /etc/ssh/ssh_host_*_key 2>/dev/null | wc -l)"
out root_password "$(passwd -S root | cut -d' ' -f2)"
out machine_id "$(test -s /etc/machine-id && echo generated || echo empty)"
out chrony "$(systemctl is-active chrony.service)"
out root_fs_mib "$(df -m --output=size / | tail -1 | tr -d ' ')"
out failed_units "$(systemctl --failed --no-legend --plain | cut -d' ' -f1 | paste -sd, -)"

# lb-controller's user data: its files, lb-agent.service retrying an API server that does not exist, and the
# data plane for real through a second agent in file mode on eth1 and eth2.
lb_controller_checks() {
    # Every program of the data plane through this kernel's verifier (the agents here attach only the fast XDP
    # ones): the TC programs and `lbctl trace`'s too, by the agent's own preflight. A line per program, then the
    # refused ones' errors with the end of their verifier logs.
    if [ "$CHECK_PROGRAMS" = 1 ]; then
        started=$(uptime_s)
        /usr/local/bin/lb-agent --check-programs >/run/lb-image-check-programs.txt 2>&1
        out programs_exit "$?"
        out programs_accepted "$(grep -c ' accepted$' /run/lb-image-check-programs.txt)"
        out programs_refused "$(sed -n 's/^\([a-z0-9_]*\) .* REFUSED$/\1/p' /run/lb-image-check-programs.txt | paste -sd, -)"
        info "lb-agent --check-programs took $(awk "BEGIN{print $(uptime_s) - $started}")s"
        grep -v -e ' accepted$' /run/lb-image-check-programs.txt | head -60 | while IFS= read -r l; do info "check-programs: $l"; done
    fi

    # The files of lb-controller's user data (cloudinit.rs), with mode and owner.
    for f in /etc/lb-agent/kubeconfig /etc/lb-agent/agent.env /etc/lb-agent/sync-secret \
        /etc/systemd/system/lb-agent.service /etc/chrony/chrony.conf; do
        out "file:$f" "$(stat -c '%a:%U:%G' "$f" 2>/dev/null || echo missing)"
    done
    out kubeconfig_server "$(sed -n 's/^ *server: *//p' /etc/lb-agent/kubeconfig)"
    # yawol compatibility stays out of the way: no /etc/yawol/env.conf, so yawollet.service is skipped.
    out yawollet_condition "$(systemctl show -p ConditionResult --value yawollet.service)"

    # The data plane for real, two-armed as a LoadBalancer with additionalNetworks: a second agent in file mode on
    # eth1 (the VIP, where the clients come from) and eth2 (another QEMU user network, where the backend is), a TCP
    # service whose backend is the host (the xtask's echo server) as reached through eth2 only — slirp's gateway
    # there, with this guest's eth2 address as the SNAT source (slirp forwards only its guest's own address). The
    # xtask opens TRAFFIC_FLOWS connections through eth1's port forward when it reads traffic=go: each crosses the
    # XDP program on eth1 and is redirected to eth2 (devmap), each reply crosses eth2's and is redirected back.
    # They must show up as flows in this agent's counters, and as XDP redirects in both NICs' counters.
    ip link set eth1 up && ip addr add "$FILE_VIP/24" dev eth1
    ip link set eth2 up && ip addr add "$FILE_SNAT/24" dev eth2
    # eth3: a multiqueue NIC (four queue pairs for two vCPUs: enough for native XDP to transmit on queues of its
    # own), no traffic: the agent attaches there too and reports its queues.
    ip link set eth3 up
    mkdir -p /run/lb-image-check
    cat >/run/lb-image-check/dataplane.yaml <<EOF
vip: $FILE_VIP
ports:
  - {name: echo, protocol: TCP, port: 80, nodePort: $ECHO_PORT}
endpoints:
  - {name: host, addresses: [${FILE_SNAT%.*}.2]}
healthCheck: {interval: 1s, timeout: 1s, unhealthyThreshold: 2, healthyThreshold: 1}
EOF
    systemd-run --quiet --unit=lb-agent-file /usr/local/bin/lb-agent --interface eth1,eth2,eth3 \
        --snat-address "$FILE_SNAT" --config /run/lb-image-check/dataplane.yaml --metrics-address 127.0.0.1:9101 \
        --max-flows 65536
    ready=0
    started=$(uptime_s)
    for _ in $(seq 120); do
        [ "$(http_get 9101 /readyz | cut -d' ' -f1)" = 200 ] && { ready=1; break; }
        sleep 0.5
    done
    out file_agent_ready "$ready"
    info "file-mode agent: ready=$ready after $(awk "BEGIN{print $(uptime_s) - $started}")s of polling"
    [ "$ready" = 1 ] || log_of lb-agent-file | tail -15 | while IFS= read -r l; do info "lb-agent-file: $l"; done
    # The mode each interface got (XdpNative; XdpGeneric when the driver refused native XDP), the hooks the agent
    # reports attached (lb_interface_attached as IFACE:HOOK, the hook "XDP" when native), and the programs the
    # kernel shows.
    for i in eth1 eth2 eth3; do
        out "file_agent_mode_$i" "$(log_of lb-agent-file | sed -n "s/.*data plane attached.*interface=$i mode=\([A-Za-z]*\).*/\1/p" | head -1)"
        out "xdp_on_$i" "$(ip -d link show "$i" | grep -q 'prog/xdp' && echo 1 || echo 0)"
    done
    # The SNAT ports the agent chose (`auto`) beside the image's kernel range for the host's own connections.
    out file_agent_snat_ports "$(log_of lb-agent-file | sed -n 's/.*SNAT ports \([0-9]*-[0-9]*\).*/\1/p' | head -1)"
    out kernel_port_range "$(sysctl -n net.ipv4.ip_local_port_range | tr -s '\t ' '-')"
    out file_agent_attached "$(http_get 9101 /metrics | sed -n 's/^lb_interface_attached{interface="\([^"]*\)",hook="\([^"]*\)"} 1$/\1:\2/p' | sort | paste -sd, -)"
    # Each NIC's queues and whether native XDP transmits under a lock there (IFACE:VALUE): eth1 and eth2 have one
    # queue pair for two vCPUs, so virtio-net shares it with XDP (its kernel log says so too); eth3 has four: the
    # stack transmits on two, XDP on the other two, all four receive.
    out file_agent_xdp_tx_locked "$(http_get 9101 /metrics | sed -n 's/^lb_interface_xdp_tx_locked{interface="\([^"]*\)"} \([0-9]*\)$/\1:\2/p' | sort | paste -sd, -)"
    out file_agent_rx_queues "$(http_get 9101 /metrics | sed -n 's/^lb_interface_queues{interface="\([^"]*\)",direction="rx"} \([0-9]*\)$/\1:\2/p' | sort | paste -sd, -)"
    # --connection-lru auto: per-CPU lists only where every interface has a receive queue per vCPU (eth1, eth2: one).
    # (A gauge without labels reads `name{} value`.)
    out file_agent_per_cpu_lists "$(http_get 9101 /metrics | sed -n 's/^lb_flow_table_per_cpu_lists[{}]* \([0-9]*\)$/\1/p')"
    dmesg | grep -i 'locked tx mode' | head -2 | while IFS= read -r l; do info "kernel: $l"; done
    ip -d link show eth2 | while IFS= read -r l; do info "eth2: $l"; done
    out traffic go
    out file_agent_flows "$(flows_counted 9101)"
    # Frames each way: client to backend (in on eth1, out of eth2) and back; XDP_REDIRECTs counted by virtio-net.
    out file_agent_client_packets "$(http_get 9101 /metrics | sed -n 's/^lb_client_packets_total{.*} \([0-9]*\)$/\1/p' | head -1)"
    out file_agent_backend_packets "$(http_get 9101 /metrics | sed -n 's/^lb_backend_packets_total{.*} \([0-9]*\)$/\1/p' | head -1)"
    out eth1_xdp_redirects "$(nic_stat eth1 rx xdp_redirects)"
    out eth2_xdp_redirects "$(nic_stat eth2 rx xdp_redirects)"
    out eth1_xdp_xmit "$(nic_stat eth1 tx xdp_tx)"
    out eth2_xdp_xmit "$(nic_stat eth2 tx xdp_tx)"
    log_of lb-agent-file | tail -5 | while IFS= read -r l; do info "lb-agent-file: $l"; done

    # lb-agent.service as cloud-init started it: the API server does not exist, so it must be up, attached to
    # eth0 and retrying the API — not restarting. Give it 20 s of running first.
    while [ "$(cut -d. -f1 /proc/uptime)" -lt "$(($(journal_mono lb-agent.service 'Kubernetes mode' | cut -d. -f1) + 20))" ]; do
        sleep 1
    done
    out agent_active "$(systemctl is-active lb-agent.service)"
    out agent_restarts "$(systemctl show -p NRestarts --value lb-agent.service)"
    out agent_started_at "$(journal_mono lb-agent.service 'Kubernetes mode')"
    out agent_dataplane_at "$(journal_mono lb-agent.service 'data plane attached')"
    out agent_mode "$(log_of lb-agent.service | sed -n 's/.*data plane attached.*mode=\([A-Za-z]*\).*/\1/p' | head -1)"
    out agent_api_retrying "$(log_of lb-agent.service | grep -c -e 'watch failed; retrying' -e 'writing the status failed')"
    out xdp_on_eth0 "$(ip -d link show eth0 | grep -q 'prog/xdp' && echo 1 || echo 0)"
    out agent_pinned "$(test -d /sys/fs/bpf/lb/eth0 && echo 1 || echo 0)"
    out agent_healthz "$(http_get 9100 /healthz)"
    out agent_readyz "$(http_get 9100 /readyz | cut -d' ' -f1)"
    log_of lb-agent.service | tail -5 | while IFS= read -r l; do info "lb-agent: $l"; done
}

# yawol-controller's user data, byte for byte (testenv/support/src/yawol.rs) with a real API server on
# the host: its files, its runcmd through the OpenRC shim, the agent started as yawollet reaching the API server,
# holding the VIP through keepalived, forwarding, and acting on ad-hoc debug access.
yawol_checks() {
    for f in /etc/chrony/chrony.conf /etc/yawol/kubeconfig /etc/keepalived/keepalived.conf \
        /var/lib/yawol/check_yawollet_health.sh /etc/promtail/promtail.yaml /etc/yawol/env.conf; do
        out "file:$f" "$(stat -c '%a:%U:%G' "$f" 2>/dev/null || echo missing)"
    done
    info "env.conf: $(cat /etc/yawol/env.conf)"
    # runcmd: eight OpenRC commands, each logged by the shim with its outcome.
    journalctl -b -t rc-service -o cat --no-pager | while IFS= read -r l; do info "shim: $l"; done
    out shim_calls "$(journalctl -b -t rc-service -o cat --no-pager | wc -l)"
    out shim_failures "$(journalctl -b -t rc-service -o cat --no-pager | grep -c ': failed (')"
    out lb_agent_unit "$(systemctl is-active lb-agent.service)"

    # The agent as yawollet: attached, keepalived (under it, from yawol's settings) holding the VIP.
    held=0
    for _ in $(seq 90); do
        ip -4 addr show dev eth0 | grep -q " $VIP/" && { held=1; break; }
        sleep 1
    done
    out vip_on_eth0 "$held"
    out yawollet_active "$(systemctl is-active yawollet.service)"
    out agent_started_at "$(journal_mono yawollet.service 'started as yawollet')"
    out agent_dataplane_at "$(journal_mono yawollet.service 'data plane attached')"
    out agent_mode "$(log_of yawollet.service | sed -n 's/.*data plane attached.*mode=\([A-Za-z]*\).*/\1/p' | head -1)"
    out xdp_on_eth0 "$(ip -d link show eth0 | grep -q 'prog/xdp' && echo 1 || echo 0)"
    conf=/run/lb-agent/vrrp/keepalived.conf
    out vrrp_router_id "$(sed -n 's/^ *virtual_router_id //p' $conf)"
    out vrrp_priority "$(sed -n 's/^ *priority //p' $conf)"
    out vrrp_advert_int "$(sed -n 's/^ *advert_int //p' $conf)"
    out vrrp_priority_bonus "$(cat /run/lb-agent/vrrp/priority-bonus 2>/dev/null)"
    out keepalived_under_agent "$(pgrep -c -f "keepalived .*$conf")"
    ready=0
    for _ in $(seq 60); do
        [ "$(http_get 8080 /readyz | cut -d' ' -f1)" = 200 ] && { ready=1; break; }
        sleep 1
    done
    out readyz_8080 "$(http_get 8080 /readyz | cut -d' ' -f1)"

    # Connections from the host to the VIP (QEMU's port forward on eth0), through the data plane to the host.
    out traffic go
    out agent_flows "$(flows_counted 8080)"
    traffic_done=$(cut -d. -f1 /proc/uptime)

    # Ad-hoc debug: the xtask has the LoadBalancer annotated, then the annotations removed.
    keys=/home/yawoldebug/.ssh/authorized_keys
    out adhoc on
    installed=0
    for _ in $(seq 60); do
        grep -q '^ssh-rsa ' $keys && [ "$(systemctl is-active ssh.service)" = active ] && { installed=1; break; }
        sleep 1
    done
    out adhoc_key_installed "$installed"
    out adhoc_sshd "$(systemctl is-active ssh.service)"
    out adhoc_keys_mode "$(stat -c '%a:%U:%G' $keys)"
    out adhoc off
    removed=0
    for _ in $(seq 60); do
        [ ! -s $keys ] && [ "$(systemctl is-active ssh.service)" != active ] && { removed=1; break; }
        sleep 1
    done
    out adhoc_key_removed "$removed"
    out adhoc_sshd_after "$(systemctl is-active ssh.service)"

    # Two heartbeats after the traffic, so the machine's status carries the flows; then the xtask reads it.
    while [ "$(cut -d. -f1 /proc/uptime)" -lt "$((traffic_done + 2 * REQUEUE + 2))" ]; do
        sleep 1
    done
    out yawollet_restarts "$(systemctl show -p NRestarts --value yawollet.service)"
    out agent_refused "$(log_of yawollet.service | grep -c -i -e forbidden -e unauthorized -e ' 403' -e ' 401')"
    log_of yawollet.service | grep -i -e forbidden -e unauthorized | head -3 | while IFS= read -r l; do info "refused: $l"; done
    log_of yawollet.service | grep -e WARN -e ERROR | head -8 | while IFS= read -r l; do info "yawollet: $l"; done
    out report go
}

# lb_upstream_cx_total of the agent whose metrics are on PORT, once it counts TRAFFIC_FLOWS (or after 60 s).
flows_counted() {
    flows=0
    for _ in $(seq 120); do
        flows=$(http_get "$1" /metrics | sed -n 's/^lb_upstream_cx_total{.*} \([0-9]*\)$/\1/p' | head -1)
        flows=${flows:-0}
        [ "$flows" -ge "$TRAFFIC_FLOWS" ] && break
        sleep 0.5
    done
    echo "$flows"
}

case "$USER_DATA" in
yawol) yawol_checks ;;
*) lb_controller_checks ;;
esac

out done 1
systemctl poweroff
