//! The data plane's rules, proven with real packets through the real programs (XDP and TC entry points)
//! in the kernel via BPF_PROG_TEST_RUN. Needs root.

mod common;
use common::*;

both_hooks! {
    fn syn_creates_flow_and_is_full_natted(h) {
        h.apply(&[web(&[1, 2, 3])]);
        let (v, out) = h.run(&client_tcp(40000, SYN, b""));
        assert_eq!(v, Verdict::Tx);
        let p = parse(&out);
        assert_eq!(p.src, VIP, "SNAT to the VIP by default");
        assert_eq!(p.dport, WEB_NODE_PORT);
        assert!(p.ip_csum_ok && p.l4_csum_ok, "{p:?}");
        let n = node_index(&p);
        assert_eq!(p.dst_mac, node_mac(n));
        assert_eq!(p.src_mac, LB_MAC);
        assert!(p.sport >= 1024);
    }
}
