//! Summaries, Markdown tables and SVG charts of simulated runs.
//!
//! Metrics per run: cache hit rate = prompt tokens served from cache / prompt tokens; cold share =
//! requests that found no cached block; TTFT percentiles (nearest rank); throughput = requests /
//! (last finish − first arrival); load spread = the busiest pod's request count / the mean.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use crate::SimError;
use crate::sim::RunResult;
use crate::workload::Workload;

/// One policy's figures on one workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Policy name.
    pub policy: String,
    /// Requests.
    pub requests: usize,
    /// Cached prompt tokens / prompt tokens, in [0,1].
    pub hit_rate: f64,
    /// Share of requests with no cached block, in [0,1].
    pub cold_share: f64,
    /// TTFT percentiles, seconds.
    pub ttft_p50_s: f64,
    /// TTFT p90, seconds.
    pub ttft_p90_s: f64,
    /// TTFT p99, seconds.
    pub ttft_p99_s: f64,
    /// Completed requests per second of simulated time.
    pub throughput_rps: f64,
    /// Busiest pod's requests / mean requests per pod (1.0 = even).
    pub load_spread: f64,
    /// TTFT p90 per load stage, seconds.
    pub stage_p90_s: Vec<f64>,
}

/// Nearest-rank percentile of sorted `v` (`q` in [0,1]); 0 when empty.
pub fn percentile(sorted: &[u64], q: f64) -> u64 {
    kvroute_harness::stats::percentile(sorted, q).unwrap_or(0)
}

/// Summarises `run` (with `stages` load stages).
pub fn summarize(run: &RunResult, stages: usize) -> Summary {
    let o = &run.outcomes;
    let mut ttft: Vec<u64> = o.iter().map(|x| x.ttft_us).collect();
    ttft.sort_unstable();
    let prompt: u64 = o.iter().map(|x| x.prompt_tokens).sum();
    let cached: u64 = o.iter().map(|x| x.cached_tokens).sum();
    let first = o.iter().map(|x| x.arrival_us).min().unwrap_or(0);
    let last = o.iter().map(|x| x.finish_us).max().unwrap_or(0);
    let mut per_pod = vec![0usize; run.pods.max(1)];
    for x in o {
        if let Some(c) = per_pod.get_mut(x.pod) {
            *c += 1;
        }
    }
    let mean = o.len() as f64 / per_pod.len() as f64;
    let max = per_pod.iter().copied().max().unwrap_or(0) as f64;
    let stage_p90_s = (0..stages.max(1))
        .map(|s| {
            let mut v: Vec<u64> = o.iter().filter(|x| x.stage == s).map(|x| x.ttft_us).collect();
            v.sort_unstable();
            percentile(&v, 0.9) as f64 / 1e6
        })
        .collect();
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
        stage_p90_s,
    }
}

/// The Markdown table for one workload, plus kvroute's p90 ratios against the baselines.
pub fn table(workload: &Workload, rows: &[Summary]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "#### {}\n\n{}\n", workload.name, workload.description);
    let _ = writeln!(
        s,
        "| policy | cache hit rate | cold requests | TTFT p50 s | TTFT p90 s | TTFT p99 s | throughput req/s | load spread (max/mean) |"
    );
    let _ = writeln!(s, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {:.1} % | {:.1} % | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} |",
            r.policy,
            r.hit_rate * 100.0,
            r.cold_share * 100.0,
            r.ttft_p50_s,
            r.ttft_p90_s,
            r.ttft_p99_s,
            r.throughput_rps,
            r.load_spread
        );
    }
    if workload.stages.len() > 1 {
        let _ = writeln!(s, "\nTTFT p90 (s) per stage:\n");
        let head: Vec<String> = workload.stages.iter().map(|st| format!("{} req/s", st.rate_rps)).collect();
        let _ = writeln!(s, "| policy | {} |", head.join(" | "));
        let _ = writeln!(s, "| --- |{}", " ---: |".repeat(head.len()));
        for r in rows {
            let cells: Vec<String> = r.stage_p90_s.iter().map(|v| format!("{v:.3}")).collect();
            let _ = writeln!(s, "| {} | {} |", r.policy, cells.join(" | "));
        }
    }
    if let Some(k) = rows.iter().find(|r| r.policy == "kvroute") {
        let ratio = |name: &str| {
            rows.iter()
                .find(|r| r.policy == name)
                .filter(|_| k.ttft_p90_s > 0.0)
                .map(|r| format!("{name} {:.1}×", r.ttft_p90_s / k.ttft_p90_s))
        };
        let parts: Vec<String> = [
            "random",
            "least-connections",
            "approximate-prefix",
            "kvroute-approximate",
            "sglang-cache-aware",
            "dynamo-cost",
        ]
        .iter()
        .filter_map(|n| ratio(n))
        .collect();
        if !parts.is_empty() {
            let _ = writeln!(s, "\nTTFT p90 of each baseline ÷ kvroute's: {}.", parts.join(", "));
        }
    }
    s
}

fn out_err(path: &Path, e: impl std::fmt::Display) -> SimError {
    SimError::Output { path: path.into(), message: e.to_string() }
}

/// Writes an SVG chart: TTFT p90 per stage (log scale) when the workload has stages, otherwise
/// TTFT p90 per policy as bars.
pub fn chart(workload: &Workload, rows: &[Summary], path: &Path) -> Result<(), SimError> {
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| out_err(path, e))?;
    let title = format!("{}: TTFT p90 (s)", workload.name);
    if workload.stages.len() > 1 {
        let rates: Vec<f64> = workload.stages.iter().map(|s| s.rate_rps).collect();
        let (x0, x1) = (rates.first().copied().unwrap_or(0.0), rates.last().copied().unwrap_or(1.0));
        let vals = rows.iter().flat_map(|r| r.stage_p90_s.iter().copied());
        let ymax = vals.clone().fold(0.01f64, f64::max) * 1.5;
        let ymin = vals.filter(|v| *v > 0.0).fold(ymax, f64::min).max(1e-3) / 1.5;
        let mut c = ChartBuilder::on(&root)
            .caption(format!("{title} vs offered rate (req/s)"), ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .right_y_label_area_size(0)
            .build_cartesian_2d(x0..x1, (ymin..ymax).log_scale())
            .map_err(|e| out_err(path, e))?;
        c.configure_mesh().x_desc("offered rate, req/s").y_desc("TTFT p90, s").draw().map_err(|e| out_err(path, e))?;
        for (i, r) in rows.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let pts: Vec<(f64, f64)> = rates.iter().copied().zip(r.stage_p90_s.iter().map(|v| v.max(ymin))).collect();
            c.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(|e| out_err(path, e))?
                .label(r.policy.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            c.draw_series(pts.iter().map(|p| Circle::new(*p, 3, color.filled()))).map_err(|e| out_err(path, e))?;
        }
        c.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| out_err(path, e))?;
    } else {
        let n = rows.len().max(1);
        let ymax = rows.iter().map(|r| r.ttft_p90_s).fold(0.01f64, f64::max) * 1.15;
        let mut c = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(120)
            .y_label_area_size(60)
            .build_cartesian_2d(0..n, 0.0..ymax)
            .map_err(|e| out_err(path, e))?;
        let names: Vec<String> = rows.iter().map(|r| r.policy.clone()).collect();
        c.configure_mesh()
            .disable_x_mesh()
            .x_labels(n)
            .x_label_formatter(&|i| names.get(*i).cloned().unwrap_or_default())
            .x_label_style(("sans-serif", 12).into_font().transform(FontTransform::Rotate90))
            .y_desc("TTFT p90, s")
            .draw()
            .map_err(|e| out_err(path, e))?;
        c.draw_series(rows.iter().enumerate().map(|(i, r)| {
            let color = Palette99::pick(i).to_rgba();
            Rectangle::new([(i, 0.0), (i + 1, r.ttft_p90_s)], color.filled())
        }))
        .map_err(|e| out_err(path, e))?;
    }
    root.present().map_err(|e| out_err(path, e))?;
    Ok(())
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
}
