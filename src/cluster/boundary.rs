//! What regrade's credential may and may not do (`regrade check-access`; docs/behaviour.md,
//! "Least privilege"), asked of the API server, never assumed: who it is
//! (SelfSubjectReview), what RBAC lets it do of what regrade needs and of what it never
//! needs (SelfSubjectAccessReview, one per request), and what the admission policy
//! refuses of what RBAC allows (dry-run requests: admission runs, nothing is stored).

use std::fmt;

use k8s_openapi::api::authentication::v1::{SelfSubjectReview, UserInfo};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;

use super::credential;
use super::endpoints::{CallError, Endpoints};
use super::events;

/// One request, as RBAC sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub verb: &'static str,
    pub group: &'static str,
    pub resource: &'static str,
    pub subresource: &'static str,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

impl Request {
    fn new(verb: &'static str, resource: &'static str) -> Request {
        let (group, resource) = resource.split_once('.').map_or(("", resource), |(r, g)| (g, r));
        let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
        Request { verb, group, resource, subresource, namespace: None, name: None }
    }
    fn ns(mut self, ns: &str) -> Request {
        self.namespace = Some(ns.into());
        self
    }
    fn named(mut self, name: &str) -> Request {
        self.name = Some(name.into());
        self
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let resource = if self.resource == "*" { "everything".to_string() } else { self.resource.to_string() };
        let verb = if self.verb == "*" { "anything on" } else { self.verb };
        write!(f, "{verb} {resource}")?;
        if !self.subresource.is_empty() {
            write!(f, "/{}", self.subresource)?;
        }
        if !self.group.is_empty() && self.group != "*" {
            write!(f, ".{}", self.group)?;
        }
        match (&self.namespace, &self.name) {
            (Some(ns), Some(n)) => write!(f, " {ns}/{n}"),
            (None, Some(n)) => write!(f, " {n}"),
            (Some(ns), None) => write!(f, " -n {ns}"),
            (None, None) => Ok(()),
        }
    }
}

/// What regrade needs, for Node `node`, its Lease, and (without `cluster.api_servers`)
/// discovery.
pub fn needs(node: &str, lease_ns: &str, lease: &str, discovers: bool) -> Vec<Request> {
    let mut v = vec![
        Request::new("get", "nodes").named(node),
        Request::new("list", "nodes"),
        Request::new("watch", "nodes"),
        Request::new("patch", "nodes").named(node),
        Request::new("create", "leases.coordination.k8s.io").ns(lease_ns),
        Request::new("get", "leases.coordination.k8s.io").ns(lease_ns).named(lease),
        Request::new("update", "leases.coordination.k8s.io").ns(lease_ns).named(lease),
        Request::new("list", "leases.coordination.k8s.io").ns(super::peers::NODE_LEASE_NAMESPACE),
        Request::new("create", "events").ns(events::NAMESPACE),
        Request::new("list", "pods"),
        Request::new("create", "pods/eviction"),
    ];
    if discovers {
        v.push(Request::new("get", "endpointslices.discovery.k8s.io").ns("default").named("kubernetes"));
    }
    v
}

/// What regrade never needs: a credential allowed any of these can do more than regrade.
pub fn beyond() -> Vec<Request> {
    vec![
        Request { verb: "*", group: "*", resource: "*", subresource: "", namespace: None, name: None },
        Request::new("delete", "nodes"),
        Request::new("update", "nodes/status"),
        Request::new("create", "pods"),
        Request::new("get", "secrets").ns("kube-system"),
        Request::new("create", "serviceaccounts/token").ns(credential::NAMESPACE),
        Request::new("create", "clusterrolebindings.rbac.authorization.k8s.io"),
        Request::new("impersonate", "users"),
    ]
}

/// A dry-run request the admission policy must refuse, and how it went.
#[derive(Clone, Debug)]
pub struct Probe {
    pub what: String,
    pub outcome: Outcome,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Refused by the admission policy, with its message.
    RefusedByPolicy(String),
    /// Refused otherwise (RBAC, validation), with the message.
    Refused(String),
    /// Allowed: nothing bounds it.
    Allowed,
}

/// All of it, for `check-access`.
#[derive(Clone, Debug)]
pub struct Boundary {
    pub user: UserInfo,
    pub node: String,
    pub needed: Vec<(Request, bool)>,
    pub beyond: Vec<(Request, bool)>,
    /// Pods delete: (needed: `on_drain_timeout = "delete"`, allowed). The policy narrows
    /// it to pods on this Node, so allowed and not needed is no excess.
    pub delete_pods: (bool, bool),
    pub probes: Vec<Probe>,
    /// regrade's own marks on its Node, as a dry run: the policy must let them through
    /// (a `cluster.taint_key`, `level_label` or `set_annotation` the policy does not
    /// name would be refused at the first step). `None`: not asked.
    pub own_marks: Option<Probe>,
}

impl Boundary {
    pub fn username(&self) -> &str {
        self.user.username.as_deref().unwrap_or("")
    }
    /// The Node-name claim of a Node-bound token.
    pub fn bound_node(&self) -> Option<&str> {
        self.user.extra.as_ref()?.get("authentication.kubernetes.io/node-name")?.first().map(String::as_str)
    }
    pub fn missing(&self) -> Vec<&Request> {
        let mut v: Vec<&Request> = self.needed.iter().filter(|(_, ok)| !ok).map(|(r, _)| r).collect();
        if self.delete_pods == (true, false) {
            v.push(&DELETE_PODS);
        }
        v
    }
    /// The policy refuses regrade's own marks.
    pub fn own_marks_refused(&self) -> Option<&str> {
        match &self.own_marks.as_ref()?.outcome {
            Outcome::Allowed => None,
            Outcome::RefusedByPolicy(m) | Outcome::Refused(m) => Some(m),
        }
    }
    pub fn excess(&self) -> Vec<&Request> {
        self.beyond.iter().filter(|(_, ok)| *ok).map(|(r, _)| r).collect()
    }
    pub fn unbounded(&self) -> Vec<&Probe> {
        self.probes.iter().filter(|p| p.outcome == Outcome::Allowed).collect()
    }
    /// Everything regrade needs, nothing beyond, and the policy in force.
    pub fn is_least_privilege(&self) -> bool {
        self.missing().is_empty()
            && self.excess().is_empty()
            && self.unbounded().is_empty()
            && !self.probes.is_empty()
            && self.own_marks_refused().is_none()
    }
}

static DELETE_PODS: Request =
    Request { verb: "delete", group: "", resource: "pods", subresource: "", namespace: None, name: None };

/// Asks the API server through `eps` (regrade's own credential) what it may do as
/// regrade of Node `node`. `delete_needed`: a level uses `on_drain_timeout = "delete"`;
/// `own_marks`: the merge patch of regrade's marks below `full` on its Node now.
pub async fn ask(
    eps: &Endpoints,
    node: &str,
    needed: Vec<Request>,
    delete_needed: bool,
    own_marks: Option<serde_json::Value>,
) -> Result<Boundary, CallError> {
    let user = who_am_i(eps).await?;
    let mut checked = Vec::new();
    for list in [needed, beyond(), vec![DELETE_PODS.clone()]] {
        let mut out = Vec::new();
        for r in list {
            let allowed = allowed(eps, &r).await?;
            out.push((r, allowed));
        }
        checked.push(out);
    }
    let delete_pods = (delete_needed, checked[2][0].1);
    let beyond = checked.remove(1);
    let needed = checked.remove(0);
    let mut b =
        Boundary { user, node: node.to_string(), needed, beyond, delete_pods, probes: Vec::new(), own_marks: None };
    // The policy matches regrade's ServiceAccounts only; anyone else it leaves alone.
    if b.username() == credential::user_name(node) {
        b.probes = probe(eps, node).await?;
        if let Some(patch) = own_marks {
            let dry = PatchParams { dry_run: true, ..Default::default() };
            let (patch, dry) = (&patch, &dry);
            let r = eps
                .call(format!("patch nodes/{node} (dry run)"), |c| async move {
                    Api::<Node>::all(c).patch(node, dry, &Patch::Merge(patch)).await.map(drop)
                })
                .await;
            b.own_marks = Some(Probe { what: format!("regrade's own marks on Node {node}"), outcome: outcome(r) });
        }
    }
    Ok(b)
}

/// Who the API server takes this credential for (SelfSubjectReview): user name, groups,
/// and for a ServiceAccount token its Node and credential ID (`extra`).
pub async fn who_am_i(eps: &Endpoints) -> Result<UserInfo, CallError> {
    let review = eps
        .call("create selfsubjectreviews", |c| async move {
            Api::<SelfSubjectReview>::all(c).create(&PostParams::default(), &SelfSubjectReview::default()).await
        })
        .await?;
    Ok(review.status.and_then(|s| s.user_info).unwrap_or_default())
}

async fn allowed(eps: &Endpoints, r: &Request) -> Result<bool, CallError> {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(r.verb.into()),
                group: Some(r.group.into()),
                resource: Some(r.resource.into()),
                subresource: (!r.subresource.is_empty()).then(|| r.subresource.into()),
                namespace: r.namespace.clone(),
                name: r.name.clone(),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let review = &review;
    let answer = eps
        .call(format!("create selfsubjectaccessreviews ({r})"), |c| async move {
            Api::<SelfSubjectAccessReview>::all(c).create(&PostParams::default(), review).await
        })
        .await?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

fn outcome(r: Result<(), CallError>) -> Outcome {
    match r {
        Ok(()) => Outcome::Allowed,
        Err(CallError::Status { status, .. }) if status.message.contains("ValidatingAdmissionPolicy") => {
            Outcome::RefusedByPolicy(status.message.clone())
        }
        Err(CallError::Status { status, .. }) => Outcome::Refused(format!("{} {}", status.code, status.message)),
        Err(e) => Outcome::Refused(e.to_string()),
    }
}

/// Dry-run requests that RBAC allows regrade and the policy must refuse.
async fn probe(eps: &Endpoints, node: &str) -> Result<Vec<Probe>, CallError> {
    let dry = PatchParams { dry_run: true, ..Default::default() };
    let dry_post = PostParams { dry_run: true, ..Default::default() };
    let nodes =
        eps.call("list nodes", |c| async move { Api::<Node>::all(c).list(&ListParams::default()).await }).await?;
    let own = nodes.items.iter().find(|n| n.metadata.name.as_deref() == Some(node));
    let other = nodes.items.iter().filter_map(|n| n.metadata.name.clone()).find(|n| n != node);
    let mut probes = Vec::new();
    let mut run = |what: String, r: Result<(), CallError>| probes.push(Probe { what, outcome: outcome(r) });
    let patch_node = |name: String, patch: serde_json::Value| {
        let dry = dry.clone();
        async move {
            let (name, patch, dry) = (&name, &patch, &dry);
            eps.call(format!("patch nodes/{name} (dry run)"), |c| async move {
                Api::<Node>::all(c).patch(name, dry, &Patch::Merge(patch)).await.map(drop)
            })
            .await
        }
    };
    if let Some(other) = other.clone() {
        let r = patch_node(other.clone(), json!({"spec": {"unschedulable": true}})).await;
        run(format!("cordon Node {other}"), r);
    }
    if let Some(own) = own {
        let mut taints = own.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default();
        taints.push(k8s_openapi::api::core::v1::Taint {
            key: "regrade.dev/access-check".into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        });
        let r = patch_node(node.to_string(), json!({"spec": {"taints": taints}})).await;
        run(format!("add the taint regrade.dev/access-check to Node {node}"), r);
        let label =
            own.metadata.labels.iter().flatten().map(|(k, _)| k.clone()).find(|k| !k.starts_with("regrade.dev/"));
        let (what, patch) = match label {
            Some(l) => (format!("remove the label {l} from Node {node}"), json!({"metadata": {"labels": {l: null}}})),
            None => (
                format!("add the label regrade.dev/access-check to Node {node}"),
                json!({"metadata": {"labels": {"regrade.dev/access-check": "x"}}}),
            ),
        };
        let r = patch_node(node.to_string(), patch).await;
        run(what, r);
    }
    let lease: Lease = serde_json::from_value(json!({"metadata": {"name": "regrade-access-check"}})).expect("a Lease");
    let (lease, dry_post) = (&lease, &dry_post);
    let r = eps
        .call("create leases kube-system/regrade-access-check (dry run)", |c| async move {
            Api::<Lease>::namespaced(c, "kube-system").create(dry_post, lease).await.map(drop)
        })
        .await;
    run("take the Lease kube-system/regrade-access-check".into(), r);
    if let Some(other) = other {
        let event: Event = serde_json::from_value(json!({
            "metadata": {"name": format!("{other}.regrade-access-check")},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": other},
            "reason": "RegradeAccessCheck", "message": "dry run", "type": "Normal",
        }))
        .expect("an Event");
        let event = &event;
        let r = eps
            .call(format!("create events -n {} (dry run)", events::NAMESPACE), |c| async move {
                Api::<Event>::namespaced(c, events::NAMESPACE).create(dry_post, event).await.map(drop)
            })
            .await;
        run(format!("record an Event about Node {other}"), r);
    }
    Ok(probes)
}

impl fmt::Display for Boundary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let yes = |b: bool| if b { "yes" } else { "no " };
        write!(f, "identity: {}", self.username())?;
        match self.bound_node() {
            Some(n) => writeln!(f, " (token bound to Node {n})")?,
            None => writeln!(f)?,
        }
        writeln!(f, "what regrade needs (SelfSubjectAccessReview):")?;
        for (r, ok) in &self.needed {
            writeln!(f, "  {}  {r}", yes(*ok))?;
        }
        writeln!(
            f,
            "  {}  {DELETE_PODS} (needed only with on_drain_timeout = \"delete\"; the admission policy allows it on \
             pods on Node {} only)",
            yes(self.delete_pods.1),
            self.node
        )?;
        writeln!(f, "what regrade never needs:")?;
        for (r, ok) in &self.beyond {
            writeln!(f, "  {}  {r}", yes(*ok))?;
        }
        if self.probes.is_empty() {
            writeln!(
                f,
                "the admission policy regrade-own-node: not asked; it applies only to {} (this server's \
                 ServiceAccount), and this credential is {}",
                credential::user_name(&self.node),
                self.username()
            )?;
        } else {
            if let Some(p) = &self.own_marks {
                let verdict = match &p.outcome {
                    Outcome::Allowed => "allowed".to_string(),
                    Outcome::RefusedByPolicy(m) | Outcome::Refused(m) => format!("REFUSED: {m}"),
                };
                writeln!(f, "what the admission policy must allow (a dry run): {}: {verdict}", p.what)?;
            }
            writeln!(f, "what the admission policy must refuse (dry-run requests; nothing is changed):")?;
            for p in &self.probes {
                match &p.outcome {
                    Outcome::RefusedByPolicy(m) => writeln!(f, "  refused      {}: {m}", p.what)?,
                    Outcome::Refused(m) => writeln!(f, "  refused      {} (not by the policy): {m}", p.what)?,
                    Outcome::Allowed => writeln!(f, "  NOT REFUSED  {}", p.what)?,
                }
            }
        }
        writeln!(
            f,
            "what nothing narrows: evicting any pod (an Eviction names the pod, not its Node: PodDisruptionBudgets \
             bound it) and listing every pod (RBAC cannot narrow a list to the field selector spec.nodeName)"
        )?;
        let (missing, excess, unbounded) = (self.missing(), self.excess(), self.unbounded());
        let list = |v: &[&Request]| v.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ");
        if !excess.is_empty() {
            let admin = self.beyond.first().is_some_and(|(_, ok)| *ok);
            writeln!(
                f,
                "verdict: OVER-PRIVILEGED: this credential can do more than regrade needs ({}){}; give regrade its own \
                 credential (`regrade credential`, deploy/rbac.yaml)",
                list(&excess),
                if admin { ": it is an admin credential" } else { "" }
            )?;
        }
        if !missing.is_empty() {
            writeln!(f, "verdict: MISSING RIGHTS: regrade cannot {} (apply deploy/rbac.yaml)", list(&missing))?;
        }
        if self.own_marks_refused().is_some() {
            writeln!(
                f,
                "verdict: MISSING RIGHTS: the admission policy refuses regrade's own marks: its names (regrade.dev/level, \
                 regrade.dev/stepped-down, regrade.dev/set) must be cluster.level_label, taint_key and set_annotation"
            )?;
        }
        if !unbounded.is_empty() || (self.probes.is_empty() && excess.is_empty()) {
            writeln!(
                f,
                "verdict: NOT BOUNDED BY THE POLICY: RBAC alone lets this credential change any field of any Node \
                 (apply deploy/admission-policy.yaml; Kubernetes >= 1.30)"
            )?;
        }
        if self.is_least_privilege() {
            writeln!(
                f,
                "verdict: least privilege: Node {} and regrade's marks on it only, the Lease, Events about Node {}",
                self.node, self.node
            )?;
        }
        Ok(())
    }
}
