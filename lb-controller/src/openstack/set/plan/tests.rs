use super::*;
use crate::runtime::changes::relevant_changes;
use crate::runtime::reported::Reported;
use futures::{stream, StreamExt};
use kube::runtime::watcher;
use serde_json::json;

fn now() -> jiff::Timestamp {
    jiff::Timestamp::now()
}

fn ago(secs: i64) -> String {
    (now() - jiff::SignedDuration::from_secs(secs)).to_string()
}

fn cond(type_: &str, status: &str, heartbeat_ago: i64, transition_ago: i64) -> serde_json::Value {
    json!({"type": type_, "status": status, "lastHeartbeatTime": ago(heartbeat_ago),
           "lastTransitionTime": ago(transition_ago)})
}

fn healthy(heartbeat_ago: i64) -> Vec<serde_json::Value> {
    [
        conditions::CONFIG_READY,
        conditions::DATAPLANE_READY,
        conditions::DATAPLANE_UP_TO_DATE,
    ]
    .iter()
    .map(|t| cond(t, "True", heartbeat_ago, 3600))
    .collect()
}

fn machine(name: &str, created_ago: i64, conds: Vec<serde_json::Value>) -> LoadBalancerMachine {
    serde_json::from_value(json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerMachine",
        "metadata": {"name": name, "namespace": "yawol", "uid": format!("uid-{name}"),
                     "creationTimestamp": ago(created_ago),
                     "ownerReferences": [{"apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerSet",
                                          "name": "web-h", "uid": "set-uid", "controller": true}]},
        "spec": {
            "infrastructure": {"flavor": {"flavorID": "f"}, "image": {"imageID": "i"}, "authSecretRef": {}},
            "portID": "p", "loadBalancerRef": {"name": "web", "namespace": "yawol"}
        },
        "status": {"conditions": conds}
    }))
    .unwrap()
}

fn set(replicas: i32) -> LoadBalancerSet {
    serde_json::from_value(json!({
        "apiVersion": "yawol.stackit.cloud/v1beta1", "kind": "LoadBalancerSet",
        "metadata": {"name": "web-h", "namespace": "yawol", "uid": "set-uid",
                     "annotations": {"loadbalancer.yawol.stackit.cloud/revision": "4"}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"yawol.stackit.cloud/loadbalancer": "abc", "lbm-template-hash": "h"}},
            "template": {
                "labels": {"yawol.stackit.cloud/loadbalancer": "abc", "lbm-template-hash": "h"},
                "spec": {
                    "infrastructure": {"flavor": {"flavorID": "f"}, "image": {"imageID": "i"}, "authSecretRef": {}},
                    "portID": "p", "loadBalancerRef": {"name": "web", "namespace": "yawol"}
                }
            }
        }
    }))
    .unwrap()
}

fn view(m: &LoadBalancerMachine) -> MachineView {
    machine_view(m, now()).0
}

fn ready(name: &str) -> MachineView {
    view(&machine(name, 3600, healthy(10)))
}

fn master(name: &str) -> MachineView {
    let mut c = healthy(10);
    c.push(cond(conditions::KEEPALIVED_MASTER, "True", 10, 600));
    view(&machine(name, 3600, c))
}

fn unready(name: &str) -> MachineView {
    let mut c = healthy(10);
    c[1] = cond(conditions::DATAPLANE_READY, "False", 10, 30);
    view(&machine(name, 3600, c))
}

fn booting(name: &str, created_ago: i64) -> MachineView {
    view(&machine(name, created_ago, vec![]))
}

fn cfg() -> Config {
    Config::default()
}

#[test]
fn views_judge_health_and_mastership() {
    assert!(ready("a").ready());
    assert!(!ready("a").master);
    assert!(master("a").master && master("a").ready());
    assert!(!unready("a").ready());
    // A master whose heartbeat stopped is not counted as holding the VIP.
    let mut c = healthy(10);
    c.push(cond(conditions::KEEPALIVED_MASTER, "True", 400, 600));
    assert!(!view(&machine("a", 3600, c)).master);
    // An eligible active-active machine holds the VIP like a master; not with a stale heartbeat.
    let mut c = healthy(10);
    c.push(cond(conditions::VIP_ELIGIBLE, "True", 10, 600));
    assert!(view(&machine("a", 3600, c)).master);
    let mut c = healthy(10);
    c.push(cond(conditions::VIP_ELIGIBLE, "True", 400, 600));
    assert!(!view(&machine("a", 3600, c)).master);
    // Marked machines are ready while they recover, but not available.
    let mut c = healthy(10);
    c.push(cond(conditions::MARKED_FOR_DELETION, "True", 30, 30));
    let v = view(&machine("a", 3600, c));
    assert!(v.marked && v.ready() && v.health == Health::ClearMark);
}

#[test]
fn yawol_condition_names_count() {
    let c = vec![
        cond(conditions::CONFIG_READY, "True", 10, 3600),
        cond(conditions::ENVOY_READY, "True", 10, 3600),
        cond(conditions::ENVOY_UP_TO_DATE, "True", 10, 3600),
    ];
    assert!(view(&machine("yawol-era", 3600, c)).ready());
    // Our own names win when both are there.
    let mut c = healthy(10);
    c[1] = cond(conditions::DATAPLANE_READY, "False", 10, 10);
    c.push(cond(conditions::ENVOY_READY, "True", 10, 3600));
    assert!(!view(&machine("both", 3600, c)).ready());
}

#[test]
fn creation_timeout_annotation_is_honoured_and_checked() {
    let mut m = machine("slow", 900, vec![]);
    assert!(matches!(
        machine_view(&m, now()).0.health,
        Health::MarkForDeletion(_)
    ));
    m.metadata.annotations = Some(
        [(
            lbm_annotations::CREATION_TIMEOUT.to_string(),
            "30m".to_string(),
        )]
        .into_iter()
        .collect(),
    );
    let (v, problem) = machine_view(&m, now());
    assert!(matches!(v.health, Health::Unready(_)) && problem.is_none());
    m.metadata.annotations.as_mut().unwrap().insert(
        lbm_annotations::CREATION_TIMEOUT.to_string(),
        "soon".to_string(),
    );
    let (v, problem) = machine_view(&m, now());
    assert!(
        matches!(v.health, Health::MarkForDeletion(_)),
        "default applies"
    );
    assert!(problem.unwrap().contains("soon"));
}

#[test]
fn outage_means_every_reporting_machine_is_stale() {
    let stale = |n: &str| machine(n, 3600, healthy(400));
    let fresh = |n: &str| machine(n, 3600, healthy(10));
    let t = now();
    assert!(heartbeat_outage(&[stale("a"), stale("b")], t, 2));
    assert!(!heartbeat_outage(
        &[stale("a"), stale("b"), fresh("c")],
        t,
        2
    ));
    // One machine cannot be told apart from an outage: the per-machine rules apply.
    assert!(!heartbeat_outage(&[stale("a")], t, 2));
    // Machines that never reported, and machines being deleted, do not count.
    let mut gone = fresh("d");
    gone.metadata.deletion_timestamp = Some(Time(t));
    assert!(heartbeat_outage(
        &[stale("a"), stale("b"), machine("new", 10, vec![]), gone],
        t,
        2
    ));
    // Our own MarkedForDeletion heartbeat is no sign of life.
    let mut marked = healthy(400);
    marked.push(cond(conditions::MARKED_FOR_DELETION, "True", 5, 5));
    assert!(heartbeat_outage(
        &[stale("a"), machine("m", 3600, marked)],
        t,
        2
    ));
}

#[test]
fn scale_up_creates_one_at_a_time() {
    let s = set(3);
    let p = plan_set(&s, &[], now(), false, &cfg());
    assert!(p.create);
    assert_eq!(p.status.replicas, Some(1));
    // The new machine is booting: wait.
    let p = plan_set(&s, &[booting("a", 30)], now(), false, &cfg());
    assert!(!p.create);
    // It is ready: the next one.
    let p = plan_set(&s, &[ready("a")], now(), false, &cfg());
    assert!(p.create);
    // A machine that does not become ready in time no longer blocks.
    let p = plan_set(&s, &[ready("a"), booting("b", 301)], now(), false, &cfg());
    assert!(p.create);
    // Enough machines: nothing.
    let p = plan_set(
        &s,
        &[ready("a"), ready("b"), ready("c")],
        now(),
        false,
        &cfg(),
    );
    assert!(!p.writes_machines());
}

#[test]
fn scale_down_removes_unready_then_non_masters() {
    let s = set(1);
    let p = plan_set(
        &s,
        &[master("a"), unready("b"), ready("c")],
        now(),
        false,
        &cfg(),
    );
    assert_eq!(p.delete, [("b".to_string(), DeleteReason::ScaleDown)]);
    let p = plan_set(&s, &[master("a"), ready("c")], now(), false, &cfg());
    assert_eq!(p.delete, [("c".to_string(), DeleteReason::ScaleDown)]);
    let p = plan_set(&s, &[ready("b"), ready("a")], now(), false, &cfg());
    assert_eq!(p.delete, [("a".to_string(), DeleteReason::ScaleDown)]);
    assert_eq!(p.status.replicas, Some(1), "the victim is not counted");
    // Set at 0 (an old revision being retired): the master goes last.
    let p = plan_set(&set(0), &[master("a"), ready("b")], now(), false, &cfg());
    assert_eq!(p.delete, [("b".to_string(), DeleteReason::ScaleDown)]);
    // Machines already being deleted are not counted.
    let mut going = ready("z");
    going.deleting = true;
    let p = plan_set(&set(1), &[ready("a"), going], now(), false, &cfg());
    assert!(!p.writes_machines());
}

#[test]
fn unhealthy_machines_are_marked_then_deleted_and_replaced() {
    let s = set(2);
    let mut dead = healthy(400);
    let m = machine("dead", 3600, dead.clone());
    let p = plan_set(&s, &[ready("a"), view(&m)], now(), false, &cfg());
    assert_eq!(p.mark.len(), 1);
    assert_eq!(p.mark[0].0, "dead");
    assert!(!p.create && p.delete.is_empty());
    dead.push(cond(conditions::MARKED_FOR_DELETION, "True", 130, 130));
    let m = machine("dead", 3600, dead);
    let p = plan_set(&s, &[ready("a"), view(&m)], now(), false, &cfg());
    assert!(matches!(&p.delete[..], [(n, DeleteReason::Unhealthy(_))] if n == "dead"));
    assert!(p.create, "the replacement starts at once");
    assert_eq!(p.status.replicas, Some(2));
    assert_eq!(p.status.ready_replicas, Some(1));
}

#[test]
fn recovered_machines_lose_their_mark() {
    let mut c = healthy(10);
    c.push(cond(conditions::MARKED_FOR_DELETION, "True", 30, 30));
    let p = plan_set(
        &set(1),
        &[view(&machine("a", 3600, c))],
        now(),
        false,
        &cfg(),
    );
    assert_eq!(p.clear_mark, ["a"]);
    assert_eq!(
        p.status.available_replicas,
        Some(0),
        "marked: not available yet"
    );
    assert_eq!(p.status.ready_replicas, Some(1));
}

#[test]
fn the_outage_guard_holds_marks_deletions_and_scale_down() {
    let mut marked = healthy(400);
    marked.push(cond(conditions::MARKED_FOR_DELETION, "True", 130, 130));
    let views = [
        view(&machine("a", 3600, healthy(400))),
        view(&machine("b", 3600, marked)),
        view(&machine("c", 3600, healthy(400))),
    ];
    let p = plan_set(&set(2), &views, now(), true, &cfg());
    assert!(p.mark.is_empty() && p.delete.is_empty(), "{p:?}");
    assert_eq!(
        p.held.len(),
        4,
        "mark a, delete b, mark c, scale down: {:?}",
        p.held
    );
    // Without the guard the same input deletes.
    let p = plan_set(&set(2), &views, now(), false, &cfg());
    assert!(!p.delete.is_empty());
    // Creating is still allowed (it deletes nothing).
    let p = plan_set(&set(4), &views, now(), true, &cfg());
    assert!(p.create);
}

#[test]
fn status_reports_master_and_keeps_its_transition_time() {
    let mut s = set(2);
    let p = plan_set(&s, &[master("a"), ready("b")], now(), false, &cfg());
    let c = &p.status.conditions.as_ref().unwrap()[0];
    assert_eq!(c.type_, conditions::HAS_KEEPALIVED_MASTER);
    assert_eq!(c.status, "True");
    assert_eq!(c.reason, conditions::REASON_KEEPALIVED_MASTER_IN_SET);
    assert_eq!(p.status.ready_replicas, Some(2));
    assert_eq!(p.status.available_replicas, Some(2));
    s.status = Some(p.status.clone());
    let later = now() + jiff::SignedDuration::from_secs(60);
    let again = plan_set(&s, &[master("a"), ready("b")], later, false, &cfg());
    assert_eq!(again.status, p.status, "nothing changed: nothing to write");
    let lost = plan_set(&s, &[ready("a"), ready("b")], later, false, &cfg());
    let c = &lost.status.conditions.as_ref().unwrap()[0];
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", conditions::REASON_NO_KEEPALIVED_MASTER_IN_SET)
    );
    assert_eq!(c.last_transition_time.0, later);
}

#[test]
fn deleting_set_wants_no_machines() {
    let mut s = set(2);
    s.metadata.deletion_timestamp = Some(Time(now()));
    let p = plan_set(&s, &[ready("a")], now(), false, &cfg());
    assert_eq!(p.delete, [("a".to_string(), DeleteReason::ScaleDown)]);
    assert!(!p.create);
}

#[test]
fn new_machines_carry_template_revision_and_owner() {
    let s = set(1);
    let m = new_machine(&s, "x7k2q");
    assert_eq!(m.name_any(), "web-h-x7k2q");
    assert_eq!(m.namespace().as_deref(), Some("yawol"));
    assert_eq!(m.labels()["lbm-template-hash"], "h");
    assert_eq!(m.annotations()[lb_annotations::REVISION], "4");
    assert_eq!(m.spec, s.spec.template.spec);
    let o = &m.owner_references()[0];
    assert_eq!(
        (o.kind.as_str(), o.uid.as_str(), o.controller),
        ("LoadBalancerSet", "set-uid", Some(true))
    );
    assert!(owned_by(&m, &s));
}

#[test]
fn suffixes_are_five_name_characters_and_differ() {
    let a = random_suffix();
    assert_eq!(a.len(), 5);
    assert!(a.bytes().all(|c| NAME_ALPHABET.contains(&c)));
    let many: HashSet<String> = (0..200).map(|_| random_suffix()).collect();
    assert!(many.len() > 190);
}

#[test]
fn ownership_by_uid_or_labels() {
    let s = set(1);
    let mut m = machine("a", 10, vec![]);
    assert!(owned_by(&m, &s));
    m.metadata.owner_references.as_mut().unwrap()[0].uid = "other".into();
    assert!(!owned_by(&m, &s));
    m.metadata.owner_references = None;
    assert!(!owned_by(&m, &s), "no labels either");
    m.metadata.labels = s.spec.selector.match_labels.clone();
    assert!(owned_by(&m, &s));
}

#[tokio::test]
async fn heartbeats_alone_wake_nobody_but_deletions_do() {
    let a = machine("a", 3600, healthy(10));
    let a_heartbeat = machine("a", 3600, healthy(5));
    let mut a_unready = a.clone();
    a_unready
        .status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()[1]
        .status = "False".into();
    let events = vec![
        Ok(watcher::Event::Init),
        Ok(watcher::Event::InitApply(a.clone())),
        Ok(watcher::Event::InitDone),
        Ok(watcher::Event::Apply(a_heartbeat)),
        Ok(watcher::Event::Apply(a_unready.clone())),
        Ok(watcher::Event::Delete(a_unready)),
    ];
    let out: Vec<_> = relevant_changes(stream::iter(events), machine_fingerprint)
        .collect()
        .await;
    assert_eq!(out.len(), 3, "initial, unready, deleted");
}

#[test]
fn problems_are_reported_once_while_they_last() {
    let r = Reported::default();
    let p = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(r.fresh("u", &p(&["a", "b"]), true), p(&["a", "b"]));
    assert!(r.fresh("u", &p(&["a", "b"]), true).is_empty());
    // A failed reconcile may not have looked at everything: nothing is forgotten.
    assert!(r.fresh("u", &p(&["a"]), false).is_empty());
    // "b" was fixed; when it comes back it is new again.
    assert!(r.fresh("u", &p(&["a"]), true).is_empty());
    assert_eq!(r.fresh("u", &p(&["a", "b"]), true), p(&["b"]));
    // Per object.
    assert_eq!(r.fresh("other", &p(&["a"]), true), p(&["a"]));
    r.forget("u");
    assert_eq!(r.fresh("u", &p(&["a"]), true), p(&["a"]));
}

#[test]
fn master_conditions_satisfy_the_crd_schema() {
    let crd = lb_api::crds()
        .into_iter()
        .find(|(stem, _)| stem.ends_with("_loadbalancersets"))
        .unwrap()
        .1;
    let schema = serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap();
    let item = &schema["properties"]["status"]["properties"]["conditions"]["items"];
    assert!(item["properties"]["reason"]["pattern"].is_string());
    let long_name = "m".repeat(253);
    for master in [Some("lbm-abcde"), Some(long_name.as_str()), None] {
        let condition = master_condition(None, master, now());
        let value = serde_json::to_value(&condition).unwrap();
        let mut errors = Vec::new();
        kube_testenv::fake_api::validate(item, &value, "condition", &mut errors);
        assert!(errors.is_empty(), "{value}: {errors:?}");
        assert!(!condition.reason.is_empty() && !condition.message.is_empty());
    }
    // The validation itself rejects what the schema forbids.
    let mut bad = serde_json::to_value(master_condition(None, None, now())).unwrap();
    bad["reason"] = json!("");
    bad["status"] = json!("Maybe");
    bad.as_object_mut().unwrap().remove("message");
    let mut errors = Vec::new();
    kube_testenv::fake_api::validate(item, &bad, "condition", &mut errors);
    assert_eq!(errors.len(), 4, "{errors:?}");
}
