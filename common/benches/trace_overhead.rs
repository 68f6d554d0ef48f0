//! What the request path pays for tracing (docs/design.md §9 traces): one decision's spans (`epp.decision` with
//! a remote `traceparent` parent, four step spans, the upstream `traceparent` injected) under
//! four subscribers, against a baseline measured in the same run: block-hashing a 2 048-token
//! prompt, one of the steps every decision performs anyway.
//!
//! - `none`: no subscriber (spans disabled; what tests and tools without logging pay);
//! - `json_logs_global_filter`: JSON logs at INFO to a sink behind one global filter, so the
//!   JSON layer also builds every span (the layout per-layer filters avoid; for comparison);
//! - `json_logs`: the binaries' subscriber (`telemetry::subscriber`) at INFO to a sink, no exporter;
//! - `json_logs_otel`: the same with the OpenTelemetry layer over an SDK tracer provider (always-on
//!   sampling, no exporter: span building and ending, not network export, which the batch
//!   processor does on its own thread).
//!
//! Run: `cargo bench -p kvroute-common --bench trace_overhead`; report ratios, not absolute times.

use std::collections::HashMap;
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_common::BlockHasher;
use kvroute_common::telemetry::{extract_parent, inject};
use tracing_subscriber::layer::SubscriberExt as _;

fn one_decision_spans(headers: &HashMap<String, String>) -> HashMap<String, String> {
    let span = tracing::info_span!(
        "epp.decision",
        otel.kind = "server",
        request_id = "3b0c2a5e-5d55-4d7e-9d1e-0d6f2b7c9a11",
        path = "/v1/chat/completions",
        model = tracing::field::Empty,
        pod = tracing::field::Empty,
    );
    extract_parent(&span, headers);
    let _entered = span.enter();
    tracing::info_span!("epp.parse").in_scope(|| black_box(1));
    span.record("model", "Qwen/Qwen2.5-7B-Instruct");
    tracing::info_span!("epp.tokenize").in_scope(|| black_box(2));
    tracing::info_span!("epp.hash", blocks = 128u64).in_scope(|| black_box(3));
    tracing::info_span!("epp.score").in_scope(|| black_box(4));
    span.record("pod", "engine-3");
    inject(&span)
}

fn bench(c: &mut Criterion) {
    opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
    let headers = HashMap::from([(
        "traceparent".to_owned(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
    )]);
    let mut g = c.benchmark_group("trace_overhead");

    let hasher = BlockHasher::new("Qwen/Qwen2.5-7B-Instruct", None, 16);
    let tokens: Vec<u32> = (0..2048u32).map(|i| i.wrapping_mul(2_654_435_761) % 151_000).collect();
    let mut out = Vec::with_capacity(128);
    g.bench_function("baseline_hash_2048_tokens", |b| {
        b.iter(|| {
            hasher.hash_prompt(black_box(&tokens), &mut out);
            black_box(out.len())
        })
    });

    g.bench_function("none", |b| b.iter(|| one_decision_spans(black_box(&headers))));

    // The layout before per-layer filters: one global filter, spans formatted by the JSON layer.
    let json = || tracing_subscriber::fmt::layer().json().with_current_span(false).with_writer(std::io::sink);
    let old = tracing_subscriber::registry().with(tracing_subscriber::EnvFilter::new("info")).with(json());
    tracing::subscriber::with_default(old, || {
        g.bench_function("json_logs_global_filter", |b| b.iter(|| one_decision_spans(black_box(&headers))));
    });

    let (logs, _) = kvroute_common::telemetry::subscriber("info", None, "bench", std::io::sink);
    tracing::subscriber::with_default(logs, || {
        g.bench_function("json_logs", |b| b.iter(|| one_decision_spans(black_box(&headers))));
    });

    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let (both, _) = kvroute_common::telemetry::subscriber("info", Some(&provider), "bench", std::io::sink);
    tracing::subscriber::with_default(both, || {
        let sample = one_decision_spans(&headers);
        assert!(sample.get("traceparent").is_some_and(|t| t.contains("4bf92f3577b34da6a3ce929d0e0e4736")));
        g.bench_function("json_logs_otel", |b| b.iter(|| one_decision_spans(black_box(&headers))));
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
