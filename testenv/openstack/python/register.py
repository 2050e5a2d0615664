"""Idempotent set-up of the OpenStack test environment, in two steps.

Run by `cargo xtask openstack up` with the venv's Python:

- `register.py identity`, once Keystone answers: the service users and the
  catalog. The other services authenticate with these users as soon as they
  start (nova-conductor exits if it cannot), so this comes before them.
- `register.py resources`, once every service runs: the test project and
  user, a flavor, an image, the external network with its subnet, the tenant
  network, subnet and router; it waits for nova-conductor, nova-scheduler and
  both nova-compute hosts and maps the hosts into cell1. Prints one JSON
  object with the IDs the caller needs to write clouds.yaml,
  cloudprovider.conf and testenv.json.

Each step creates only what is missing, so re-running it is cheap.

Everything it needs comes from the environment (set by xtask):
LBTEST_PASSWORD, LBTEST_STATE_DIR, LBTEST_NOVA_MANAGE (argv as JSON).
"""

import json
import os
import subprocess
import sys
import time

import openstack

AUTH_URL = "http://127.0.0.1:5000/v3"
REGION = "RegionOne"
PASSWORD = os.environ["LBTEST_PASSWORD"]
STATE_DIR = os.environ["LBTEST_STATE_DIR"]
NOVA_MANAGE = json.loads(os.environ["LBTEST_NOVA_MANAGE"])

# service type -> (service name, catalog URL, user that the service runs as)
SERVICES = {
    "image": ("glance", "http://127.0.0.1:9292", "glance"),
    "placement": ("placement", "http://127.0.0.1:8778", "placement"),
    "network": ("neutron", "http://127.0.0.1:9696", "neutron"),
    "compute": ("nova", "http://127.0.0.1:8774/v2.1", "nova"),
}
COMPUTE_HOSTS = ["lbtest-compute-1", "lbtest-compute-2"]

PROJECT = "lbtest"
USER = "lbtest"
FLAVOR = "lbtest.tiny"
IMAGE = "lbtest-image"
EXTERNAL_NET = "public"
EXTERNAL_SUBNET = "public-subnet"
TENANT_NET = "lbtest-net"
TENANT_SUBNET = "lbtest-subnet"
TENANT_ROUTER = "lbtest-router"


def log(msg):
    print(f"register: {msg}", file=sys.stderr, flush=True)


def connect():
    return openstack.connect(
        auth_url=AUTH_URL,
        username="admin",
        password=PASSWORD,
        project_name="admin",
        user_domain_name="Default",
        project_domain_name="Default",
        region_name=REGION,
        identity_api_version="3",
    )


def ensure_project(conn, name):
    project = conn.identity.find_project(name, domain_id="default")
    if project is None:
        log(f"creating project {name}")
        project = conn.identity.create_project(name=name, domain_id="default")
    return project


def ensure_role(conn, name):
    role = conn.identity.find_role(name)
    if role is None:
        role = conn.identity.create_role(name=name)
    return role


def ensure_user(conn, name, project, roles):
    user = conn.identity.find_user(name, domain_id="default")
    if user is None:
        log(f"creating user {name}")
        user = conn.identity.create_user(
            name=name, password=PASSWORD, domain_id="default", default_project_id=project.id
        )
    for role in roles:
        conn.identity.assign_project_role_to_user(project, user, role)
    return user


def ensure_catalog(conn):
    admin_role = ensure_role(conn, "admin")
    service_role = ensure_role(conn, "service")
    service_project = ensure_project(conn, "service")
    for service_type, (name, url, user) in SERVICES.items():
        ensure_user(conn, user, service_project, [admin_role, service_role])
        service = conn.identity.find_service(name)
        if service is None:
            log(f"registering service {name} ({service_type})")
            service = conn.identity.create_service(name=name, type=service_type)
        present = {ep.interface for ep in conn.identity.endpoints(service_id=service.id)}
        for interface in ("public", "internal"):
            if interface not in present:
                conn.identity.create_endpoint(
                    service_id=service.id, interface=interface, url=url, region_id=REGION
                )


def ensure_flavor(conn):
    flavor = conn.compute.find_flavor(FLAVOR)
    if flavor is None:
        log(f"creating flavor {FLAVOR}")
        flavor = conn.compute.create_flavor(name=FLAVOR, ram=256, vcpus=1, disk=1, is_public=True)
    return flavor


def ensure_image(conn):
    image = conn.image.find_image(IMAGE)
    if image is not None and image.status != "active":
        # A half-uploaded image from an interrupted run: start again.
        conn.image.delete_image(image)
        image = None
    if image is None:
        log(f"creating image {IMAGE}")
        path = os.path.join(STATE_DIR, "lbtest-image.raw")
        with open(path, "wb") as f:
            f.write(b"\0" * (1 << 20))
        image = conn.create_image(
            IMAGE,
            filename=path,
            disk_format="raw",
            container_format="bare",
            visibility="public",
            wait=True,
        )
        os.remove(path)
    return image


def ensure_network(conn, name, project, **attrs):
    net = conn.network.find_network(name, project_id=project.id)
    if net is None:
        log(f"creating network {name}")
        net = conn.network.create_network(name=name, project_id=project.id, **attrs)
    return net


def ensure_subnet(conn, name, net, project, **attrs):
    subnet = conn.network.find_subnet(name, network_id=net.id)
    if subnet is None:
        log(f"creating subnet {name}")
        subnet = conn.network.create_subnet(
            name=name, network_id=net.id, project_id=project.id, ip_version=4, **attrs
        )
    return subnet


def ensure_networks(conn, admin_project, project):
    ext = ensure_network(
        conn,
        EXTERNAL_NET,
        admin_project,
        provider_network_type="flat",
        provider_physical_network="public",
        is_router_external=True,
    )
    # Documentation ranges (RFC 5737): nothing is routed, these exist in the DB only.
    ext_subnet = ensure_subnet(
        conn,
        EXTERNAL_SUBNET,
        ext,
        admin_project,
        cidr="203.0.113.0/24",
        gateway_ip="203.0.113.1",
        is_dhcp_enabled=False,
        allocation_pools=[{"start": "203.0.113.10", "end": "203.0.113.250"}],
    )
    net = ensure_network(conn, TENANT_NET, project)
    subnet = ensure_subnet(
        conn,
        TENANT_SUBNET,
        net,
        project,
        cidr="198.51.100.0/24",
        gateway_ip="198.51.100.1",
        is_dhcp_enabled=False,
    )
    router = conn.network.find_router(TENANT_ROUTER, project_id=project.id)
    if router is None:
        log(f"creating router {TENANT_ROUTER}")
        router = conn.network.create_router(
            name=TENANT_ROUTER,
            project_id=project.id,
            external_gateway_info={"network_id": ext.id},
        )
    interfaces = conn.network.ports(device_id=router.id, device_owner="network:router_interface")
    if not any(ip["subnet_id"] == subnet.id for p in interfaces for ip in p.fixed_ips):
        conn.network.add_interface_to_router(router, subnet_id=subnet.id)
    return ext, ext_subnet, net, subnet, router


def ensure_compute_hosts(conn):
    """Waits for the conductor, the scheduler and both compute hosts, then maps the hosts into cell1."""
    deadline = time.monotonic() + 180
    wanted = {("nova-conductor", None), ("nova-scheduler", None)} | {("nova-compute", h) for h in COMPUTE_HOSTS}
    while True:
        up = {(s.binary, s.host) for s in conn.compute.services() if s.state == "up"}
        missing = [b if h is None else f"{b} on {h}" for b, h in sorted(wanted, key=str)
                   if not any(ub == b and (h is None or uh == h) for ub, uh in up)]
        if not missing:
            break
        if time.monotonic() > deadline:
            sys.exit(f"register: not reported up after 180 s: {', '.join(missing)}; see their logs")
        time.sleep(1)
    hypervisors = {h.name for h in conn.compute.hypervisors()}
    if not all(h in hypervisors for h in COMPUTE_HOSTS):
        log("mapping compute hosts into cell1")
        subprocess.run(NOVA_MANAGE + ["cell_v2", "discover_hosts"], check=True, stdout=sys.stderr)
    while True:
        hypervisors = {h.name for h in conn.compute.hypervisors()}
        if all(h in hypervisors for h in COMPUTE_HOSTS):
            return
        if time.monotonic() > deadline:
            sys.exit(f"register: hypervisors {COMPUTE_HOSTS} not listed after 180 s (have {sorted(hypervisors)})")
        time.sleep(1)


def main():
    step = sys.argv[1] if len(sys.argv) == 2 else None
    if step == "identity":
        ensure_catalog(connect())
        print("{}")
        return
    if step != "resources":
        sys.exit("usage: register.py identity|resources")
    conn = connect()
    admin_project = conn.identity.find_project("admin", domain_id="default")
    project = ensure_project(conn, PROJECT)
    member = ensure_role(conn, "member")
    ensure_user(conn, USER, project, [member])
    flavor = ensure_flavor(conn)
    image = ensure_image(conn)
    ext, ext_subnet, net, subnet, router = ensure_networks(conn, admin_project, project)
    ensure_compute_hosts(conn)
    json.dump(
        {
            "project_id": project.id,
            "project_name": project.name,
            "username": USER,
            "flavor_id": flavor.id,
            "image_id": image.id,
            "external_network_id": ext.id,
            "external_subnet_id": ext_subnet.id,
            "network_id": net.id,
            "subnet_id": subnet.id,
            "router_id": router.id,
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
