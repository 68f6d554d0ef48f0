//! The stand-in's object store: what etcd plus the API server's watch cache hold.
//!
//! One cluster-wide `resourceVersion` counter (every write takes the next value, as etcd's revision
//! does); objects kept as JSON; a bounded log of past events (the watch cache's window) from which
//! watches resume and paginated lists read a consistent snapshot. A watch or `continue` token older
//! than the window is answered `410 Gone` / `Expired`, which makes kube-rs and client-go relist.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

use super::ApiError;

/// Groups whose kinds are built into the API server (their lists omit the items' `kind` and
/// `apiVersion`, as a real server's typed encoder does; custom resources keep them).
const BUILTIN_GROUPS: &[&str] = &[
    "",
    "apps",
    "batch",
    "autoscaling",
    "policy",
    "discovery.k8s.io",
    "networking.k8s.io",
    "rbac.authorization.k8s.io",
    "coordination.k8s.io",
    "apiextensions.k8s.io",
    "storage.k8s.io",
    "node.k8s.io",
    "scheduling.k8s.io",
];

/// Field labels every namespaced resource supports in `fieldSelector`.
const META_FIELDS: &[&str] = &["metadata.name", "metadata.namespace"];
/// Pods' extra field labels (k8s.io/kubernetes pkg/registry/core/pod `PodToSelectableFields`).
const POD_FIELDS: &[&str] = &[
    "metadata.name",
    "metadata.namespace",
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
];

/// A namespaced resource the stand-in serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceType {
    /// API group, `""` for core.
    pub group: String,
    /// Version, e.g. `v1`.
    pub version: String,
    /// Kind, e.g. `Pod`.
    pub kind: String,
    /// URL plural, e.g. `pods`.
    pub plural: String,
    /// Built into the API server (typed encoding) rather than a custom resource.
    pub builtin: bool,
    /// Paths accepted in `fieldSelector`.
    pub field_labels: Vec<&'static str>,
}

impl ResourceType {
    /// The resource of a kube-rs type (k8s-openapi types and `#[derive(CustomResource)]` types).
    pub fn of<K: kube::Resource<DynamicType = ()>>() -> Self {
        let group = K::group(&()).to_string();
        let kind = K::kind(&()).to_string();
        let builtin = BUILTIN_GROUPS.contains(&group.as_str());
        let field_labels = if group.is_empty() && kind == "Pod" { POD_FIELDS.to_vec() } else { META_FIELDS.to_vec() };
        Self {
            group,
            version: K::version(&()).to_string(),
            kind,
            plural: K::plural(&()).to_string(),
            builtin,
            field_labels,
        }
    }

    /// A custom resource (namespaced; `fieldSelector` on `metadata.name` / `metadata.namespace`).
    pub fn custom(group: &str, version: &str, kind: &str, plural: &str) -> Self {
        Self {
            group: group.into(),
            version: version.into(),
            kind: kind.into(),
            plural: plural.into(),
            builtin: false,
            field_labels: META_FIELDS.to_vec(),
        }
    }

    /// `group/version`, or `version` for the core group.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() { self.version.clone() } else { format!("{}/{}", self.group, self.version) }
    }

    fn key(&self) -> ResKey {
        (self.group.clone(), self.plural.clone())
    }

    /// The object of a BOOKMARK event: an empty object of the kind carrying only
    /// `metadata.resourceVersion` (and `annotations`). Built-in kinds are Go structs serialised
    /// whole, so a Pod bookmark reads `{"kind":"Pod","apiVersion":"v1","metadata":{
    /// "resourceVersion":"556","creationTimestamp":null},"spec":{"containers":null},"status":{}}`
    /// (recorded from a v1.33 API server: tests/fixtures/kube-apiserver).
    pub(crate) fn bookmark(&self, rv: u64, annotations: Option<Value>) -> Value {
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if self.builtin {
            metadata["creationTimestamp"] = Value::Null;
        }
        if let Some(a) = annotations {
            metadata["annotations"] = a;
        }
        let mut obj = json!({"kind": self.kind, "apiVersion": self.api_version(), "metadata": metadata});
        if self.builtin && self.group.is_empty() && self.kind == "Pod" {
            obj["spec"] = json!({"containers": null});
            obj["status"] = json!({});
        }
        obj
    }

    /// The `kubernetes.io/initial-events-list-blueprint` annotation value of a built-in kind: the
    /// base64 of the empty list's JSON (with Go's trailing newline).
    pub(crate) fn list_blueprint(&self) -> Option<String> {
        use base64::Engine as _;
        self.builtin.then(|| {
            let list = format!(
                "{{\"kind\":\"{}List\",\"apiVersion\":\"{}\",\"metadata\":{{}},\"items\":null}}\n",
                self.kind,
                self.api_version()
            );
            base64::engine::general_purpose::STANDARD.encode(list)
        })
    }
}

type ResKey = (String, String);

/// `(group, plural, namespace, name)`: ordered as etcd keys are, so lists come out sorted by
/// namespace then name.
type ObjKey = (String, String, String, String);

/// Watch event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Created.
    Added,
    /// Changed.
    Modified,
    /// Removed; the object is its last state at the deletion's resourceVersion.
    Deleted,
}

/// One write, as the watch cache keeps it.
#[derive(Debug)]
pub struct StoredEvent {
    /// The write's resourceVersion.
    pub rv: u64,
    pub(crate) key: ObjKey,
    /// What happened.
    pub kind: EventType,
    /// The object after the write (for a deletion: its last state, stamped with `rv`).
    pub object: Arc<Value>,
    /// The object before the write (absent for a creation).
    pub prev: Option<Arc<Value>>,
}

impl StoredEvent {
    pub(crate) fn resource(&self) -> ResKey {
        (self.key.0.clone(), self.key.1.clone())
    }
    pub(crate) fn namespace(&self) -> &str {
        &self.key.2
    }
}

/// Requests served, per resource (tests assert relists with it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestCounts {
    /// List requests (each page counts).
    pub lists: u64,
    /// Watch requests.
    pub watches: u64,
    /// Watches answered with `410 Expired`.
    pub expired: u64,
}

pub(crate) struct Inner {
    pub(crate) rv: u64,
    /// Events at or below this resourceVersion are no longer in the log.
    pub(crate) compacted_rv: u64,
    pub(crate) resources: HashMap<ResKey, ResourceType>,
    pub(crate) objects: BTreeMap<ObjKey, Arc<Value>>,
    pub(crate) log: VecDeque<Arc<StoredEvent>>,
    log_capacity: usize,
    uid_counter: u64,
    pub(crate) counts: HashMap<ResKey, RequestCounts>,
    requests: VecDeque<String>,
}

/// Requests remembered for [`Store::requests`].
const REQUEST_LOG: usize = 512;

/// The shared store; cheap to clone handles via `Arc`.
pub struct Store {
    inner: Mutex<Inner>,
    events: broadcast::Sender<Arc<StoredEvent>>,
    /// Bumped to end every open watch stream.
    pub(crate) drop_epoch: watch::Sender<u64>,
    /// While true, requests wait (the server is unreachable).
    pub(crate) paused: watch::Sender<bool>,
    /// ServiceAccount tokens for TokenReview.
    pub(crate) tokens: super::tokens::Tokens,
}

impl Store {
    pub(crate) fn new(log_capacity: usize) -> Self {
        let (events, _) = broadcast::channel(4096);
        let (drop_epoch, _) = watch::channel(0);
        let (paused, _) = watch::channel(false);
        Self {
            inner: Mutex::new(Inner {
                rv: 1,
                compacted_rv: 0,
                resources: HashMap::new(),
                objects: BTreeMap::new(),
                log: VecDeque::new(),
                log_capacity: log_capacity.max(1),
                uid_counter: 0,
                counts: HashMap::new(),
                requests: VecDeque::new(),
            }),
            events,
            drop_epoch,
            paused,
            tokens: super::tokens::Tokens::default(),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock is a bug in the stand-in; keep serving what is there.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Arc<StoredEvent>> {
        self.events.subscribe()
    }

    /// Makes `res` servable.
    pub fn register(&self, res: ResourceType) {
        self.lock().resources.insert(res.key(), res);
    }

    /// The registered resource of `apiVersion` + `kind`.
    pub fn resource_of(&self, api_version: &str, kind: &str) -> Option<ResourceType> {
        self.lock().resources.values().find(|r| r.api_version() == api_version && r.kind == kind).cloned()
    }

    pub(crate) fn resource(&self, group: &str, plural: &str) -> Option<ResourceType> {
        self.lock().resources.get(&(group.to_string(), plural.to_string())).cloned()
    }

    /// Current cluster resourceVersion (the last write's).
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// The last requests served (`METHOD path?query`), oldest first (at most 512).
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.iter().cloned().collect()
    }

    pub(crate) fn log_request(&self, line: String) {
        let mut inner = self.lock();
        if inner.requests.len() >= REQUEST_LOG {
            inner.requests.pop_front();
        }
        inner.requests.push_back(line);
    }

    /// Requests served for `res` so far.
    pub fn counts(&self, res: &ResourceType) -> RequestCounts {
        self.lock().counts.get(&res.key()).copied().unwrap_or_default()
    }

    fn record(&self, inner: &mut Inner, key: ObjKey, kind: EventType, object: Arc<Value>, prev: Option<Arc<Value>>) {
        let ev = Arc::new(StoredEvent { rv: inner.rv, key, kind, object, prev });
        if inner.log.len() >= inner.log_capacity
            && let Some(old) = inner.log.pop_front()
        {
            inner.compacted_rv = old.rv;
        }
        inner.log.push_back(ev.clone());
        // No receiver is fine: nobody watches.
        let _ = self.events.send(ev);
    }

    /// Creates an object (`POST`): fills `kind`, `apiVersion`, `metadata.{namespace, uid,
    /// creationTimestamp, generation, resourceVersion}`.
    ///
    /// # Errors
    /// 404 for an unregistered resource, 422 without `metadata.name`, 409 if it exists.
    pub fn create(&self, res: &ResourceType, namespace: Option<&str>, mut obj: Value) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        if !inner.resources.contains_key(&res.key()) {
            return Err(ApiError::not_found_resource());
        }
        let (ns, name) = ident(&obj, namespace)?;
        let key = (res.group.clone(), res.plural.clone(), ns.clone(), name.clone());
        if inner.objects.contains_key(&key) {
            return Err(ApiError::already_exists(res, &name));
        }
        inner.rv += 1;
        inner.uid_counter += 1;
        let uid = format!("00000000-0000-4000-8000-{:012x}", inner.uid_counter);
        let now = serde_json::to_value(Time(k8s_openapi::jiff::Timestamp::now())).unwrap_or(Value::Null);
        obj["kind"] = json!(res.kind);
        obj["apiVersion"] = json!(res.api_version());
        let meta = meta_mut(&mut obj);
        meta.insert("namespace".into(), json!(ns));
        meta.insert("uid".into(), json!(uid));
        meta.insert("creationTimestamp".into(), now);
        meta.insert("generation".into(), json!(1));
        meta.insert("resourceVersion".into(), json!(inner.rv.to_string()));
        let obj = Arc::new(obj);
        inner.objects.insert(key.clone(), obj.clone());
        self.record(&mut inner, key, EventType::Added, obj.clone(), None);
        Ok((*obj).clone())
    }

    /// Replaces an object (`PUT`): keeps `uid` and `creationTimestamp`, bumps `generation` when
    /// `spec` changed, takes the next resourceVersion.
    ///
    /// # Errors
    /// 404 if it does not exist.
    pub fn replace(&self, res: &ResourceType, namespace: Option<&str>, mut obj: Value) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let (ns, name) = ident(&obj, namespace)?;
        let key = (res.group.clone(), res.plural.clone(), ns.clone(), name.clone());
        let Some(prev) = inner.objects.get(&key).cloned() else {
            return Err(ApiError::not_found(res, &name));
        };
        inner.rv += 1;
        obj["kind"] = json!(res.kind);
        obj["apiVersion"] = json!(res.api_version());
        let generation =
            prev["metadata"]["generation"].as_i64().unwrap_or(1) + i64::from(prev.get("spec") != obj.get("spec"));
        let meta = meta_mut(&mut obj);
        meta.insert("namespace".into(), json!(ns));
        for k in ["uid", "creationTimestamp"] {
            meta.insert(k.into(), prev["metadata"][k].clone());
        }
        meta.insert("generation".into(), json!(generation));
        meta.insert("resourceVersion".into(), json!(inner.rv.to_string()));
        let obj = Arc::new(obj);
        inner.objects.insert(key.clone(), obj.clone());
        self.record(&mut inner, key, EventType::Modified, obj.clone(), Some(prev));
        Ok((*obj).clone())
    }

    /// Changes an object in place through `f` (a read-modify-write under the store's lock).
    ///
    /// # Errors
    /// 404 if it does not exist.
    pub fn modify(
        &self,
        res: &ResourceType,
        namespace: &str,
        name: &str,
        f: impl FnOnce(&mut Value),
    ) -> Result<Value, ApiError> {
        let current = self.get(res, namespace, name).ok_or_else(|| ApiError::not_found(res, name))?;
        let mut next = current;
        f(&mut next);
        self.replace(res, Some(namespace), next)
    }

    /// Deletes an object (`DELETE`, no grace period): a DELETED event carrying its last state.
    ///
    /// # Errors
    /// 404 if it does not exist.
    pub fn delete(&self, res: &ResourceType, namespace: &str, name: &str) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let key = (res.group.clone(), res.plural.clone(), namespace.to_string(), name.to_string());
        let Some(prev) = inner.objects.remove(&key) else {
            return Err(ApiError::not_found(res, name));
        };
        inner.rv += 1;
        let mut last = (*prev).clone();
        meta_mut(&mut last).insert("resourceVersion".into(), json!(inner.rv.to_string()));
        let last = Arc::new(last);
        self.record(&mut inner, key, EventType::Deleted, last.clone(), Some(prev));
        Ok((*last).clone())
    }

    /// One object, if present.
    pub fn get(&self, res: &ResourceType, namespace: &str, name: &str) -> Option<Value> {
        let key = (res.group.clone(), res.plural.clone(), namespace.to_string(), name.to_string());
        self.lock().objects.get(&key).map(|o| (**o).clone())
    }

    /// Forgets the event history, as a compaction of the watch cache would, after a write
    /// elsewhere in the cluster (the resourceVersion moves on by one): every watch that resumes
    /// from an older resourceVersion, and every older `continue` token, gets `410 Expired`.
    /// Open watch streams are ended, so each client resumes (and is told to relist) at once.
    pub fn expire_history(&self) {
        let mut inner = self.lock();
        inner.rv += 1;
        inner.compacted_rv = inner.rv;
        inner.log.clear();
        drop(inner);
        self.drop_watches();
    }

    /// Ends every open watch stream (a dropped connection): clients resume from their last
    /// resourceVersion without a relist.
    pub fn drop_watches(&self) {
        self.drop_epoch.send_modify(|e| *e += 1);
    }

    /// Makes the server unreachable: open watches end and new requests wait until
    /// [`Store::resume`] (writes through this handle still happen, unseen by clients).
    pub fn pause(&self) {
        self.paused.send_replace(true);
        self.drop_watches();
    }

    /// Ends a [`Store::pause`]: waiting requests proceed.
    pub fn resume(&self) {
        self.paused.send_replace(false);
    }

    /// The objects of `res` (in `namespace`, or all) as they were at resourceVersion `at`, rolled
    /// back from the current state through the event log.
    ///
    /// # Errors
    /// `410 Expired` when `at` is older than the log.
    pub(crate) fn snapshot_at(
        inner: &Inner,
        res: &ResourceType,
        namespace: Option<&str>,
        at: u64,
    ) -> Result<Vec<Arc<Value>>, ()> {
        if at < inner.compacted_rv {
            return Err(());
        }
        let in_scope = |k: &ObjKey| k.0 == res.group && k.1 == res.plural && namespace.is_none_or(|ns| k.2 == ns);
        let mut state: BTreeMap<ObjKey, Arc<Value>> =
            inner.objects.iter().filter(|(k, _)| in_scope(k)).map(|(k, v)| (k.clone(), v.clone())).collect();
        for ev in inner.log.iter().rev().take_while(|e| e.rv > at) {
            if !in_scope(&ev.key) {
                continue;
            }
            match (&ev.kind, &ev.prev) {
                (EventType::Added, _) => {
                    state.remove(&ev.key);
                }
                (_, Some(prev)) => {
                    state.insert(ev.key.clone(), prev.clone());
                }
                (_, None) => {}
            }
        }
        Ok(state.into_values().collect())
    }
}

fn ident(obj: &Value, namespace: Option<&str>) -> Result<(String, String), ApiError> {
    if !obj.is_object() {
        return Err(ApiError::bad_request("the body of the request is not a JSON object"));
    }
    let name = obj["metadata"]["name"].as_str().filter(|n| !n.is_empty());
    let Some(name) = name else {
        return Err(ApiError::invalid("metadata.name: Required value: name or generateName is required"));
    };
    let body_ns = obj["metadata"]["namespace"].as_str().filter(|n| !n.is_empty());
    let ns = match (namespace, body_ns) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        (Some(a), _) => a,
        (None, Some(b)) => b,
        (None, None) => "default",
    };
    Ok((ns.to_string(), name.to_string()))
}

fn meta_mut(obj: &mut Value) -> &mut serde_json::Map<String, Value> {
    if !obj.is_object() {
        *obj = json!({});
    }
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    match obj.get_mut("metadata") {
        Some(Value::Object(m)) => m,
        // Both branches above leave `metadata` an object.
        _ => unreachable!("metadata is an object"),
    }
}
