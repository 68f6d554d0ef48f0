//! Tables (Markdown) and charts (SVG and PNG) from simulation runs.
//!
//! Every figure counts only *measured* requests: routed by a router (not sent straight to a pod)
//! and outside warm-up stages. Per-stage figures are given for every stage, warm-up ones marked.

use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::SimError;
use crate::sim::{Outcome, RunResult};
use crate::workload::Workload;

/// One policy's figures on one workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Policy name.
    pub policy: String,
    /// Measured requests.
    pub requests: usize,
    /// Cached prompt tokens / prompt tokens, in [0,1].
    pub hit_rate: f64,
    /// Share of requests with no cached block, in [0,1].
    pub cold_share: f64,
    /// TTFT p50, seconds.
    pub ttft_p50_s: f64,
    /// TTFT p90, seconds.
    pub ttft_p90_s: f64,
    /// TTFT p99, seconds.
    pub ttft_p99_s: f64,
    /// Completed measured requests per second of their span (first arrival to last finish).
    pub throughput_rps: f64,
    /// Busiest pod's measured requests / mean requests per pod (1.0 = even).
    pub load_spread: f64,
    /// TTFT p50 per load stage (warm-up ones included), seconds.
    pub stage_p50_s: Vec<f64>,
    /// TTFT p90 per load stage (warm-up ones included), seconds.
    pub stage_p90_s: Vec<f64>,
    /// Preemptions over the whole run (all requests).
    pub preemptions: u64,
    /// Where the workload has prefix groups (`chat-groups`): the groups' measured requests as
    /// [`GroupPlacement`]; `None` otherwise.
    pub groups: Option<GroupPlacement>,
}

/// How a policy placed a workload's prefix groups (measured requests only).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupPlacement {
    /// Mean over groups of the distinct pods that served the group (1.0: every group on one pod).
    pub engines_per_group: f64,
    /// Requests served on a pod other than their group's home (the pod that served most of the
    /// group's requests; ties: the lower pod index).
    pub away_from_home: usize,
}

/// [`GroupPlacement`] of the outcomes that carry a group; `None` when none does.
pub fn group_placement<'a>(outcomes: impl Iterator<Item = &'a Outcome>) -> Option<GroupPlacement> {
    let mut per_group: std::collections::BTreeMap<u64, std::collections::BTreeMap<usize, usize>> =
        std::collections::BTreeMap::new();
    for o in outcomes {
        if let Some(g) = o.group {
            *per_group.entry(g).or_default().entry(o.pod).or_default() += 1;
        }
    }
    if per_group.is_empty() {
        return None;
    }
    let engines: usize = per_group.values().map(|m| m.len()).sum();
    let away: usize = per_group
        .values()
        .map(|m| {
            let total: usize = m.values().sum();
            // max_by_key keeps the last maximum: iterate in reverse so the lowest pod index wins.
            let home = m.iter().rev().max_by_key(|(_, n)| **n).map_or(0, |(_, n)| *n);
            total - home
        })
        .sum();
    Some(GroupPlacement { engines_per_group: engines as f64 / per_group.len() as f64, away_from_home: away })
}

/// Nearest-rank percentile of sorted `v` (`q` in [0,1]); 0 when empty.
pub fn percentile(sorted: &[u64], q: f64) -> u64 {
    kvroute_harness::stats::percentile(sorted, q).unwrap_or(0)
}

/// Summarises `run` (with `stages` load stages).
pub fn summarize(run: &RunResult, stages: usize) -> Summary {
    let o: Vec<_> = run.outcomes.iter().filter(|x| x.measured()).collect();
    let mut ttft: Vec<u64> = o.iter().map(|x| x.ttft_us).collect();
    ttft.sort_unstable();
    let prompt: u64 = o.iter().map(|x| x.prompt_tokens).sum();
    let cached: u64 = o.iter().map(|x| x.cached_tokens).sum();
    let first = o.iter().map(|x| x.arrival_us).min().unwrap_or(0);
    let last = o.iter().map(|x| x.finish_us).max().unwrap_or(0);
    let mut per_pod = vec![0usize; run.pods.max(1)];
    for x in &o {
        if let Some(c) = per_pod.get_mut(x.pod) {
            *c += 1;
        }
    }
    let mean = o.len() as f64 / per_pod.len() as f64;
    let max = per_pod.iter().copied().max().unwrap_or(0) as f64;
    let stage = |s: usize, q: f64| {
        let mut v: Vec<u64> =
            run.outcomes.iter().filter(|x| x.stage == s && x.router.is_some()).map(|x| x.ttft_us).collect();
        v.sort_unstable();
        percentile(&v, q) as f64 / 1e6
    };
    Summary {
        policy: run.policy.clone(),
        requests: o.len(),
        hit_rate: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
        cold_share: if o.is_empty() {
            0.0
        } else {
            o.iter().filter(|x| x.hit_blocks == 0).count() as f64 / o.len() as f64
        },
        ttft_p50_s: percentile(&ttft, 0.5) as f64 / 1e6,
        ttft_p90_s: percentile(&ttft, 0.9) as f64 / 1e6,
        ttft_p99_s: percentile(&ttft, 0.99) as f64 / 1e6,
        throughput_rps: if last > first { o.len() as f64 / ((last - first) as f64 / 1e6) } else { 0.0 },
        load_spread: if mean > 0.0 { max / mean } else { 0.0 },
        stage_p50_s: (0..stages.max(1)).map(|s| stage(s, 0.5)).collect(),
        stage_p90_s: (0..stages.max(1)).map(|s| stage(s, 0.9)).collect(),
        preemptions: run.preemptions,
        groups: group_placement(o.iter().copied()),
    }
}

/// Baselines whose p90 is compared with kvroute's, in table order.
const BASELINES: [&str; 6] =
    ["random", "least-connections", "approximate-prefix", "kvroute-approximate", "sglang-cache-aware", "dynamo-cost"];

fn stage_label(workload: &Workload, i: usize) -> String {
    let st = &workload.stages[i];
    format!("{} req/s{}", st.rate_rps, if st.warmup { " (warm-up)" } else { "" })
}

/// The Markdown table for one workload and one seed, plus kvroute's p90 ratios.
pub fn table(workload: &Workload, rows: &[Summary]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "#### {}\n\n{}\n", workload.name, workload.description);
    let _ = writeln!(
        s,
        "| policy | cache hit rate | cold requests | TTFT p50 s | TTFT p90 s | TTFT p99 s | throughput req/s | load spread (max/mean) | preemptions |"
    );
    let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {:.1} % | {:.1} % | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {} |",
            r.policy,
            r.hit_rate * 100.0,
            r.cold_share * 100.0,
            r.ttft_p50_s,
            r.ttft_p90_s,
            r.ttft_p99_s,
            r.throughput_rps,
            r.load_spread,
            r.preemptions
        );
    }
    if rows.iter().any(|r| r.groups.is_some()) {
        let _ = writeln!(s, "\nPrefix groups (a group's home: the pod that served most of its requests):\n");
        let _ = writeln!(s, "| policy | engines per group | requests away from home |\n| --- | ---: | ---: |");
        for r in rows {
            if let Some(g) = r.groups {
                let _ = writeln!(s, "| {} | {:.2} | {} |", r.policy, g.engines_per_group, g.away_from_home);
            }
        }
    }
    if workload.stages.len() > 1 {
        let _ = writeln!(s, "\nTTFT p90 (s) per stage:\n");
        let head: Vec<String> = (0..workload.stages.len()).map(|i| stage_label(workload, i)).collect();
        let _ = writeln!(s, "| policy | {} |", head.join(" | "));
        let _ = writeln!(s, "| --- |{}", " ---: |".repeat(head.len()));
        for r in rows {
            let cells: Vec<String> = r.stage_p90_s.iter().map(|v| format!("{v:.3}")).collect();
            let _ = writeln!(s, "| {} | {} |", r.policy, cells.join(" | "));
        }
    }
    if let Some(k) = rows.iter().find(|r| r.policy == "kvroute") {
        let parts: Vec<String> = BASELINES
            .iter()
            .filter_map(|name| {
                rows.iter()
                    .find(|r| r.policy == *name)
                    .filter(|_| k.ttft_p90_s > 0.0)
                    .map(|r| format!("{name} {:.1}×", r.ttft_p90_s / k.ttft_p90_s))
            })
            .collect();
        if !parts.is_empty() {
            let _ = writeln!(s, "\nTTFT p90 of each baseline ÷ kvroute's: {}.", parts.join(", "));
        }
    }
    s
}

fn slash(values: impl Iterator<Item = String>) -> String {
    values.collect::<Vec<_>>().join(" / ")
}

/// One table for several seeds of one workload: each cell lists the seeds' values in order
/// (`seed 1 / seed 2 / seed 3`). `runs[i]` is seed `seeds[i]`'s rows, policies in the same order.
pub fn seeds_table(workload: &Workload, seeds: &[u64], runs: &[Vec<Summary>]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "#### {}\n\n{}\n", workload.name, workload.description);
    let seed_list = slash(seeds.iter().map(|x| x.to_string()));
    let _ = writeln!(
        s,
        "Seeds {seed_list}; each cell is `seed {seed_list}`. Measured requests only (warm-up stages and direct traffic left out).\n"
    );
    let _ = writeln!(s, "| policy | cache hit rate % | TTFT p50 s | TTFT p90 s | TTFT p99 s | preemptions |");
    let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: | ---: |");
    let Some(first) = runs.first() else { return s };
    for (i, r) in first.iter().enumerate() {
        let col = |f: &dyn Fn(&Summary) -> String| slash(runs.iter().filter_map(|run| run.get(i)).map(f));
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            r.policy,
            col(&|x| format!("{:.1}", x.hit_rate * 100.0)),
            col(&|x| format!("{:.3}", x.ttft_p50_s)),
            col(&|x| format!("{:.3}", x.ttft_p90_s)),
            col(&|x| format!("{:.3}", x.ttft_p99_s)),
            col(&|x| x.preemptions.to_string()),
        );
    }
    if first.iter().any(|r| r.groups.is_some()) {
        let _ = writeln!(
            s,
            "\nPrefix groups, seeds {seed_list} (a group's home: the pod that served most of its requests):\n"
        );
        let _ = writeln!(s, "| policy | engines per group | requests away from home |\n| --- | ---: | ---: |");
        for (i, r) in first.iter().enumerate() {
            let group = |f: &dyn Fn(&GroupPlacement) -> String| {
                slash(runs.iter().filter_map(|run| run.get(i)).map(|x| x.groups.as_ref().map_or_else(String::new, f)))
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} |",
                r.policy,
                group(&|g| format!("{:.2}", g.engines_per_group)),
                group(&|g| g.away_from_home.to_string())
            );
        }
    }
    if workload.stages.iter().filter(|st| !st.warmup).count() > 1 {
        let _ = writeln!(s, "\nTTFT p90 (s) per stage, seeds {seed_list}:\n");
        let head: Vec<String> = (0..workload.stages.len()).map(|i| stage_label(workload, i)).collect();
        let _ = writeln!(s, "| policy | {} |", head.join(" | "));
        let _ = writeln!(s, "| --- |{}", " ---: |".repeat(head.len()));
        for (i, r) in first.iter().enumerate() {
            let cells: Vec<String> = (0..workload.stages.len())
                .map(|st| {
                    slash(
                        runs.iter()
                            .filter_map(|run| run.get(i))
                            .map(|x| x.stage_p90_s.get(st).map_or_else(String::new, |v| format!("{v:.2}"))),
                    )
                })
                .collect();
            let _ = writeln!(s, "| {} | {} |", r.policy, cells.join(" | "));
        }
    }
    let ratio = |name: &str, p: fn(&Summary) -> f64| -> Option<String> {
        let i = first.iter().position(|r| r.policy == name)?;
        let k = first.iter().position(|r| r.policy == "kvroute")?;
        Some(slash(runs.iter().filter_map(|run| {
            let (b, kv) = (p(run.get(i)?), p(run.get(k)?));
            (kv > 0.0).then(|| format!("{:.2}", b / kv))
        })))
    };
    let mut lines = Vec::new();
    for name in BASELINES {
        if let (Some(p50), Some(p90), Some(p99)) =
            (ratio(name, |x| x.ttft_p50_s), ratio(name, |x| x.ttft_p90_s), ratio(name, |x| x.ttft_p99_s))
        {
            lines.push(format!("| {name} | {p50} | {p90} | {p99} |"));
        }
    }
    if !lines.is_empty() {
        let _ = writeln!(s, "\nEach baseline's TTFT ÷ kvroute's (above 1: kvroute faster), seeds {seed_list}:\n");
        let _ = writeln!(s, "| baseline | p50 | p90 | p99 |\n| --- | ---: | ---: | ---: |");
        for l in lines {
            let _ = writeln!(s, "{l}");
        }
    }
    s
}

fn out_err(path: &Path, e: impl std::fmt::Display) -> SimError {
    SimError::Output { path: path.into(), message: e.to_string() }
}

/// Font the charts are laid out with (the SVGs name the family and leave rendering to the viewer;
/// the PNGs are rendered with it): the file in `KVROUTE_SIM_FONT`, else DejaVu Sans or Liberation
/// Sans where the system has them. `None` when no font is found: charts are then skipped with a
/// warning (tables are still written).
fn png_font() -> Option<&'static str> {
    static FONT: OnceLock<Option<&'static str>> = OnceLock::new();
    *FONT.get_or_init(|| {
        let candidates = std::env::var("KVROUTE_SIM_FONT").ok().into_iter().chain(
            [
                "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
                "/usr/share/fonts/TTF/DejaVuSans.ttf",
                "/usr/share/fonts/dejavu/DejaVuSans.ttf",
                "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
                "/Library/Fonts/Arial.ttf",
            ]
            .map(String::from),
        );
        for path in candidates {
            if let Ok(bytes) = std::fs::read(&path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return Some("sans-serif");
                }
            }
        }
        None
    })
}

const P50_COLOR: RGBColor = RGBColor(158, 202, 225);
const P90_COLOR: RGBColor = RGBColor(33, 113, 181);

/// Grouped horizontal bars: TTFT p50 and p90 (measured requests) per policy on a log scale, the
/// policy names level on the left axis, a legend in the lower right corner.
fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    workload: &Workload,
    rows: &[Summary],
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let n = rows.len().max(1);
    let vals = rows.iter().flat_map(|r| [r.ttft_p50_s, r.ttft_p90_s]);
    let xmax = vals.clone().fold(0.01f64, f64::max) * 20.0;
    let xmin = (vals.filter(|v| *v > 0.0).fold(xmax, f64::min) / 2.0).max(1e-3);
    let mut c = ChartBuilder::on(root)
        .caption(format!("{}: TTFT per policy (measured requests)", workload.name), ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(50)
        .y_label_area_size(190)
        .build_cartesian_2d((xmin..xmax).log_scale(), 0f64..n as f64)
        .map_err(|e| e.to_string())?;
    let names: Vec<String> = rows.iter().map(|r| r.policy.clone()).collect();
    // Policy i occupies the band [n − i − 1, n − i): the first policy on top.
    c.configure_mesh()
        .disable_y_mesh()
        .y_labels(n * 2 + 1)
        .y_label_formatter(&|y| {
            let band = y.floor();
            if (y - band - 0.5).abs() < 0.01 && band >= 0.0 {
                names.get(n - 1 - band as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_label_style(("sans-serif", 14))
        .x_desc("TTFT, seconds (log scale)")
        .x_label_formatter(&|v| format!("{v}"))
        .draw()
        .map_err(|e| e.to_string())?;
    let bar = |i: usize, upper: bool, v: f64, color: RGBColor| {
        let top = (n - i) as f64;
        let (y0, y1) = if upper { (top - 0.5, top - 0.1) } else { (top - 0.9, top - 0.5) };
        Rectangle::new([(xmin, y0), (v.max(xmin), y1)], color.filled())
    };
    c.draw_series(rows.iter().enumerate().map(|(i, r)| bar(i, true, r.ttft_p50_s, P50_COLOR)))
        .map_err(|e| e.to_string())?
        .label("TTFT p50")
        .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 16, y + 6)], P50_COLOR.filled()));
    c.draw_series(rows.iter().enumerate().map(|(i, r)| bar(i, false, r.ttft_p90_s, P90_COLOR)))
        .map_err(|e| e.to_string())?
        .label("TTFT p90")
        .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 16, y + 6)], P90_COLOR.filled()));
    c.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

/// Line colours, distinguishable on white (Tableau's ten, then grey).
const LINE_COLORS: [RGBColor; 11] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
    RGBColor(188, 189, 34),
    RGBColor(0, 0, 0),
    RGBColor(127, 127, 127),
];

fn line_color(i: usize) -> RGBColor {
    LINE_COLORS[i % LINE_COLORS.len()]
}

/// Lines: TTFT p90 (solid) and p50 (dashed markers) per stage for each policy, log scale, legend
/// outside the plot on the right.
fn draw_stages<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    workload: &Workload,
    rows: &[Summary],
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (plot, legend) = root.split_horizontally(root.dim_in_pixel().0 * 3 / 4);
    let stages = workload.stages.len();
    let vals = rows.iter().flat_map(|r| r.stage_p90_s.iter().chain(r.stage_p50_s.iter()).copied());
    let ymax = vals.clone().fold(0.01f64, f64::max) * 2.0;
    let ymin = (vals.filter(|v| *v > 0.0).fold(ymax, f64::min) / 2.0).max(1e-3);
    let labels: Vec<String> = (0..stages).map(|i| stage_label(workload, i)).collect();
    let mut c = ChartBuilder::on(&plot)
        .caption(format!("{}: TTFT per stage", workload.name), ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(60)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.3f64..(stages as f64 - 0.7), (ymin..ymax).log_scale())
        .map_err(|e| e.to_string())?;
    c.configure_mesh()
        .x_labels(stages)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 0.01 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .x_desc("stage (offered rate)")
        .y_desc("TTFT, seconds (log scale)")
        .y_label_formatter(&|v| format!("{v}"))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, r) in rows.iter().enumerate() {
        let color = line_color(i);
        let p90: Vec<(f64, f64)> = r.stage_p90_s.iter().enumerate().map(|(s, v)| (s as f64, v.max(ymin))).collect();
        let p50: Vec<(f64, f64)> = r.stage_p50_s.iter().enumerate().map(|(s, v)| (s as f64, v.max(ymin))).collect();
        c.draw_series(LineSeries::new(p90.clone(), color.stroke_width(2))).map_err(|e| e.to_string())?;
        c.draw_series(p90.iter().map(|p| Circle::new(*p, 4, color.filled()))).map_err(|e| e.to_string())?;
        c.draw_series(p50.iter().map(|p| TriangleMarker::new(*p, 4, color.stroke_width(1))))
            .map_err(|e| e.to_string())?;
    }
    // The legend: one line per policy, then the marker key.
    let style = ("sans-serif", 15).into_font();
    for (i, r) in rows.iter().enumerate() {
        let y = 40 + 22 * i as i32;
        let color = line_color(i);
        legend.draw(&PathElement::new(vec![(10, y), (34, y)], color.stroke_width(3))).map_err(|e| e.to_string())?;
        legend.draw(&Text::new(r.policy.clone(), (40, y - 8), style.clone())).map_err(|e| e.to_string())?;
    }
    let y = 40 + 22 * rows.len() as i32 + 14;
    legend.draw(&Circle::new((22, y), 4, BLACK.filled())).map_err(|e| e.to_string())?;
    legend.draw(&Text::new("TTFT p90 (line)", (40, y - 8), style.clone())).map_err(|e| e.to_string())?;
    legend.draw(&TriangleMarker::new((22, y + 22), 4, BLACK.stroke_width(1))).map_err(|e| e.to_string())?;
    legend.draw(&Text::new("TTFT p50", (40, y + 14), style)).map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

#[derive(Clone, Copy)]
enum Chart {
    Bars,
    Stages,
}

fn draw<DB: DrawingBackend>(
    chart: Chart,
    root: &DrawingArea<DB, Shift>,
    workload: &Workload,
    rows: &[Summary],
) -> Result<(), String> {
    match chart {
        Chart::Bars => draw_bars(root, workload, rows),
        Chart::Stages => draw_stages(root, workload, rows),
    }
}

fn write_both(base: &Path, workload: &Workload, rows: &[Summary], chart: Chart) -> Result<Vec<PathBuf>, SimError> {
    // Both backends lay text out with the registered font.
    if png_font().is_none() {
        eprintln!("no TrueType font found (set KVROUTE_SIM_FONT=FILE.ttf): charts skipped");
        return Ok(Vec::new());
    }
    let size = (1100, 620);
    let svg_path = base.with_extension("svg");
    {
        let root = SVGBackend::new(&svg_path, size).into_drawing_area();
        draw(chart, &root, workload, rows).map_err(|e| out_err(&svg_path, e))?;
    }
    let png_path = base.with_extension("png");
    {
        let root = BitMapBackend::new(&png_path, size).into_drawing_area();
        draw(chart, &root, workload, rows).map_err(|e| out_err(&png_path, e))?;
    }
    Ok(vec![svg_path, png_path])
}

/// Writes the charts of one workload beside `base` (a path without extension): `<base>.svg` and
/// `<base>.png` (TTFT p50 and p90 per policy) and, for workloads with several stages,
/// `<base>-stages.svg` / `.png` (TTFT per stage). Returns the files written.
pub fn charts(workload: &Workload, rows: &[Summary], base: &Path) -> Result<Vec<PathBuf>, SimError> {
    let mut out = write_both(base, workload, rows, Chart::Bars)?;
    if workload.stages.len() > 1 {
        let name = base.file_name().map(|n| format!("{}-stages", n.to_string_lossy())).unwrap_or_default();
        out.extend(write_both(&base.with_file_name(name), workload, rows, Chart::Stages)?);
    }
    Ok(out)
}

/// Every pod's stats reads of a run as CSV, one line per pod per read (`--dump-pods`): time (s),
/// pod, waiting and running requests, KV usage in [0,1] and preemptions so far. The timeline
/// that shows where KV pressure built up and which pod tipped into preemptions first.
pub fn pod_samples_csv(run: &RunResult) -> String {
    let mut out = String::from("time_s,pod,waiting,running,kv_usage,preemptions\n");
    for s in &run.pod_samples {
        out.push_str(&format!(
            "{:.3},{},{},{},{:.4},{}\n",
            s.time_us as f64 / 1e6,
            s.pod,
            s.waiting,
            s.running,
            s.kv_usage,
            s.preemptions
        ));
    }
    out
}

/// Every request's outcome as CSV, one line per request in id order (`--dump-requests`).
pub fn outcomes_csv(run: &RunResult) -> String {
    let mut out = String::from(
        "id,arrival_s,router,pod,session,group,stage,warmup,prompt_tokens,cached_tokens,hit_blocks,total_blocks,ttft_s,finish_s\n",
    );
    for (id, o) in run.outcomes.iter().enumerate() {
        out.push_str(&format!(
            "{id},{:.6},{},{},{},{},{},{},{},{},{},{},{:.6},{:.6}\n",
            o.arrival_us as f64 / 1e6,
            o.router.map_or(String::new(), |r| r.to_string()),
            o.pod,
            o.session.map_or(String::new(), |s| s.to_string()),
            o.group.map_or(String::new(), |g| g.to_string()),
            o.stage,
            o.warmup,
            o.prompt_tokens,
            o.cached_tokens,
            o.hit_blocks,
            o.total_blocks,
            o.ttft_us as f64 / 1e6,
            o.finish_us as f64 / 1e6,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), 50);
        assert_eq!(percentile(&v, 0.9), 90);
        assert_eq!(percentile(&v, 0.99), 99);
        assert_eq!(percentile(&[7], 0.99), 7);
        assert_eq!(percentile(&[], 0.5), 0);
    }

    #[test]
    fn group_placement_counts_engines_and_requests_away_from_home() {
        let o = |group: Option<u64>, pod: usize| Outcome { group, pod, ..Outcome::default() };
        // Group 1: 3 requests on pod 2, 1 on pod 0; group 2: 2 on pod 1 and 2 on pod 3 (a tie).
        let outcomes = [
            o(Some(1), 2),
            o(Some(1), 0),
            o(Some(1), 2),
            o(Some(1), 2),
            o(Some(2), 1),
            o(Some(2), 3),
            o(Some(2), 3),
            o(Some(2), 1),
            o(None, 0),
        ];
        let g = group_placement(outcomes.iter());
        assert_eq!(g, Some(GroupPlacement { engines_per_group: 2.0, away_from_home: 3 }));
        let one_pod = [o(Some(5), 1), o(Some(5), 1)];
        assert_eq!(group_placement(one_pod.iter()), Some(GroupPlacement { engines_per_group: 1.0, away_from_home: 0 }));
        assert_eq!(group_placement([o(None, 0)].iter()), None);
    }
}
