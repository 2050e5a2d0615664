//! Well-known names shared by yawol and this project: annotation keys, labels, finalizers,
//! condition types and defaults. The values are wire contracts; never change them.

/// API group of all three kinds.
pub const GROUP: &str = "yawol.stackit.cloud";
/// API version of all three kinds.
pub const VERSION: &str = "v1beta1";
/// `apiVersion` string of all three kinds.
pub const API_VERSION: &str = "yawol.stackit.cloud/v1beta1";

/// Service annotation keys (`yawol.stackit.cloud/*`), read by the cloud controller.
pub mod service_annotations {
    /// Overrides the default image ID.
    pub const IMAGE_ID: &str = "yawol.stackit.cloud/imageId";
    /// Overrides the default flavor ID.
    pub const FLAVOR_ID: &str = "yawol.stackit.cloud/flavorId";
    /// Overrides the default (listener) network; the controller default network is then
    /// appended to the additional networks unless [`SKIP_CLOUD_CONTROLLER_DEFAULT_NETWORK_ID`].
    pub const DEFAULT_NETWORK_ID: &str = "yawol.stackit.cloud/defaultNetworkID";
    /// "true": do not append the controller default network to the additional networks.
    pub const SKIP_CLOUD_CONTROLLER_DEFAULT_NETWORK_ID: &str =
        "yawol.stackit.cloud/skipCloudControllerDefaultNetworkID";
    /// Subnet for the VIP and machine ports.
    pub const DEFAULT_SUBNET_ID: &str = "yawol.stackit.cloud/defaultSubnetID";
    /// Overrides the OpenStack project of the auth secret; immutable once set.
    pub const PROJECT_ID: &str = "yawol.stackit.cloud/projectID";
    /// Overrides the floating IP pool network.
    pub const FLOATING_NETWORK_ID: &str = "yawol.stackit.cloud/floatingNetworkID";
    /// OpenStack availability zone.
    pub const AVAILABILITY_ZONE: &str = "yawol.stackit.cloud/availabilityZone";
    /// "true": internal load balancer (no floating IP).
    pub const INTERNAL_LB: &str = "yawol.stackit.cloud/internalLB";
    /// "true": enable debug settings (sshd on the machines).
    pub const DEBUG: &str = "yawol.stackit.cloud/debug";
    /// Nova keypair name used when [`DEBUG`] is on.
    pub const DEBUG_SSH_KEY: &str = "yawol.stackit.cloud/debugsshkey";
    /// Deprecated class filter; `spec.loadBalancerClass` is preferred.
    pub const CLASS_NAME: &str = "yawol.stackit.cloud/className";
    /// Number of load-balancer machines (default 1, invalid values mean 1).
    pub const REPLICAS: &str = "yawol.stackit.cloud/replicas";
    /// Comma-separated allow-list CIDRs; ignored when `spec.loadBalancerSourceRanges` is set.
    pub const LOAD_BALANCER_SOURCE_RANGES: &str = "yawol.stackit.cloud/loadBalancerSourceRanges";
    /// "true": send a PROXY protocol v2 header upstream on TCP.
    pub const TCP_PROXY_PROTOCOL: &str = "yawol.stackit.cloud/tcpProxyProtocol";
    /// Comma-separated service ports that get the PROXY header (empty: all TCP ports).
    pub const TCP_PROXY_PROTOCOL_PORTS_FILTER: &str =
        "yawol.stackit.cloud/tcpProxyProtocolPortsFilter";
    /// Go duration: TCP idle timeout.
    pub const TCP_IDLE_TIMEOUT: &str = "yawol.stackit.cloud/tcpIdleTimeout";
    /// Go duration: UDP idle timeout.
    pub const UDP_IDLE_TIMEOUT: &str = "yawol.stackit.cloud/udpIdleTimeout";
    /// Adopt an existing floating IP by address.
    pub const EXISTING_FLOATING_IP: &str = "yawol.stackit.cloud/existingFloatingIP";
    /// "true": ship VM logs to Loki.
    pub const LOG_FORWARD: &str = "yawol.stackit.cloud/logForward";
    /// Loki push URL.
    pub const LOG_FORWARD_LOKI_URL: &str = "yawol.stackit.cloud/logForwardLokiURL";
    /// HTTP proxy for the Loki push.
    pub const LOG_FORWARD_PROXY_URL: &str = "yawol.stackit.cloud/logForwardProxyURL";
    /// Nova server group policy.
    pub const SERVER_GROUP_POLICY: &str = "yawol.stackit.cloud/serverGroupPolicy";
    /// "true": the machines serve the VIP active-active behind the VIP network's router (ECMP over its extra
    /// routes) instead of as a VRRP pair; wants `replicas` of 2 or more.
    pub const ACTIVE_ACTIVE: &str = "yawol.stackit.cloud/activeActive";
    /// Comma-separated extra network IDs.
    pub const ADDITIONAL_NETWORKS: &str = "yawol.stackit.cloud/additionalNetworks";
    /// Prefix of annotations that become extra Loki labels (the prefix is stripped).
    pub const LOG_LABEL_PREFIX: &str = "logging.yawol.stackit.cloud/";
}

/// Annotation keys on LoadBalancer objects.
pub mod lb_annotations {
    /// "true": the machines start sshd and accept [`AD_HOC_DEBUG_SSH_KEY`].
    pub const AD_HOC_DEBUG: &str = "yawol.stackit.cloud/adHocDebug";
    /// An `ssh-rsa ...` public key injected into running machines for ad-hoc debugging.
    pub const AD_HOC_DEBUG_SSH_KEY: &str = "yawol.stackit.cloud/adHocDebugSSHKey";
    /// "true": orphan the floating IP when the LoadBalancer is deleted.
    pub const KEEP_FLOATING_IP: &str = "yawol.stackit.cloud/keepFloatingIP";
    /// "true": orphan the VIP port when the LoadBalancer is deleted.
    pub const KEEP_PORT: &str = "yawol.stackit.cloud/keepPort";
    /// "true": orphan the security group when the LoadBalancer is deleted.
    pub const KEEP_SECURITY_GROUP: &str = "yawol.stackit.cloud/keepSecurityGroup";
    /// `<namespace>/<name>` of the Service this LoadBalancer belongs to (set by the cloud controller).
    pub const SERVICE_NAME: &str = "yawol.stackit.cloud/serviceName";
    /// Current LoadBalancerSet revision (LoadBalancer, LoadBalancerSet and LoadBalancerMachine).
    pub const REVISION: &str = "loadbalancer.yawol.stackit.cloud/revision";
    /// VRRP virtual router ID (1..=255) of the load balancer's machines, allocated by the controller once and
    /// distinct among the LoadBalancers on the same network.
    pub const VRRP_ROUTER_ID: &str = "loadbalancer.yawol.stackit.cloud/vrrpRouterID";
    /// Comma-separated, sorted `status.defaultPortIP`s of the load balancer's live machines (all sets), written by
    /// the controller; the agents find their state-sync peers here.
    pub const SYNC_PEERS: &str = "loadbalancer.yawol.stackit.cloud/syncPeers";
}

/// State sync between the machines of one load balancer.
pub mod sync {
    /// TCP port the agents sync on; the security group admits it from members of the same group.
    pub const PORT: u16 = 9190;
    /// The shared secret lives in the Secret `<loadbalancer><SECRET_SUFFIX>` (owned by the LoadBalancer).
    pub const SECRET_SUFFIX: &str = "-sync";
    /// Key of the shared secret in that Secret.
    pub const SECRET_KEY: &str = "secret";
}

/// Annotation keys on LoadBalancerMachine objects.
pub mod lbm_annotations {
    /// Go duration overriding the 10-minute "no conditions yet" creation timeout.
    pub const CREATION_TIMEOUT: &str = "yawol.stackit.cloud/creationTimeout";
}

/// Entries of `LoadBalancerMachine.status.metrics` (beside yawol's) that the controllers read.
pub mod machine_metrics {
    /// Active-active: the open connections translated to the machine's own address, which only it can carry;
    /// the machine controller keeps a draining machine's server until they are gone.
    pub const OWN_CONNECTIONS_ACTIVE: &str = "ownConnectionsActive";
}

/// Label keys.
pub mod labels {
    /// Selector label linking a LoadBalancer to its sets and machines
    /// (value: [`crate::naming::loadbalancer_selector_value`]).
    pub const LOADBALANCER: &str = "yawol.stackit.cloud/loadbalancer";
    /// Hash of the machine template of a LoadBalancerSet.
    pub const LBM_TEMPLATE_HASH: &str = "lbm-template-hash";
}

/// Finalizers.
pub mod finalizers {
    /// On Services handled by the cloud controller.
    pub const SERVICE: &str = "stackit.cloud/loadbalancer";
    /// On LoadBalancers (OpenStack resources still exist).
    pub const LOADBALANCER: &str = "yawol.stackit.cloud/controller2";
    /// On LoadBalancerSets (machines still exist).
    pub const LOADBALANCERSET: &str = "stackit.cloud/loadbalancermachine";
    /// On LoadBalancerMachines (server still exists).
    pub const LOADBALANCERMACHINE: &str = "yawol.stackit.cloud/controller4";
}

/// Condition types written to `LoadBalancerMachine.status.conditions` by the agent, and the
/// LoadBalancerSet condition. yawol's controllers key on the `Envoy*` names, so the agent writes
/// both the data-plane names and the yawol names with the same truth.
pub mod conditions {
    /// The agent has a valid configuration for its LoadBalancer.
    pub const CONFIG_READY: &str = "ConfigReady";
    /// yawol name: the data plane is running and healthy.
    pub const ENVOY_READY: &str = "EnvoyReady";
    /// yawol name: the data plane runs the desired configuration.
    pub const ENVOY_UP_TO_DATE: &str = "EnvoyUpToDate";
    /// Our name: the XDP data plane is attached and healthy.
    pub const DATAPLANE_READY: &str = "DataplaneReady";
    /// Our name: the applied data-plane configuration equals the desired one.
    pub const DATAPLANE_UP_TO_DATE: &str = "DataplaneUpToDate";
    /// The VRRP/keepalived process is running.
    pub const KEEPALIVED_PROCESS: &str = "KeepalivedProcess";
    /// This machine currently holds the VIP (VRRP master).
    pub const KEEPALIVED_MASTER: &str = "KeepalivedMaster";
    /// Set by the machine-health logic before a machine is deleted.
    pub const MARKED_FOR_DELETION: &str = "MarkedForDeletion";
    /// Reason of [`MARKED_FOR_DELETION`].
    pub const REASON_PENDING_DELETION: &str = "PendingDeletion";
    /// LoadBalancerSet condition: some machine of the set is VRRP master.
    pub const HAS_KEEPALIVED_MASTER: &str = "HasKeepalivedMaster";
    /// Reason of [`HAS_KEEPALIVED_MASTER`] = True.
    pub const REASON_KEEPALIVED_MASTER_IN_SET: &str = "KeepalivedMasterInSet";
    /// Reason of [`HAS_KEEPALIVED_MASTER`] = False.
    pub const REASON_NO_KEEPALIVED_MASTER_IN_SET: &str = "NoKeepalivedMasterInSet";
    /// Machine condition (active-active): this machine should receive the VIP's traffic now (data plane attached,
    /// configuration current, flows synced with its peers); the controller routes the VIP to the machines that say
    /// True with a fresh heartbeat.
    pub const VIP_ELIGIBLE: &str = "VIPEligible";
    /// LoadBalancer condition (active-active): the router's routes for the VIP are the eligible machines.
    pub const ACTIVE_ACTIVE: &str = "ActiveActive";
    /// Reason of [`ACTIVE_ACTIVE`] = True: the VIP's routes name every eligible machine.
    pub const REASON_ROUTES_PROGRAMMED: &str = "RoutesProgrammed";
    /// Reason of [`ACTIVE_ACTIVE`] = False: fewer than two replicas are asked for (the one serves alone).
    pub const REASON_TOO_FEW_REPLICAS: &str = "TooFewReplicas";
    /// Reason of [`ACTIVE_ACTIVE`] = False: no machine is eligible, so the VIP has no route.
    pub const REASON_NO_ELIGIBLE_MACHINE: &str = "NoEligibleMachine";
    /// Reason of [`ACTIVE_ACTIVE`] = False: the VIP's subnet has no router to program.
    pub const REASON_NO_ROUTER: &str = "NoRouter";
    /// Reason of [`ACTIVE_ACTIVE`] = False: OpenStack refused or failed to change the routes.
    pub const REASON_ROUTES_FAILED: &str = "RoutesFailed";
    /// Condition status "True".
    pub const TRUE: &str = "True";
    /// Condition status "False".
    pub const FALSE: &str = "False";
    /// Condition status "Unknown".
    pub const UNKNOWN: &str = "Unknown";
}

/// Defaults and fixed names.
pub mod defaults {
    use std::time::Duration;

    /// Default load-balancer class handled by the cloud controller.
    pub const LOADBALANCER_CLASS: &str = "stackit.cloud/yawol";
    /// Event source component whose LoadBalancer events are re-emitted on the Service.
    pub const USER_EVENT_COMPONENT: &str = "yawol-service";
    /// TCP idle timeout when `options.tcpIdleTimeout` is unset (Envoy's default in yawol).
    pub const TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
    /// UDP idle timeout when `options.udpIdleTimeout` is unset.
    pub const UDP_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
    /// Default replica count of a LoadBalancer / LoadBalancerSet.
    pub const REPLICAS: i32 = 1;
    /// Protocol of a load-balancer port without `protocol` (also the CRD schema's default).
    pub const PORT_PROTOCOL: &str = "TCP";
    /// Key of the OpenStack credentials in the auth secret.
    pub const CLOUDPROVIDER_CONF_KEY: &str = "cloudprovider.conf";
}
