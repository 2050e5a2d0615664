#!/bin/sh
# Final touches of the load-balancer VM's root filesystem. `cargo xtask image build` runs this once per
# cached root-filesystem stage, as an mmdebstrap customize hook: on the build machine, after the packages
# and the overlay (image/rootfs/) are in place.
#   $1         the root directory
#   ROOT_UUID  UUID of the root filesystem (fstab, grub.cfg)
#   GRUB_CFG   the grub.cfg template (image/grub/grub.cfg)
set -eu
root="$1"
: "${ROOT_UUID:?}" "${GRUB_CFG:?}"
in_root() { chroot "$root" "$@"; }

# Boot: the root filesystem by UUID; GRUB's configuration lives on it (the core images only find it).
printf 'UUID=%s / ext4 defaults,errors=remount-ro 0 1\n' "$ROOT_UUID" >"$root/etc/fstab"
mkdir -p "$root/boot/grub"
sed "s/@ROOT_UUID@/$ROOT_UUID/g" "$GRUB_CFG" >"$root/boot/grub/grub.cfg"
# Again, with FSTYPE=ext4 from rootfs/ (the package's run had nothing to probe, so no fsck for the root).
in_root update-initramfs -u -k all

# Services. sshd only in debug mode (lb-controller's user data enables it then); keepalived and BIRD only under
# the agent, which writes their configurations and supervises them; no background apt runs on an appliance that
# is replaced, not upgraded in place.
in_root systemctl disable --quiet ssh.service keepalived.service bird.service apt-daily.timer apt-daily-upgrade.timer

# yawol compatibility (image/README.md, "yawol compatibility"): the users yawol-controller's user data writes files for
# (write_files fails on an unknown owner) — yawol (its kubeconfig) and promtail (its config) as system users
# without a login —, yawol's debug user (the agent installs the key of the LoadBalancer's adHocDebug annotation
# in its authorized_keys; no password: key only), the agent under yawollet's name, and yawollet.service, which
# runs only when the user data wrote /etc/yawol/env.conf.
in_root useradd --system --user-group --no-create-home --home-dir /var/lib/yawol --shell /usr/sbin/nologin yawol
in_root useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin promtail
in_root useradd --create-home --shell /bin/bash --password '*' yawoldebug
install -d -m 0700 "$root/home/yawoldebug/.ssh"
install -m 0600 /dev/null "$root/home/yawoldebug/.ssh/authorized_keys"
in_root chown -R yawoldebug:yawoldebug /home/yawoldebug/.ssh
printf 'yawoldebug ALL=(ALL) NOPASSWD:ALL\n' >"$root/etc/sudoers.d/yawoldebug"
chmod 0440 "$root/etc/sudoers.d/yawoldebug"
install -d -m 0755 "$root/etc/yawol"
install -d -m 0755 -o "$(in_root id -u yawol)" -g "$(in_root id -g yawol)" "$root/var/lib/yawol"
ln -sf lb-agent "$root/usr/local/bin/yawollet"
in_root systemctl enable --quiet yawollet.service

# Nothing secret or machine-specific: root locked (no password), no SSH host keys (cloud-init makes new ones
# on the first boot), empty machine-id (systemd generates one on the first boot), host name and resolver from
# cloud-init and DHCP.
in_root passwd --lock root >/dev/null
rm -f "$root"/etc/ssh/ssh_host_*
: >"$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id" "$root/etc/resolv.conf"
echo localhost >"$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\nff02::1\t\tip6-allnodes\nff02::2\t\tip6-allrouters\n' \
    >"$root/etc/hosts"

# Leftovers of the build (mmdebstrap empties the apt lists and the package cache itself).
find "$root/var/log" -type f -delete
rm -f "$root"/var/cache/debconf/*-old "$root"/var/lib/dpkg/*-old "$root/var/cache/ldconfig/aux-cache"
rm -rf "$root"/tmp/* "$root"/var/tmp/*
