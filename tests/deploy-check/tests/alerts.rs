//! deploy/observability/alerts.yaml tells the truth per pool: every aggregation keeps `namespace`
//! (one pool per namespace), every alert has a promtool unit test that fires it on series from two
//! pools in two namespaces labelled as a ServiceMonitor scrape labels them, the real promtool
//! passes those tests, and the same tests fail for every alert once its expressions aggregate
//! across namespaces (so they can tell the difference).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/observability").canonicalize().unwrap()
}

fn yaml(file: &str) -> serde_json::Value {
    serde_norway::from_str(&std::fs::read_to_string(dir().join(file)).unwrap()).unwrap()
}

/// alert name → expression.
fn alerts() -> BTreeMap<String, String> {
    let rules = yaml("alerts.yaml");
    let mut out = BTreeMap::new();
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            out.insert(rule["alert"].as_str().unwrap().to_owned(), rule["expr"].as_str().unwrap().to_owned());
        }
    }
    out
}

const AGGREGATIONS: [&str; 8] = ["sum", "max", "min", "avg", "count", "topk", "bottomk", "quantile"];

/// Each aggregation in `expr` and its grouping clause (`None`: no `by`/`without`).
fn aggregations(expr: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    for agg in AGGREGATIONS {
        let mut from = 0;
        while let Some(i) = expr[from..].find(agg).map(|i| i + from) {
            from = i + agg.len();
            let before_ok = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
            let rest = expr[from..].trim_start();
            if !before_ok || !(rest.starts_with('(') || rest.starts_with("by") || rest.starts_with("without")) {
                continue;
            }
            let clause = ["by", "without"].iter().find_map(|kw| {
                let r = rest.strip_prefix(kw)?.trim_start().strip_prefix('(')?;
                Some(format!("{kw} ({})", &r[..r.find(')')?]))
            });
            out.push((agg.to_string(), clause));
        }
    }
    out
}

#[test]
fn every_aggregation_keeps_the_namespace() {
    for (alert, expr) in alerts() {
        let aggs = aggregations(&expr);
        assert!(!aggs.is_empty(), "{alert}: no aggregation found in {expr}");
        for (agg, clause) in aggs {
            let keeps = match clause.as_deref() {
                Some(c) if c.starts_with("by") => c.split(['(', ')', ',', ' ']).any(|l| l == "namespace"),
                Some(c) => !c.split(['(', ')', ',', ' ']).any(|l| l == "namespace"),
                None => false,
            };
            assert!(keeps, "{alert}: `{agg} {clause:?}` aggregates across namespaces in {expr}");
        }
    }
    // The scanner itself: a bare sum and a by-clause without namespace are seen.
    assert_eq!(aggregations("sum(rate(x[5m]))"), [("sum".to_string(), None)]);
    assert_eq!(
        aggregations("histogram_quantile(0.5, sum by (le) (rate(b[5m])))"),
        [("sum".to_string(), Some("by (le)".to_string()))]
    );
}

#[test]
fn every_alert_fires_in_a_two_namespace_test() {
    let tests = yaml("alerts.test.yaml");
    let mut proven = BTreeSet::new();
    for t in tests["tests"].as_array().unwrap() {
        let namespaces: BTreeSet<String> = t["input_series"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| {
                let series = s["series"].as_str()?;
                let at = series.find("namespace=\"")? + "namespace=\"".len();
                Some(series[at..].split('"').next()?.to_string())
            })
            .collect();
        for a in t["alert_rule_test"].as_array().unwrap() {
            let fired = a["exp_alerts"].as_array().unwrap();
            if fired.is_empty() || namespaces.len() < 2 {
                continue;
            }
            // Each expected alert names its pool, and not every pool alerts.
            let alerting: BTreeSet<&str> =
                fired.iter().map(|e| e["exp_labels"]["namespace"].as_str().expect("alert without namespace")).collect();
            if alerting.len() < namespaces.len() {
                proven.insert(a["alertname"].as_str().unwrap().to_owned());
            }
        }
    }
    let all: BTreeSet<String> = alerts().into_keys().collect();
    let missing: Vec<_> = all.difference(&proven).collect();
    assert!(missing.is_empty(), "alerts without a two-namespace test that fires for one pool only: {missing:?}");
}

fn promtool() -> PathBuf {
    let p = std::env::var_os("KVROUTE_PROMTOOL").map_or_else(|| PathBuf::from("promtool"), PathBuf::from);
    let found = Command::new(&p).arg("--version").output().is_ok_and(|o| o.status.success());
    assert!(
        found,
        "promtool not found: run scripts/install-promtool (Debian package prometheus) or set KVROUTE_PROMTOOL"
    );
    p
}

fn promtool_test(dir: &Path) -> (bool, String) {
    let out = Command::new(promtool()).args(["test", "rules", "alerts.test.yaml"]).current_dir(dir).output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn promtool_passes_and_each_test_fails_when_namespaces_are_summed_away() {
    let out = Command::new(promtool()).args(["check", "rules", "alerts.yaml"]).current_dir(dir()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    let (ok, text) = promtool_test(&dir());
    assert!(ok, "{text}");

    // The same rules with `namespace` dropped from every grouping: each alert's test must fail.
    let rules = std::fs::read_to_string(dir().join("alerts.yaml")).unwrap();
    let summed = rules.replace("by (namespace, ", "by (").replace("by (namespace) (", "(");
    assert_ne!(summed, rules);
    let tmp = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/deploy-check-alerts-summed");
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("alerts.yaml"), summed).unwrap();
    std::fs::copy(dir().join("alerts.test.yaml"), tmp.join("alerts.test.yaml")).unwrap();
    let (ok, text) = promtool_test(&tmp);
    assert!(!ok, "the tests pass with namespaces summed away:\n{text}");
    for alert in alerts().keys() {
        assert!(text.contains(&format!("alertname: {alert},")), "{alert}'s test still passes summed:\n{text}");
    }
}
