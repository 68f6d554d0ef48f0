//! Logging and tracing set-up shared by every kvroute binary (docs/design.md §9, §12).
//!
//! - Logs: structured JSON lines on stderr through `tracing`, level from a flag or the binary's
//!   environment variable (e.g. `EPP_LOG_LEVEL`). A line is formatted where it is logged and
//!   written to stderr by a logging thread ([`LOG_LINES_BUFFERED`] lines queued at most; past
//!   that a logging thread waits, no line is dropped), so a request's log lines cost it no write
//!   system call and a stalled sink does not stall requests
//!   (docs/decisions/0017-logging-thread.md).
//! - Traces: OpenTelemetry spans exported over OTLP gRPC (tonic) when an endpoint is configured by
//!   the standard variables `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`
//!   (the first wins); `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn export off.
//!   With no endpoint no exporter is built and spans cost only the `tracing` subscriber's work.
//!   The remaining `OTEL_*` variables (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//!   `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_EXPORTER_OTLP_TIMEOUT`, …) are read by the SDK itself.
//! - Propagation: the W3C Trace Context propagator is installed globally, so [`extract_parent`] and
//!   [`inject_current`] read and write `traceparent` / `tracestate`.
//!
//! The exporter must be built inside a tokio runtime (tonic channel); [`init`] is called from the
//! binaries' `#[tokio::main]`. Keep the returned [`Telemetry`] alive and call
//! [`Telemetry::shutdown`] before exit so the last batch of spans is flushed.

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, fmt};

/// Errors of the telemetry set-up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter could not be built (bad endpoint URL, no tokio runtime, …).
    #[error("OTLP trace exporter for `{endpoint}`: {source}")]
    Exporter {
        /// The endpoint that was configured.
        endpoint: String,
        /// The SDK's error.
        source: opentelemetry_otlp::ExporterBuildError,
    },
}

/// Where traces go. [`TelemetryConfig::from_env`] reads the standard `OTEL_*` variables.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TelemetryConfig {
    /// OTLP gRPC endpoint, e.g. `http://127.0.0.1:4317`; `None` = no exporter.
    pub otlp_endpoint: Option<String>,
}

impl TelemetryConfig {
    /// From the process environment (see the module docs for the variables and precedence).
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// From a variable lookup (testable without touching the process environment).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Self {
        let truthy = |k: &str| get(k).is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        let disabled = truthy("OTEL_SDK_DISABLED")
            || get("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"));
        let endpoint = ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
            .iter()
            .filter_map(|k| get(k))
            .map(|v| v.trim().to_owned())
            .find(|v| !v.is_empty());
        Self { otlp_endpoint: if disabled { None } else { endpoint } }
    }
}

/// Most log lines queued for the logging thread (≈ 300 bytes each, so about 5 MB); a thread that
/// logs past it waits for the queue to drain.
pub const LOG_LINES_BUFFERED: usize = 16_384;

/// The installed telemetry; flushes and stops the span exporter on [`Telemetry::shutdown`]. Log
/// lines still queued are written when it is dropped (keep it alive until the binary exits).
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    /// Held for its drop, which writes the log lines still queued and stops the logging thread.
    _log_writer: Option<tracing_appender::non_blocking::WorkerGuard>,
}

impl Telemetry {
    /// Whether spans are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Flushes the spans still queued and stops the exporter (blocking; bounded by the SDK's
    /// export timeout). Run from a blocking thread: the exporter needs the runtime to make progress.
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            let joined = tokio::task::spawn_blocking(move || {
                let _ = provider.force_flush();
                provider.shutdown()
            })
            .await;
            match joined {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("kvroute: trace exporter shutdown: {e}"),
                Err(e) => eprintln!("kvroute: trace exporter shutdown task: {e}"),
            }
        }
    }
}

fn env_filter(level: &str) -> (EnvFilter, bool) {
    match EnvFilter::try_new(level) {
        Ok(f) => (f, false),
        Err(_) => (EnvFilter::new("info"), true),
    }
}

/// Installs the global subscriber: JSON logs at `level` (an `EnvFilter` directive such as `info`
/// or `kvroute_picker=debug,info`; an invalid one falls back to `info` and says so) and, when
/// `config` names an endpoint, an OpenTelemetry layer exporting spans as `service_name`
/// (`OTEL_SERVICE_NAME` overrides it). Spans are filtered by the same directive as logs.
/// Calling it twice installs nothing the second time.
pub fn init(service_name: &str, level: &str, config: &TelemetryConfig) -> Result<Telemetry, TelemetryError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let provider = match &config.otlp_endpoint {
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint.clone())
                .build()
                .map_err(|source| TelemetryError::Exporter { endpoint: endpoint.clone(), source })?;
            let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service_name.to_owned());
            let resource = opentelemetry_sdk::Resource::builder().with_service_name(service).build();
            Some(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build())
        }
        None => None,
    };
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .buffered_lines_limit(LOG_LINES_BUFFERED)
        .thread_name("kvroute-log")
        .finish(std::io::stderr());
    let (subscriber, bad) = subscriber(level, provider.as_ref(), service_name, writer);
    let installed = subscriber.try_init().is_ok();
    if bad {
        tracing::warn!(level, "invalid log level directive, using info");
    }
    if let (true, Some(p), Some(endpoint)) = (installed, &provider, &config.otlp_endpoint) {
        opentelemetry::global::set_tracer_provider(p.clone());
        tracing::info!(endpoint = %endpoint, "exporting traces over OTLP gRPC");
    }
    Ok(Telemetry { provider: if installed { provider } else { None }, _log_writer: installed.then_some(guard) })
}

/// The subscriber [`init`] installs, writing log lines to `writer` (public for the
/// `trace_overhead` bench). Each layer has its own copy of the `level` filter: the JSON layer
/// sees events only (log lines name their request with an explicit `request_id` field), so
/// spans are only built when `provider` is given; without an exporter a span costs about as
/// much as with no subscriber at all (measured in `benches/trace_overhead.rs`).
/// The flag is true when `level` was invalid and `info` is used instead.
pub fn subscriber<W>(
    level: &str,
    provider: Option<&SdkTracerProvider>,
    service_name: &str,
    writer: W,
) -> (impl tracing::Subscriber + Send + Sync + 'static, bool)
where
    W: for<'w> fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::filter::FilterExt as _;
    let (filter, bad) = env_filter(level);
    // Spans are the OpenTelemetry layer's business; events and `enabled!` hints (neither event
    // nor span: `tracing::enabled!(Level::DEBUG)` asks with a hint) are the log layer's. Keeping
    // only events here would make every `enabled!` guard false without an exporter, and the DEBUG
    // `candidate`/`timings` lines would never appear.
    let events_only = tracing_subscriber::filter::filter_fn(|m| !m.is_span());
    // One combined filter, so a callsite both reject (every span, every event below `level`) is
    // disabled once at registration; two stacked filters, or an absent (`None`) layer beside them,
    // left every TRACE span and event of h2/hyper/tonic evaluated per call (≈ 30 ns per event,
    // 130 ns per span, measured).
    let fmt_layer = fmt::layer()
        .json()
        .with_current_span(false)
        .with_span_list(false)
        .with_target(true)
        .with_writer(writer)
        .with_filter(filter.and(events_only));
    let subscriber: Box<dyn tracing::Subscriber + Send + Sync> = match provider {
        Some(p) => {
            let otel = tracing_opentelemetry::layer()
                .with_tracer(p.tracer(service_name.to_owned()))
                .with_filter(env_filter(level).0);
            Box::new(tracing_subscriber::registry().with(fmt_layer).with(otel))
        }
        None => Box::new(tracing_subscriber::registry().with(fmt_layer)),
    };
    (subscriber, bad)
}

/// Makes the trace context in `headers` (lower-case `traceparent`, `tracestate`) the parent of
/// `span`. A missing or malformed `traceparent` leaves the span a root (W3C Trace Context §4.3:
/// an invalid header is ignored, never an error).
pub fn extract_parent(span: &tracing::Span, headers: &HashMap<String, String>) {
    let cx = TraceContextPropagator::new().extract(headers);
    if opentelemetry::trace::TraceContextExt::span(&cx).span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// The W3C headers (`traceparent`, and `tracestate` when non-empty) naming `span` as the parent,
/// for passing the trace upstream. Empty when the span is not recorded by an OpenTelemetry layer
/// (no exporter installed) and had no remote parent.
pub fn inject(span: &tracing::Span) -> HashMap<String, String> {
    let mut out = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut out);
    out
}

/// [`inject`] for the current span.
pub fn inject_current() -> HashMap<String, String> {
    inject(&tracing::Span::current())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> TelemetryConfig {
        let m: HashMap<String, String> = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        TelemetryConfig::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn endpoint_from_standard_variables() {
        assert_eq!(cfg(&[]).otlp_endpoint, None);
        assert_eq!(
            cfg(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4317")]).otlp_endpoint.as_deref(),
            Some("http://a:4317")
        );
        let both = cfg(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4317"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://b:4317"),
        ]);
        assert_eq!(both.otlp_endpoint.as_deref(), Some("http://b:4317"));
        assert_eq!(cfg(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "  ")]).otlp_endpoint, None);
        let off = cfg(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4317"), ("OTEL_SDK_DISABLED", "TRUE")]);
        assert_eq!(off.otlp_endpoint, None);
        let none = cfg(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a:4317"), ("OTEL_TRACES_EXPORTER", "none")]);
        assert_eq!(none.otlp_endpoint, None);
    }

    /// Without an exporter, `enabled!` guards follow the level (not false always).
    #[test]
    fn enabled_guards_follow_the_level_without_an_exporter() {
        for (level, debug_on) in [("debug", true), ("info", false), ("trace", true)] {
            let (sub, bad) = subscriber(level, None, "test", std::io::sink);
            assert!(!bad);
            tracing::subscriber::with_default(sub, || {
                assert_eq!(tracing::enabled!(tracing::Level::DEBUG), debug_on, "level {level}");
                assert!(tracing::enabled!(tracing::Level::INFO), "level {level}");
                assert!(!tracing::span_enabled!(tracing::Level::ERROR), "spans are off without an exporter");
            });
        }
    }

    #[test]
    fn malformed_traceparent_is_ignored() {
        let span = tracing::info_span!("x");
        let headers = HashMap::from([("traceparent".to_owned(), "not-a-traceparent".to_owned())]);
        extract_parent(&span, &headers);
        assert!(!inject(&span).contains_key("traceparent"));
    }
}
