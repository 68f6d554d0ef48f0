//! A no-op ext_proc server: the floor under the picker in `kvroute-gateway-bench`
//! (docs/design.md §10, docs/decisions/0021-ext-proc-layout.md).
//!
//! It answers Envoy exactly as the picker does, phase by phase and with the same reply shapes
//! (the picker's `ext_proc::reply`: CONTINUE on request headers, then on the buffered body the
//! destination header + `x-request-id` + `envoy.lb` metadata with the route cache cleared;
//! `x-request-id` on response headers; CONTINUE on every streamed response-body chunk), and reads
//! the stream the same way (replies produced on the task that writes them, no task or channel of
//! its own per stream), but decides nothing: the destination is the fixed `--endpoint`. Envoy +
//! this server against Envoy + picker therefore isolates the picker's own share of the added
//! latency from Envoy's ext_proc exchange. It serves on one single-threaded event loop, as each
//! of the picker's ext_proc threads does (the picker spreads connections over one loop per core;
//! at the bench's rates one loop is not the bottleneck), so the per-request CPU of the two counts
//! the same kind of wake-ups.
//! Prints `READY` once listening. Run: `kvroute-noop-ext-proc --listen 127.0.0.1:PORT --endpoint IP:PORT`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Result;
use clap::Parser;
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ProcessingRequest, ProcessingResponse,
    TrailersResponse,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use futures::Stream;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status, Streaming};

/// Header (and `envoy.lb` key) naming the destination, as the picker sets it.
const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
const REQUEST_ID_HEADER: &str = "x-request-id";

#[derive(Parser, Debug)]
#[command(version = kvroute_cli::LONG_VERSION, about = "ext_proc server with the picker's reply shapes and a fixed destination")]
struct Args {
    /// Address to listen on.
    #[arg(long)]
    listen: SocketAddr,
    /// Destination `ip:port` for every request.
    #[arg(long)]
    endpoint: String,
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.to_owned(), value: String::new(), raw_value: value.as_bytes().to_vec() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// The picker's routing reply (`reply::routed`).
fn routed(endpoint: &str, request_id: &str, on_headers: bool) -> ProcessingResponse {
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![set_header(DESTINATION_HEADER, endpoint), set_header(REQUEST_ID_HEADER, request_id)],
            remove_headers: Vec::new(),
        }),
        clear_route_cache: true,
        ..Default::default()
    };
    let response = if on_headers {
        Response::RequestHeaders(HeadersResponse { response: Some(common) })
    } else {
        Response::RequestBody(BodyResponse { response: Some(common) })
    };
    let inner = Struct {
        fields: HashMap::from([(
            DESTINATION_HEADER.to_owned(),
            Value { kind: Some(Kind::StringValue(endpoint.to_owned())) },
        )]),
    };
    let metadata =
        Struct { fields: HashMap::from([("envoy.lb".to_owned(), Value { kind: Some(Kind::StructValue(inner)) })]) };
    ProcessingResponse { response: Some(response), dynamic_metadata: Some(metadata), ..Default::default() }
}

fn reply(response: Response) -> ProcessingResponse {
    ProcessingResponse { response: Some(response), ..Default::default() }
}

/// The reply to one message (every phase Envoy sends here gets exactly one).
fn on_message(
    endpoint: &str,
    request_id: &mut String,
    next_id: &AtomicU64,
    msg: ProcessingRequest,
) -> ProcessingResponse {
    match msg.request {
        Some(Request::RequestHeaders(h)) => {
            let given = h.headers.as_ref().and_then(|m| {
                m.headers
                    .iter()
                    .find(|x| x.key == REQUEST_ID_HEADER)
                    .map(|x| String::from_utf8_lossy(&x.raw_value).into_owned())
            });
            *request_id = given.unwrap_or_else(|| format!("noop-{}", next_id.fetch_add(1, Ordering::Relaxed)));
            if h.end_of_stream {
                routed(endpoint, request_id, true)
            } else {
                reply(Response::RequestHeaders(HeadersResponse::default()))
            }
        }
        Some(Request::RequestBody(b)) if b.end_of_stream => routed(endpoint, request_id, false),
        Some(Request::RequestBody(_)) => reply(Response::RequestBody(BodyResponse::default())),
        Some(Request::ResponseHeaders(_)) => {
            let common = CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers: vec![set_header(REQUEST_ID_HEADER, request_id)],
                    remove_headers: Vec::new(),
                }),
                ..Default::default()
            };
            reply(Response::ResponseHeaders(HeadersResponse { response: Some(common) }))
        }
        Some(Request::ResponseBody(_)) => reply(Response::ResponseBody(BodyResponse::default())),
        Some(Request::RequestTrailers(_)) => reply(Response::RequestTrailers(TrailersResponse::default())),
        Some(Request::ResponseTrailers(_)) | None => reply(Response::ResponseTrailers(TrailersResponse::default())),
    }
}

struct NoOp {
    endpoint: Arc<str>,
    next_id: Arc<AtomicU64>,
}

struct NoOpStream {
    endpoint: Arc<str>,
    next_id: Arc<AtomicU64>,
    inbound: Streaming<ProcessingRequest>,
    request_id: String,
}

async fn next_reply(mut s: NoOpStream) -> Option<(Result<ProcessingResponse, Status>, NoOpStream)> {
    let msg = s.inbound.message().await.ok()??;
    let r = on_message(&s.endpoint, &mut s.request_id, &s.next_id, msg);
    Some((Ok(r), s))
}

#[tonic::async_trait]
impl ExternalProcessor for NoOp {
    type ProcessStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

    async fn process(
        &self,
        request: GrpcRequest<Streaming<ProcessingRequest>>,
    ) -> Result<GrpcResponse<Self::ProcessStream>, Status> {
        let s = NoOpStream {
            endpoint: self.endpoint.clone(),
            next_id: self.next_id.clone(),
            inbound: request.into_inner(),
            request_id: String::new(),
        };
        Ok(GrpcResponse::new(Box::pin(futures::stream::unfold(s, next_reply))))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let service = NoOp { endpoint: args.endpoint.into(), next_id: Arc::new(AtomicU64::new(0)) };
    // The picker's limit for bodies (16 MiB), so large prompts travel the same way.
    let server =
        ExternalProcessorServer::new(service).max_decoding_message_size(16 << 20).max_encoding_message_size(16 << 20);
    println!("READY");
    tonic::transport::Server::builder()
        .add_service(server)
        // TCP_NODELAY as the picker's ext_proc listener has it: small replies must not wait on
        // Nagle and Envoy's delayed ACK.
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)))
        .await?;
    Ok(())
}
