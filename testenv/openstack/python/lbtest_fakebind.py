"""An ML2 mechanism driver that binds every port without an agent.

Neutron's in-tree drivers (openvswitch, ovn, sriov, macvtap) bind a port only
when an agent reports in or an OVN database exists. This test environment has
neither, so without this driver every port stays unbound and Nova puts every
server in ERROR (PortBindingFailed). It binds the first segment offered with
vif_type=ovs and sets the port ACTIVE; nothing is wired anywhere.

Installed into the venv by `cargo xtask openstack up` together with a
dist-info whose entry point `neutron.ml2.mechanism_drivers: lbtest_fakebind`
lets ML2 load it by name.
"""

from neutron_lib import constants
from neutron_lib.api.definitions import portbindings
from neutron_lib.plugins.ml2 import api


class FakeBindMechanismDriver(api.MechanismDriver):
    """Binds every port to its first segment, as if an OVS agent had."""

    def initialize(self):
        pass

    def bind_port(self, context):
        for segment in context.segments_to_bind:
            context.set_binding(
                segment[api.ID],
                portbindings.VIF_TYPE_OVS,
                {
                    portbindings.CAP_PORT_FILTER: True,
                    portbindings.OVS_HYBRID_PLUG: False,
                },
                status=constants.PORT_STATUS_ACTIVE,
            )
            return
