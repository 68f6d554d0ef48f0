//! The model table: which model a client's `model` resolves to (weighted splits across targets,
//! a target possibly a LoRA adapter) and the priority of each objective. Built from the llm-d
//! router's InferenceModelRewrite / InferenceObjective objects of the pool, or from the pool file.
//! docs/design.md §14.
//!
//! Resolution follows the llm-d router (`pkg/epp/datastore/modelrewritestore.go`,
//! `requestcontrol/director.go`): a rule with an exact match on the model wins over a generic rule
//! (one with no matches); among equals, the oldest object (creation time, then name) wins, then
//! the first rule in the object. A rule's targets are chosen in proportion to their weights;
//! when no target is weighted they are equally likely; when only some are, the unweighted ones are
//! never chosen. An objective is named by the request header `x-llm-d-inference-objective`;
//! without one (or for an unknown name) the priority is 0.

use std::collections::{BTreeMap, HashMap};

use crate::crd::{InferenceModelRewrite, InferenceObjective};
use crate::pool::Source;

/// The request header that names the InferenceObjective.
pub const OBJECTIVE_HEADER: &str = "x-llm-d-inference-objective";
/// Its deprecated spelling.
pub const LEGACY_OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// Largest weight the CRD allows.
pub const MAX_WEIGHT: u32 = 1_000_000;
/// Most rules a table holds (further ones are dropped and counted).
pub const MAX_RULES: usize = 4096;
/// Most targets per rule.
pub const MAX_TARGETS: usize = 64;

/// One destination of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelTarget {
    /// The model id sent to the engine (`modelRewrite`): a base model, or a LoRA adapter's name.
    pub model: String,
    /// The adapter, when the source names it apart from its base model (pool files may;
    /// InferenceModelRewrite names only the served id, and the picker learns from the engines'
    /// `/v1/models` whether that id is an adapter).
    pub adapter: Option<String>,
    /// Weight 1–1 000 000, or `None` when unweighted.
    pub weight: Option<u32>,
}

/// One rewrite rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRule {
    /// The object it came from (`InferenceModelRewrite` name, or `file`).
    pub source: String,
    /// Exact client model names it matches; empty = every model.
    pub matches: Vec<String>,
    /// Destinations.
    pub targets: Vec<ModelTarget>,
}

impl ModelRule {
    /// The target for a uniform random draw `r` (any `u64`), per the module rules; `None` when
    /// the rule has no target.
    pub fn pick(&self, r: u64) -> Option<&ModelTarget> {
        let total: u64 = self.targets.iter().filter_map(|t| t.weight).map(u64::from).sum();
        if total == 0 {
            let n = self.targets.len() as u64;
            return (n > 0).then(|| &self.targets[(r % n) as usize]);
        }
        let mut x = r % total;
        for t in &self.targets {
            let Some(w) = t.weight else { continue };
            if x < u64::from(w) {
                return Some(t);
            }
            x -= u64::from(w);
        }
        self.targets.last()
    }
}

/// An immutable model table, published whole on every change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelTable {
    /// Where it comes from.
    pub source: Source,
    /// Rules in precedence order (see the module doc).
    pub rules: Vec<ModelRule>,
    /// Objective name → priority.
    pub objectives: BTreeMap<String, i32>,
    /// The first complete list (or file read) has been applied.
    pub synced: bool,
    /// Rules or objects left out (over the limits, or without a usable target).
    pub dropped: usize,
    /// Bumped on every published change.
    pub generation: u64,
    exact: HashMap<String, usize>,
    generic: Option<usize>,
}

crate::watch::snapshot_impl!(ModelTable);

impl ModelTable {
    /// An empty, unsynced table.
    pub fn empty(source: Source) -> Self {
        Self::build(source, Vec::new(), BTreeMap::new(), 0, false)
    }

    /// A table from rules already in precedence order.
    pub fn build(
        source: Source,
        mut rules: Vec<ModelRule>,
        objectives: BTreeMap<String, i32>,
        mut dropped: usize,
        synced: bool,
    ) -> Self {
        if rules.len() > MAX_RULES {
            dropped += rules.len() - MAX_RULES;
            rules.truncate(MAX_RULES);
        }
        let mut exact = HashMap::new();
        let mut generic = None;
        for (i, r) in rules.iter().enumerate() {
            if r.matches.is_empty() {
                generic.get_or_insert(i);
            }
            for m in &r.matches {
                exact.entry(m.clone()).or_insert(i);
            }
        }
        Self { source, rules, objectives, synced, dropped, generation: 0, exact, generic }
    }

    /// From the pool's InferenceModelRewrite and InferenceObjective objects (`pool` = the pool
    /// name; objects naming another pool are ignored).
    pub fn from_objects(
        source: Source,
        pool: &str,
        rewrites: &[InferenceModelRewrite],
        objectives: &[InferenceObjective],
        synced: bool,
    ) -> Self {
        let mut dropped = 0;
        let mut mine: Vec<&InferenceModelRewrite> =
            rewrites.iter().filter(|r| r.spec.pool_ref.as_ref().is_some_and(|p| p.refers_to(pool))).collect();
        mine.sort_by(|a, b| {
            (a.metadata.creation_timestamp.as_ref(), a.metadata.name.as_deref())
                .cmp(&(b.metadata.creation_timestamp.as_ref(), b.metadata.name.as_deref()))
        });
        let mut rules = Vec::new();
        for rw in mine {
            let name = rw.metadata.name.clone().unwrap_or_default();
            for rule in &rw.spec.rules {
                let targets: Vec<ModelTarget> = rule
                    .targets
                    .iter()
                    .filter(|t| !t.model_rewrite.is_empty())
                    .take(MAX_TARGETS)
                    .map(|t| ModelTarget {
                        model: t.model_rewrite.clone(),
                        adapter: None,
                        weight: t
                            .weight
                            .and_then(|w| u32::try_from(w).ok())
                            .filter(|w| *w >= 1)
                            .map(|w| w.min(MAX_WEIGHT)),
                    })
                    .collect();
                if targets.is_empty() {
                    dropped += 1;
                    continue;
                }
                let matches = rule
                    .matches
                    .iter()
                    .filter_map(|m| m.model.as_ref())
                    .filter(|m| m.match_type.as_deref().is_none_or(|t| t == "Exact"))
                    .map(|m| m.value.clone())
                    .filter(|v| !v.is_empty())
                    .collect::<Vec<_>>();
                if matches.is_empty() && !rule.matches.is_empty() {
                    // Only unsupported match types: matching everything instead would be wrong.
                    dropped += 1;
                    continue;
                }
                rules.push(ModelRule { source: name.clone(), matches, targets });
            }
        }
        let objectives = objectives
            .iter()
            .filter(|o| o.spec.pool_ref.refers_to(pool))
            .filter_map(|o| Some((o.metadata.name.clone()?, o.spec.priority.unwrap_or(0))))
            .collect();
        Self::build(source, rules, objectives, dropped, synced)
    }

    /// The rule for client model `model`: the first exact-match rule, else the first generic one.
    pub fn rule_for(&self, model: &str) -> Option<&ModelRule> {
        self.exact.get(model).or(self.generic.as_ref()).map(|&i| &self.rules[i])
    }

    /// The priority of objective `name` (0 when absent or unknown).
    pub fn priority(&self, objective: Option<&str>) -> i32 {
        objective.and_then(|o| self.objectives.get(o)).copied().unwrap_or(0)
    }

    /// Content equality, generation aside.
    pub fn same_content(&self, other: &Self) -> bool {
        // `exact` and `generic` are derived from `rules`.
        self.synced == other.synced
            && self.dropped == other.dropped
            && self.source == other.source
            && self.objectives == other.objectives
            && self.rules == other.rules
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn rewrite(name: &str, created_s: i64, pool: &str, rules: Vec<InferenceModelRewriteRule>) -> InferenceModelRewrite {
        InferenceModelRewrite {
            metadata: ObjectMeta {
                name: Some(name.into()),
                creation_timestamp: Some(Time(k8s_openapi::jiff::Timestamp::from_second(created_s).unwrap())),
                ..Default::default()
            },
            spec: InferenceModelRewriteSpec {
                pool_ref: Some(PoolObjectReference { name: pool.into(), ..Default::default() }),
                rules,
            },
        }
    }

    fn rule(matches: &[&str], targets: &[(&str, Option<i32>)]) -> InferenceModelRewriteRule {
        InferenceModelRewriteRule {
            matches: matches
                .iter()
                .map(|m| RewriteMatch { model: Some(ModelMatch { match_type: None, value: (*m).into() }) })
                .collect(),
            targets: targets.iter().map(|(m, w)| RewriteTarget { weight: *w, model_rewrite: (*m).into() }).collect(),
        }
    }

    fn src() -> Source {
        Source::File("t".into())
    }

    #[test]
    fn exact_beats_generic_and_oldest_wins() {
        let rws = [
            rewrite("newer", 200, "pool", vec![rule(&["chat"], &[("chat-v2", None)])]),
            rewrite(
                "older",
                100,
                "pool",
                vec![rule(&[], &[("fallback", None)]), rule(&["chat"], &[("chat-v1", None)])],
            ),
            rewrite("elsewhere", 1, "other-pool", vec![rule(&["chat"], &[("wrong", None)])]),
        ];
        let t = ModelTable::from_objects(src(), "pool", &rws, &[], true);
        assert_eq!(t.rule_for("chat").unwrap().targets[0].model, "chat-v1");
        assert_eq!(t.rule_for("anything").unwrap().targets[0].model, "fallback");
        assert_eq!(t.rule_for("chat").unwrap().source, "older");
        let no_generic = ModelTable::from_objects(src(), "pool", &rws[..1], &[], true);
        assert!(no_generic.rule_for("other").is_none());
    }

    #[test]
    fn weighted_pick_follows_weights_and_ignores_unweighted_when_mixed() {
        let r = ModelRule {
            source: "x".into(),
            matches: vec![],
            targets: vec![
                ModelTarget { model: "a".into(), adapter: None, weight: Some(90) },
                ModelTarget { model: "b".into(), adapter: None, weight: Some(10) },
                ModelTarget { model: "c".into(), adapter: None, weight: None },
            ],
        };
        let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
        for i in 0..1000u64 {
            *counts.entry(r.pick(i).unwrap().model.as_str()).or_default() += 1;
        }
        assert_eq!(counts.get("a"), Some(&900));
        assert_eq!(counts.get("b"), Some(&100));
        assert_eq!(counts.get("c"), None, "unweighted targets are never chosen when others are weighted");
        let uniform = ModelRule {
            targets: r.targets.iter().map(|t| ModelTarget { weight: None, ..t.clone() }).collect(),
            ..r.clone()
        };
        assert_eq!((0..3).map(|i| uniform.pick(i).unwrap().model.as_str()).collect::<Vec<_>>(), ["a", "b", "c"]);
        assert!(ModelRule { targets: vec![], ..r }.pick(7).is_none());
    }

    /// The weighted draw is unbiased for uniform draws over all of `u64` (as the picker's
    /// `rand::random()` gives): for 8 seeds × 20 000 draws of a SplitMix64 sequence, Pearson's
    /// χ² against the weights stays below the 0.1 % critical value (10.83 for 1 degree of
    /// freedom, 13.82 for 2).
    #[test]
    fn weighted_draws_pass_a_chi_square_test_over_many_seeds() {
        fn splitmix(state: &mut u64) -> u64 {
            *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = *state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        let rule = |weights: &[u32]| ModelRule {
            source: "x".into(),
            matches: vec![],
            targets: weights
                .iter()
                .enumerate()
                .map(|(i, w)| ModelTarget { model: format!("t{i}"), adapter: None, weight: Some(*w) })
                .collect(),
        };
        const DRAWS: u32 = 20_000;
        for (weights, critical) in [(&[80, 20][..], 10.83), (&[50, 30, 20][..], 13.82), (&[999_999, 1][..], 10.83)] {
            let r = rule(weights);
            let total: u32 = weights.iter().sum();
            for seed in 0..8u64 {
                let mut state = seed;
                let mut counts = vec![0u32; weights.len()];
                for _ in 0..DRAWS {
                    let t = r.pick(splitmix(&mut state)).unwrap();
                    counts[r.targets.iter().position(|x| x == t).unwrap()] += 1;
                }
                let chi2: f64 = counts
                    .iter()
                    .zip(weights)
                    .map(|(&o, &w)| {
                        let e = f64::from(DRAWS) * f64::from(w) / f64::from(total);
                        (f64::from(o) - e).powi(2) / e
                    })
                    .sum();
                assert!(chi2 < critical, "weights {weights:?}, seed {seed}: counts {counts:?}, χ² {chi2:.2}");
            }
        }
    }

    #[test]
    fn objectives_give_priorities_and_bad_rules_are_dropped() {
        let objs = [
            InferenceObjective {
                metadata: ObjectMeta { name: Some("premium".into()), ..Default::default() },
                spec: InferenceObjectiveSpec {
                    priority: Some(10),
                    pool_ref: PoolObjectReference { name: "pool".into(), ..Default::default() },
                },
            },
            InferenceObjective {
                metadata: ObjectMeta { name: Some("batch".into()), ..Default::default() },
                spec: InferenceObjectiveSpec {
                    priority: None,
                    pool_ref: PoolObjectReference { name: "pool".into(), ..Default::default() },
                },
            },
        ];
        let mut bad_type = rule(&["m"], &[("x", None)]);
        bad_type.matches[0].model.as_mut().unwrap().match_type = Some("Prefix".into());
        let rws = [rewrite("r", 1, "pool", vec![rule(&["m"], &[]), bad_type])];
        let t = ModelTable::from_objects(src(), "pool", &rws, &objs, true);
        assert_eq!(t.priority(Some("premium")), 10);
        assert_eq!(t.priority(Some("batch")), 0);
        assert_eq!(t.priority(Some("unknown")), 0);
        assert_eq!(t.priority(None), 0);
        assert_eq!((t.rules.len(), t.dropped), (0, 2));
    }
}
